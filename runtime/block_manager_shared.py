"""Pages shared without content keys (`BlockManager`'s part for the gated-DeltaNet hybrids,
docs/design.md section 6b): a request's n samples take their leader's prompt pages
(`runtime.scheduler_siblings`), and a kept prompt state holds its prompt's pages for later requests,
which take them (`runtime.scheduler_prefix_states`). Each holder is a reference; a page with none
goes back to the free list."""

from __future__ import annotations

from collections import Counter

from .sequence import Sequence

__all__ = ["SharedPagesMixin"]


class SharedPagesMixin:
    """`BlockManager`'s pages shared by reference (its ``_ref`` counts, ``_free`` list, ``tables``)."""

    def can_share_prefix(self, num_tokens: int, total: int) -> bool:
        """Whether `share_prefix` of ``num_tokens`` tokens (whole pages of a running donor) and
        fresh pages up to position ``total`` fit the free pages (the shared ones take none)."""
        return self.blocks_for(total) - num_tokens // self.block_size <= len(self._free)

    def share_prefix(self, seq: Sequence, donor: Sequence, num_tokens: int) -> None:
        """Give ``seq``, which holds no page yet, ``donor``'s first ``num_tokens // block_size``
        pages (a reference more each) and mark those tokens computed: the n samples of one prompt
        of a model whose gated-DeltaNet state is copied beside them (`Scheduler`'s prompt-state
        sharing, docs/design.md section 6b), without the content keys of prefix sharing.
        ValueError, changing nothing, when ``num_tokens`` is not a positive multiple of
        ``block_size``, ``seq`` holds pages or computed tokens, or ``donor``'s computed pages do
        not cover it."""
        bs = self.block_size
        if num_tokens <= 0 or num_tokens % bs:
            raise ValueError(f"BlockManager.share_prefix: num_tokens={num_tokens} must be a positive multiple of "
                             f"block_size={bs}")
        if donor.num_computed_tokens < num_tokens or len(donor.block_table) * bs < num_tokens:
            raise ValueError(f"BlockManager.share_prefix: {donor!r} has not computed {num_tokens} tokens")
        self.share_pages(seq, donor.block_table[:num_tokens // bs])

    def share_pages(self, seq: Sequence, pages: list[int]) -> None:
        """Give ``seq``, which holds no page yet, `pages` (held: a reference more each), which hold
        its first ``len(pages) * block_size`` tokens, and mark those computed (a sibling's prompt
        pages, `share_prefix`; a kept prompt state's, `runtime.scheduler_prefix_states`).
        ValueError, changing nothing, when ``seq`` holds pages or computed tokens, `pages` is
        empty or one of them is held by nobody."""
        if seq.block_table or seq.num_computed_tokens:
            raise ValueError(f"BlockManager.share_pages: {seq!r} must hold no pages and no computed tokens")
        if not pages or any(self._ref[block] < 1 for block in pages):
            raise ValueError(f"BlockManager.share_pages: pages={list(pages)} must be a non-empty list of held pages")
        for block in pages:
            self._ref[block] += 1
        seq.block_table.extend(pages)
        seq.num_computed_tokens = len(pages) * self.block_size
        self.num_shared_hits += len(pages)
        self.tables.extend(seq.seq_id, 0, list(pages))

    def hold(self, pages: list[int]) -> None:
        """A reference more to each of `pages`, all held already (a kept prompt state's,
        `runtime.scheduler_prefix_states`); ValueError, changing nothing, for one held by nobody."""
        if any(self._ref[block] < 1 for block in pages):
            raise ValueError(f"BlockManager.hold: pages={list(pages)} must all be held")
        for block in pages:
            self._ref[block] += 1

    def release(self, pages: list[int]) -> None:
        """Drop the references `hold` took: a page left with none goes to the back of the free
        list (last page first, as `free` returns a sequence's)."""
        if any(self._ref[block] < count for block, count in Counter(pages).items()):
            raise RuntimeError(f"BlockManager.release: pages={list(pages)} are not all held")
        for block in reversed(pages):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None
