"""Scheduling one step ahead: `Scheduler.schedule_ahead` picks the next step while the
current one still runs, so that an engine can launch it before the current step's tokens
reach the host (`runtime.llm_steps`), and the device never waits for the host's step work.

The step it returns is the step the ordinary ``schedule()`` would pick after the step in
flight, except for what nobody can know yet:
- the tokens: every running sequence decodes the token the step in flight is sampling for it,
  at position ``len(seq.token_ids)`` (``ScheduledSeq.in_flight``; these items come first, one
  token each, so they are the step's first flat tokens); the engine feeds them from the device
  (`ModelRunner.execute_ahead`);
- stop tokens and EOS: a sequence that stops in the step in flight still runs in the step
  ahead. Its result is dropped in ``postprocess`` (one wasted row), its K/V goes to a page it
  owned (the page holding its last position is never published, nor shared) and stream order
  puts that write before any later step's use of the page. Length limits are known: a
  sequence that reaches ``max_tokens`` or ``max_model_len`` with the token in flight is left out;
- the slots and pages those sequences free: waiting sequences are admitted (their prompt chunks
  join the step, as in ``schedule()``) into the slots and pages free now; the ones freed by
  the step in flight serve an admission one step later.

Batch invariance (rule 1) and sampling keyed by (seed, token index) (rule 7) make the numbers
independent of which step a token runs in and with whom, so scheduling ahead changes no token
and no logprob; the scheduler's decisions stay a pure function of its state.

It declines (returns None) whenever the ordinary path would decide differently: the step in
flight has a non-final prefill chunk, a running sequence is not in it, every one reaches a length
limit, a decode needs a new page and none is free (a preemption), or sequences errored at
``add`` wait to be reported. The engine then postprocesses and calls ``schedule()`` as usual.

A running sequence that samples from a mask or bans that depend on its last token (a grammar, a
bad word of several tokens: ``Sequence.samples_from_its_last_token``) does not stop it: the host
does not know that token yet, so the engine runs the step's forward at once and samples it only
after postprocessing the step in flight (`last_token_samplers_running` says when;
`runtime.llm_steps`).
"""

from __future__ import annotations

from .scheduled import ScheduledSeq
from .sequence import Sequence, SequenceStatus

__all__ = ["LookaheadMixin"]


class LookaheadMixin:
    """`Scheduler.schedule_ahead`, for `Scheduler` (its queues, limits and block manager)."""

    def schedule_ahead(self) -> list[ScheduledSeq] | None:
        """The step after the one step in flight (scheduled, not postprocessed): its running
        sequences' decodes, then admissions; or None when it cannot be decided before that
        step's tokens are known (the module docstring). Allocates the pages it needs;
        ``postprocess`` takes the steps in the order scheduled."""
        if len(self._in_flight) != 1 or self._errored:
            return None
        self._ready_kept()  # (states kept by the step in flight are copied before this one runs)
        step, _ = self._in_flight[0]
        if not all(item.samples for item in step):
            return None  # a prefill chunk goes on next step: the ordinary path decides it
        running = [item.seq for item in step if item.seq.status is SequenceStatus.RUNNING]
        if len(running) != len(self._running):
            return None  # someone running sits this step out (the token budget, max_num_seqs)
        ahead = [seq for seq in running if not self._ends_by_length(seq)]
        if not ahead or len(ahead) > self.max_num_batched_tokens:
            return None
        bm = self.block_manager
        bs = bm.block_size
        entering = [seq for seq in ahead if len(seq.token_ids) >= len(seq.block_table) * bs]
        if not bm.can_append(len(entering)):
            return None  # a preemption: the ordinary path's decision
        for seq in entering:
            bm.append_block(seq)
        items = [ScheduledSeq(seq, 1, True, in_flight=True) for seq in ahead]
        if self.prefix_states:  # (a reply's state moves along it: its slot holds its first len(token_ids) tokens' then)
            for item in items:
                self._keep_reply(item, len(item.seq.token_ids))
        if self._waiting:  # slots free now (the ones freed by the step in flight count next step)
            self._schedule_waiting(self.max_num_batched_tokens - len(items), items)
        self._in_flight.append((items, True))
        return items

    def last_token_samplers_running(self) -> bool:
        """Whether a running sequence samples from a mask or bans that depend on its last token
        (``Sequence.samples_from_its_last_token``): a step scheduled ahead must then sample only
        once the step in flight is postprocessed. Scans only the sequences added with such
        settings, dropping the finished ones."""
        if not self._last_token_samplers:
            return False
        self._last_token_samplers = [seq for seq in self._last_token_samplers if not seq.is_finished]
        return any(seq.status is SequenceStatus.RUNNING for seq in self._last_token_samplers)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """Whether ``seq`` finishes with the token in flight for a length limit (known now)."""
        num_tokens = len(seq.token_ids) + 1
        return num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens or num_tokens >= self.max_model_len
