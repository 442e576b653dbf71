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
  copies its slot into a free kept-state slot (when none is free, the kept state the sequence
  took (below) gives its slot back first, its conversation having moved past it, else the least
  recently used one), before the forward (``ScheduledSeq.state_to``), and the kept state holds a
  reference to the sequence's first ``s / block_size`` pages;
- a sequence admitted with nothing computed takes the deepest kept state whose tokens begin its
  prompt, up to its own share point: those pages (a reference more each) and a copy of the
  state, before its first step (``ScheduledSeq.state_from``); it computes from there. A state kept
  in this step is taken from the next one on (the copy into it runs in this step);
- kept states give their pages and slots back least recently used first when pages run short
  (before any preemption) or a slot is needed, and all of them at `reset_prefix_states` (the
  engine's `reset_prefix_cache`: the weights or the cache may have changed).

Prompts that begin alike (a system prompt; one prompt sent as several requests, as TRL's GRPO
does) share their common prefix the same way: a prompt prefilling from below a page end where
the prefix it shares with a waiting prompt or a kept state ends (a branch point:
`_branch_point`) stops its chunk there and keeps the state there as above; the waiting prompts
wait for it (`_waits_for_state`; counted against ``max_num_seqs``, as a held sibling is) and then
take it, and so do later ones (the second conversation behind a system prompt keeps the state
where it ends, the first having kept a deeper one; the third on take it).

A reply moves its conversation's state along (`_keep_reply`): every ``reply_stride`` tokens
(`REPLY_STRIDE`, rounded up to whole pages) past its prompt's share point, a decoding sequence's
step copies its slot, then holding the state of exactly its first ``p`` tokens, into the state
it kept last when that one is its own (no one took it, no waiting prompt wants it: it moves,
taking the new pages), else into a new one; a step scheduled ahead does it at its position
``len(token_ids)``, whose state the step in flight leaves in the slot. So a conversation's next
turn takes its last turn's reply too, up to the last stride, at one slot copy a stride.

The copies are the data a prefill of the same tokens writes (a sequence's GDN step depends only on
its own tokens, rules 1-3; its pages hold the K/V it would write), so the tokens and logprobs are
bitwise those of prefilling everything, and a conversation's next turn prefills only what it adds
past the last share point. Each kept state costs one sequence's state
(`LinearStateSpec.bytes_per_slot`) of the KV budget, plus the pages it holds.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass

from .linear_state_cache import snapshot_slot
from .prefix_cache import ROOT_KEY, chain_key
from .scheduled import ScheduledSeq
from .sequence import Sequence, SequenceStatus

__all__ = ["REPLY_STRIDE", "KeptState", "PrefixStatesMixin"]

#: a reply's kept state moves along it every this many tokens (rounded up to whole pages)
REPLY_STRIDE = 64


@dataclass
class KeptState:
    """One kept prompt state: its slot, the pages it holds, the tokens and the chain keys of those pages."""

    slot: int
    pages: list[int]
    tokens: tuple[int, ...]
    keys: list[bytes]
    branch: bool = False  #: kept where prompts' common prefix ends (not at its prompt's share point)
    ready: bool = False  #: the copy into it ran in a step scheduled before this one
    takers: int = 0  #: sequences that took it

    @property
    def key(self) -> bytes:
        """Its last page's key (the one it is found by)."""
        return self.keys[-1]


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
        self._interest: Counter[bytes] = Counter()  # page key -> waiting prompts (nothing computed) holding it
        self._seen: Counter[bytes] = Counter()  # page key -> kept states holding it
        self._noted: set[int] = set()  # seq_ids counted in _interest
        self._computing: dict[bytes, Sequence] = {}  # page key -> the running prompt that computes it
        self._owned: dict[int, bytes] = {}  # seq_id -> the key of the state it kept last (moved along its reply)
        self._reply_keys: dict[int, list[bytes]] = {}  # seq_id -> its page keys past the share point, as far as kept
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
        """Where `seq`'s chunk from `computed` stops so that its state there can be kept: the first
        branch point past `computed`, else its share point, while below it and not kept; None: no stop."""
        if not self.prefix_states:
            return None
        point = self.share_point(seq)
        if computed >= point or not point:
            return None
        branch = self._branch_point(seq, computed)
        if branch is not None:
            return branch
        return None if self._keys(seq)[-1] in self._kept else point

    def _branch_point(self, seq: Sequence, computed: int) -> int | None:
        """The first page end past `computed`, before `seq`'s share point, where the prefix that
        `seq` shares with a waiting prompt or a kept state ends and whose state is not kept; None
        when none.

        With ``c_j`` the waiting prompts (`seq` not counted) and kept states whose keys hold
        `seq`'s page key ``j`` (``c_j`` falls as ``j`` grows: the keys are chained), a prefix
        shared with one of them ends at page ``j`` where ``c_j > c_{j+1}``."""
        if not (self._interest or self._seen):
            return None
        keys, bs = self._keys(seq), self.block_manager.block_size
        own = seq.seq_id in self._noted

        def count(key: bytes) -> int:
            return self._interest.get(key, 0) - own + self._seen.get(key, 0)

        for j in range(computed // bs, len(keys) - 1):
            here = count(keys[j])
            if here <= 0:
                return None
            if here > count(keys[j + 1]) and keys[j] not in self._kept:
                return (j + 1) * bs
        return None

    def _keep_state(self, item: ScheduledSeq) -> None:
        """Copy `item`'s state into a kept slot before its step when it stands at its share point
        or at a branch point before it (`_branch_point`), and the state there is not kept (a slot
        free, or a ready one given back)."""
        seq = item.seq
        computed, bs = seq.num_computed_tokens, self.block_manager.block_size
        point = self.share_point(seq)
        if not self.prefix_states or not computed or computed % bs:
            return
        if computed > point:
            return self._keep_reply(item, computed)
        key = self._keys(seq)[computed // bs - 1]
        if computed != point and self._branch_point(seq, computed - 1) != computed:
            return  # (a chunk that ended on a page end that is no branch point)
        if key in self._kept:
            return
        taken = self._kept.get(self._taken.get(seq.seq_id, b""))
        if taken is not None and not taken.branch and not self._interest.get(taken.key):
            self._kept.move_to_end(taken.key, last=False)  # (its conversation moved past it: given back first)
        if not (self._free_state_slots or self._drop_kept(wanted=bool(self._interest.get(key)))):
            return  # (a state no waiting prompt shares never takes the slot of one that some do)
        self._taken.pop(seq.seq_id, None)
        pages = seq.block_table[:computed // bs]
        self.block_manager.hold(pages)
        keys = self._keys(seq)[:computed // bs]
        kept = self._kept[key] = KeptState(self._free_state_slots.pop(), list(pages), tuple(seq.token_ids[:computed]),
                                           keys, branch=computed != point)
        self._count_seen(keys, 1)
        self._fresh.append(kept)
        item.state_to = kept.slot
        if not kept.branch:
            self._owned[seq.seq_id] = key

    def _keep_reply(self, item: ScheduledSeq, position: int) -> None:
        """Before `item`'s step, whose slot then holds the state of its sequence's first `position`
        tokens, past its share point: at every `reply_stride` tokens move the state the sequence
        kept last there (its own: no one took it, no waiting prompt wants it), else keep a new one
        (a slot free, or one no waiting prompt wants given back), so that a conversation's next turn
        takes its reply too. An item scheduled ahead passes its position (``len(token_ids)``)."""
        seq, bs = item.seq, self.block_manager.block_size
        if not self.prefix_states or position % self.reply_stride:
            return
        keys = self._reply_keys.setdefault(seq.seq_id, list(self._keys(seq)))
        for index in range(len(keys), position // bs):
            keys.append(chain_key(keys[-1] if keys else ROOT_KEY, tuple(seq.token_ids[index * bs:(index + 1) * bs])))
        if keys[position // bs - 1] in self._kept:
            return
        own = self._kept.get(self._owned.get(seq.seq_id, b""))
        if own is not None and not own.branch and not own.takers and not self._interest.get(own.key):
            del self._kept[own.key]
            self._count_seen(own.keys, -1)
            self.block_manager.hold(seq.block_table[len(own.pages):position // bs])
            own.pages = list(seq.block_table[:position // bs])
        elif self._free_state_slots or self._drop_kept(wanted=False):
            self.block_manager.hold(seq.block_table[:position // bs])
            own = KeptState(self._free_state_slots.pop(), list(seq.block_table[:position // bs]), (), [])
        else:
            return
        own.tokens, own.keys, own.ready = tuple(seq.token_ids[:position]), keys[:position // bs], False
        self._kept[own.key] = own
        self._count_seen(own.keys, 1)
        self._fresh.append(own)
        self._owned[seq.seq_id] = own.key
        item.state_to = own.slot

    @property
    def reply_stride(self) -> int:
        """Tokens between the states a sequence's reply keeps (`_keep_reply`): the smallest
        whole number of pages of at least `REPLY_STRIDE` tokens (each move is a copy of its slot)."""
        bs = self.block_manager.block_size
        return -(-REPLY_STRIDE // bs) * bs

    def _kept_for(self, seq: Sequence) -> KeptState | None:
        """The deepest ready kept state whose tokens begin waiting `seq`'s prompt, up to its share
        point, when it has nothing computed; None otherwise."""
        if not self._kept or seq.num_computed_tokens or seq.prompt_unscored or not self.share_point(seq):
            return None  # (a prompt still to score computes every position: runtime.top_logprobs)
        if self._keys(seq)[0] not in self._seen:
            return None  # (no kept state holds its first page, so none begins it: each waiting prompt's early out)
        leader = self._leader(seq)  # (a sample whose leader is live takes the whole shared prompt, or waits for it)
        keys = self._keys(seq)[-1:] if leader is not None and leader.status is not SequenceStatus.FINISHED else self._keys(seq)
        for key in reversed(keys):
            kept = self._kept.get(key)
            if kept is not None and kept.ready and tuple(seq.token_ids[:len(kept.tokens)]) == kept.tokens:
                return kept
        return None

    def _note_waiting(self, seq: Sequence) -> None:
        """Count queued `seq`'s prompt page keys as wanted (`Scheduler.add`, a preemption): a
        prompt computing them stops where their shared prefix ends (`_branch_point`)."""
        self._owned.pop(seq.seq_id, None)  # (after a preemption its pages are new: what it kept stays as it is)
        if (self.prefix_states and seq.seq_id not in self._noted and not seq.num_computed_tokens
                and not seq.prompt_unscored and self.share_point(seq)):
            self._noted.add(seq.seq_id)
            self._interest.update(self._keys(seq))

    def _unnote(self, seq: Sequence) -> None:
        if seq.seq_id in self._noted:
            self._noted.discard(seq.seq_id)
            for key in self._keys(seq):
                self._interest[key] -= 1
                if not self._interest[key]:
                    del self._interest[key]

    def _started(self, seq: Sequence) -> None:
        """Admitted `seq` is no longer waiting; the page keys it computes (past those it took) are
        its own to keep for the prompts that wait for them (`_waits_for_state`)."""
        if not self.prefix_states:
            return
        self._unnote(seq)
        for key in self._keys(seq)[seq.num_computed_tokens // self.block_manager.block_size:]:
            self._computing[key] = seq

    def _waits_for_state(self, seq: Sequence, kept: KeptState | None) -> bool:
        """Whether waiting `seq` waits for another request's running prompt to keep the state where
        their shared prefix ends, deeper than `kept` (the state it could take now): that prompt
        computes there now, or kept it in this step (the copy runs first)."""
        if not self._computing or seq.seq_id not in self._noted:
            return False
        keys, bs = self._keys(seq), self.block_manager.block_size
        for j in range(len(keys) - 1, -1 if kept is None else len(kept.tokens) // bs - 1, -1):
            other = self._computing.get(keys[j])
            if other is None or other.status is not SequenceStatus.RUNNING or other.request_id == seq.request_id:
                continue  # (a sample's own request: its leader shares with it, `scheduler_siblings`)
            state = self._kept.get(keys[j])
            return other.num_computed_tokens < (j + 1) * bs or (state is not None and not state.ready)
        return False

    def _admit_kept(self, seq: Sequence, kept: KeptState, num_new: int) -> ScheduledSeq:
        """Give `seq` the kept state's pages, allocate the rest of this step's chunk; the item carries
        the state's copy."""
        shared = len(kept.tokens)
        kept.takers += 1
        self._kept.move_to_end(kept.key)
        self._taken[seq.seq_id] = kept.key
        self.block_manager.share_pages(seq, kept.pages)
        self.block_manager.allocate(seq, shared + num_new)
        self.num_prefix_state_tokens += shared
        return ScheduledSeq(seq, num_new, shared + num_new == seq.num_tokens, state_from=kept.slot)

    def _ready_kept(self) -> None:
        """A new step: the states kept by the steps before it are copied before it runs."""
        for kept in self._fresh:
            kept.ready = True
        self._fresh.clear()

    def _drop_kept(self, spare: KeptState | None = None, wanted: bool = True) -> bool:
        """Give back the least recently used ready kept state's pages and slot (never `spare`'s),
        one no waiting prompt shares first (`wanted` False: only such a one); False when none."""
        ready = [kept for kept in self._kept.values() if kept.ready and kept is not spare]
        unwanted = [kept for kept in ready if not self._interest.get(kept.key)]
        if not (unwanted or (wanted and ready)):
            return False
        kept = (unwanted or ready)[0]
        del self._kept[kept.key]
        self._give_back(kept)
        return True

    def _give_back(self, kept: KeptState) -> None:
        """A kept state's pages and slot go back, and its keys stop counting."""
        self.block_manager.release(kept.pages)
        self._free_state_slots.append(kept.slot)
        self._count_seen(kept.keys, -1)

    def _count_seen(self, keys: list[bytes], step: int) -> None:
        """Add `step` to each key's count of kept states holding it (a count of 0 leaves)."""
        for key in keys:
            self._seen[key] += step
            if not self._seen[key]:
                del self._seen[key]

    def reset_prefix_states(self) -> None:
        """Give back every kept state (the weights or the cache may have changed)."""
        for kept in self._kept.values():
            self._give_back(kept)
        self._kept.clear()
        self._fresh.clear()

    def _finish(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish`, and forget the sequence's prompt keys."""
        super()._finish(seq, reason)  # type: ignore[misc]
        self._forget(seq)

    def _finish_waiting(self, seq: Sequence, reason: str) -> None:
        """`PostprocessMixin._finish_waiting`, and forget the sequence's prompt keys."""
        super()._finish_waiting(seq, reason)  # type: ignore[misc]
        self._forget(seq)

    def _forget(self, seq: Sequence) -> None:
        self._unnote(seq)
        for key in self._prompt_keys.pop(seq.seq_id, ()):
            if self._computing.get(key) is seq:
                del self._computing[key]
        self._taken.pop(seq.seq_id, None)
        self._owned.pop(seq.seq_id, None)
        self._reply_keys.pop(seq.seq_id, None)
