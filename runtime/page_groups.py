"""A second KV page group for the windowed layers of models that mix windowed and full attention
(Gemma 3's local layers, GPT-OSS's sliding ones; docs/design.md section 6).

The full-attention layers keep every page of a sequence; the windowed layers need only the keys
within their window. `PageGroups` is the `BlockManager` of the full layers' pages (the *global*
group: its block tables, its prefix sharing, everything the scheduler sees) with a second
BlockManager, ``window_group``, for the windowed layers' pages (the *window* group), whose K/V
tensors are sized by its own page count. Both groups number a sequence's positions alike: entry
``j`` of either table holds positions ``[j * block_size, (j + 1) * block_size)``, and the tables
grow in lockstep (every page the global group hands a sequence comes with one of the window
group's). The window group releases the leading pages wholly below
`attention_window.window_block_start` of a sequence's next position after each step, as the one
group of a model whose every layer is windowed does (`BlockManager.release_behind_window`); a
released entry keeps its place and is never read (docs/design.md rule 2).

Prefix sharing: the window group publishes its pages under the same content keys as the global
group. A sequence takes ``h`` leading pages by content only when the global group has them all
and the window group has the ones its next query can read, ``[first_kept(h), h)``; the entries
below ``first_kept(h)`` enter its window table released on arrival (no page, never read). The
shared pages hold exactly the K/V the sequence would have computed (the same tokens at the same
positions, row-invariant kernels), so the numbers are bitwise those of sharing off. Preemption
frees both groups' pages; a released page goes to the back of its free list with its key, as a
freed one does.

Each running sequence holds at most `window_pages_bound` pages of the window group, so the
engine sizes that group to `window_pages_cap` pages (never more than the global group's) and
gives the rest of the budget to the global group (`runtime.llm_setup.kv_cache_pages`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from vexact_models.kernels import PagedLayout
from vexact_models.layers import WindowPages

from .block_manager import BlockManager, window_pages_bound
from .sequence import Sequence

__all__ = ["PageGroups", "WindowGroup", "WindowTable", "window_pages_bound", "window_pages_cap"]


@dataclass(frozen=True)
class WindowGroup:
    """The window group of an engine (`runtime.engine_config.EngineConfig.window_group`).

    Attributes:
        window: the largest window of its layers (pages behind it are freed).
        layers: the decoder layers whose K/V it holds (`layers.window_layers`).
        num_blocks: its pages.
    """

    window: int
    layers: tuple[int, ...]
    num_blocks: int

    def step_pages(self, layout: PagedLayout, block_table: torch.Tensor, slot_mapping: torch.Tensor) -> WindowPages:
        """A step's `layers.WindowPages`: the global group's `layout` (the step's sequences, query
        offsets, lengths and order) over the window group's `block_table`, and its `slot_mapping`."""
        return WindowPages(replace(layout, block_table=block_table), slot_mapping, frozenset(self.layers), self.window)


def window_pages_cap(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Pages of the window group that `max_num_seqs` running sequences hold at most, their steps'
    chunks together at most `max_num_batched_tokens` tokens: `window_pages_bound` of a decode for
    each, plus the pages of the step's chunks."""
    return max_num_seqs * window_pages_bound(window, block_size, 1) + -(-max_num_batched_tokens // block_size)


class WindowTable:
    """A sequence's entries in the window group: what `BlockManager` reads of a `Sequence`, with
    a block table of its own (``seq.window_pages``). Tokens, computed count and id are the
    sequence's."""

    __slots__ = ("seq", "block_table", "released_blocks", "released_key")

    def __init__(self, seq: Sequence) -> None:
        self.seq = seq
        self.block_table: list[int] = []
        self.released_blocks = 0
        self.released_key: bytes | None = None

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids)

    @property
    def num_computed_tokens(self) -> int:
        return self.seq.num_computed_tokens


class PageGroups(BlockManager):
    """The global group's `BlockManager` (full-attention layers; the scheduler's interface) with
    the window group beside it (``window_group``: `num_window_blocks` pages freed behind `window`).
    The module docstring says how the two move together."""

    def __init__(self, num_blocks: int, block_size: int, num_window_blocks: int, window: int,
                 enable_prefix_sharing: bool = True) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"PageGroups window={window!r} must be an int >= 1")
        self.window_group = BlockManager(num_window_blocks, block_size, enable_prefix_sharing, window=window)
        super().__init__(num_blocks, block_size, enable_prefix_sharing)

    @staticmethod
    def table(seq: Sequence) -> WindowTable:
        """``seq``'s entries in the window group (made on first use)."""
        if seq.window_pages is None:
            seq.window_pages = WindowTable(seq)
        return seq.window_pages

    def first_kept(self, num_pages: int) -> int:
        """The window group's `BlockManager.first_kept` (the global group keeps every page)."""
        return self.window_group.first_kept(num_pages)

    def can_append(self, count: int = 1) -> bool:
        return super().can_append(count) and self.window_group.can_append(count)

    def shortfall(self, positions: int, chunk: int) -> str | None:
        short = super().shortfall(positions, chunk)
        if short is not None:
            return short
        group = self.window_group
        needed = min(self.blocks_for(positions), window_pages_bound(group.window, self.block_size, chunk))
        if needed > group.num_blocks:
            return (f"needs {needed} KV cache blocks of its windowed layers for {positions} positions in chunks of "
                    f"{chunk} but their cache has only {group.num_blocks} blocks in total "
                    f"(block_size={self.block_size}, window={group.window})")
        return None

    # -- prefix lookup over both groups -----------------------------------------------------
    def _group_hits(self, seq: Sequence, num_tokens: int) -> tuple[list[int], int, bytes | None, list[int]]:
        """(global pages taken, window entries released on arrival, the key the last of them stands
        for, window pages taken) for ``allocate(seq, num_tokens)``: the longest run of the global
        group's hits whose pages the window group still needs are all published there."""
        walk = self._walk(seq, num_tokens)
        if not walk:
            return [], 0, None, []
        group = self.window_group
        start = len(seq.block_table)
        found = [group.prefix.lookup(key, content) for _, key, content in walk]
        last_miss, missing = [], -1
        for i, block in enumerate(found):
            missing = i if block is None else missing
            last_miss.append(missing)
        for count in range(len(walk), 0, -1):
            kept = max(start, self.first_kept(start + count)) - start
            if last_miss[count - 1] < kept:
                return ([block for block, _, _ in walk[:count]], kept, walk[kept - 1][1] if kept else None,
                        found[kept:count])
        return [], 0, None, []

    def _hits(self, seq: Sequence, num_tokens: int) -> list[int]:
        return self._group_hits(seq, num_tokens)[0]

    def _plan(self, seq: Sequence, num_tokens: int) -> tuple:
        """(`_group_hits`' four, fresh pages per group, pages each group's free list gives)."""
        hits, skipped, key, window_hits = plan = self._group_hits(seq, num_tokens)
        fresh = max(0, self.blocks_for(num_tokens) - len(seq.block_table) - len(hits))
        group = self.window_group
        needed = fresh + sum(1 for block in hits if self._ref[block] == 0)
        window_needed = fresh + sum(1 for block in window_hits if group._ref[block] == 0)
        return plan + (fresh, needed, window_needed)

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        *_, needed, window_needed = self._plan(seq, num_tokens)
        return needed <= len(self._free) and window_needed <= len(self.window_group._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """`BlockManager.allocate` in both groups (the window group's entries below the window of
        the sequence's next position released on arrival). RuntimeError, changing nothing, when
        either group lacks free pages."""
        hits, skipped, key, window_hits, fresh, needed, window_needed = self._plan(seq, num_tokens)
        group = self.window_group
        if needed > len(self._free) or window_needed > len(group._free):
            raise RuntimeError(f"PageGroups: sequence {seq.seq_id} needs {needed} more blocks ({window_needed} of "
                               f"the windowed layers) to cover {num_tokens} tokens but only {len(self._free)} of "
                               f"{self.num_blocks} ({len(group._free)} of {group.num_blocks}) are free")
        self._place(seq, hits, fresh)
        group._place(self.table(seq), window_hits, fresh, skipped, key)
        seq.num_computed_tokens += len(hits) * self.block_size

    def can_share_prefix(self, num_tokens: int, total: int) -> bool:
        fresh = self.blocks_for(total) - num_tokens // self.block_size
        return fresh <= len(self._free) and fresh <= len(self.window_group._free)

    def share_prefix(self, seq: Sequence, donor: Sequence, num_tokens: int) -> None:
        """`BlockManager.share_prefix` in both groups: ``seq`` takes the donor's window pages its
        next query reads, the entries below them released on arrival. ValueError, changing
        nothing, also when the donor has released some of those."""
        pages = num_tokens // self.block_size
        kept = self.first_kept(pages) if pages else 0
        donated = self.table(donor)
        if donated.released_blocks > kept:
            raise ValueError(f"PageGroups.share_prefix: {donor!r} has released the windowed layers' pages "
                             f"{kept}..{donated.released_blocks - 1} that {num_tokens} shared tokens need")
        super().share_prefix(seq, donor, num_tokens)  # validates the rest first
        group = self.window_group
        group._place(self.table(seq), donated.block_table[kept:pages], 0, kept,
                     group._parent_key(donated, kept) if kept else None)

    def append_block(self, seq: Sequence) -> None:
        if not self.window_group.can_append():
            raise RuntimeError(f"PageGroups: sequence {seq.seq_id} needs a block of the windowed layers but none of "
                               f"{self.window_group.num_blocks} is free")
        super().append_block(seq)
        self.window_group.append_block(self.table(seq))

    # -- publishing, releasing, freeing ------------------------------------------------------
    def cache_full_blocks(self, seq: Sequence, num_tokens: int) -> None:
        super().cache_full_blocks(seq, num_tokens)
        if seq.window_pages is not None:
            self.window_group.cache_full_blocks(seq.window_pages, num_tokens)

    def release_behind_window(self, seq: Sequence) -> int:
        """Release ``seq``'s window-group pages behind the window of its next position (the global
        group keeps every page); returns how many."""
        return 0 if seq.window_pages is None else self.window_group.release_behind_window(seq.window_pages)

    def free(self, seq: Sequence) -> None:
        if seq.window_pages is not None:
            self.window_group.free(seq.window_pages)
        super().free(seq)

    def reset_prefix_cache(self) -> None:
        super().reset_prefix_cache()
        self.window_group.reset_prefix_cache()

