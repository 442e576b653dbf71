"""Paged KV cache bookkeeping: fixed-size pages, a free list and per-sequence block tables.

Only ids are managed here; the K/V tensors live in the model runner. Pages are exclusively
owned by one sequence for now (sharing prompt pages between the n samples of a request comes
later). Which physical page a sequence gets never changes its numbers (attention reads K/V
through the block table, in blocks aligned to absolute positions), but allocation is still
deterministic, so a rerun of the same workload touches the same pages, which keeps debugging
and replay simple.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Sequence

__all__ = ["BlockManager"]


class BlockManager:
    """Fixed-size KV pages, a free list, per-sequence block tables.

    A sequence's ``block_table`` lists the pages that hold its positions:
    position ``p`` is slot ``p % block_size`` of page ``block_table[p // block_size]``.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"BlockManager {name}={value!r} must be an int, got {type(value).__name__}"
                )
            if value < 1:
                raise ValueError(f"BlockManager {name}={value} is below the minimum 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # FIFO free list: pages are handed out lowest id first and returned to the back, so
        # the allocation order is a pure function of the sequence of allocate/free calls.
        self._free: deque[int] = deque(range(num_blocks))
        # Guards exclusive ownership: catches double frees and tables edited behind our back.
        self._in_use = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold positions [0, num_tokens): ceil(num_tokens / block_size)."""
        if num_tokens < 0:
            raise ValueError(f"num_tokens={num_tokens} is below the minimum 0")
        return -(-num_tokens // self.block_size)

    def _missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether the free pages suffice to cover positions [0, num_tokens) of ``seq``,
        counting the pages it already owns."""
        return self._missing_blocks(seq, num_tokens) <= len(self._free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` until it covers positions [0, num_tokens).

        Raises RuntimeError, leaving everything unchanged, when there are not enough free
        pages: a half-grown table would leak pages on the caller's error path.
        """
        missing = self._missing_blocks(seq, num_tokens)
        if missing > len(self._free):
            raise RuntimeError(
                f"BlockManager: sequence {seq.seq_id} needs {missing} more blocks to cover "
                f"{num_tokens} tokens but only {len(self._free)} of {self.num_blocks} are free"
            )
        for _ in range(missing):
            block = self._free.popleft()
            self._in_use[block] = True
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Return all of ``seq``'s pages to the free list and clear its block table."""
        for block in seq.block_table:
            if not self._in_use[block]:
                raise RuntimeError(
                    f"BlockManager: block {block} of sequence {seq.seq_id} is already free"
                )
        for block in seq.block_table:
            self._in_use[block] = False
            self._free.append(block)
        seq.block_table.clear()

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat cache slot of ``position`` of ``seq``: page * block_size + offset in page."""
        index = position // self.block_size
        if position < 0 or index >= len(seq.block_table):
            raise IndexError(
                f"BlockManager: position {position} of sequence {seq.seq_id} is not covered "
                f"by its {len(seq.block_table)} blocks of {self.block_size}"
            )
        return seq.block_table[index] * self.block_size + position % self.block_size
