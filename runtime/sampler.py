"""Sampler: turns the LM head's logits into (token, logprob) per sequence.

The token comes from `kernels.sample_tokens` (Gumbel-max over a counter RNG keyed by the
sequence's seed and output index, after grammar masks (`runtime.grammar_masks`), allowed tokens
and logit biases (`runtime.logit_bias`),
repetition/frequency/presence penalties (`runtime.penalties`), min_tokens and bad-word bans
(`runtime.bad_words`) and min-p/top-k/top-p filtering); the logprob is
``gather_logprobs(logits, token, T)`` on the *unfiltered* logits at the sequence's temperature
(1.0 for greedy): the quantity training recomputes with ``token_logprobs``, by the same kernel.
The logits are the model's (`kernels.lm_head_logits`, soft-capped where the config sets Gemma's
``final_logit_softcapping``), as training's ``token_logprobs`` computes them.

A row whose logits hold a NaN or an infinity (a NaN weight, an overflow) reports a NaN logprob,
whatever the logprob kernel made of it: the finite check rides on the logprobs the step copies
to the host anyway (no sync of its own), and the engine raises on it (`runtime.llm_steps`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.kernels import gather_logprobs, sample_tokens
from vexact_models.kernels.sampling import filter_thresholds

from .grammar_masks import GrammarMasks, GrammarRows
from .logit_bias import LogitEdits
from .penalties import PenaltyCounts, PenaltyRows
from .scheduled import ScheduledSeq
from .sequence import Sequence
from .staging import HostCopy, to_device
from .top_logprobs import Alternatives, AskingRows


class Sampler:
    """Samples one token per row of fp32 logits for the given sequences."""

    def __init__(self, eos_token_id: int | None) -> None:
        self.eos_token_id = eos_token_id
        self._rows: _RowParams | None = None  # the last call's, reused for the same sequences
        #: the device token counts of the sequences that use penalties (None until one does)
        self.penalty_counts: PenaltyCounts | None = None

    def begin_call(self, penalties: bool) -> None:
        """A `generate` call starts (no sequence of an earlier one samples again): forget the
        cached rows, and free the penalty counts unless the call's requests use `penalties`."""
        self._rows = None
        if not penalties:
            self.release()

    def release(self) -> None:
        """Free the penalty counts (`LLM.sleep`, and a call that uses no penalties): the device
        memory the sampler keeps between calls that grows with the vocabulary."""
        self.penalty_counts = None

    def _penalty_rows(self, seqs: list[Sequence], logits: torch.Tensor) -> PenaltyRows | None:
        """The penalty rows of `seqs` (None when none uses penalties), the counts kept from the
        first batch that uses them."""
        counts = self.penalty_counts
        if counts is None or counts.device != logits.device or counts.vocab_size != logits.shape[1]:
            counts = PenaltyCounts(logits.shape[1], logits.device)  # (no memory until a slot is taken)
        rows = counts.rows(seqs)
        if rows is not None:
            self.penalty_counts = counts
        return rows

    def _banned(self, seq: Sequence) -> list[int]:
        """Tokens that may not be sampled yet by a sequence short of ``min_tokens``: its stop
        tokens and EOS (`_bans` decides who is short, counting tokens in flight)."""
        banned = list(seq.params.stop_token_ids)
        if self.eos_token_id is not None and not seq.params.ignore_eos:
            banned.append(self.eos_token_id)
        return banned

    def _bans(self, seqs: list[Sequence], step: np.ndarray, min_tokens: np.ndarray,
              bad_word_rows: list[int]) -> list[tuple[int, int]]:
        """(row, token) pairs that may not be sampled: the stop tokens and EOS of the sequences still
        short of min_tokens (found with one vector compare), and the bad words of the sequences at
        `bad_word_rows` (`runtime.bad_words`)."""
        bans = [(i, tok) for i in np.flatnonzero(step < min_tokens).tolist() for tok in self._banned(seqs[i])]
        bans += [(i, tok) for i in bad_word_rows for tok in seqs[i].bad_words.banned(seqs[i])]
        return bans

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float]]:
        """The token and logprob of each row of `logits` (one per sequence of `seqs`): one host
        sync; the alternatives of the rows that ask for them are stored on their sequences."""
        if not seqs:
            return [], []
        return self.launch(logits, seqs).result()

    def launch(self, logits: torch.Tensor, seqs: list[Sequence], ahead: int | np.ndarray = 0) -> SampledTokens:
        """Start sampling one token per row of `logits` for `seqs`, without waiting for it.
        `ahead` (per row, or one value for all): 1 where the sequence's last token is still in
        flight (a ``schedule_ahead`` decode), which the RNG counter and min_tokens then count."""
        rows = self._rows
        if rows is None or rows.device != logits.device or rows.seqs != seqs:  # identity per element
            rows = self._rows = _RowParams(seqs, logits.device, ahead)
            rows.penalties = self._penalty_rows(rows.seqs, logits)
            rows.edits = LogitEdits.of(rows.seqs, logits.shape[1], logits.device)
            rows.grammar = GrammarRows.of(rows.seqs)
        else:
            rows.refresh(ahead)
        masks = rows.grammar.launch(logits.shape[1], logits.device) if rows.grammar is not None else None
        sampled = launch_sample(logits, rows.temps, rows.logprob_temps, rows.top_k, rows.top_p, rows.log_min_p,
                                rows.seeds, rows.steps, rows.filter_rows,
                                self._bans(seqs, rows.step, rows.min_tokens, rows.bad_word_rows),
                                rows.penalties, rows.edits, masks)
        if rows.alternatives:
            sampled.alternatives = rows.alternatives.launch(logits, sampled.tokens, rows.logprob_temps, rows.step)
        return sampled

    def host_rows(self, seqs: list[Sequence]) -> HostRows:
        """What sampling `seqs` needs, as host arrays (a pipeline's first stage sends them to the
        last, which samples with `sample_host_rows`): the same values `__call__` uses."""
        host = _host_arrays(seqs)
        # (no bad words: pipeline stages refuse them)
        bans = np.array(self._bans(seqs, host["step"], host["min_tokens"], []), np.int64).reshape(-1, 2)
        return HostRows(host["temps"], host["top_p"], host["top_k"], host["log_min_p"], host["seeds"], host["step"],
                        bans)


@dataclass
class HostRows:
    """The sampling parameters of R rows on the host: what the sampler's kernels take."""

    temps: np.ndarray  #: float32 [R] temperatures (0: greedy)
    top_p: np.ndarray  #: float64 [R]
    top_k: np.ndarray  #: int64 [R] (0: off)
    log_min_p: np.ndarray  #: float32 [R] log(min_p) (-inf: off)
    seeds: np.ndarray  #: int64 [R]
    steps: np.ndarray  #: int64 [R] index of the token each row generates (the RNG counter)
    bans: np.ndarray  #: int64 [B, 2] (row, token) pairs that may not be sampled (min_tokens)

    @property
    def filter_rows(self) -> np.ndarray:
        """The rows that need min-p/top-k/top-p thresholds (`filtering_rows`)."""
        return filtering_rows(self.temps, self.top_k, self.top_p, self.log_min_p)


def filtering_rows(temps: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, log_min_p: np.ndarray) -> np.ndarray:
    """int64 indices of the rows that need min-p/top-k/top-p thresholds (greedy rows are never
    filtered): known on the host, so the device never has to find them (a sync)."""
    return np.flatnonzero((temps > 0) & ((top_k > 0) | (top_p < 1) | (log_min_p > -np.inf))).astype(np.int64)


def sample_host_rows(logits: torch.Tensor, rows: HostRows) -> tuple[list[int], list[float]]:
    """`Sampler.__call__` for rows given as `HostRows` (a pipeline's last stage): bitwise the
    same tokens and logprobs."""
    if not len(rows.temps):
        return [], []
    temps, logprob_temps, top_p, top_k, log_min_p, seeds, steps, filter_rows = _to_device(
        rows.temps, rows.top_p, rows.top_k, rows.log_min_p, rows.seeds, rows.steps, logits.device)
    return sample(logits, temps, logprob_temps, top_k, top_p, log_min_p, seeds, steps, filter_rows,
                  [tuple(pair) for pair in rows.bans.tolist()])


def _to_device(temps: np.ndarray, top_p: np.ndarray, top_k: np.ndarray, log_min_p: np.ndarray, seeds: np.ndarray,
               steps: np.ndarray, device: torch.device) -> tuple:
    """The sampling kernels' arguments on `device` in one pinned copy: temperatures, the logprob
    temperatures (1 for greedy rows), top-p, top-k, log(min-p) (None when no row uses min-p), seeds,
    RNG counters and the rows that filter (None when none does)."""
    filter_rows = filtering_rows(temps, top_k, top_p, log_min_p)
    temps_dev, logprob_temps, top_p, top_k, min_p_dev, seeds, steps, filter_dev = to_device(
        [temps, np.where(temps > 0, temps, np.float32(1)), top_p, top_k, log_min_p, seeds, steps, filter_rows], device)
    uses_min_p = bool((log_min_p > -np.inf).any())
    return (temps_dev, logprob_temps, top_p, top_k, min_p_dev if uses_min_p else None, seeds, steps,
            filter_dev if len(filter_rows) else None)


class SampledTokens:
    """A step's sampled tokens and their logprobs: on the device at once (``tokens``, int64
    ``[R]``, which the next step may take as its input ids), on the host after `result`."""

    def __init__(self, tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
        self.tokens = tokens
        # into pinned memory without waiting: the step's one host sync is result()
        self._host = HostCopy([torch.stack([tokens.double(), logprobs.double()])])
        #: the most probable tokens of the rows that ask for them (`runtime.top_logprobs`)
        self.alternatives: Alternatives | None = None

    def result(self) -> tuple[list[int], list[float]]:
        """(tokens, logprobs) on the host, waiting for the device if needed; the alternatives of
        the rows that ask for them are stored on their sequences (`Alternatives.record`)."""
        [both] = self._host.result()
        if self.alternatives is not None:
            self.alternatives.record()
        return both[0].long().tolist(), both[1].float().tolist()


def sample(logits: torch.Tensor, temps, logprob_temps, top_k, top_p, log_min_p, seeds, steps,
           filter_rows: torch.Tensor | None, banned: list[tuple[int, int]]) -> tuple[list[int], list[float]]:
    """The device side of sampling (rule 7) without penalties or logit edits: bans, min-p/top-k/top-p thresholds (of
    `filter_rows`, None: no row filters), Gumbel-max, and the logprob of the unfiltered logits;
    one host sync."""
    return launch_sample(logits, temps, logprob_temps, top_k, top_p, log_min_p, seeds, steps, filter_rows,
                         banned).result()


def launch_sample(logits: torch.Tensor, temps, logprob_temps, top_k, top_p, log_min_p, seeds, steps,
                  filter_rows: torch.Tensor | None, banned: list[tuple[int, int]],
                  penalties: PenaltyRows | None = None, edits: LogitEdits | None = None,
                  grammar: GrammarMasks | None = None) -> SampledTokens:
    """`sample` without the host sync: the device work, and the results on their way to the
    host. Every index reaches the device through a pinned copy (a pageable one would wait for
    the stream), so nothing here waits for the device. `grammar` (structured outputs' masks),
    `edits` (allowed tokens, biases) and `penalties` act first, in that order, on copies; with
    `penalties`, the sampled tokens are added to their sequences' counts."""
    sample_logits = logits if grammar is None else grammar.apply(logits)
    if edits is not None:
        sample_logits = edits.apply(sample_logits)
    if penalties is not None:
        sample_logits = penalties.apply(sample_logits)
    if banned:
        ban_rows, ban_cols = to_device([np.array(pairs, np.int64) for pairs in zip(*banned)], logits.device)
        if sample_logits is logits:
            sample_logits = logits.clone()
        # (a Python scalar value would be copied to the device: a sync)
        sample_logits.index_put_((ban_rows, ban_cols), torch.full((len(banned),), float("-inf"), device=logits.device))
    thresholds = None
    if filter_rows is not None:
        thresholds = filter_thresholds(sample_logits, temps, top_k, top_p, filter_rows, log_min_p)
    tokens = sample_tokens(sample_logits, temps, seeds, steps, thresholds)
    if penalties is not None:
        penalties.count(tokens)
    return SampledTokens(tokens, flag_nonfinite_rows(logits, gather_logprobs(logits, tokens, logprob_temps)))


def flag_nonfinite_rows(logits: torch.Tensor, logprobs: torch.Tensor) -> torch.Tensor:
    """`logprobs` with NaN in the rows whose `logits` are not all finite; the others' bits are
    unchanged. On the device, without a sync: the step's host copy of the logprobs carries the
    flag (`nonfinite_rows`). The logprob kernel alone may not show it: its running max can skip a
    NaN (Triton's ``maximum`` does not propagate it), and a sampled finite column still gets a
    finite logprob beside a NaN one."""
    finite = torch.isfinite(logits).all(dim=1)
    return torch.where(finite, logprobs, float("nan"))  # a Python scalar: no host->device copy


def nonfinite_rows(logprobs: list[float | None]) -> list[int]:
    """The indices of the NaN or infinite logprobs in a step's host results (None: a row that
    samples nothing): the rows `flag_nonfinite_rows` flagged. One sum in the common case."""
    sampled = logprobs if None not in logprobs else [lp for lp in logprobs if lp is not None]
    if math.isfinite(sum(sampled)):  # logprobs of finite logits are finite, and so is their sum
        return []
    return [i for i, lp in enumerate(logprobs) if lp is not None and not math.isfinite(lp)]


def spread_samples(scheduled: list[ScheduledSeq], tokens: list[int], logprobs: list[float]
                   ) -> tuple[list[int | None], list[float | None]]:
    """The sampling rows' results spread over a step's scheduled sequences, None for the
    non-final prefill chunks (which sample nothing): what `Scheduler.postprocess` takes."""
    if len(tokens) == len(scheduled):
        return tokens, logprobs
    it_t, it_l = iter(tokens), iter(logprobs)
    return ([next(it_t) if item.samples else None for item in scheduled],
            [next(it_l) if item.samples else None for item in scheduled])


def _host_arrays(seqs: list[Sequence], ahead: int | np.ndarray = 0) -> dict[str, np.ndarray]:
    """The rows' sampling parameters on the host, one Python pass per field (`ahead`: tokens in
    flight per sequence, `_steps`)."""
    n = len(seqs)
    params = [s.params for s in seqs]
    # fp32 as the kernels take it, rounded on the host exactly as .float() would on the device
    return dict(temps=np.fromiter((p.temperature for p in params), np.float64, n).astype(np.float32),
                top_p=np.fromiter((p.top_p for p in params), np.float64, n),
                top_k=np.fromiter((p.top_k for p in params), np.int64, n),
                log_min_p=_log_min_p(np.fromiter((p.min_p for p in params), np.float64, n)),
                min_tokens=np.fromiter((p.min_tokens for p in params), np.int64, n),
                seeds=np.fromiter((s.seed for s in seqs), np.int64, n),
                step=_steps(seqs, ahead))


def _log_min_p(min_p: np.ndarray) -> np.ndarray:
    """float32 log(min_p), rounded once from the float64 log; -inf where min-p is off (0)."""
    with np.errstate(divide="ignore"):
        return np.log(min_p).astype(np.float32)


def _steps(seqs: list[Sequence], ahead: int | np.ndarray = 0) -> np.ndarray:
    """The index of the token each sequence generates next (its RNG counter), counting `ahead`
    (per sequence, or one value for all) sampled tokens that are not in ``token_ids`` yet."""
    return np.fromiter((len(s.token_ids) - s.num_prompt_tokens for s in seqs), np.int64, len(seqs)) + ahead


class _RowParams:
    """The sampling parameters of a list of sequences, on the host and on the device.

    A sequence's params and seed never change over its life, so while a decode batch keeps its
    sequences (most steps) only the RNG counters ``step`` are read again and copied; a new list
    of sequences is read once, one Python pass per field. Either way one pinned copy."""

    def __init__(self, seqs: list[Sequence], device: torch.device, ahead: int | np.ndarray = 0) -> None:
        self.seqs, self.device = list(seqs), device
        #: the rows that use repetition/frequency/presence penalties (`runtime.penalties`; the sampler sets it)
        self.penalties: PenaltyRows | None = None
        #: the rows' allowed tokens and biases (`runtime.logit_bias`; the sampler sets it)
        self.edits: LogitEdits | None = None
        #: the rows that follow a grammar (`runtime.grammar_masks`; the sampler sets it)
        self.grammar: GrammarRows | None = None
        #: the rows whose requests forbid words (`runtime.bad_words`)
        self.bad_word_rows = [i for i, seq in enumerate(self.seqs) if seq.bad_words is not None]
        #: the rows whose requests ask for their most probable tokens (`runtime.top_logprobs`)
        self.alternatives = AskingRows(self.seqs, device)
        host = _host_arrays(seqs, ahead)
        temps = host["temps"]
        self.min_tokens = host["min_tokens"]
        self.step = host["step"]
        # filter_rows: the rows that need min-p/top-k/top-p thresholds, on the device (None: no row does)
        (self.temps, self.logprob_temps, self.top_p, self.top_k, self.log_min_p, self.seeds, self.steps,
         self.filter_rows) = _to_device(temps, host["top_p"], host["top_k"], host["log_min_p"], host["seeds"],
                                        self.step, device)

    def refresh(self, ahead: int | np.ndarray = 0) -> None:
        """Re-read and copy the RNG counters (the index of the token each sequence generates,
        `ahead` tokens past its last known one)."""
        self.step = _steps(self.seqs, ahead)
        [self.steps] = to_device([self.step], self.device)
