"""A chat reply's reasoning split from its answer, as vLLM's ``--reasoning-parser`` splits it (the
server's replies carry it as ``reasoning``, vLLM's field; `runtime.openai_protocol`).

The ``<think>`` parsers read a ``<think>`` ... ``</think>`` block that the prompt opens (Qwen3.5's,
DeepSeek-R1's, MiniMax-M2's templates) or the reply does (Qwen3's older ones): the reply reasons
until ``</think>`` (a ``<think>`` it begins with dropped), and a reply cut short before it is all
reasoning:

- ``qwen3`` (Qwen3, Qwen3.5, as vLLM's current parser): a prompt that closed its think block
  (``enable_thinking: false``: the template wrote an empty block) makes the reply all answer
  (`reply_parser`), as the grammar after the reasoning then holds it from its first token
  (`runtime.grammar_masks.grammar_trigger`, which reads the prompt the same way);
- ``deepseek_r1`` (DeepSeek-R1, Qwen3's thinking-only models) and ``minimax_m2`` (MiniMax-M2):
  the reply reasons until ``</think>`` whatever the prompt;
- ``minimax_m2_append_think`` (MiniMax-M2, for clients that keep the think block in the
  conversation, as MiniMax asks of multi-turn tool use): no reasoning; the answer is the whole reply
  after the ``<think>`` its prompt opened.

`ReasoningSplit` reads a reply as it streams, holding back only what may still begin a tag; a
whole reply is read the same way, so a stream's pieces always add up to the whole reply's split.
The tool parsers read the answer alone.

- ``openai_gptoss`` (GPT-OSS): the reply's harmony messages (`runtime.harmony`): its ``analysis``
  messages are the reasoning, its ``final`` ones and preambles the answer; its calls are read
  beside them (``--tool-call-parser openai``).
"""

from __future__ import annotations

from .harmony import CHANNEL, MESSAGE, START as HARMONY_START, HarmonyReader
from .text_deltas import tag_prefix

__all__ = ["APPEND_THINK", "HARMONY", "PARSERS", "AppendThink", "ReasoningSplit", "reasoning_block", "reasoning_split",
           "reply_parser", "split_reasoning"]

START, END = "<think>", "</think>"

#: the ``<think>`` parsers
THINK: tuple[str, ...] = ("qwen3", "deepseek_r1", "minimax_m2")
#: those whose reply is all answer after a prompt that closed its think block (thinking off)
ANSWER_AFTER_CLOSED: tuple[str, ...] = ("qwen3",)
HARMONY = "openai_gptoss"
APPEND_THINK = "minimax_m2_append_think"
#: vLLM's ``--reasoning-parser`` names
PARSERS: tuple[str, ...] = (*THINK, HARMONY, APPEND_THINK)


class ReasoningSplit:
    """One reply's split, fed its text as it comes: `feed` returns each new piece of reasoning and
    of answer."""

    def __init__(self, parser: str) -> None:
        if parser not in THINK:
            raise ValueError(f"ReasoningSplit: parser={parser!r} is not one of the <think> parsers {list(THINK)}")
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
                self.state = "reasoning"  # (the prompt opened the block)
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


def reply_parser(parser: str | None, prompt_closed: bool) -> str | None:
    """The parser that splits a reply to a prompt that closed its reasoning block or not (the
    server's `parser`, or None: the reply is all answer, as ``qwen3``'s after thinking off)."""
    return None if prompt_closed and parser in ANSWER_AFTER_CLOSED else parser


def split_reasoning(parser: str, text: str) -> tuple[str | None, str | None]:
    """(reasoning, answer) of a whole reply (None where empty)."""
    reasoning, answer = reasoning_split(parser).feed(text, True)
    return reasoning or None, answer or None
