"""The most probable tokens at a position, as vLLM returns them: at each sampled position
(``SamplingParams(logprobs=k)``: ``CompletionOutput.logprobs[i]`` a dict ``{token_id: Logprob}``)
and at each prompt position (``SamplingParams(prompt_logprobs=k)``: ``RequestOutput.prompt_logprobs``,
the logprob of prompt token i after tokens 0..i-1, None for the first).

For the rows of a step that ask for them, on the device before the next step is launched (a
captured step's logits buffer is read before the next replay writes it): the k largest logits of
the row and the own token's rank (`kernels.top_tokens`: one pass over the row, equal logits taken
lowest id first), then `gather_logprobs` of the position's own token (the sampled one, or
the prompt's next token) and those k together, ``[rows, k + 1]`` targets, at the request's
logprob temperature (1 for greedy). An entry is bitwise the one-target gather of its token
(`gather_logprobs`' contract): the sampled token's entry is the float the engine reports without
``logprobs`` (docs/design.md rule 7), and every entry is what the training forward's
``token_logprobs`` gives that token at that position. The own token's ``rank`` is 1 + the number
of logits above its own (ties share a rank); the alternatives are ranked 1..k in the order
`top_tokens` returns them. Results reach the host through pinned memory at the step's host sync;
the output's dicts are built when read (`PositionLogprobs`).

Prompt positions get logits only where a request asks (`prompt_rows_of`): the runner then runs
the step eagerly and returns those rows' final hidden states beside the sampling rows' logits
(`ModelRunner.execute_scoring`), and their logits are computed `PROMPT_ROWS_AT_ONCE` rows at a
time, the final norm and LM head being row-wise (rule 3): the sampling rows' bits do not move, and
a long prompt chunk never holds all its positions' fp32 logits at once. Only the
request's first sample scores its prompt; it takes no published page before its prompt is
scored (`Sequence.prompt_unscored`, `BlockManager`), so every position is computed once.
"""

from __future__ import annotations

from collections import abc
from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.kernels import gather_logprobs, top_tokens

from .scheduled import ScheduledSeq
from .sequence import Sequence
from .staging import HostCopy, to_device

__all__ = ["Alternatives", "AskingRows", "Logprob", "PositionLogprobs", "PromptRows", "Stored", "completion_logprobs",
           "launch_prompt_alternatives", "prompt_logprobs_of", "prompt_rows_of"]


@dataclass(slots=True)
class Logprob:
    """One token's entry at a position, as vLLM's ``Logprob``: its logprob at the request's
    temperature, its rank among the vocabulary (1: the most probable) and its text (None
    without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: what a sequence stores per position (``Sequence.top_logprobs``): its step's host arrays (the
#: targets ``[R, k + 1]``, their logprobs, the own tokens' ranks ``[R]``), its row there and its k
Stored = tuple[np.ndarray, np.ndarray, np.ndarray, int, int]


class Alternatives:
    """Alternatives on their way to the host: for each row, the targets (the position's own
    token, then the k most probable), their logprobs and the own token's rank; `record` stores
    ``(arrays, row, ks[i])`` in ``stores[i][indices[i]]`` (`Stored`)."""

    def __init__(self, stores: list[dict], indices: list[int], ks: list[int], targets: torch.Tensor,
                 logprobs: torch.Tensor, ranks: torch.Tensor) -> None:
        self.stores, self.indices, self.ks = stores, indices, ks
        self._host = HostCopy([targets, logprobs, ranks])  # `record` waits

    def record(self) -> None:
        """Store each row's place in the step's host arrays (waits for the device). The arrays are
        read into Python values only when the output's dicts are (`PositionLogprobs`): per step, a
        row costs a tuple here, not 2k + 3 Python numbers."""
        targets, logprobs, ranks = (t.numpy().copy() for t in self._host.result())  # pageable, not pinned
        for row, (store, index, k) in enumerate(zip(self.stores, self.indices, self.ks)):
            store[index] = (targets, logprobs, ranks, row, k)


def _alternatives(logits: torch.Tensor, own: torch.Tensor, temps: torch.Tensor, k: int):
    """``(targets [R, k + 1], logprobs [R, k + 1], ranks [R])`` of the rows of `logits`, whose
    own tokens are `own` (int64 ``[R, 1]``), at `temps` (k at most the vocabulary)."""
    top, ranks = top_tokens(logits, own[:, 0], min(k, logits.shape[1]))
    targets = torch.cat([own, top], dim=1)
    return targets, gather_logprobs(logits, targets, temps), ranks


class AskingRows:
    """The rows of a sampling batch whose sequences ask for alternatives (``params.logprobs``),
    read once per list of sequences (the sampler keeps it while a decode batch keeps its
    sequences): the rows, where their alternatives are stored, how many each keeps, and on the
    device the rows' index when only some of the batch asks."""

    def __init__(self, seqs: list[Sequence], device: torch.device) -> None:
        self.rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        self.stores = [seqs[i].top_logprobs for i in self.rows]
        self.ks = [seqs[i].params.logprobs for i in self.rows]
        self.index = None  # every row asks (the common case): no copy of the rows
        if self.rows and len(self.rows) < len(seqs):
            [self.index] = to_device([np.asarray(self.rows, np.int64)], device)

    def __bool__(self) -> bool:
        return bool(self.rows)

    def launch(self, logits: torch.Tensor, tokens: torch.Tensor, logprob_temps: torch.Tensor,
               steps: np.ndarray) -> Alternatives:
        """Start the alternatives of these rows of `logits`. `tokens` are all rows' sampled
        tokens (on the device), `logprob_temps` the temperatures their logprobs take, `steps` the
        index each row's token gets in its sequence."""
        sub, sampled, temps = logits, tokens[:, None], logprob_temps
        if self.index is not None:
            sub, sampled, temps = (t.index_select(0, self.index) for t in (logits, sampled, temps))
        return Alternatives(self.stores, steps[self.rows].tolist(), self.ks,
                            *_alternatives(sub, sampled, temps, max(self.ks)))


@dataclass
class PromptRows:
    """The prompt positions a step scores: flat rows of its batch, the prompt token each row
    predicts, the request's logprob temperature, and the (sequence, prompt index) it is stored under."""

    rows: np.ndarray  #: int64 [X] flat token index in the step's batch
    targets: np.ndarray  #: int64 [X] the prompt's next token at each
    temps: np.ndarray  #: float32 [X]
    owners: list[tuple[Sequence, int]]


def prompt_rows_of(scheduled: list[ScheduledSeq]) -> PromptRows | None:
    """The prompt positions of `scheduled`'s chunks whose next token is a prompt token, for the
    sequences that score their prompt and have not yet (None when there are none): position p
    of a chunk [start, end) predicts prompt token p + 1, for p < P - 1 (the last prompt position
    samples)."""
    rows, targets, temps, owners = [], [], [], []
    offset = 0
    for item in scheduled:
        seq, count = item.seq, item.num_new_tokens
        if seq.prompt_unscored and not item.in_flight:
            start = seq.num_computed_tokens
            temp = seq.params.temperature if seq.params.temperature > 0 else 1.0
            for p in range(start, min(start + count, seq.num_prompt_tokens - 1)):
                rows.append(offset + p - start)
                targets.append(seq.token_ids[p + 1])
                temps.append(temp)
                owners.append((seq, p + 1))
        offset += count
    if not rows:
        return None
    return PromptRows(np.asarray(rows, np.int64), np.asarray(targets, np.int64), np.asarray(temps, np.float32), owners)


#: prompt positions whose fp32 logits are held at a time (`launch_prompt_alternatives`): 512 x 151,936 x 4
#: bytes = 311 MB, where a step's whole chunk (up to ``max_num_batched_tokens``) would take gigabytes
PROMPT_ROWS_AT_ONCE = 512


@torch.no_grad()  # (the head's weights may be a trainer's, which require grad)
def launch_prompt_alternatives(hidden: torch.Tensor, prompt: PromptRows, head) -> Alternatives:
    """Start the alternatives of the prompt positions whose final hidden states are `hidden`
    (``[X, hidden size]``, in `prompt`'s order): their logits (`head`, the model's
    ``final_logits``) `PROMPT_ROWS_AT_ONCE` rows at a time, the head being row-wise (rule 3)."""
    seqs = [seq for seq, _ in prompt.owners]
    ks = [seq.params.prompt_logprobs for seq in seqs]
    targets, temps = to_device([prompt.targets, prompt.temps], hidden.device)
    parts = [_alternatives(head(hidden[i:i + PROMPT_ROWS_AT_ONCE]), targets[i:i + PROMPT_ROWS_AT_ONCE, None],
                           temps[i:i + PROMPT_ROWS_AT_ONCE], max(ks))
             for i in range(0, len(hidden), PROMPT_ROWS_AT_ONCE)]
    return Alternatives([seq.prompt_top_logprobs for seq in seqs], [index for _, index in prompt.owners], ks,
                        *(torch.cat(part) for part in zip(*parts)))


def completion_logprobs(seq: Sequence, tokenizer=None, start: int = 0) -> PositionLogprobs:
    """vLLM's per-position dicts of a sequence that asked for ``logprobs``, from output `start`
    on: the sampled token first, then its alternatives (rank 1 first); a token among both appears
    once; each token's ``decoded_token`` from `tokenizer` (None without one). Built as they are
    read (`PositionLogprobs`)."""
    return PositionLogprobs([seq.top_logprobs[i] for i in range(start, seq.num_output_tokens)], tokenizer)


def prompt_logprobs_of(seq: Sequence, tokenizer=None) -> PositionLogprobs:
    """vLLM's ``RequestOutput.prompt_logprobs`` from the sample that scored the prompt: None for
    the first token, then each prompt token's dict as `completion_logprobs` builds them."""
    return PositionLogprobs([None] + [seq.prompt_top_logprobs[i] for i in range(1, seq.num_prompt_tokens)], tokenizer)


class PositionLogprobs(abc.Sequence):
    """vLLM's list of per-position dicts ``{token_id: Logprob}``, each dict built when it is first
    read (then kept), as vLLM's ``FlatLogprobs`` does: a rollout of 139k tokens asking for 20
    alternatives holds 2.9M entries, and building them all at the end of ``generate`` took longer
    than the rollout's decode steps (performance.md, section 3).

    It reads as a list: ``len``, indexing and slices, iteration, ``==`` with a list (or another
    such sequence), ``+`` (a list). It pickles, copies and ``list()``-s as a plain list of dicts.
    Stored per position: its place in a step's host arrays (`Stored`), or None (the prompt's first
    token). Decoding goes through `tokenizer` once per distinct token read."""

    def __init__(self, stored: list[Stored | None], tokenizer=None) -> None:
        self._stored = stored
        self._built: list[dict[int, Logprob] | None] = [None] * len(stored)
        self._tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def __len__(self) -> int:
        return len(self._stored)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        entry = self._built[index]
        if entry is None and self._stored[index] is not None:
            entry = self._built[index] = self._entry(*self._stored[index])
        return entry

    def _entry(self, targets: np.ndarray, logprobs: np.ndarray, ranks: np.ndarray, row: int, k: int
               ) -> dict[int, Logprob]:
        ids, lps = targets[row, :k + 1].tolist(), logprobs[row, :k + 1].tolist()
        entry = {ids[0]: Logprob(lps[0], int(ranks[row]))}
        for alt_rank, token in enumerate(ids[1:], start=1):
            if token not in entry:
                entry[token] = Logprob(lps[alt_rank], alt_rank)
        if self._tokenizer is not None:
            new = [token for token in entry if token not in self._text]
            self._text.update(zip(new, self._tokenizer.batch_decode([[t] for t in new])))
            for token, value in entry.items():
                value.decoded_token = self._text[token]
        return entry

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, PositionLogprobs)):
            return len(self) == len(other) and list(self) == list(other)
        return NotImplemented

    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __reduce__(self):
        return list, (list(self),)

    def __repr__(self) -> str:
        return repr(list(self))
