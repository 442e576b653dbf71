"""The engine's step loop: schedule, run, sample, postprocess; with `async_scheduling`, one
step ahead of the host.

Without it each step ends in a host sync (the sampled tokens come back), and the device then idles
while the host postprocesses, schedules and builds the next step: ~1 ms of a ~5 ms Qwen3-0.6B decode
step on the H200 (`benchmarks/decode_profile.py`, 2026-11-24: 4.56 -> 4.09 ms a step at 128
sequences). With it, once a step whose rows all sample is launched the loop asks the scheduler for
the following one (`Scheduler.schedule_ahead`: the decodes, then admissions) and launches it at
once, the decodes' input tokens taken on the device from the step still running
(`ModelRunner.execute_ahead`); only then does it wait for the first step's tokens and postprocess
them. The device always has the next step queued while the host works.

Nothing numeric changes (rules 1 and 7; `runtime.scheduler_ahead`): a sequence that stops in a
step also runs in the step launched ahead of it, and that row's result is dropped.

Rows whose mask or bans depend on their last token (a grammar, a bad word of several tokens) need
that token on the host: while such a sequence runs, the step ahead launches its forward at once
and its sampling after the step before is postprocessed (`LaunchedStep.waiting`), so the host's
mask fill runs beside the forward instead of before it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from .model_runner import ModelRunner
from .pipeline_worker import Pipeline
from .sampler import SampledTokens, Sampler, nonfinite_rows, spread_samples
from .scheduled import ScheduledSeq
from .scheduler import Scheduler
from .sequence import Sequence
from .staging import to_device
from .top_logprobs import Alternatives, launch_prompt_alternatives, prompt_rows_of

__all__ = ["EngineStepsMixin", "LaunchedStep"]


@dataclass
class LaunchedStep:
    """A step on its way: launched on the device, its tokens not read back yet."""

    scheduled: list[ScheduledSeq]
    #: the sampling rows' tokens (None: the step samples nothing, or ``done`` holds them)
    sampled: SampledTokens | None
    #: (tokens, logprobs) when known at launch (a pipeline's first stage returns them)
    done: tuple[list, list] | None = None
    #: the prompt positions' alternatives, where requests score their prompts (`runtime.top_logprobs`)
    prompt_scores: Alternatives | None = None
    #: (logits, sampling sequences) of a step launched ahead whose sampling waits for the step
    #: before it to be postprocessed (`EngineStepsMixin._sample_waiting`)
    waiting: tuple[torch.Tensor, list[Sequence]] | None = None

    def results(self) -> tuple[list[int | None], list[float | None]]:
        """Each scheduled sequence's token and logprob (None for a non-final prefill chunk),
        as `Scheduler.postprocess` takes them; waits for the device."""
        if self.done is None:
            tokens, logprobs = self.sampled.result() if self.sampled is not None else ([], [])
            if self.prompt_scores is not None:
                self.prompt_scores.record()
            self.done = spread_samples(self.scheduled, tokens, logprobs)
        return self.done


class EngineStepsMixin:
    """`LLM`'s step loop. A part of the engine's class rather than an object of its own: it
    drives the engine's own scheduler (which a failed call replaces, `LLM._abort`) and reads the
    switches users set on the engine (``async_scheduling``, ``step_times``). What it uses of
    `LLM`, all set by ``LLM.__init__``:"""

    scheduler: Scheduler
    runner: ModelRunner
    model: torch.nn.Module  #: the inference model (its ``causal_lm.final_logits`` scores prompt positions)
    sampler: Sampler
    pipeline: Pipeline | None  #: None on a single process
    #: Overlap the host's step work with the device (the module docstring).
    async_scheduling: bool = True
    #: When a list, each completed step appends (sequences, decode-only, seconds since the last).
    step_times: list[tuple[int, bool, float]] | None
    #: Whether some request of the current call scores its prompt (``prompt_logprobs``): its
    #: steps are checked for prompt positions and run one at a time (set by ``generate``).
    _scores_prompts: bool = False
    num_preemptions: int  #: sequences preempted (by recompute) so far

    #: the step launched ahead of the last completed one, still in flight (None: nothing is)
    _launched: LaunchedStep | None = None

    def _loop(self, bar) -> None:
        """Run steps until every scheduled sequence has finished (`generate`'s requests). A stalled
        scheduler raises RuntimeError rather than returning empty steps forever (`scheduler_progress`)."""
        self._last_completion = time.perf_counter()
        try:
            while self._launched is not None or self.scheduler.has_unfinished():
                self._advance(bar)
        finally:
            bar.close()

    def _advance(self, bar) -> list[ScheduledSeq]:
        """One turn of the loop: launch a step unless one launched ahead is in flight, launch the
        step after it where the scheduler can pick it now, then complete the first. Returns the
        completed step's sequences (none when the scheduler only reported errored ones). A step
        launched ahead stays in flight, in ``_launched``, for the next turn (or `LLM.step`)."""
        launched, self._launched = self._launched, None
        if launched is None:
            launched = self._schedule_and_launch(bar)
            if launched is None:
                return []
        ahead = self._launch_ahead(launched) if self._may_look_ahead() else None
        self._complete(launched, bar)
        if ahead is not None and ahead.waiting is not None:
            self._sample_waiting(ahead)
        self._launched = ahead
        return launched.scheduled

    def _may_look_ahead(self) -> bool:
        return self.async_scheduling and self.pipeline is None and not self._scores_prompts

    def _schedule_and_launch(self, bar) -> LaunchedStep | None:
        """An ordinary step: schedule it, report preemptions and errors, launch it."""
        step = self.scheduler.schedule()
        self.num_preemptions += len(step.preempted)
        bar.update(len(step.errored))
        return self._launch(step.scheduled) if step.scheduled else None

    def _launch(self, scheduled: list[ScheduledSeq]) -> LaunchedStep:
        """Run `scheduled` and start sampling, without waiting for the tokens."""
        if self.pipeline is not None:
            return LaunchedStep(scheduled, None, self.pipeline.execute_first(self, scheduled))
        prompt = prompt_rows_of(scheduled) if self._scores_prompts else None
        if prompt is None:
            logits, hidden = self.runner.execute(scheduled), None
        else:
            logits, hidden = self.runner.execute_scoring(scheduled, prompt.rows)
        sampling = [item.seq for item in scheduled if item.samples]
        launched = LaunchedStep(scheduled, self.sampler.launch(logits, sampling) if sampling else None)
        if prompt is not None:
            launched.prompt_scores = launch_prompt_alternatives(hidden, prompt, self.model.causal_lm.final_logits)
        return launched

    def _launch_ahead(self, launched: LaunchedStep) -> LaunchedStep | None:
        """Launch the step after `launched` if the scheduler can pick it now: its decodes' input
        tokens are `launched`'s sampled tokens, gathered on the device."""
        items = self.scheduler.schedule_ahead()
        if items is None:
            return None
        tokens = launched.sampled.tokens  # schedule_ahead: every row of `launched` samples
        row_of = {id(item.seq): i for i, item in enumerate(launched.scheduled)}
        flying = [item for item in items if item.in_flight]  # the step's first items
        rows = np.fromiter((row_of[id(item.seq)] for item in flying), np.int64, len(flying))
        if not np.array_equal(rows, np.arange(len(tokens))):  # some left out: gather the others' tokens
            tokens = tokens.index_select(0, to_device([rows], tokens.device)[0])
        logits = self.runner.execute_ahead(items, tokens)
        sampling = [item for item in items if item.samples]
        if self.scheduler.last_token_samplers_running():  # their masks or bans need the tokens in flight
            return LaunchedStep(items, None, waiting=(logits, [item.seq for item in sampling]))
        ahead = np.fromiter((item.in_flight for item in sampling), np.int64, len(sampling))
        return LaunchedStep(items, self.sampler.launch(logits, [item.seq for item in sampling], ahead))

    def _sample_waiting(self, step: LaunchedStep) -> None:
        """Start sampling a step launched ahead whose sampling waited (`LaunchedStep.waiting`),
        now that the step before it is postprocessed: its rows' last tokens are on the host, so
        nothing counts as in flight. Rows of sequences that finished meanwhile sample too; their
        results are dropped (`runtime.scheduler_ahead`)."""
        logits, seqs = step.waiting
        step.sampled, step.waiting = self.sampler.launch(logits, seqs), None

    def _complete(self, launched: LaunchedStep, bar) -> None:
        """Wait for `launched`'s tokens and postprocess them; RuntimeError when some sampled
        row's logits were not finite (`_check_finite`)."""
        tokens, logprobs = launched.results()
        self._check_finite(launched.scheduled, logprobs)
        bar.update(len(self.scheduler.postprocess(launched.scheduled, tokens, logprobs)))
        if self.step_times is not None:  # the interval between step completions: a step's cost
            now = time.perf_counter()
            decode = all(item.num_new_tokens == 1 for item in launched.scheduled)
            self.step_times.append((len(launched.scheduled), decode, now - self._last_completion))
        self._last_completion = time.perf_counter()

    def _check_finite(self, scheduled: list[ScheduledSeq], logprobs: list[float | None]) -> None:
        """Raise RuntimeError naming the requests whose logits in this step held a NaN or an
        infinity (the sampler flags them as NaN logprobs: `sampler.flag_nonfinite_rows`; no sync
        of its own), before their tokens are recorded. The KV cache is zeroed first, since the
        step (and one launched ahead of it) may have written non-finite K/V into pages that later
        calls reuse; ``generate`` then drops the call's requests and frees their pages
        (`LLM._abort`), and the engine serves the next call as a fresh one would."""
        bad = nonfinite_rows(logprobs)
        if not bad:
            return
        self.runner.zero_cache()
        names = ", ".join(f"request {scheduled[i].seq.request_id} (sample {scheduled[i].seq.sample_index}, "
                          f"after {scheduled[i].seq.num_output_tokens} output tokens)" for i in bad[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise RuntimeError(f"LLM.generate: the logits of {names}{more} hold NaN or inf (of the step's "
                           f"{len(scheduled)} sequences); the weights or activations are not finite (e.g. a NaN written "
                           "by update_weights). The call's requests are dropped; the engine stays usable")
