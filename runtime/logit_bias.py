"""vLLM's ``allowed_token_ids`` and ``logit_bias``: per-request edits of the logits a token is
sampled from, read once per list of sequences (the sampler's row cache) since a request's lists
never change.

``allowed_token_ids`` leaves only those tokens samplable (the others' logits -inf), ``logit_bias``
adds its value to each listed token's logit; both come before the penalties and the min-p/top-k/
top-p filters, in vLLM's order. Each edits its own row from its own request's parameters, so a
request samples the same tokens in any batch (rule 7); the reported logprob stays the unedited one
that training recomputes, as for the filters (`SamplingParams`' ``logprobs``: where vLLM's differ).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .sequence import Sequence
from .staging import to_device

__all__ = ["LogitEdits", "check_token_lists"]


def check_token_lists(params: list, vocab: int) -> None:
    """Raise ValueError naming the first ``allowed_token_ids`` entry or ``logit_bias`` key of
    `params` (`SamplingParams`) outside the vocabulary ``[0, vocab)`` (``LLM.generate``'s check)."""
    for p in params:
        for name, ids in (("allowed_token_ids", p.allowed_token_ids or ()), ("logit_bias", p.logit_bias or {})):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(f"LLM.generate: SamplingParams.{name} holds token id {bad[0]}, outside the vocabulary "
                                 f"[0, {vocab})")


@dataclass
class LogitEdits:
    """The allowed-token masks and biases of a sampling batch's rows, on the device."""

    allowed_rows: torch.Tensor | None  #: int64: the rows restricted to their allowed tokens
    allowed: torch.Tensor | None  #: bool [len(allowed_rows), vocab]: which tokens each may sample
    bias_at: tuple[torch.Tensor, torch.Tensor] | None  #: (rows, tokens) int64 of the biases
    bias: torch.Tensor | None  #: fp32: their values

    @classmethod
    def of(cls, seqs: list[Sequence], vocab: int, device: torch.device) -> LogitEdits | None:
        """The edits of a batch of `seqs` (None when no request sets either field)."""
        params = [seq.params for seq in seqs]
        restricted = [i for i, p in enumerate(params) if p.allowed_token_ids is not None]
        biased = [(i, tok, value) for i, p in enumerate(params) for tok, value in (p.logit_bias or {}).items()]
        if not restricted and not biased:
            return None
        allowed_pairs = [(k, tok) for k, i in enumerate(restricted) for tok in params[i].allowed_token_ids]
        rows, a_rows, a_cols, b_rows, b_cols, b_values = to_device(
            [np.array(restricted, np.int64), *_columns(allowed_pairs, 2, np.int64),
             *_columns([(i, tok) for i, tok, _ in biased], 2, np.int64),
             np.array([value for _, _, value in biased], np.float32)], device)
        allowed = None
        if restricted:
            allowed = torch.zeros(len(restricted), vocab, dtype=torch.bool, device=device)
            allowed.index_put_((a_rows, a_cols), torch.ones_like(a_cols, dtype=torch.bool))  # (no host scalar: a sync)
        return cls(rows if restricted else None, allowed, (b_rows, b_cols) if biased else None,
                   b_values if biased else None)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The edited copy of the batch's fp32 logits."""
        out = logits.clone()
        if self.allowed_rows is not None:
            rows = out.index_select(0, self.allowed_rows)
            out.index_copy_(0, self.allowed_rows, torch.where(self.allowed, rows, float("-inf")))
        if self.bias is not None:  # (each (row, token) once: a dict's keys)
            out.index_put_(self.bias_at, out[self.bias_at] + self.bias)
        return out


def _columns(pairs: list[tuple], width: int, dtype) -> list[np.ndarray]:
    """The `width` columns of `pairs` as arrays (empty ones when there are none)."""
    table = np.array(pairs, dtype).reshape(-1, width)
    return [np.ascontiguousarray(table[:, i]) for i in range(width)]
