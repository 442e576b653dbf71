"""The token masks of constrained rows (`runtime.structured_outputs`).

Each constrained sequence holds a `GrammarState`: xgrammar's matcher, fed the sequence's tokens as
the scheduler records them (`Scheduler.postprocess`, which also ends the sequence when its grammar
has accepted a stop token). When a sampling batch holds constrained rows, each step fills their
bitmasks on the host from the matchers (xgrammar's layout: bit ``t % 32`` of int32 word ``t // 32``
allows token ``t``), sends them in one pinned copy, and the sampler sets the logits of the tokens
they do not allow to -inf on the device (`GrammarMasks.apply`), before any other edit.

A row's next mask needs its last token on the host, so while a constrained sequence runs, a step
scheduled ahead of the host runs its forward at once and samples after the step before it is
postprocessed (`runtime.llm_steps`); the masks are filled beside that forward.

A grammar that starts after the reasoning (``StructuredOutputsParams.after_reasoning``) waits
until the sequence's outputs end with the reasoning end's tokens (`grammar_trigger`): until then
its row allows every token and its matcher is fed nothing; the tokens after the trigger are the
grammar's. Harmony's end, ``<|channel|>final<|message|>``, is matched as vLLM's GPT-OSS parser
matches it: ``<|message|>`` may begin up to 20 tokens after ``<|channel|>final`` (a header's
content type between, ``<|channel|>final <|constrain|>json<|message|>``).
"""

from __future__ import annotations

import sys
from collections import deque
from dataclasses import dataclass
from itertools import takewhile

import numpy as np
import torch

from .harmony import CHANNEL, MESSAGE
from .sequence import Sequence
from .staging import to_device
from .structured_outputs import xgrammar_module

__all__ = ["GrammarMasks", "GrammarRows", "GrammarState", "Trigger", "allowed_tokens", "grammar_trigger"]

#: harmony's reasoning end, in its two parts, and the most tokens that may come between them (vLLM's)
HARMONY_FINAL, HARMONY_GAP = (f"{CHANNEL}final", MESSAGE), 20

assert sys.byteorder == "little", "GrammarMasks.apply reads xgrammar's int32 words as bytes, lowest first"


@dataclass(frozen=True)
class Trigger:
    """The token ids after which a grammar holds a sequence's outputs: `end`, or with `then`,
    `end` and then `then` beginning within `gap` tokens after it; `pending`: the prompt's tokens
    after its last `end`, when `then` may still follow them (None: none)."""

    end: tuple[int, ...]
    then: tuple[int, ...] = ()
    gap: int = 0
    pending: tuple[int, ...] | None = None


class GrammarState:
    """One sequence's place in its grammar: xgrammar's ``GrammarMatcher``, how many of the
    sequence's outputs it has seen, and the `trigger` it waits for (`grammar_trigger`'s; None: the
    grammar holds the outputs from the first)."""

    def __init__(self, matcher, trigger: Trigger | None = None) -> None:
        self.matcher = matcher
        self.accepted = 0  #: output tokens fed so far (those before the trigger too)
        self.trigger = trigger
        self.active = self.trigger is None  #: whether the grammar holds the next output
        if self.trigger is not None:  # the last outputs while waiting: for `end`, and since it for `then`
            self._tail: deque[int] = deque(maxlen=len(self.trigger.end))
            self._then: deque[int] = deque(self.trigger.pending or (), maxlen=len(self.trigger.then))
            self._since = None if self.trigger.pending is None else len(self.trigger.pending)

    def accept(self, token: int) -> bool:
        """Feed the sequence's next output token; False when the grammar does not allow it (a row
        whose other settings left it no token the grammar allows: `Scheduler.postprocess`)."""
        if not self.active:
            self.active = self._wait(token)
        elif not self.matcher.accept_token(token):
            return False
        self.accepted += 1
        return True

    def _wait(self, token: int) -> bool:
        """Whether `token` completes the trigger (a few tuple compares a token: no search)."""
        trigger = self.trigger
        self._tail.append(token)
        if not trigger.then:
            return tuple(self._tail) == trigger.end
        if self._since is not None:  # (after an `end`: `then` may begin within `gap` tokens of it)
            self._since += 1
            self._then.append(token)
            if tuple(self._then) == trigger.then:
                return True
            if self._since - len(trigger.then) + 1 >= trigger.gap:
                self._since = None
        if tuple(self._tail) == trigger.end:
            self._since = 0
            self._then.clear()
        return False

    @property
    def terminated(self) -> bool:
        """Whether the grammar has accepted a stop token after a complete output."""
        return self.active and self.matcher.is_terminated()


def grammar_trigger(tokenizer, after_reasoning: tuple[str, str] | None, prompt: list[int]) -> Trigger | None:
    """The `Trigger` a sequence's grammar waits for: the reasoning end's tokens (harmony's in its
    two parts, `HARMONY_FINAL`), unless the `prompt` already closed its last reasoning block (its
    last start's tokens followed by the end's) or no ``after_reasoning`` is set (then None: the
    grammar holds every output)."""
    if after_reasoning is None:
        return None
    ids = lambda text: tuple(tokenizer.encode(text, add_special_tokens=False))  # noqa: E731
    start_text, end_text = after_reasoning
    if end_text == "".join(HARMONY_FINAL):
        trigger = Trigger(ids(HARMONY_FINAL[0]), ids(HARMONY_FINAL[1]), HARMONY_GAP)
    else:
        trigger = Trigger(ids(end_text))
    opened = _last(ids(start_text), prompt)
    if opened < 0:
        return trigger
    if not trigger.then:
        return None if _last(trigger.end, prompt) > opened else trigger
    ends = list(takewhile(lambda at: at > opened, _places(trigger.end, prompt)))  # (the block's, from the last)
    reach = trigger.gap + len(trigger.then) - 1  # (the tokens after an end in which `then` may lie)
    for at in ends:
        after = prompt[at + len(trigger.end):at + len(trigger.end) + reach]
        if any(tuple(after[i:i + len(trigger.then)]) == trigger.then for i in range(trigger.gap)):
            return None
    last = prompt[ends[0] + len(trigger.end):] if ends else None
    if last is not None and len(last) < reach:  # (the prompt ends in a header: `then` may still follow)
        return Trigger(trigger.end, trigger.then, trigger.gap, tuple(last))
    return trigger


def _last(part: tuple[int, ...], ids: list[int]) -> int:
    """Where `part` last begins in `ids` (-1: nowhere)."""
    return next(_places(part, ids), -1)


def _places(part: tuple[int, ...], ids: list[int]):
    """Where `part` begins in `ids`, from the last: its first token's places, found from the end by
    the list's own search (a long prompt without the part costs no Python loop over its tokens)."""
    backwards, n, at = ids[::-1], len(part), 0
    while True:
        try:
            at = backwards.index(part[0], at)
        except ValueError:
            return
        start = len(ids) - 1 - at
        if tuple(ids[start:start + n]) == part:
            yield start
        at += 1


@dataclass
class GrammarMasks:
    """One step's masks of the constrained rows of a sampling batch, on the device."""

    rows: torch.Tensor  #: int64 [C]: the constrained rows
    bits: torch.Tensor  #: int32 [C, ceil(vocab / 32)]: xgrammar's bitmasks

    every_row: bool = False  #: whether the rows are all the batch's, in order

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A copy of the batch's fp32 logits, -inf where a constrained row's grammar does not
        allow the token."""
        allowed = allowed_tokens(self.bits, logits.shape[1])
        if self.every_row:
            return torch.where(allowed, logits, float("-inf"))
        out = logits.clone()
        out.index_copy_(0, self.rows, torch.where(allowed, out.index_select(0, self.rows), float("-inf")))
        return out


def allowed_tokens(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool ``[C, vocab]`` from xgrammar's int32 bitmasks ``[C, W]``: token t is allowed where bit
    ``t % 32`` of word ``t // 32`` is set (a word's bytes, lowest first, hold its bits 8 at a time)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=bits.device)
    bytes_ = bits.contiguous().view(torch.uint8)
    return ((bytes_.unsqueeze(-1) >> shifts) & 1).view(bits.shape[0], -1)[:, :vocab].bool()


class GrammarRows:
    """The constrained rows of a sampling batch (the sampler's row cache holds it while the batch
    keeps its sequences); `launch` makes each step's masks."""

    def __init__(self, rows: list[int], seqs: list[Sequence], batch: int) -> None:
        self.rows, self.seqs = rows, seqs
        self.every_row = rows == list(range(batch))
        self._rows_dev: torch.Tensor | None = None
        self._fill = xgrammar_module().BatchGrammarMatcher()  # fills the rows' masks in threads

    @classmethod
    def of(cls, seqs: list[Sequence]) -> GrammarRows | None:
        """The constrained rows of `seqs` (None when no sequence has a grammar)."""
        rows = [i for i, seq in enumerate(seqs) if seq.grammar is not None]
        return cls(rows, [seqs[i] for i in rows], len(seqs)) if rows else None

    def launch(self, vocab: int, device: torch.device) -> GrammarMasks:
        """This step's masks: filled on the host from each running row's matcher, which must have
        accepted every output token of its sequence (its sampling did not run ahead of the host),
        straight into fresh pinned memory (on CUDA; the pinned cache hands it out again only once
        its copy is done), and sent in one copy. A sequence finished since its step was launched
        ahead (its row's result is dropped), or whose grammar waits for its trigger, allows every token."""
        live = [i for i, seq in enumerate(self.seqs) if not seq.is_finished]
        for seq in (self.seqs[i] for i in live):
            if seq.grammar.accepted != seq.num_output_tokens:
                raise RuntimeError(f"{seq!r}: its grammar has accepted {seq.grammar.accepted} of its "
                                   f"{seq.num_output_tokens} output tokens (a step sampled ahead of the host)")
        held = [i for i in live if self.seqs[i].grammar.active]  # (one still waiting for its trigger allows every token)
        cuda = device.type == "cuda"
        bits = torch.empty(len(self.seqs), (vocab + 31) // 32, dtype=torch.int32, pin_memory=cuda)
        if len(held) < len(self.seqs):
            bits.fill_(-1)
        if held:
            self._fill.batch_fill_next_token_bitmask([self.seqs[i].grammar.matcher for i in held], bits,
                                                     indices=held if len(held) < len(self.seqs) else None)
        if self._rows_dev is None or self._rows_dev.device != device:
            [self._rows_dev] = to_device([np.array(self.rows, np.int64)], device)
        return GrammarMasks(self._rows_dev, bits.to(device, non_blocking=cuda), self.every_row)
