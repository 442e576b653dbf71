"""The end of a scheduler step: `Scheduler.postprocess` applies the sampled tokens, decides
which sequences finish (stop tokens, EOS, stop strings, a grammar's end, ``min_tokens``,
``max_tokens``, ``max_model_len``) and frees their pages.

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
        reached at the same token (the model chose to stop); a grammar's end is a stop; a token
        no setting allowed ends it with "error" (`_drawn_from_nothing`)."""
        params = seq.params
        num_tokens = len(seq.token_ids)  # called per sequence per step: no property calls
        num_output = num_tokens - seq.num_prompt_tokens
        short = num_output - 1 < params.min_tokens
        if short or seq.grammar is not None or params.allowed_token_ids is not None or seq.bad_words is not None:
            error = self._drawn_from_nothing(seq, token, short)
            if error is not None:
                seq.error = f"output {num_output - 1} of request {seq.request_id}: {error}"
                return "error"
            if seq.grammar is not None and seq.grammar.terminated:  # a stop token after a complete output
                if token != self.eos_token_id:  # another EOS id of the checkpoint: a stop token, reported
                    seq.stop_reason = token
                return "stop"
        # Stop tokens/EOS count only once min_tokens outputs precede them: the sampler bans
        # them while num_output_tokens < min_tokens (counted before the new token).
        if not short:
            if token == self.eos_token_id and not params.ignore_eos:  # the model's own EOS: no stop_reason
                return "stop"
            if token in params.stop_token_ids:  # reported as the stop_reason, as vLLM's
                seq.stop_reason = token
                return "stop"
            if seq.stop_strings is not None:
                seq.stop_reason = seq.stop_strings.matched(seq.token_ids, seq.num_prompt_tokens)
                if seq.stop_reason is not None:
                    return "stop"
        if num_output >= params.max_tokens or num_tokens >= self.max_model_len:
            return "length"
        return None

    def _drawn_from_nothing(self, seq: Sequence, token: int, short: bool) -> str | None:
        """Why ``token`` cannot have been sampled from a row with a samplable token, or None. The
        sampler never draws a token its row excludes: a token outside ``allowed_token_ids``, a
        stop token or EOS while short of ``min_tokens``, one completing a bad word, or one the
        grammar rejects comes from a
        row whose settings together excluded every token (Gumbel-max over all -inf picks token
        0). Such a sequence ends with finish_reason "error" and this message (the token stays,
        with its exact logprob); the grammar, when there is one, accepts the token here."""
        params = seq.params
        if params.allowed_token_ids is not None and token not in params.allowed_token_set:
            return f"token {token} is not in allowed_token_ids: {self._excluded_every_token}"
        if short and (token in params.stop_token_ids or (token == self.eos_token_id and not params.ignore_eos)):
            return f"stop token {token} came before min_tokens={params.min_tokens}: {self._excluded_every_token}"
        if seq.bad_words is not None and token in seq.bad_words.banned(seq, len(seq.token_ids) - 1):
            return f"token {token} completes one of bad_words: {self._excluded_every_token}"
        if seq.grammar is not None and not seq.grammar.accept(token):
            return f"structured_outputs' grammar does not allow token {token}: {self._excluded_every_token}"
        return None

    _excluded_every_token = ("the request's structured_outputs, allowed_token_ids, bad_words and min_tokens (which "
                             "bans stop tokens and EOS) excluded every token at this step")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _finish_waiting(self, seq: Sequence, reason: str) -> None:
        """Finish `seq`, taken out of the waiting queue (``Scheduler.abort``): it holds no pages
        (a preempted sequence freed them)."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
