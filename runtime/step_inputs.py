"""One step's model inputs, built on the host with vectorised numpy ops.

The flat batch is the scheduled sequences' new tokens back to back. Per sequence only a few
scalars are read in Python (computed count, chunk length, whether it samples, its block-table
row; the token ids themselves, which are one per sequence in decode); positions, slots, query
offsets and lengths follow from those by array arithmetic, and the block tables are one gather
from the BlockManager's ``BlockTables`` mirror instead of per-page list work.

The step also fixes the order the attention kernels' programs take its sequences
(`attention_order`, ``PagedLayout.seq_order``): most attention work first. A GPU runs a launch's
programs in grid order as SMs free up, so with one or two programs per SM (latent MLA decode: one
per sequence) a long sequence started last runs alone at the end while the other SMs idle; longest
first is the classic list-scheduling remedy. No bit changes: a program computes its sequence's rows
the same wherever it sits in the grid.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from vexact_models.kernels.kernel_switch import KernelSwitch

from .block_tables import BlockTables
from .scheduled import ScheduledSeq
from .sequence import Sequence

__all__ = ["ATTENTION_ORDER", "StepInputs", "attention_order", "build_step_inputs"]

#: ``VEXACT_ATTENTION_ORDER``: ``longest`` (default; `attention_order`) or ``arrival`` (the
#: scheduled order, the only one until 2026-11-27: for measuring what the order brings)
ATTENTION_ORDER = KernelSwitch("VEXACT_ATTENTION_ORDER", ("longest", "arrival"), "longest",
                               "attention program order")


@dataclass
class StepInputs:
    """A step's flat batch of T tokens from S sequences, R of which sample."""

    ids: np.ndarray  #: int64 [T] token ids
    positions: np.ndarray  #: int64 [T] position of each token in its sequence
    slots: np.ndarray  #: int64 [T] flat KV cache slot (page * block_size + offset) of each token
    logits_rows: np.ndarray  #: int64 [R] flat index of each sampling sequence's last token
    cu_seqlens: np.ndarray  #: int32 [S + 1] offsets of each sequence's tokens
    seq_lens: np.ndarray  #: int32 [S] cached + new tokens of each sequence
    block_table: np.ndarray  #: int32 [S, W] pages, zero padded to the longest table W
    seq_order: np.ndarray  #: int32 [S] the order attention programs take the sequences (`attention_order`)
    max_seqlen_q: int  #: the most new tokens of one sequence
    #: int64 [S] each sequence's row of the BlockManager's ``BlockTables`` (None without them): its
    #: slot in the gated-DeltaNet state cache (`runtime.linear_state_cache`)
    seq_rows: np.ndarray | None = None
    #: int64 [K, 2] (from row, to row): gated-DeltaNet slots to copy before the step runs (a
    #: sample taking its prompt's state from a sibling, ``ScheduledSeq.state_from``); [0, 2] if none
    state_copies: np.ndarray = field(default_factory=lambda: np.zeros((0, 2), np.int64))
    #: int64 [T] each token's slot in the window group (`runtime.page_groups`; None with one group)
    window_slots: np.ndarray | None = None
    #: int32 [S, W] the sequences' block tables in the window group (None with one group)
    window_block_table: np.ndarray | None = None

    @property
    def decode_only(self) -> bool:
        """Every sequence runs one token and samples (the shape the decode graphs capture)."""
        return len(self.ids) == len(self.seq_lens) == len(self.logits_rows)


def build_step_inputs(scheduled: list[ScheduledSeq], block_size: int, tables: BlockTables | None = None,
                      window_tables: BlockTables | None = None) -> StepInputs:
    """The inputs of running ``scheduled`` (its chunks start at each ``num_computed_tokens``;
    an ``in_flight`` item's one token at ``len(seq.token_ids)``, its id a 0 the runner replaces
    on the device).

    ``tables`` is the BlockManager's mirror of the block tables; without it they are read from
    the ``block_table`` lists (slower, same values). ``window_tables``: the window group's mirror
    (`runtime.page_groups`; its tables have the global ones' lengths), for ``window_slots`` and
    ``window_block_table``. Raises IndexError when a chunk runs past its sequence's pages."""
    n = len(scheduled)
    seqs = [item.seq for item in scheduled]
    flying = [item.in_flight for item in scheduled]
    starts = np.fromiter((len(s.token_ids) if f else s.num_computed_tokens for s, f in zip(seqs, flying)), np.int64, n)
    counts = np.fromiter((item.num_new_tokens for item in scheduled), np.int64, n)
    samples = np.fromiter((item.samples for item in scheduled), np.bool_, n)
    ends = starts + counts
    cu = np.zeros(n + 1, np.int64)
    np.cumsum(counts, out=cu[1:])
    total = int(cu[-1])
    if total == n:  # decode: one token per sequence, so no per-token index arithmetic
        ids = np.fromiter((0 if f else s.token_ids[s.num_computed_tokens] for s, f in zip(seqs, flying)), np.int64, n)
        owner, positions = np.arange(n), starts
    else:
        chunks = ((0,) if f else s.token_ids[a:b] for s, f, a, b in zip(seqs, flying, starts.tolist(), ends.tolist()))
        ids = np.fromiter(chain.from_iterable(chunks), np.int64, total)
        owner = np.repeat(np.arange(n), counts)  # the sequence of each flat token
        positions = np.arange(total) - (cu[:-1] - starts)[owner]
    table, lengths, rows = _block_tables(seqs, tables)
    over = ends > lengths.astype(np.int64) * block_size
    if over.any():
        bad = int(np.argmax(over))
        raise IndexError(f"build_step_inputs: {seqs[bad]!r} runs to position {int(ends[bad]) - 1}, past its "
                         f"{int(lengths[bad])} blocks of {block_size}")
    page, offset = positions // block_size, positions % block_size
    window_slots = window_table = None
    if window_tables is not None:
        window_rows = window_tables.rows(seqs)
        window_table = window_tables.gather(window_rows, table.shape[1])
        if not np.array_equal(window_tables.lengths[window_rows], lengths):
            raise RuntimeError("build_step_inputs: the window group's block tables are not as long as the global ones")
        window_slots = window_table[owner, page].astype(np.int64) * block_size + offset
    return StepInputs(ids=ids, positions=positions, slots=table[owner, page].astype(np.int64) * block_size + offset,
                      logits_rows=cu[1:][samples] - 1, cu_seqlens=cu.astype(np.int32), seq_lens=ends.astype(np.int32),
                      block_table=table, seq_order=attention_order(counts, ends), max_seqlen_q=int(counts.max()),
                      seq_rows=rows, state_copies=_state_copies(scheduled, tables), window_slots=window_slots,
                      window_block_table=window_table)


def _state_copies(scheduled: list[ScheduledSeq], tables: BlockTables | None) -> np.ndarray:
    """int64 ``[K, 2]``: (source slot, destination slot) of the step's gated-DeltaNet state copies:
    into an item's slot from a sibling's or a kept prompt state's (``ScheduledSeq.state_from``), out
    of it into a kept prompt state's (``state_to``). A sequence's slot is its row."""
    items = [item for item in scheduled if item.state_from is not None or item.state_to is not None]
    if items and tables is None:
        raise ValueError("build_step_inputs: a state copy (ScheduledSeq.state_from, state_to) needs the BlockManager's "
                         "block tables, whose rows are the state slots")
    pairs = []
    for item in items:
        row = tables.row(item.seq.seq_id)
        if item.state_to is not None:
            pairs.append((row, item.state_to))
        if isinstance(item.state_from, Sequence):
            pairs.append((tables.row(item.state_from.seq_id), row))
        elif item.state_from is not None:
            pairs.append((item.state_from, row))
    return np.array(pairs, np.int64).reshape(-1, 2)


def attention_order(new_tokens: np.ndarray, seq_lens: np.ndarray) -> np.ndarray:
    """int32 ``[S]``: a step's sequences by decreasing attention work, new tokens times keys (in a
    decode step: the longest context first), ties in scheduled order; ``0..S-1`` under
    ``VEXACT_ATTENTION_ORDER=arrival``. Measured on the H200 at 256 decode sequences of 164-1,424
    tokens: latent MLA 1.30-1.38x, GQA at 128 sequences 1.12-1.21x, no change where every program
    finds an SM at once (`benchmarks/attention_order.py`, 2026-11-27)."""
    n = len(seq_lens)
    if ATTENTION_ORDER.mode() == "arrival":
        return np.arange(n, dtype=np.int32)
    work = np.asarray(new_tokens, np.int64) * np.asarray(seq_lens, np.int64)
    return np.argsort(-work, kind="stable").astype(np.int32)


def _block_tables(seqs: list[Sequence], tables: BlockTables | None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(``[S, W]`` int32 block tables zero padded to the longest W, ``[S]`` table lengths, ``[S]``
    rows of `tables`, None without them)."""
    if tables is None:
        lengths = np.fromiter((len(s.block_table) for s in seqs), np.int32, len(seqs))
        table = np.zeros((len(seqs), int(lengths.max())), np.int32)
        for i, seq in enumerate(seqs):
            table[i, :len(seq.block_table)] = seq.block_table
        return table, lengths, None
    rows = tables.rows(seqs)
    lengths = tables.lengths[rows]
    return tables.gather(rows, int(lengths.max())), lengths, rows
