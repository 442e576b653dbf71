"""What a scheduler step runs: `ScheduledSeq` (one sequence's share of a step) and
`SchedulerOutput` (what one ``Scheduler.schedule()`` call decided).

Their own module, below the scheduler: the scheduler's parts (`scheduler_ahead`,
`scheduler_postprocess`) and everything that runs a step (`step_inputs`, `model_runner`,
`sampler`, `llm_steps`, `pipeline_worker`) take these records without importing the scheduler.
`runtime.scheduler` re-exports both.
"""

from __future__ import annotations

from dataclasses import dataclass

from .sequence import Sequence

__all__ = ["ScheduledSeq", "SchedulerOutput"]


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq: Sequence
    #: Tokens ``seq.token_ids[seq.num_computed_tokens : seq.num_computed_tokens + num_new_tokens]``
    #: run through the model this step (their K/V go to the cache). ``num_computed_tokens`` is
    #: read after ``schedule()``: it already counts the pages shared at this step's allocation.
    num_new_tokens: int
    #: True when this chunk ends at ``seq.num_tokens``: the step samples seq's next token from
    #: the logits of the chunk's last position. False for a non-final prefill chunk.
    samples: bool
    #: A ``schedule_ahead`` decode: its one token is the one the step before is still sampling,
    #: at position ``len(seq.token_ids)``, not in ``token_ids`` yet (its id comes on the device).
    in_flight: bool = False
    #: Where this sequence's gated-DeltaNet slot state comes from before the step runs (its prompt
    #: pages shared up to ``num_computed_tokens``): the sample of the same prompt whose slot it
    #: copies (`runtime.scheduler_siblings`), or the state slot of a kept prompt state
    #: (`runtime.scheduler_prefix_states`); None otherwise.
    state_from: Sequence | int | None = None
    #: The state slot this sequence's slot state is copied into before the step runs (it stands at
    #: its prompt's share point: a prompt state kept for later requests); None otherwise.
    state_to: int | None = None


@dataclass
class SchedulerOutput:
    """What one ``schedule()`` call decided."""

    scheduled: list[ScheduledSeq]
    #: Sequences preempted by recompute during this call (their pages are freed; they wait again).
    preempted: list[Sequence]
    #: Sequences that can never fit, finished with finish_reason "error" since the last call.
    errored: list[Sequence]

    @property
    def num_tokens(self) -> int:
        """Total new tokens run this step."""
        return sum(item.num_new_tokens for item in self.scheduled)
