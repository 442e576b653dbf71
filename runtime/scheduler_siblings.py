"""The n samples of one prompt prefilled once, for models with gated-DeltaNet layers
(docs/design.md section 6b): `Scheduler`'s prompt-state sharing.

Prefix sharing by content keys (`block_manager`) is off for these models: a sequence that took a
published page would skip tokens its gated-DeltaNet (GDN) state must see. The samples of one
request, though, have the same prompt, so one of them (the leader: the first added) prefills it
and the others (its siblings) start from copies of its state:

- the share point ``s`` is the prompt's last whole page before its last token, ``(P - 1) //
  block_size * block_size`` (the page holding the last token is never shared, as in prefix
  sharing: every sample computes at least that token, whose logits it samples from);
- while a sibling waits with nothing computed, the leader's prompt chunks stop at ``s``, so that
  its slot holds the GDN state at exactly ``s`` after that step;
- a waiting sibling whose leader runs below ``s`` is held (the queue goes on past it, counting it
  against ``max_num_seqs``); once the leader's computed tokens are ``s`` and no step is in flight
  (the slot is final), an admitted sibling takes the leader's first ``s / block_size`` pages
  (`BlockManager.share_prefix`) and the step carries a copy of the leader's GDN slot (conv state,
  delta-rule state: `ScheduledSeq.state_from`, the runner's `LinearStateCache.copy_slots`),
  made before the step's forward; the sibling then computes positions ``s..P-1`` itself;
- in that step the running sequences after the leader leave the siblings' tokens of the budget
  to them (`_sibling_tokens`); otherwise (no room that step: ``max_num_seqs``, pages; the leader
  past ``s``, finished or preempted; a step scheduled ahead) the sibling prefills its prompt
  itself, as a preempted sibling re-prefills from 0.

The copy is the data a prefill of the same tokens would have written (the GDN step of a sequence
depends only on its own tokens, rules 1-3), so the siblings' numbers are bitwise those of prefilling
separately, and the prompt's first ``s`` tokens run once instead of ``n`` times.
"""

from __future__ import annotations

from .scheduled import ScheduledSeq
from .sequence import Sequence, SequenceStatus

__all__ = ["PromptStateMixin"]


class PromptStateMixin:
    """Prompt-state sharing between the samples of one request, for `Scheduler` (its
    ``block_manager``, ``_waiting`` and ``_in_flight``); on when ``share_prompt_state``."""

    share_prompt_state: bool = False

    def _init_siblings(self, share_prompt_state: bool) -> None:
        if not isinstance(share_prompt_state, bool):
            raise ValueError(f"Scheduler share_prompt_state={share_prompt_state!r} must be a bool")
        if share_prompt_state and self.block_manager.enable_prefix_sharing:
            raise ValueError("Scheduler share_prompt_state=True needs a BlockManager with enable_prefix_sharing=False "
                             "(a page shared by content would skip tokens the copied state must see)")
        self.share_prompt_state = share_prompt_state
        #: request id -> its samples in arrival order (requests with n > 1 that are not finished)
        self._siblings: dict[int, list[Sequence]] = {}

    def _join_siblings(self, seq: Sequence) -> None:
        """Note a queued sample of an n > 1 request (`Scheduler.add`)."""
        if self.share_prompt_state and seq.params.n > 1:
            self._siblings.setdefault(seq.request_id, []).append(seq)

    def share_point(self, seq: Sequence) -> int:
        """Positions of `seq`'s prompt its siblings take from the leader: the whole pages before
        the prompt's last token (0: nothing to share)."""
        bs = self.block_manager.block_size
        return (seq.num_prompt_tokens - 1) // bs * bs

    def _leader(self, seq: Sequence) -> Sequence | None:
        """The sample of `seq`'s request that prefills the shared prompt, or None (`seq` is it,
        or its request shares nothing)."""
        group = self._siblings.get(seq.request_id) if self.share_prompt_state else None
        return None if not group or group[0] is seq else group[0]

    def _held(self, seq: Sequence) -> bool:
        """Whether waiting `seq` waits for its leader, which runs below the share point."""
        leader = self._leader(seq)
        return (leader is not None and seq.num_computed_tokens == 0 and leader.status is SequenceStatus.RUNNING
                and leader.num_computed_tokens < self.share_point(seq))

    def _donor(self, seq: Sequence) -> Sequence | None:
        """The leader whose slot holds the prompt's state at the share point now, for waiting
        `seq` to copy in this step (never in a step scheduled ahead: the leader may be in flight)."""
        leader = self._leader(seq)
        point = self.share_point(seq)
        if (leader is None or self._in_flight or point == 0 or seq.num_computed_tokens
                or leader.status is not SequenceStatus.RUNNING or leader.num_computed_tokens != point):
            return None
        return leader

    def _capped(self, seq: Sequence, num_new: int) -> int:
        """`num_new` tokens of leader `seq`, stopped at the share point while a sibling waits with
        nothing computed (so that its slot holds the state there after the step)."""
        group = self._siblings.get(seq.request_id) if self.share_prompt_state else None
        if not group or group[0] is not seq:
            return num_new
        point = self.share_point(seq)
        if seq.num_computed_tokens >= point:
            return num_new
        if not any(s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0 for s in group[1:]):
            return num_new
        return min(num_new, point - seq.num_computed_tokens)

    def _sibling_tokens(self, seq: Sequence) -> int:
        """The prompt tokens the waiting siblings of leader `seq` run in this step if they take its
        state now (it stands at the share point, no step in flight); 0 otherwise."""
        group = self._siblings.get(seq.request_id) if self.share_prompt_state else None
        point = self.share_point(seq)
        if not group or group[0] is not seq or self._in_flight or not point or seq.num_computed_tokens != point:
            return 0
        return sum(s.num_tokens - point for s in group[1:]
                   if s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0)

    def _admit_sharing(self, seq: Sequence, donor: Sequence, num_new: int) -> ScheduledSeq:
        """Take `donor`'s prompt pages up to the share point and allocate the rest of this step's
        chunk; the item carries the state copy."""
        point = self.share_point(seq)
        self.block_manager.share_prefix(seq, donor, point)
        self.block_manager.allocate(seq, point + num_new)
        return ScheduledSeq(seq, num_new, point + num_new == seq.num_tokens, state_from=donor)

    def _finish(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish`, and forget a request whose samples all finished."""
        super()._finish(seq, reason)  # type: ignore[misc]
        self._forget_finished_group(seq)

    def _finish_waiting(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish_waiting`, and forget a request whose samples all finished."""
        super()._finish_waiting(seq, reason)  # type: ignore[misc]
        self._forget_finished_group(seq)

    def _forget_finished_group(self, seq: Sequence) -> None:
        group = self._siblings.get(seq.request_id)
        if group is not None and all(s.status is SequenceStatus.FINISHED for s in group):
            del self._siblings[seq.request_id]
