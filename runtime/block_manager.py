"""Paged KV cache bookkeeping: fixed-size pages, a free list, per-sequence block tables, and
prefix sharing of full pages between sequences (the n samples of one prompt, or requests with
a common prefix).

Only ids are managed here; the K/V tensors live in the model runner. Which physical page a
sequence gets never changes its numbers (attention reads K/V through the block table, in blocks
aligned to absolute positions), but allocation is still deterministic, so a rerun of the same
workload touches the same pages, which keeps debugging and replay simple.

Every block table is mirrored, as a row of one array, in ``BlockManager.tables`` (see
``block_tables``): the model runner gathers a step's tables from there in one vectorised op.

Prefix sharing
--------------
Full pages whose K/V are written are published under content keys (`runtime.prefix_cache`,
which says how and why sharing them is bitwise); ``allocate`` hands a sequence a published page
instead of a fresh one where its leading pages' keys match, and advances
``seq.num_computed_tokens`` past it. Pages are reference counted. A page whose count drops to 0
goes back to the free list but keeps its key, so a later identical prefix (for instance a
preempted sequence coming back) can still revive it; its key is dropped only when the page is
handed out fresh to someone else. The free list is FIFO and a sequence's pages are returned last
page first, so the cache loses prefixes from their tail (the least shareable part) first.

Sliding windows
---------------
With a ``window`` (the engine's when every attention layer of the model has a sliding window,
their largest; the window group's of a model mixing windowed and full layers, whose
``PageGroups`` keeps the full layers' pages here and the windowed layers' in a second
BlockManager, `runtime.page_groups`; docs/design.md section 6) ``release_behind_window`` drops a
sequence's references to its leading pages that no later query of it can read: those wholly below
``attention_window.window_block_start`` of its next position (the attention kernels never read
below it, docs/design.md rule 2). The entries stay in ``block_table`` (so positions keep their
page index) but count as released (``seq.released_blocks``): never freed again, never a parent
looked up through (``seq.released_key`` keeps the last one's content key for the chain). A
released page goes to the back of the free list with its key, like a freed one, so prefix
sharing and preemption see exactly what they would without the window. A prefix-cache hit takes
only the pages the sequence's next query reads: the entries below its window enter released, with
no page (`_window_hits`), so a cached prefix longer than the cache still fits while its window does.

When a page may be published is the caller's contract; the Scheduler's rule is in
``Scheduler._publish``. The K/V cache contents must stay valid for as long as keys live:
``reset_prefix_cache`` forgets every key (the LLM calls it whenever the weights or the cache may
have changed: `LLM._keep_prefix_cache`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from vexact_models.kernels.attention_window import WIDEST_KEY_BLOCK, window_block_start

from .block_tables import BlockTables
from .block_manager_shared import SharedPagesMixin
from .prefix_cache import ROOT_KEY, PrefixCache, chain_key
from .sequence import Sequence

__all__ = ["BlockManager"]

def window_pages_bound(window: int, block_size: int, chunk: int) -> int:
    """Pages behind a `window` one sequence holds at most when its steps run at most `chunk`
    tokens: its next position's window (`window` keys and up to ``WIDEST_KEY_BLOCK - 1`` more below
    them, `window_block_start`'s rounding), the step's chunk, two pages cut by the edges and one
    decode page a step scheduled ahead takes before the step in flight releases."""
    return -(-(window + WIDEST_KEY_BLOCK - 1 + chunk) // block_size) + 3


class BlockManager(SharedPagesMixin):
    """Fixed-size KV pages, a free list, per-sequence block tables, shared full prefix pages.

    A sequence's ``block_table`` lists the pages that hold its positions:
    position ``p`` is slot ``p % block_size`` of page ``block_table[p // block_size]``.

    Args:
        num_blocks: pages in the cache, >= 1.
        block_size: positions per page, >= 1.
        enable_prefix_sharing: when False no page is ever published or shared: every page is
            owned by exactly one sequence (the behaviour before prefix sharing).
        window: None, or the sliding window every attention layer whose pages these are stays
            within (their largest): ``release_behind_window`` then frees the pages behind it.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_sharing: bool = True,
                 window: int | None = None) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"BlockManager window={window!r} must be None or an int >= 1")
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"BlockManager {name}={value!r} must be an int, got {type(value).__name__}"
                )
            if value < 1:
                raise ValueError(f"BlockManager {name}={value} is below the minimum 1")
        if not isinstance(enable_prefix_sharing, bool):
            raise ValueError(
                f"BlockManager enable_prefix_sharing={enable_prefix_sharing!r} must be a bool"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_sharing = enable_prefix_sharing
        self.window = window
        # FIFO free list (insertion ordered; an OrderedDict so that a cached page can be revived
        # from the middle in O(1)): pages are handed out from the front, returned to the back,
        # so the allocation order is a pure function of the sequence of calls.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # References per page: sequences whose block table lists it. 0 <=> on the free list.
        self._ref = [0] * num_blocks
        #: The published pages' content keys (prefix sharing).
        self.prefix = PrefixCache(num_blocks)
        #: Pages taken from the prefix cache instead of being computed (a running total).
        self.num_shared_hits = 0
        #: Every allocated sequence's block table as a row of one array, for the model runner.
        self.tables = BlockTables()

    @property
    def num_free_blocks(self) -> int:
        """Pages with no reference (cached ones included: they are reclaimed on demand)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Published pages that can be shared right now (in use or free)."""
        return len(self.prefix)

    def can_append(self, count: int = 1) -> bool:
        """Whether `count` sequences can each enter one fresh page now (`append_block`)."""
        return count <= len(self._free)

    def shortfall(self, positions: int, chunk: int) -> str | None:
        """Why a sequence that will hold `positions` positions, run alone in chunks of at most
        `chunk` tokens, can never fit these pages (the end of a sentence naming what it needs),
        or None. A sequence alone in the cache always progresses: what makes preemption end. With
        a window it holds at most `window_pages_bound` pages at once, whatever its length."""
        needed = self.blocks_for(positions)
        if self.window is None:
            if needed > self.num_blocks:
                return (f"needs {needed} KV cache blocks for {positions} positions but the cache has only "
                        f"{self.num_blocks} blocks in total (block_size={self.block_size})")
            return None
        # the pages behind the window are released as it advances
        needed = min(needed, window_pages_bound(self.window, self.block_size, chunk))
        if needed > self.num_blocks:
            return (f"needs {needed} KV cache blocks for {positions} positions in chunks of {chunk} but the cache "
                    f"has only {self.num_blocks} blocks in total (block_size={self.block_size}, window={self.window})")
        return None

    def ref_count(self, block: int) -> int:
        """How many block tables list ``block``."""
        return self._ref[block]

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold positions [0, num_tokens): ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is below the minimum 0")
        return -(-num_tokens // self.block_size)

    # -- prefix lookup ---------------------------------------------------------------------
    def _page_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        bs = self.block_size
        return tuple(seq.token_ids[index * bs : (index + 1) * bs])

    def _walk(self, seq: Sequence, num_tokens: int) -> list[tuple[int, bytes, tuple[bytes, tuple[int, ...]]]]:
        """(page, key, (parent key, token ids)) of the published pages that ``allocate(seq,
        num_tokens)`` may take for the next entries of ``seq.block_table``: leading full pages of
        ``seq``'s tokens within [0, num_tokens), never the one holding its last token, looked up in
        order until the first miss."""
        if not self.enable_prefix_sharing or not len(self.prefix) or seq.prompt_unscored:
            return []  # (a prompt still to score computes every position: runtime.top_logprobs)
        bs = self.block_size
        table = seq.block_table
        start = len(table)
        # The table must end exactly at the computed prefix (no page allocated but unwritten),
        # so that the next page is the next thing to compute.
        if seq.num_computed_tokens != start * bs:
            return []
        stop = min((seq.num_tokens - 1) // bs, num_tokens // bs)
        if start >= stop:
            return []
        parent = self._parent_key(seq, start)
        if parent is None:  # the last page of the table was never published
            return []
        walk = []
        for index in range(start, stop):
            tokens = self._page_tokens(seq, index)
            key = chain_key(parent, tokens)
            block = self.prefix.lookup(key, (parent, tokens))
            if block is None:
                break
            walk.append((block, key, (parent, tokens)))
            parent = key
        return walk

    def _hits(self, seq: Sequence, num_tokens: int) -> list[int]:
        """The pages of `_walk`: what ``allocate(seq, num_tokens)`` covers by sharing (under a
        window, the ones below it enter released: `_window_hits`)."""
        return [block for block, _, _ in self._walk(seq, num_tokens)]

    def first_kept(self, num_pages: int) -> int:
        """The first entry a sequence whose table holds `num_pages` pages, all computed, may still
        read (0 without a window): its next position's `window_block_start` in pages, the table's
        last page kept, as `release_behind_window` keeps it."""
        if self.window is None or num_pages <= 1:
            return 0
        return min(window_block_start(num_pages * self.block_size, self.window) // self.block_size, num_pages - 1)

    def _window_hits(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int, bytes | None]:
        """(pages ``allocate(seq, num_tokens)`` takes, entries before them released on arrival, the
        content key the last of those stands for): `_walk`'s pages, less, under a window, those
        below `first_kept` of the table they complete. No query of the sequence reads those, so they
        are neither revived nor counted (as `runtime.page_groups`' window group takes hits): a
        sequence alone in the cache fits however long its cached prefix."""
        walk = self._walk(seq, num_tokens)
        start = len(seq.block_table)
        skipped = max(start, self.first_kept(start + len(walk))) - start if walk else 0
        return [block for block, _, _ in walk[skipped:]], skipped, walk[skipped - 1][1] if skipped else None

    def num_cached_tokens(self, seq: Sequence) -> int:
        """Tokens of ``seq`` past ``seq.num_computed_tokens`` that the next ``allocate`` call
        covering them will mark computed by sharing published pages (a multiple of
        ``block_size``; 0 when sharing is off). The scheduler plans a step's chunk after them."""
        return len(self._hits(seq, seq.num_tokens)) * self.block_size

    # -- allocation ------------------------------------------------------------------------
    def _needs(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int, bytes | None, int, int]:
        """(`_window_hits`' three, fresh pages, free-list pages consumed) for covering [0, num_tokens)."""
        hits, skipped, key = self._window_hits(seq, num_tokens)
        fresh = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - skipped - len(hits))
        revived = sum(1 for block in hits if self._ref[block] == 0)
        return hits, skipped, key, fresh, fresh + revived

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the free pages suffice to cover positions [0, num_tokens) of ``seq``,
        counting the pages it already owns and the shared pages it would take."""
        return self._needs(seq, num_tokens)[4] <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` until it covers positions [0, num_tokens).

        With prefix sharing on, the leading full pages that are already published are shared
        (a reference more each) instead of fresh, and ``seq.num_computed_tokens`` advances past
        them (see ``num_cached_tokens``); under a window the ones below the window of its next
        position enter released, with no page (`_window_hits`). Raises RuntimeError, leaving
        everything unchanged, when there are not enough free pages: a half-grown table would leak
        pages on the caller's error path.
        """
        hits, skipped, key, fresh, needed = self._needs(seq, num_tokens)
        if needed > len(self._free):
            raise RuntimeError(
                f"BlockManager: sequence {seq.seq_id} needs {needed} more blocks to cover "
                f"{num_tokens} tokens but only {len(self._free)} of {self.num_blocks} are free"
            )
        self._place(seq, hits, fresh, skipped, key)
        seq.num_computed_tokens += (skipped + len(hits)) * self.block_size

    def _place(self, seq: Sequence, hits: list[int], fresh: int, skipped: int = 0,
               skipped_key: bytes | None = None) -> None:
        """Append to ``seq.block_table``: `skipped` entries released on arrival (shared pages below
        the window of the sequence's next position, `_window_hits` and `runtime.page_groups`: no
        page, no reference; `skipped_key` the content key the last of them stands for), the shared pages
        `hits` (a reference more each, revived from the free list where unowned), then `fresh`
        pages. The caller has checked that the free list holds them."""
        table = seq.block_table
        start = len(table)
        if skipped:
            self._release_below(seq, start)
            table.extend([0] * skipped)  # never read: below every later query's window_block_start
            seq.released_blocks, seq.released_key = start + skipped, skipped_key
        for block in hits:
            if self._ref[block] == 0:
                del self._free[block]  # revive a cached page: its K/V are still in place
            self._ref[block] += 1
            table.append(block)
        self.num_shared_hits += len(hits)
        for _ in range(fresh):
            table.append(self._pop_fresh())
        self.tables.extend(seq.seq_id, start, table[start:])

    def append_block(self, seq: Sequence) -> None:
        """One fresh page at the end of ``seq.block_table``: what ``allocate`` does for a decode
        step that enters a new page (nothing can be shared there), minus its general
        bookkeeping, for the scheduler's hot path. Raises RuntimeError when no page is free."""
        if not self._free:
            raise RuntimeError(f"BlockManager: sequence {seq.seq_id} needs a block but none of "
                               f"{self.num_blocks} is free")
        seq.block_table.append(self._pop_fresh())
        self.tables.extend(seq.seq_id, len(seq.block_table) - 1, seq.block_table[-1:])

    def _pop_fresh(self) -> int:
        """Take the page at the front of the free list for a new owner."""
        block, _ = self._free.popitem(last=False)
        self.prefix.forget(block)  # its old contents are about to be overwritten
        self._ref[block] = 1
        return block

    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        """Publish the full pages of ``seq`` within positions [0, num_tokens) for sharing.

        The caller promises that their K/V are in the cache before any sequence that could
        take them reads them (see ``Scheduler._publish`` for the scheduler's rule). Pages
        published before are skipped; a page whose key is already served by another page is
        keyed (so the chain continues) and serves it once the pages before it lose it
        (`PrefixCache.forget`).
        """
        if not self.enable_prefix_sharing:
            return
        table = seq.block_table
        bs = self.block_size
        full = min(num_tokens, len(seq.token_ids), len(table) * bs) // bs
        if full <= 0 or self.prefix.key(table[full - 1]) is not None:
            return  # nothing new to publish (most decode steps): the cheap exit first
        # Published pages are always a leading run of the table (shared pages come first,
        # then pages are published in order as they fill up): walk back to its end.
        index = full - 1
        while index > seq.released_blocks and self.prefix.key(table[index - 1]) is None:
            index -= 1
        parent = self._parent_key(seq, index)
        if parent is None:  # the page before was released unpublished: nothing after it can be keyed
            return
        for index in range(index, full):
            block = table[index]
            tokens = self._page_tokens(seq, index)
            key = chain_key(parent, tokens)  # type: ignore[arg-type]
            self.prefix.publish(block, key, (parent, tokens))  # type: ignore[arg-type]
            parent = key

    def _parent_key(self, seq: Sequence, index: int) -> bytes | None:
        """The content key of page ``index - 1`` of ``seq`` (the root's before page 0), None when
        unpublished; a released page's own entry may belong to someone else now, so the key it
        had is ``seq.released_key`` (and none before it is needed)."""
        if index == 0:
            return ROOT_KEY
        if index < seq.released_blocks:
            return None
        if index == seq.released_blocks:
            return seq.released_key
        return self.prefix.key(seq.block_table[index - 1])

    def release_behind_window(self, seq: Sequence) -> int:
        """Drop ``seq``'s references to the pages wholly behind the window of its next position
        (``seq.num_computed_tokens``; nothing without a ``window``): no later query of it reads
        them. Pages left with no reference go to the back of the free list, keeping their keys.
        Returns how many pages were released now."""
        if self.window is None:
            return 0
        keep_from = window_block_start(seq.num_computed_tokens, self.window) // self.block_size
        return self._release_below(seq, min(keep_from, len(seq.block_table) - 1))  # a table's last page is kept

    def _release_below(self, seq: Sequence, stop: int) -> int:
        """Release ``seq``'s entries below index `stop` not released yet (`release_behind_window`);
        returns how many."""
        start = seq.released_blocks
        for index in range(start, stop):
            block = seq.block_table[index]
            seq.released_key = self.prefix.key(block)
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        seq.released_blocks = max(start, stop)
        return max(0, stop - start)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references and clear its block table. Pages left with no reference
        go to the back of the free list, last page first, and stay published until reused
        (released pages, `release_behind_window`, were dropped already)."""
        held = seq.block_table[seq.released_blocks:]
        for block, count in Counter(held).items():
            if self._ref[block] < count:
                raise RuntimeError(
                    f"BlockManager: block {block} of sequence {seq.seq_id} is already free"
                )
        for block in reversed(held):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
        seq.block_table.clear()
        seq.released_blocks, seq.released_key = 0, None
        self.tables.release(seq.seq_id)

    def reset_prefix_cache(self) -> None:
        """Unpublish every page, so nothing computed so far is shared again (call it when the
        cached K/V may be stale: new weights, a re-allocated cache). Pages keep their owners."""
        self.prefix.reset()

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of ``position`` of ``seq``: page * block_size + offset in page."""
        index = position // self.block_size
        if position < 0 or index >= len(seq.block_table):
            raise IndexError(
                f"BlockManager: position {position} of sequence {seq.seq_id} is not covered "
                f"by its {len(seq.block_table)} blocks of {self.block_size}"
            )
        return seq.block_table[index] * self.block_size + position % self.block_size
