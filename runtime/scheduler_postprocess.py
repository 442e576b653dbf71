"""The end of a scheduler step: `Scheduler.postprocess` applies the sampled tokens, decides
which sequences finish (stop tokens, EOS, stop strings, ``min_tokens``, ``max_tokens``,
``max_model_len``) and frees their pages.

A mixin of `runtime.scheduler.Scheduler` (it uses the scheduler's ``_running`` list, its
``block_manager``, ``eos_token_id`` and ``max_model_len``), kept apart so that each file holds
one concept: deciding a step there, applying its results here.
"""

from __future__ import annotations

from .scheduled import ScheduledSeq
from .sequence import Sequence, SequenceStatus

__all__ = ["PostprocessMixin"]


class PostprocessMixin:
    """Applying a step's results and the finishing rules, for `Scheduler`."""

    def postprocess(
        self,
        scheduled: list[ScheduledSeq],
        tokens: list[int | None],
        logprobs: list[float | None],
    ) -> list[Sequence]:
        """Apply one step's results. ``tokens[i]``/``logprobs[i]`` are the token sampled for
        ``scheduled[i]`` and its logprob (ignored, may be None, where ``samples`` is False).
        Steps are postprocessed in the order they were scheduled. Returns the sequences that
        finished in this step; their pages are freed.

        A ``schedule_ahead`` step may hold sequences that stopped in the step before it: their
        results are dropped. Its pages that filled up are published here, now that their
        tokens are known and their K/V written: later than ``_publish``'s rule, so a sequence
        admitted in between computes those tokens itself instead of sharing them (same numbers)."""
        if len(tokens) != len(scheduled) or len(logprobs) != len(scheduled):
            raise ValueError(
                f"postprocess: {len(scheduled)} scheduled sequences but {len(tokens)} tokens "
                f"and {len(logprobs)} logprobs"
            )
        ahead = False
        if self._in_flight:
            if self._in_flight[0][0] is not scheduled:
                raise RuntimeError("postprocess: steps must be postprocessed in the order they were scheduled")
            ahead = self._in_flight[0][1]
        if ahead:
            kept = [i for i, item in enumerate(scheduled) if item.seq.status is SequenceStatus.RUNNING]
            scheduled = [scheduled[i] for i in kept]
            tokens, logprobs = [tokens[i] for i in kept], [logprobs[i] for i in kept]
        self._validate_results(scheduled, tokens, logprobs)
        if self._in_flight:
            self._in_flight.popleft()
        finished: list[Sequence] = []
        finish_reason = self._finish_reason
        for item, token, logprob in zip(scheduled, tokens, logprobs):
            seq = item.seq
            seq.num_computed_tokens += item.num_new_tokens
            if ahead:
                self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens)
            # published first: a released page keeps its key (docs/design.md section 6)
            self.block_manager.release_behind_window(seq)
            if not item.samples:
                continue
            # Sequence.append_token, minus its status check: every sequence was checked RUNNING.
            seq.token_ids.append(token)  # type: ignore[arg-type]
            seq.output_logprobs.append(logprob)  # type: ignore[arg-type]
            reason = finish_reason(seq, token)
            if reason is not None:
                self._finish(seq, reason)
                finished.append(seq)
        return finished

    @staticmethod
    def _validate_results(scheduled: list[ScheduledSeq], tokens: list[int | None],
                          logprobs: list[float | None]) -> None:
        """Check a step's results before anything is mutated, so a bad call leaves no
        half-applied step. A decode step has no None at all: then only the statuses need a look."""
        running = SequenceStatus.RUNNING
        if None not in tokens and None not in logprobs:
            for item in scheduled:
                if item.seq.status is not running:
                    raise RuntimeError(f"postprocess: {item.seq!r} is not running")
            return
        for i, (item, token, logprob) in enumerate(zip(scheduled, tokens, logprobs)):
            if item.seq.status is not running:
                raise RuntimeError(f"postprocess: {item.seq!r} is not running")
            if item.samples and (token is None or logprob is None):
                raise ValueError(f"postprocess: scheduled[{i}] samples but got no token/logprob")

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """Whether ``token``, just appended, ends ``seq``. A stop token wins over a length limit
        reached at the same token (the model chose to stop)."""
        params = seq.params
        num_tokens = len(seq.token_ids)  # called per sequence per step: no property calls
        num_output = num_tokens - seq.num_prompt_tokens
        # Stop tokens/EOS count only once min_tokens outputs precede them: the sampler bans
        # them while num_output_tokens < min_tokens (counted before the new token).
        if num_output - 1 >= params.min_tokens:
            if token in params.stop_token_ids:
                return "stop"
            if token == self.eos_token_id and not params.ignore_eos:
                return "stop"
            if seq.stop_strings is not None:
                seq.stop_reason = seq.stop_strings.matched(seq.token_ids, seq.num_prompt_tokens)
                if seq.stop_reason is not None:
                    return "stop"
        if num_output >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
