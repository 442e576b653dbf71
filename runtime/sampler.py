"""Sampler: turns the LM head's logits into (token, logprob) per sequence.

The token comes from `kernels.sample_tokens` (Gumbel-max over a counter RNG keyed by the
sequence's seed and output index, after min_tokens/top-k/top-p filtering); the logprob is
``gather_logprobs(logits, token, T)`` on the *unfiltered* logits at the sequence's temperature
(1.0 for greedy): the quantity training recomputes with ``token_logprobs``, by the same kernel.
"""

from __future__ import annotations

import torch

from vexact_models.kernels import gather_logprobs, sample_tokens
from vexact_models.kernels.sampling import filter_thresholds

from .sequence import Sequence


class Sampler:
    """Samples one token per row of fp32 logits for the given sequences."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id

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
        device = logits.device
        params = [s.params for s in seqs]
        meta = torch.tensor([[p.temperature, p.top_p, float(p.top_k)] for p in params], dtype=torch.float64)
        counters = torch.tensor([[s.seed, s.num_output_tokens] for s in seqs], dtype=torch.int64)
        meta, counters = meta.to(device, non_blocking=True), counters.to(device, non_blocking=True)
        temps = meta[:, 0].float()
        sample_logits = logits
        banned = [(i, tok) for i, s in enumerate(seqs) for tok in self._banned(s)]
        if banned:
            rows, cols = zip(*banned)
            sample_logits = logits.clone()
            sample_logits[list(rows), list(cols)] = float("-inf")
        thresholds = None
        if any(p.temperature > 0 and (p.top_k > 0 or p.top_p < 1) for p in params):
            thresholds = filter_thresholds(sample_logits, temps, meta[:, 2].long(), meta[:, 1])
        tokens = sample_tokens(sample_logits, temps, counters[:, 0], counters[:, 1], thresholds)
        logprobs = gather_logprobs(logits, tokens, torch.where(temps > 0, temps, torch.ones_like(temps)))
        both = torch.stack([tokens.double(), logprobs.double()]).cpu()  # the step's one host sync
        return [int(t) for t in both[0]], both[1].float().tolist()
