"""Host mirror of the sequences' block tables: one row of a growable int32 array per sequence.

``Sequence.block_table`` (a Python list) stays the BlockManager's source of truth. The model
runner, though, needs the tables of a whole step as one ``[sequences, pages]`` array, and
rebuilding that from lists costs per-page Python work every step. The BlockManager therefore
also writes each page it hands a sequence into that sequence's row here (a row is assigned at
its first page and given back when its pages are freed), so a step's tables are one vectorised
gather: a decode step touches only the rows whose sequence got a new page.
"""

from __future__ import annotations

import numpy as np

from .sequence import Sequence

__all__ = ["BlockTables"]


class BlockTables:
    """Rows of page ids keyed by ``seq_id``; ``array[row, :lengths[row]]`` is that sequence's
    block table and the rest of the row is 0, so a gathered row is already zero padded. Both
    dimensions grow (doubling) on demand, so no limit has to be known up front."""

    def __init__(self, rows: int = 64, width: int = 16) -> None:
        if rows < 1 or width < 1:
            raise ValueError(f"BlockTables: rows={rows} and width={width} must be >= 1")
        self.array = np.zeros((rows, width), dtype=np.int32)
        self.lengths = np.zeros(rows, dtype=np.int32)
        self._row: dict[int, int] = {}
        # Lowest row first, so a fixed sequence of calls always yields the same rows.
        self._free_rows = list(range(rows - 1, -1, -1))

    def __len__(self) -> int:
        """Sequences that hold a row."""
        return len(self._row)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row

    def row(self, seq_id: int) -> int:
        """The row of ``seq_id`` (KeyError when it holds none)."""
        return self._row[seq_id]

    def table(self, seq_id: int) -> list[int]:
        """The mirrored block table of ``seq_id`` ([] when it holds no row)."""
        row = self._row.get(seq_id)
        return [] if row is None else self.array[row, : self.lengths[row]].tolist()

    def extend(self, seq_id: int, start: int, blocks: list[int]) -> None:
        """Write ``blocks`` as entries [start, start + len(blocks)) of ``seq_id``'s table (the
        BlockManager calls it with the pages it just appended); assigns a row on first use."""
        if not blocks:
            return
        row = self._row.get(seq_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * len(self.lengths))
            row = self._row[seq_id] = self._free_rows.pop()
        stop = start + len(blocks)
        if stop > self.array.shape[1]:
            self._grow(width=max(stop, 2 * self.array.shape[1]))
        self.array[row, start:stop] = blocks
        self.lengths[row] = stop

    def release(self, seq_id: int) -> None:
        """Give ``seq_id``'s row back (its pages were freed); a no-op when it holds none."""
        row = self._row.pop(seq_id, None)
        if row is not None:
            self.array[row, :self.lengths[row]] = 0  # keeps "0 past the length" for the next owner
            self.lengths[row] = 0
            self._free_rows.append(row)

    def rows(self, seqs: list[Sequence]) -> np.ndarray:
        """int64 rows of the given sequences, in order (KeyError for one without a row)."""
        row = self._row
        return np.fromiter((row[s.seq_id] for s in seqs), np.int64, len(seqs))

    def gather(self, rows: np.ndarray, width: int) -> np.ndarray:
        """``[len(rows), width]`` int32 copy of the given rows' first ``width`` entries (zero
        padded past each row's length)."""
        if width > self.array.shape[1]:
            self._grow(width=width)
        return self.array[rows, :width]

    def _grow(self, rows: int = 0, width: int = 0) -> None:
        old_rows, old_width = self.array.shape
        rows, width = max(rows, old_rows), max(width, old_width)
        array = np.zeros((rows, width), dtype=np.int32)
        array[:old_rows, :old_width] = self.array
        lengths = np.zeros(rows, dtype=np.int32)
        lengths[:old_rows] = self.lengths
        self.array, self.lengths = array, lengths
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)  # new rows after the old free ones
