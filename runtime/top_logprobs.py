"""The most probable tokens at each sampled position, as vLLM returns them
(``SamplingParams(logprobs=k)``: ``CompletionOutput.logprobs[i]`` a dict ``{token_id: Logprob}``).

For the rows of a step whose requests ask for them, on the device right after the sampler and
before the next step is launched (a captured step's logits buffer is read before the next replay
writes it): the k largest logits of the row (``torch.topk``), then `gather_logprobs` of the sampled
token and those k together, ``[rows, k + 1]`` targets, at the row's logprob temperature. An entry
is bitwise the one-target gather of its token (`gather_logprobs`' contract), so the sampled
token's entry is the float the engine reports without ``logprobs`` (docs/design.md rule 7), and
every entry is what the training forward's ``token_logprobs`` gives that token at that position.
The sampled token's ``rank`` is 1 + the number of logits above its own (ties share a rank); the
alternatives are ranked 1..k in the order ``topk`` returns them. Results reach the host through
pinned memory at the step's one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.kernels import gather_logprobs

from .sequence import Sequence
from .staging import HostCopy, to_device

__all__ = ["Alternatives", "Logprob", "completion_logprobs", "launch_alternatives"]


@dataclass(slots=True)
class Logprob:
    """One token's entry at a sampled position, as vLLM's ``Logprob``: its logprob at the
    request's temperature, its rank among the vocabulary (1: the most probable) and its text
    (None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class Alternatives:
    """A step's alternatives on their way to the host: for each asking row, the targets
    (sampled token, then the k most probable), their logprobs and the sampled token's rank."""

    def __init__(self, seqs: list[Sequence], indices: list[int], targets: torch.Tensor, logprobs: torch.Tensor,
                 ranks: torch.Tensor) -> None:
        self.seqs, self.indices = seqs, indices
        self._host = HostCopy([targets, logprobs, ranks])  # `record` waits

    def record(self) -> None:
        """Store each row's ``(token ids, logprobs, sampled token's rank)`` on its sequence, under
        the index of the token sampled there (waits for the device)."""
        targets, logprobs, ranks = (t.tolist() for t in self._host.result())
        for seq, index, ids, lps, rank in zip(self.seqs, self.indices, targets, logprobs, ranks):
            k = seq.params.logprobs
            seq.top_logprobs[index] = (ids[:k + 1], lps[:k + 1], rank)


def launch_alternatives(logits: torch.Tensor, tokens: torch.Tensor, logprob_temps: torch.Tensor,
                        seqs: list[Sequence], steps: np.ndarray, rows: list[int]) -> Alternatives:
    """Start the alternatives of `rows` of `logits` (those whose sequences ask for them, at
    least one). `tokens` are all rows' sampled tokens (on the device), `logprob_temps` the
    temperatures their logprobs take, `steps` the index each row's token gets in its sequence."""
    k = max(seqs[i].params.logprobs for i in rows)
    sub, sampled, temps = logits, tokens[:, None], logprob_temps
    if len(rows) < len(seqs):  # (every row asks, the common case: no copy)
        [index] = to_device([np.asarray(rows, np.int64)], logits.device)
        sub, sampled, temps = logits.index_select(0, index), sampled.index_select(0, index), temps.index_select(0, index)
    top = torch.topk(sub, k, dim=1).indices if k else sampled[:, :0]
    targets = torch.cat([sampled, top], dim=1)
    ranks = (sub > sub.gather(1, sampled)).sum(dim=1) + 1
    logprobs = gather_logprobs(sub, targets, temps)
    return Alternatives([seqs[i] for i in rows], [int(steps[i]) for i in rows], targets, logprobs, ranks)


def completion_logprobs(seq: Sequence, tokenizer=None) -> list[dict[int, Logprob]]:
    """vLLM's per-position dicts of a finished sequence that asked for ``logprobs``: the sampled
    token first, then its alternatives (rank 1 first); a token among both appears once. Each
    distinct token is decoded once (``decoded_token``; None without a tokenizer)."""
    out = []
    for index in range(seq.num_output_tokens):
        ids, lps, rank = seq.top_logprobs[index]
        entry = {ids[0]: Logprob(lps[0], rank)}
        for alt_rank, token in enumerate(ids[1:], start=1):
            if token not in entry:
                entry[token] = Logprob(lps[alt_rank], alt_rank)
        out.append(entry)
    if tokenizer is not None:
        distinct = sorted({token for entry in out for token in entry})
        text = dict(zip(distinct, tokenizer.batch_decode([[t] for t in distinct])))
        for entry in out:
            for token, value in entry.items():
                value.decoded_token = text[token]
    return out
