"""Continuous-batching scheduler (vLLM v1 style): a token budget per step, chunked prefill,
decode and prefill mixed in one step, preemption by recompute when KV pages run out.

Every decision is a pure function of the scheduler's state (arrival order, token counts, free
pages), never of timing, so a workload always yields the same steps. The numbers do not depend
on the schedule anyway (batch-invariant kernels, sampling keyed by seed and token index);
determinism keeps runs replayable. Drive loop: while ``has_unfinished()``: ``schedule()``,
report ``errored``, run the model on ``scheduled`` and sample, then ``postprocess()``
(`scheduler_postprocess.py`: applying the results and the finishing rules). An engine that
overlaps its host work with the device may call ``schedule_ahead()`` between running a step and
postprocessing it (`scheduler_ahead.py`: the next decode step, before the tokens are known).

With prefix sharing on in the BlockManager, a sequence's leading full pages that another
sequence has already computed (or computes earlier in the same step, see ``_publish``) are
shared instead of recomputed: its ``num_computed_tokens`` jumps past them when its pages are
allocated, and the step's chunk (and the token budget) covers only what is left. Models with
gated-DeltaNet layers share the prompt of a request's n samples instead (`scheduler_siblings`:
the prompt's pages and a copy of its state, ``share_prompt_state``).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from itertools import islice

from .block_manager import BlockManager
from .scheduled import ScheduledSeq, SchedulerOutput
from .scheduler_ahead import LookaheadMixin
from .scheduler_postprocess import PostprocessMixin
from .scheduler_prefix_states import KeptState, PrefixStatesMixin
from .scheduler_progress import ProgressMixin
from .scheduler_siblings import PromptStateMixin
from .sequence import Sequence, SequenceStatus

__all__ = ["ScheduledSeq", "SchedulerOutput", "Scheduler"]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"Scheduler {name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"Scheduler {name}={value} is below the minimum {minimum}")
    return value


class Scheduler(LookaheadMixin, PrefixStatesMixin, PromptStateMixin, PostprocessMixin, ProgressMixin):
    """Decides, step by step, which tokens of which sequences run through the model.

    Args:
        block_manager: owns the KV pages.
        max_num_seqs: most sequences running at once (so also per step), >= 1.
        max_num_batched_tokens: token budget of one step, >= 1.
        max_model_len: most tokens (prompt + output) a sequence may reach, >= 1.
        eos_token_id: the model's EOS token, or None when it has none.
        chunked_prefill: when False a sequence is only scheduled if all its uncomputed tokens
            fit in the step's remaining budget; this requires
            ``max_num_batched_tokens >= max_model_len``, otherwise a long prompt (or a long
            sequence re-prefilling after a preemption) could never be scheduled.
        share_prompt_state: the n samples of a request prefill its prompt once and copy its
            gated-DeltaNet state (`scheduler_siblings`; needs prefix sharing off).
        prefix_states: keep the gated-DeltaNet states of up to this many prompts for later
            requests that begin with them (`scheduler_prefix_states`; needs prefix sharing off).

    Prefix sharing is switched on and off in the BlockManager (``enable_prefix_sharing``).
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_id: int | None,
        chunked_prefill: bool = True,
        share_prompt_state: bool = False,
        prefix_states: int = 0,
    ) -> None:
        if not isinstance(block_manager, BlockManager):
            raise ValueError(
                f"Scheduler block_manager must be a BlockManager, got {type(block_manager).__name__}"
            )
        self.block_manager = block_manager
        self.max_num_seqs = _check_int("max_num_seqs", max_num_seqs, 1)
        self.max_num_batched_tokens = _check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
        self.max_model_len = _check_int("max_model_len", max_model_len, 1)
        if eos_token_id is not None:
            _check_int("eos_token_id", eos_token_id, 0)
        self.eos_token_id = eos_token_id
        if not isinstance(chunked_prefill, bool):
            raise ValueError(f"Scheduler chunked_prefill={chunked_prefill!r} must be a bool")
        if not chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"Scheduler max_num_batched_tokens={max_num_batched_tokens} is below the minimum "
                f"max_model_len={max_model_len} required when chunked_prefill is False"
            )
        self.chunked_prefill = chunked_prefill
        self._init_siblings(share_prompt_state)
        self._init_prefix_states(prefix_states)
        self._waiting: deque[Sequence] = deque()
        self._running: list[Sequence] = []  # kept sorted by arrival
        self._errored: list[Sequence] = []  # finished at add(), reported by the next schedule()
        #: added sequences whose next mask or bans need their last token (`last_token_samplers_running`)
        self._last_token_samplers: list[Sequence] = []
        self._next_arrival = 0
        # Steps scheduled and not postprocessed yet, oldest first, each with whether it came from
        # schedule_ahead(). A step's tokens are only marked computed by postprocess(), so
        # schedule() waits for an empty queue (it would run the same tokens twice).
        self._in_flight: deque[tuple[list[ScheduledSeq], bool]] = deque()

    @property
    def enable_prefix_sharing(self) -> bool:
        """Whether full pages are shared between sequences (the BlockManager's setting)."""
        return self.block_manager.enable_prefix_sharing

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (FIFO). One that can never fit is finished right away with
        finish_reason "error" and reported in the next ``schedule()``'s ``errored``."""
        if seq.arrival != -1:
            raise ValueError(f"Scheduler.add: {seq!r} was already added to a scheduler")
        if seq.status is not SequenceStatus.WAITING or seq.num_computed_tokens or seq.block_table:
            raise ValueError(f"Scheduler.add: {seq!r} is not a fresh WAITING sequence")
        seq.arrival = self._next_arrival
        self._next_arrival += 1
        if seq.samples_from_its_last_token:  # (last_token_samplers_running watches these only)
            self._last_token_samplers.append(seq)
        error = self._never_fits(seq)
        if error is not None:
            seq.status = SequenceStatus.FINISHED
            seq.finish_reason = "error"
            seq.error = error
            self._errored.append(seq)
            return
        self._waiting.append(seq)
        self._join_siblings(seq)
        self._note_waiting(seq)

    def abort(self, seqs: Iterable[Sequence]) -> None:
        """Finish `seqs` now with finish_reason "abort" (`LLM.abort_request`): a waiting one leaves
        the queue, a running one frees its pages; finished ones are left as they are. Between
        steps only: a step scheduled ahead may still be in flight (its rows of these sequences are
        dropped when it is postprocessed, as those of sequences that stopped), not one from
        ``schedule()``, whose postprocess would find them gone."""
        if any(not ahead for _, ahead in self._in_flight):
            raise RuntimeError("Scheduler.abort: called while a step from schedule() is in flight; postprocess it first")
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                self._finish(seq, "abort")
            elif seq.status is SequenceStatus.WAITING:
                self._waiting.remove(seq)
                self._finish_waiting(seq, "abort")

    def has_unfinished(self) -> bool:
        """True while there is anything left to schedule or to report (errored sequences not
        yet returned by ``schedule()`` count, so a drive loop never drops their errors)."""
        return bool(self._waiting or self._running or self._errored)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work: running sequences first (arrival order), then waiting ones
        (FIFO) while the token budget and ``max_num_seqs`` allow. RuntimeError rather than a step
        that would leave the scheduler stalled for good (`scheduler_progress`)."""
        if self._in_flight:
            raise RuntimeError("Scheduler.schedule() called before postprocess() of the last step")
        errored, self._errored = self._errored, []
        self._ready_kept()
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self._schedule_running(self.max_num_batched_tokens, scheduled, preempted)
        # After a preemption the cache is full: admitting now would only take pages that the
        # running sequences need next step (and could re-admit the victim at once).
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        if scheduled:
            self._in_flight.append((scheduled, False))
        else:
            self._check_progress(preempted, errored)
        return SchedulerOutput(scheduled=scheduled, preempted=preempted, errored=errored)

    def _chunk(self, seq: Sequence, budget: int, shared: int | None = None) -> tuple[int, int]:
        """(tokens ``seq`` gets from shared pages, new tokens within ``budget``) for this step;
        new tokens are 0 when it cannot be scheduled now. Shared tokens cost no budget; `shared`
        given: the prompt state taken from a sibling (`scheduler_siblings`)."""
        if shared is None:
            shared = self.block_manager.num_cached_tokens(seq)
        # >= 1: the last token is never shared; a leader stops at its prompt's share point, and so
        # does a prompt whose state is to be kept
        uncomputed = self._capped(seq, seq.num_uncomputed_tokens - shared)
        stop = self._state_cap(seq, seq.num_computed_tokens + shared)
        if stop is not None:
            uncomputed = min(uncomputed, stop - seq.num_computed_tokens - shared)
        if uncomputed <= budget:
            return shared, uncomputed
        return shared, (budget if self.chunked_prefill else 0)

    def _allocate(self, seq: Sequence, shared: int, num_new: int) -> None:
        """Allocate ``seq``'s pages for this step (sharing ``shared`` tokens' worth of pages)."""
        computed = seq.num_computed_tokens
        self.block_manager.allocate(seq, computed + shared + num_new)
        if seq.num_computed_tokens != computed + shared:  # num_cached_tokens and allocate disagree
            raise RuntimeError(
                f"Scheduler: {seq!r} was to share {shared} tokens but shares "
                f"{seq.num_computed_tokens - computed}"
            )

    def _publish(self, item: ScheduledSeq) -> None:
        """Offer the pages that ``item`` completes for sharing, right when it is scheduled.

        The rule: a full page becomes shareable in the step whose chunk writes its last K/V,
        already for sequences scheduled after it in that same step. That is safe because
        (1) the model runner runs a step as one forward in which every layer first writes all
        the step's new K/V into the cache (``PagedContext.attend``: ``kv_cache_write``, then
        attention), so a reader scheduled in the same step sees the writer's K/V exactly as
        it sees its own; (2) a sequence scheduled in a step is never preempted or finished
        within that ``schedule()`` call (victims come after it in arrival order and admission
        stops after a preemption), so its pages stay referenced until written; (3) a failed
        step leaves the cache suspect and the LLM then discards the BlockManager (``_abort``).
        A runner that split one step into several forwards would break (1) and must instead
        publish in ``postprocess`` (the previous-step rule). This rule is what lets the n
        samples of a prompt, which are admitted together, share its pages at once.
        """
        seq = item.seq
        self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + item.num_new_tokens)

    def _item(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        samples = seq.num_computed_tokens + num_new == seq.num_tokens
        return ScheduledSeq(seq=seq, num_new_tokens=num_new, samples=samples)

    def _schedule_running(
        self, budget: int, scheduled: list[ScheduledSeq], preempted: list[Sequence]
    ) -> int:
        """Schedule running sequences in arrival order; returns the budget left. The tokens of
        the siblings that take a leader's prompt state in this step (`scheduler_siblings`) are
        kept from the running sequences after it, for the admissions that follow."""
        running = self._running
        i = kept = 0
        while i < len(running) and budget > kept and len(scheduled) < self.max_num_seqs:
            limit = min(len(running) - i, budget - kept, self.max_num_seqs - len(scheduled))
            decodes = self._schedule_decodes(islice(running, i, i + limit), scheduled)
            if decodes:
                i += decodes
                budget -= decodes
                continue
            seq = running[i]
            shared, num_new = self._chunk(seq, budget - kept)
            if num_new == 0:
                i += 1  # only without chunking: a smaller sequence behind it may still fit
                continue
            if not self._reserve(seq, shared, num_new, preempted):
                break  # seq had to preempt itself: nothing after it is running any more
            scheduled.append(self._item(seq, num_new))
            self._keep_state(scheduled[-1])
            self._publish(scheduled[-1])
            budget -= num_new
            kept += self._sibling_tokens(seq)
            i += 1
        return budget

    def _schedule_decodes(self, seqs: Iterable[Sequence], scheduled: list[ScheduledSeq]) -> int:
        """The hot path: schedule the leading decodes of ``seqs`` (one token left each) up to the
        first other sequence or the first that would need a page when none is free; returns
        how many. Exactly what the general path decides for them, at a fraction of the cost: a
        decode chunk shares nothing (the page holding a sequence's last token never is shared),
        so it costs one token of budget and needs at most one fresh page. A leader whose siblings
        take its prompt state this step (its prompt's last token left at its share point) is left
        to the general path, which keeps their tokens from the budget (`_sibling_tokens`)."""
        bm = self.block_manager
        bs = bm.block_size
        siblings = self._siblings  # (empty unless share_prompt_state)
        count = 0
        for seq in seqs:
            computed = seq.num_computed_tokens
            if len(seq.token_ids) != computed + 1:
                break
            if siblings and seq.num_prompt_tokens == computed + 1 and self._sibling_tokens(seq):
                break
            covered = len(seq.block_table) * bs
            if covered == computed and bm.can_append():
                bm.append_block(seq)  # = allocate(seq, computed + 1) here
                covered += bs
            if covered <= computed:
                break  # needs a page that only a preemption can free: the general path's case
            scheduled.append(ScheduledSeq(seq, 1, True))
            if self.prefix_states:  # (a prompt's last token after its share point)
                self._keep_state(scheduled[-1])
            bm.cache_full_blocks(seq, computed + 1)  # what _publish does
            count += 1
        return count

    def _reserve(self, seq: Sequence, shared: int, num_new: int, preempted: list[Sequence]) -> bool:
        """Make ``seq``'s pages cover this step's chunk (after ``shared`` tokens of shared
        pages), preempting the latest-arrived running sequences as needed. Returns False if
        ``seq`` itself had to be preempted.

        The victim is always at or after ``seq`` in the running list (which is sorted by
        arrival), so sequences already scheduled this step are never preempted. Preempting
        only drops references: published pages stay published, so ``shared`` still holds.
        """
        num_tokens = seq.num_computed_tokens + shared + num_new
        while not self.block_manager.can_allocate(seq, num_tokens):
            if self._drop_kept():  # kept prompt states give their pages back before anyone is preempted
                continue
            victim = self._running[-1]
            self._preempt(victim)
            preempted.append(victim)
            if victim is seq:
                return False
        self._allocate(seq, shared, num_new)
        return True

    def reset_prefix_cache(self) -> None:
        """Forget every shared prefix: the published pages' keys and the kept prompt states (the
        weights or the cache may have changed)."""
        self.reset_prefix_states()
        self.block_manager.reset_prefix_cache()

    def _preempt(self, seq: Sequence) -> None:
        """Preempt by recompute: drop the K/V, keep the tokens, wait at the front of the queue
        (it arrived before everything queued behind it, so FIFO order is kept). Its published
        pages stay cached until reused, so on re-admission it shares back what is left."""
        self._running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self._waiting.appendleft(seq)
        self._note_waiting(seq)

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> None:
        """Admit waiting sequences strictly in FIFO order: stop at the first one that does not
        fit (budget, ``max_num_seqs`` or pages) instead of skipping ahead. Only a sample waiting
        for its leader's prompt state (`scheduler_siblings`) and a prompt waiting for the state of
        the prefix it shares with a running one (`scheduler_prefix_states`) are passed over,
        keeping their places in ``max_num_seqs``."""
        held = index = 0
        while index < len(self._waiting) and budget > 0 and len(self._running) + held < self.max_num_seqs:
            seq = self._waiting[index]
            kept = self._kept_for(seq)
            if (kept is None and self._held(seq)) or self._waits_for_state(seq, kept):
                held, index = held + 1, index + 1
                continue
            item = self._admit(seq, budget, kept)
            if item is None:
                break
            del self._waiting[index]
            seq.status = SequenceStatus.RUNNING
            self._started(seq)
            # Keep running sorted by arrival. (Running is always the earliest-arrived unfinished
            # sequences, so this is an append in practice; bisect keeps it true by construction.)
            if self._running and self._running[-1].arrival > seq.arrival:
                arrivals = [s.arrival for s in self._running]
                self._running.insert(bisect.bisect(arrivals, seq.arrival), seq)
            else:
                self._running.append(seq)
            scheduled.append(item)
            self._publish(item)
            budget -= item.num_new_tokens

    def _admit(self, seq: Sequence, budget: int, kept: KeptState | None) -> ScheduledSeq | None:
        """Allocate waiting `seq`'s pages for its first chunk within `budget`: from a kept prompt
        state (`kept`), a sibling's prompt state or nothing; None when it does not fit now (kept
        prompt states give their pages back first)."""
        donor = None if kept is not None else self._donor(seq)
        shared = len(kept.tokens) if kept is not None else None if donor is None else self.share_point(seq)
        shared, num_new = self._chunk(seq, budget, shared)
        if num_new == 0:
            return None
        bm = self.block_manager
        while not (bm.can_share_prefix(shared, shared + num_new) if kept is not None or donor is not None
                   else bm.can_allocate(seq, seq.num_computed_tokens + shared + num_new)):
            if not self._drop_kept(spare=kept):
                return None
        if kept is not None:
            return self._admit_kept(seq, kept, num_new)
        if donor is not None:
            return self._admit_sharing(seq, donor, num_new)
        self._allocate(seq, shared, num_new)
        return self._item(seq, num_new)
