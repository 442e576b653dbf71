"""Prompt states kept for later requests, for models with gated-DeltaNet layers (docs/design.md
section 6b): `Scheduler`'s ``prefix_states``, the multi-turn form of prefix sharing for them.

Prefix sharing by content keys is off for these models: a page carries K/V but no gated-DeltaNet
(GDN) state, and a slot holds the state at its sequence's last position only. So an agent's next
turn, whose prompt is the conversation so far, would prefill all of it again. With
``prefix_states`` > 0 the scheduler keeps that many prompt states, each at a prompt's share point
``s`` (its whole pages before its last token, `scheduler_siblings.share_point`):

- a sequence prefilling its prompt from below ``s`` stops its chunk at ``s`` unless the state of
  its first ``s`` tokens is kept already; in its next step (none in flight: the ordinary path,
  since the chunk before was not final, so its slot holds exactly the state at ``s``) the step
  copies its slot into a free kept-state slot (the least recently used kept state gives its slot
  back when none is free), before the forward (``ScheduledSeq.state_to``), and the kept state
  holds a reference to the sequence's first ``s / block_size`` pages; the kept state the
  sequence took (below) becomes the first to be given back, its conversation having moved past it;
- a sequence admitted with nothing computed takes the deepest kept state whose tokens begin its
  prompt, up to its own share point: those pages (a reference more each) and a copy of the
  state, before its first step (``ScheduledSeq.state_from``); it computes from there. A state kept
  in this step is taken from the next one on (the copy into it runs in this step);
- kept states give their pages and slots back least recently used first when pages run short
  (before any preemption) or a slot is needed, and all of them at `reset_prefix_states` (the
  engine's `reset_prefix_cache`: the weights or the cache may have changed).

The copies are the data a prefill of the same tokens writes (a sequence's GDN step depends only on
its own tokens, rules 1-3; its pages hold the K/V it would write), so the tokens and logprobs are
bitwise those of prefilling everything, and a conversation's next turn prefills only what it adds
past the last share point. Each kept state costs one sequence's state
(`LinearStateSpec.bytes_per_slot`) of the KV budget, plus the pages it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from .linear_state_cache import snapshot_slot
from .prefix_cache import ROOT_KEY, chain_key
from .scheduled import ScheduledSeq
from .sequence import Sequence

__all__ = ["KeptState", "PrefixStatesMixin"]


@dataclass
class KeptState:
    """One kept prompt state: its slot, the pages it holds, the tokens they hold."""

    slot: int
    pages: list[int]
    tokens: tuple[int, ...]
    ready: bool = False  #: the copy into it ran in a step scheduled before this one


class PrefixStatesMixin:
    """Kept prompt states, for `Scheduler` (its ``block_manager`` and ``max_num_seqs``, and the
    prompt-state sharing's ``share_point``); on when ``prefix_states`` > 0."""

    prefix_states: int = 0

    def _init_prefix_states(self, prefix_states: int) -> None:
        if isinstance(prefix_states, bool) or not isinstance(prefix_states, int) or prefix_states < 0:
            raise ValueError(f"Scheduler prefix_states={prefix_states!r} must be an int >= 0")
        if prefix_states and self.block_manager.enable_prefix_sharing:
            raise ValueError("Scheduler prefix_states > 0 needs a BlockManager with enable_prefix_sharing=False (the "
                             "states go with pages shared without content keys)")
        if prefix_states and getattr(self.block_manager, "window_group", None) is not None:
            raise ValueError("Scheduler prefix_states > 0 needs a BlockManager without a window page group")
        self.prefix_states = prefix_states
        self._kept: OrderedDict[bytes, KeptState] = OrderedDict()  # least recently used first
        self._free_state_slots = [snapshot_slot(self.max_num_seqs, i) for i in reversed(range(prefix_states))]
        self._prompt_keys: dict[int, list[bytes]] = {}  # seq_id -> its prompt's page keys up to the share point
        self._taken: dict[int, bytes] = {}  # seq_id -> the key of the kept state it took
        self._fresh: list[KeptState] = []  # kept in the step being scheduled (not ready yet)
        #: prompt tokens taken from kept states instead of being computed (a running total)
        self.num_prefix_state_tokens = 0

    @property
    def num_kept_states(self) -> int:
        """Prompt states kept now."""
        return len(self._kept)

    def _keys(self, seq: Sequence) -> list[bytes]:
        """Content keys of `seq`'s prompt pages before its share point (computed once)."""
        keys = self._prompt_keys.get(seq.seq_id)
        if keys is None:
            bs, parent, keys = self.block_manager.block_size, ROOT_KEY, []
            for index in range(self.share_point(seq) // bs):
                parent = chain_key(parent, tuple(seq.token_ids[index * bs:(index + 1) * bs]))
                keys.append(parent)
            self._prompt_keys[seq.seq_id] = keys
        return keys

    def _state_cap(self, seq: Sequence, computed: int) -> int | None:
        """Where `seq`'s chunk from `computed` stops so that its state there can be kept: its share
        point, while below it and not kept; None: no stop."""
        if not self.prefix_states:
            return None
        point = self.share_point(seq)
        if computed >= point or not point or self._keys(seq)[-1] in self._kept:
            return None
        return point

    def _keep_state(self, item: ScheduledSeq) -> None:
        """Copy `item`'s state into a kept slot before its step when it stands at its share point
        and the state there is not kept (a slot free, or a ready one given back)."""
        seq = item.seq
        point = self.share_point(seq)
        if not self.prefix_states or not point or seq.num_computed_tokens != point:
            return
        key = self._keys(seq)[-1]
        if key in self._kept or not (self._free_state_slots or self._drop_kept()):
            return
        taken = self._taken.pop(seq.seq_id, None)
        if taken in self._kept:  # (the state it took served its conversation: given back first now)
            self._kept.move_to_end(taken, last=False)
        pages = seq.block_table[:point // self.block_manager.block_size]
        self.block_manager.hold(pages)
        kept = self._kept[key] = KeptState(self._free_state_slots.pop(), list(pages), tuple(seq.token_ids[:point]))
        self._fresh.append(kept)
        item.state_to = kept.slot

    def _kept_for(self, seq: Sequence) -> KeptState | None:
        """The deepest ready kept state whose tokens begin waiting `seq`'s prompt, up to its share
        point, when it has nothing computed; None otherwise."""
        if not self._kept or seq.num_computed_tokens or seq.prompt_unscored or not self.share_point(seq):
            return None  # (a prompt still to score computes every position: runtime.top_logprobs)
        for key in reversed(self._keys(seq)):
            kept = self._kept.get(key)
            if kept is not None and kept.ready and tuple(seq.token_ids[:len(kept.tokens)]) == kept.tokens:
                self._kept.move_to_end(key)
                self._taken[seq.seq_id] = key
                return kept
        return None

    def _admit_kept(self, seq: Sequence, kept: KeptState, num_new: int) -> ScheduledSeq:
        """Give `seq` the kept state's pages, allocate the rest of this step's chunk; the item carries
        the state's copy."""
        shared = len(kept.tokens)
        self.block_manager.share_pages(seq, kept.pages)
        self.block_manager.allocate(seq, shared + num_new)
        self.num_prefix_state_tokens += shared
        return ScheduledSeq(seq, num_new, shared + num_new == seq.num_tokens, state_from=kept.slot)

    def _ready_kept(self) -> None:
        """A new step: the states kept by the steps before it are copied before it runs."""
        for kept in self._fresh:
            kept.ready = True
        self._fresh.clear()

    def _drop_kept(self, spare: KeptState | None = None) -> bool:
        """Give back the least recently used ready kept state's pages and slot (never `spare`'s);
        False when none."""
        for key, kept in self._kept.items():
            if kept.ready and kept is not spare:
                del self._kept[key]
                self.block_manager.release(kept.pages)
                self._free_state_slots.append(kept.slot)
                return True
        return False

    def reset_prefix_states(self) -> None:
        """Give back every kept state (the weights or the cache may have changed)."""
        for kept in self._kept.values():
            self.block_manager.release(kept.pages)
            self._free_state_slots.append(kept.slot)
        self._kept.clear()
        self._fresh.clear()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish`, and forget the sequence's prompt keys."""
        super()._finish(seq, reason)  # type: ignore[misc]
        self._prompt_keys.pop(seq.seq_id, None)
        self._taken.pop(seq.seq_id, None)

    def _finish_waiting(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish_waiting`, and forget the sequence's prompt keys."""
        super()._finish_waiting(seq, reason)  # type: ignore[misc]
        self._prompt_keys.pop(seq.seq_id, None)
        self._taken.pop(seq.seq_id, None)
