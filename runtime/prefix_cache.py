"""Content keys of published KV pages: what prefix sharing looks pages up by.

A *full* page of a sequence (``block_size`` tokens) whose K/V are written gets a content key,
chained over the previous page's key and the page's token ids (`chain_key`), so the key stands
for the whole prefix up to the page's end. `BlockManager.cache_full_blocks` publishes such pages
here; `BlockManager.allocate` hands a sequence a published page instead of a fresh one when the
key (and, as a collision guard, the stored parent key and token ids: `PrefixCache.lookup`) match,
adds a reference to it and advances ``seq.num_computed_tokens`` past it, so the scheduler never
recomputes it. Only the leading pages of a sequence can be taken that way (its block table must
end exactly at its computed prefix), and never the page holding the sequence's last token: at
least that token is always computed by the sequence itself, since the step that samples needs
its logits. The last, partial page of a prompt is therefore never shared either; every sample
recomputes those few tokens. Both are bitwise identical to computing everything: the shared K/V
are exactly the bf16/fp32 values the sequence would have written (same tokens, same positions,
row-invariant kernels), and attention reads them in the same absolute-position-aligned blocks.

A page keeps its key while it sits on the free list (a later identical prefix can revive it)
and loses it when it is handed out fresh (`PrefixCache.forget`) or when every key is dropped
(`PrefixCache.reset`: the K/V may be stale after new weights).

Several pages may hold the same key (two sequences computed the same prefix at once, a prompt
scoring its positions recomputed it): one serves the key, the first published under it; the
others wait in publishing order, and when the serving page is forgotten the next of them serves
(as vLLM's block-hash map keeps several blocks per hash), so a live copy stays reachable.
"""

from __future__ import annotations

import hashlib
from array import array

__all__ = ["ROOT_KEY", "PrefixCache", "chain_key"]

#: Parent key of a sequence's first page.
ROOT_KEY = b""

#: (parent page's key, the page's token ids): what a key was computed from, the collision guard.
Content = tuple[bytes, tuple[int, ...]]


def chain_key(parent: bytes, tokens: tuple[int, ...]) -> bytes:
    """Content key of a full page: a 128-bit BLAKE2b digest over its parent page's key and its
    token ids, so equal keys mean equal prefixes (up to a 2**-64-ish birthday bound; the
    lookup still compares parent key and tokens before sharing)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


class PrefixCache:
    """The published pages of one `BlockManager`'s `num_blocks` pages: each page's key and
    `Content`, for each key the page that serves it (the first published under it) and the other
    pages published under it, which serve it in turn when it is forgotten."""

    def __init__(self, num_blocks: int) -> None:
        self._key: list[bytes | None] = [None] * num_blocks
        self._content: list[Content | None] = [None] * num_blocks
        self._serving: dict[bytes, int] = {}
        #: key -> the other pages published under it, in publishing order (an ordered set)
        self._spare: dict[bytes, dict[int, None]] = {}

    def __len__(self) -> int:
        """Keys served right now (pages that can be shared, in use or free)."""
        return len(self._serving)

    def key(self, block: int) -> bytes | None:
        """The content key `block` was published under, or None."""
        return self._key[block]

    def lookup(self, key: bytes, content: Content) -> int | None:
        """The page serving `key` whose stored `Content` is `content` (the collision guard), or
        None."""
        block = self._serving.get(key)
        return None if block is None or self._content[block] != content else block

    def publish(self, block: int, key: bytes, content: Content) -> None:
        """Key `block` (so a chain continues through it); it serves `key` unless another page
        already does, and then serves it after that one (`forget`)."""
        self._key[block] = key
        self._content[block] = content
        if self._serving.setdefault(key, block) != block:
            self._spare.setdefault(key, {})[block] = None

    def forget(self, block: int) -> None:
        """Unpublish `block` (its K/V are about to be overwritten); nothing if unpublished. When
        it served its key, the next page published under that key serves it now."""
        key = self._key[block]
        if key is None:
            return
        self._key[block] = None
        self._content[block] = None
        if self._serving[key] == block:
            spare = self._spare.get(key)
            if spare is None:
                del self._serving[key]
                return
            block = self._serving[key] = next(iter(spare))  # the next one published serves it
        else:
            spare = self._spare[key]
        del spare[block]
        if not spare:
            del self._spare[key]

    def reset(self) -> None:
        """Unpublish every page."""
        self._key = [None] * len(self._key)
        self._content = [None] * len(self._content)
        self._serving.clear()
        self._spare.clear()
