"""What keeps `Scheduler` moving: a sequence alone in the cache always progresses.

``Scheduler.add`` refuses a sequence that could not complete even alone in the cache
(`_never_fits`: finish_reason "error", from `BlockManager.shortfall`), so preemption, which ends
with the earliest-arrived running sequence alone, terminates, with prefix sharing on as with it
off (a windowed block manager never revives cached pages below the window:
`BlockManager._window_hits`).

A ``schedule()`` that schedules and preempts nothing while nothing runs and sequences wait would
stall for good: its decisions are a pure function of the scheduler's state, which no step changes
then, so every later call decides the same and a drive loop (`runtime.llm_steps`) would spin
forever. Only a broken invariant leads there; `_check_progress` raises RuntimeError naming the
sequence at the head of the queue instead.

A mixin of `runtime.scheduler.Scheduler` (its queues, limits and ``block_manager``).
"""

from __future__ import annotations

from .sequence import Sequence

__all__ = ["ProgressMixin"]


class ProgressMixin:
    """The progress guarantees of `Scheduler`."""

    def _never_fits(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never complete, or None. Checked once: its needs never grow."""
        who = f"request {seq.request_id} (sample {seq.sample_index})"
        if seq.num_prompt_tokens >= self.max_model_len:
            return (
                f"{who}: prompt of {seq.num_prompt_tokens} tokens leaves no room for output "
                f"within max_model_len={self.max_model_len}"
            )
        # Upper bound on the positions it will ever hold; a sequence alone in the cache can
        # always make progress, which is what guarantees that preemption terminates.
        positions = min(seq.num_prompt_tokens + seq.params.max_tokens, self.max_model_len)
        short = self.block_manager.shortfall(positions, self.max_num_batched_tokens)
        if short is not None:
            return f"{who} {short}"
        return None

    def _check_progress(self, preempted: list[Sequence], errored: list[Sequence]) -> None:
        """RuntimeError when a step that scheduled nothing leaves the scheduler stalled: nothing
        preempted, nothing running, sequences waiting (the module docstring). `errored`, taken for
        the step, go back to be reported by the next call."""
        if preempted or self._running or not self._waiting:
            return
        self._errored[:0] = errored
        seq = self._waiting[0]
        bm = self.block_manager
        raise RuntimeError(
            f"Scheduler.schedule: request {seq.request_id} (sample {seq.sample_index}) waits first in the queue and "
            f"cannot be scheduled although no sequence runs ({seq.num_computed_tokens} of its {seq.num_tokens} tokens "
            f"computed, {bm.num_cached_tokens(seq)} more in the prefix cache; {bm.num_free_blocks} of {bm.num_blocks} "
            f"KV cache blocks free, max_num_batched_tokens={self.max_num_batched_tokens}): no later step would "
            "differ, so it would wait forever. A sequence alone in the cache always progresses; this is a bug"
        )
