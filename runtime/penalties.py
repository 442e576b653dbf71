"""vLLM's ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty``: per-sequence
token counts kept on the device, and the rows of a sampling batch that use them.

Each sequence whose request sets a penalty gets a slot of `PenaltyCounts` on its first sampling
step: a row of ``counts`` (int32, how often it generated each token) and one of ``in_prompt``
(whether each token is in its prompt), filled from the host once. After that the device keeps the
counts itself: each step adds the tokens it just sampled (`PenaltyRows.count`), in stream order
before the next step's sampling reads them, so the host never sends them and steps launched ahead
of the host (`runtime.llm_steps`) count the token in flight. A row that a step ahead samples for
a sequence that stopped is counted into its slot and dropped; that sequence samples no more, and
a later owner of the slot clears it first (stream order again).

The sampler applies them with `kernels.apply_penalties` before min-p/top-k/top-p and Gumbel-max
(vLLM's order). They change which token is sampled, deterministically from the sequence's own
tokens: no other row's state enters, so a request samples the same tokens in any batch, under
preemption (its outputs are kept) and with any step sizes (rules 1 and 7). The reported logprob
stays the unpenalised one that training recomputes (rule 7; `SamplingParams`' ``logprobs``: where vLLM's differ).

Memory: 5 bytes per vocabulary entry per slot (0.76 MB at Qwen3's 151,936), not budgeted with the
KV cache: 195 MB for 256 sequences. A slot is freed when its sequence finishes; a call that uses no
penalties frees the tensors (`PenaltyCounts` is made again when one does).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.kernels import apply_penalties

from .sequence import Sequence
from .staging import to_device

__all__ = ["PenaltyCounts", "PenaltyRows"]

_MIN_SLOTS = 8  # the first allocation; it doubles as sequences need more


class PenaltyCounts:
    """The device counts of the sequences that use penalties, one slot each (the module docstring)."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        """No slot yet: zero-row tensors, grown at the first sequence that uses penalties."""
        self.vocab_size, self.device = vocab_size, device
        self.counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._slot: dict[int, int] = {}  # seq_id -> slot
        self._owner: dict[int, Sequence] = {}  # slot -> its sequence
        self._free: list[int] = []

    @property
    def num_slots(self) -> int:
        return self.counts.shape[0]

    def slots_of(self, seqs: list[Sequence]) -> list[int]:
        """Each sequence's slot, giving the ones without one a slot filled from the host (its
        prompt's tokens, and the outputs it already has, none at its first sampling step)."""
        new = [seq for seq in seqs if seq.seq_id not in self._slot]
        if new:
            self._take_slots(new)
        return [self._slot[seq.seq_id] for seq in seqs]

    def _take_slots(self, seqs: list[Sequence]) -> None:
        if len(self._free) < len(seqs):
            self._free += [slot for slot, owner in self._owner.items() if owner.is_finished]
            for slot in self._free:
                self._forget(slot)
        if len(self._free) < len(seqs):
            self._grow(len(self._owner) + len(seqs))
        slots = [self._free.pop() for _ in seqs]
        for seq, slot in zip(seqs, slots):
            self._slot[seq.seq_id], self._owner[slot] = slot, seq
        prompt = [seq.token_ids[:seq.num_prompt_tokens] for seq in seqs]
        outputs = [seq.output_token_ids for seq in seqs]
        slot_ids, p_rows, p_cols, o_rows, o_cols = to_device(
            [np.array(slots, np.int64), *_pairs(slots, prompt), *_pairs(slots, outputs)], self.device)
        self.counts.index_fill_(0, slot_ids, 0)
        self.in_prompt.index_fill_(0, slot_ids, False)
        # values made on the device: a Python scalar would be copied there from pageable memory (a sync)
        self.in_prompt.index_put_((p_rows, p_cols), torch.ones_like(p_cols, dtype=torch.bool))
        self.counts.index_put_((o_rows, o_cols), torch.ones_like(o_cols, dtype=torch.int32), accumulate=True)

    def _forget(self, slot: int) -> None:
        owner = self._owner.pop(slot, None)
        if owner is not None:
            del self._slot[owner.seq_id]

    def _grow(self, needed: int) -> None:
        """Room for `needed` slots at least (doubling), the held slots' rows copied."""
        old = self.num_slots
        size = max(needed, 2 * old, _MIN_SLOTS)
        counts = torch.zeros(size, self.vocab_size, dtype=torch.int32, device=self.device)
        in_prompt = torch.zeros(size, self.vocab_size, dtype=torch.bool, device=self.device)
        counts[:old], in_prompt[:old] = self.counts, self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free = sorted(set(self._free) | set(range(old, size)), reverse=True)  # the lowest slots first

    def rows(self, seqs: list[Sequence]) -> PenaltyRows | None:
        """The penalty rows of a sampling batch of `seqs` (None when no sequence uses penalties)."""
        using = [i for i, seq in enumerate(seqs) if seq.params.uses_penalties]
        if not using:
            return None
        slots = np.full(len(seqs), -1, np.int64)
        slots[using] = self.slots_of([seqs[i] for i in using])
        params = [seq.params for seq in seqs]
        rep = np.array([p.repetition_penalty for p in params], np.float32)
        freq = np.array([p.frequency_penalty for p in params], np.float32)
        pres = np.array([p.presence_penalty for p in params], np.float32)
        every = len(using) == len(seqs)
        arrays = [slots, rep, freq, pres] + ([] if every else [np.array(using, np.int64)])
        slots_dev, rep_dev, freq_dev, pres_dev, *using_dev = to_device(arrays, self.device)
        counted = slots_dev if every else slots_dev.index_select(0, using_dev[0])
        return PenaltyRows(self, slots_dev, rep_dev, freq_dev, pres_dev, None if every else using_dev[0], counted)


def _pairs(slots: list[int], tokens: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(slot, token) pairs of each slot's tokens, as two int64 arrays."""
    rows = np.repeat(np.array(slots, np.int64), [len(t) for t in tokens])
    cols = np.fromiter((tok for t in tokens for tok in t), np.int64, len(rows))
    return rows, cols


@dataclass
class PenaltyRows:
    """The rows of one sampling batch that use penalties, on the device: read once per list of
    sequences (the sampler's row cache), like the other sampling parameters."""

    counts: PenaltyCounts
    slots: torch.Tensor  #: int64 [R]: each row's slot, -1 for a row without penalties
    repetition: torch.Tensor  #: fp32 [R]
    frequency: torch.Tensor  #: fp32 [R]
    presence: torch.Tensor  #: fp32 [R]
    using: torch.Tensor | None  #: int64: the rows with penalties (None: every row)
    counted: torch.Tensor  #: int64: their slots, in that order

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalised copy of the batch's fp32 logits (`kernels.apply_penalties`)."""
        c = self.counts
        return apply_penalties(logits, c.counts, c.in_prompt, self.slots, self.repetition, self.frequency,
                               self.presence)

    def count(self, tokens: torch.Tensor) -> None:
        """Add the batch's sampled `tokens` (int64 ``[R]``, on the device) to their rows' slots."""
        sampled = tokens if self.using is None else tokens.index_select(0, self.using)
        self.counts.counts.index_put_((self.counted, sampled), torch.ones_like(sampled, dtype=torch.int32),
                                      accumulate=True)
