"""Sampler: turns the LM head's logits into (token, logprob) per sequence.

The token comes from `kernels.sample_tokens` (Gumbel-max over a counter RNG keyed by the
sequence's seed and output index, after min_tokens/top-k/top-p filtering); the logprob is
``gather_logprobs(logits, token, T)`` on the *unfiltered* logits at the sequence's temperature
(1.0 for greedy): the quantity training recomputes with ``token_logprobs``, by the same kernel.
"""

from __future__ import annotations

import numpy as np
import torch

from vexact_models.kernels import gather_logprobs, sample_tokens
from vexact_models.kernels.sampling import filter_thresholds

from .sequence import Sequence
from .staging import to_device


class Sampler:
    """Samples one token per row of fp32 logits for the given sequences."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self._rows: _RowParams | None = None  # the last call's, reused for the same sequences

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens that may not be sampled yet: stop tokens and EOS before ``min_tokens``."""
        if seq.num_output_tokens >= seq.params.min_tokens:
            return []
        banned = list(seq.params.stop_token_ids)
        if self.eos_token_id is not None and not seq.params.ignore_eos:
            banned.append(self.eos_token_id)
        return banned

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        if not seqs:
            return [], []
        rows = self._rows
        if rows is None or rows.device != logits.device or rows.seqs != seqs:  # identity per element
            rows = self._rows = _RowParams(seqs, logits.device)
        else:
            rows.refresh()
        sample_logits = logits
        # Bans apply only to sequences still short of min_tokens: found with one vector compare.
        banned = [(i, tok) for i in np.flatnonzero(rows.step < rows.min_tokens).tolist()
                  for tok in self._banned(seqs[i])]
        if banned:
            ban_rows, ban_cols = zip(*banned)
            sample_logits = logits.clone()
            sample_logits[list(ban_rows), list(ban_cols)] = float("-inf")
        thresholds = None
        if rows.filters:
            thresholds = filter_thresholds(sample_logits, rows.temps, rows.top_k, rows.top_p)
        tokens = sample_tokens(sample_logits, rows.temps, rows.seeds, rows.steps, thresholds)
        logprobs = gather_logprobs(logits, tokens, rows.logprob_temps)
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # the step's one host sync
        return both[0].long().tolist(), both[1].float().tolist()


class _RowParams:
    """The sampling parameters of a list of sequences, on the host and on the device.

    A sequence's params and seed never change over its life, so while a decode batch keeps its
    sequences (most steps) only the RNG counters ``step`` are read again and copied; a new list
    of sequences is read once, one Python pass per field. Either way one pinned copy."""

    def __init__(self, seqs: list[Sequence], device: torch.device) -> None:
        n = len(seqs)
        self.seqs, self.device = list(seqs), device
        params = [s.params for s in seqs]
        temperature = np.fromiter((p.temperature for p in params), np.float64, n)
        top_p = np.fromiter((p.top_p for p in params), np.float64, n)
        top_k = np.fromiter((p.top_k for p in params), np.int64, n)
        self.min_tokens = np.fromiter((p.min_tokens for p in params), np.int64, n)
        #: whether any row needs top-k/top-p thresholds (greedy rows are never filtered)
        self.filters = bool(((temperature > 0) & ((top_k > 0) | (top_p < 1))).any())
        # fp32 as the kernels take it, rounded on the host exactly as .float() would on the device;
        # the logprob is taken at T = 1 for greedy rows.
        temps = temperature.astype(np.float32)
        self.step = self._read_steps()
        (self.temps, self.logprob_temps, self.top_p, self.top_k, self.seeds, self.steps) = to_device(
            [temps, np.where(temps > 0, temps, np.float32(1)), top_p, top_k,
             np.fromiter((s.seed for s in seqs), np.int64, n), self.step], device)

    def refresh(self) -> None:
        """Re-read and copy the RNG counters (the index of the token each sequence generates)."""
        self.step = self._read_steps()
        [self.steps] = to_device([self.step], self.device)

    def _read_steps(self) -> np.ndarray:
        return np.fromiter((len(s.token_ids) - s.num_prompt_tokens for s in self.seqs), np.int64, len(self.seqs))
