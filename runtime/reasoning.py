"""A chat reply's reasoning split from its answer, as vLLM's ``--reasoning-parser`` splits it (the
server's replies carry it as ``reasoning``, vLLM's field; `runtime.openai_protocol`).

Both parsers read a ``<think>`` ... ``</think>`` block:

- ``qwen3`` (Qwen3's hybrid models, which open the block themselves): a reply that begins with
  ``<think>`` reasons until ``</think>``; a reply that does not (``enable_thinking: false``: the
  template wrote an empty block into the prompt) is all answer.
- ``deepseek_r1`` (DeepSeek-R1, Qwen3's thinking-only models, Qwen3.5: their templates open the
  block in the prompt): the reply reasons until ``</think>`` (a ``<think>`` it begins with dropped);
  ``minimax_m2`` (MiniMax-M2, whose template opens it too) reads replies the same way.
- ``minimax_m2_append_think`` (MiniMax-M2, for clients that keep the think block in the
  conversation, as MiniMax asks of multi-turn tool use): no reasoning; the answer is the whole reply
  after the ``<think>`` its prompt opened.

A reply cut short before ``</think>`` is all reasoning. `ReasoningSplit` reads a reply as it
streams, holding back only what may still begin a tag; a whole reply is read the same way, so a
stream's pieces always add up to the whole reply's split. The tool parsers read the answer alone.

- ``openai_gptoss`` (GPT-OSS): the reply's harmony messages (`runtime.harmony`): its ``analysis``
  messages are the reasoning, its ``final`` ones and preambles the answer; its calls are read
  beside them (``--tool-call-parser openai``).
"""

from __future__ import annotations

from .harmony import CHANNEL, MESSAGE, START as HARMONY_START, HarmonyReader
from .text_deltas import tag_prefix

__all__ = ["APPEND_THINK", "HARMONY", "PARSERS", "AppendThink", "ReasoningSplit", "reasoning_block", "reasoning_split",
           "split_reasoning"]

START, END = "<think>", "</think>"

#: the ``<think>`` parsers: whether a reply that does not begin with ``<think>`` reasons
IMPLICIT: dict[str, bool] = {"qwen3": False, "deepseek_r1": True, "minimax_m2": True}
HARMONY = "openai_gptoss"
APPEND_THINK = "minimax_m2_append_think"
#: vLLM's ``--reasoning-parser`` names
PARSERS: tuple[str, ...] = (*IMPLICIT, HARMONY, APPEND_THINK)


class ReasoningSplit:
    """One reply's split, fed its text as it comes: `feed` returns each new piece of reasoning and
    of answer."""

    def __init__(self, parser: str) -> None:
        self.implicit = IMPLICIT[parser]
        self.state = "start"  # then "reasoning" or "answer"
        self.held = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) pieces of the reply's next `text` (`finished`: its last)."""
        self.held += text
        reasoning = ""
        if self.state == "start":
            if self.held.startswith(START):
                self.held, self.state = self.held[len(START):], "reasoning"
            elif START.startswith(self.held) and not finished:
                return "", ""  # may still begin "<think>"
            else:
                self.state = "reasoning" if self.implicit else "answer"
        if self.state == "reasoning":
            end = self.held.find(END)
            if end >= 0:
                reasoning, self.held, self.state = self.held[:end], self.held[end + len(END):], "answer"
            else:
                keep = 0 if finished else tag_prefix(self.held, END)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
        answer, self.held = self.held, ""
        return reasoning, answer


class AppendThink:
    """``minimax_m2_append_think``'s split: no reasoning, and the answer is ``<think>`` (which the
    prompt opened) then the whole reply, as vLLM's parser of that name answers."""

    def __init__(self) -> None:
        self.opened = False

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) pieces of the reply's next `text`: ``<think>`` goes before the first."""
        answer, self.opened = (text if self.opened else START + text), True
        return "", answer


def reasoning_split(parser: str) -> ReasoningSplit | HarmonyReader | AppendThink:
    """The split of one reply by `parser` (one of `PARSERS`): each has ``feed(text, finished) ->
    (reasoning, answer)``."""
    if parser == HARMONY:
        return HarmonyReader()
    return AppendThink() if parser == APPEND_THINK else ReasoningSplit(parser)


def reasoning_block(parser: str) -> tuple[str, str]:
    """The texts around `parser`'s reasoning, as ``StructuredOutputsParams.after_reasoning`` takes
    them (a request's grammar starts after it): the think block's tags; for harmony, a message's
    start and the opening of the final channel's body."""
    return (HARMONY_START, f"{CHANNEL}final{MESSAGE}") if parser == HARMONY else (START, END)


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply (None where empty)."""
    reasoning, answer = reasoning_split(parser).feed(text, True)
    return reasoning or None, answer or None
