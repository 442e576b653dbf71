"""The static input buffers a captured step graph reads (`runtime.cuda_graphs`), and how a step's
inputs fill them.

A graph captured for a bucket of ``tokens`` flat tokens and ``seqs`` sequences reads the first
rows of these buffers. A step of T <= tokens tokens, S <= seqs sequences and R <= S sampling
rows fills its own rows, then padding that changes nothing the step reads back:

- tokens T..tokens-1: id 0, position 0, slot -1 (no KV write). They belong to no sequence, so
  no attention program writes their output rows; every other kernel works row by row, so
  whatever those rows hold stays in them.
- sequences S..seqs-1: no query tokens (``cu_seqlens`` = T) and no keys (length 0): their
  attention programs exit at once; they take the last places of ``seq_order``.
- logits rows R..seqs-1: row 0, computed and never read.

A model with gated-DeltaNet layers also reads its step's plan over their state cache from fixed
buffers (`runtime.linear_state_cache.LinearStepBuffers`), whose padding entries have no work and
write nothing (`kernels.gated_delta_step`). A model with a window
page group (`runtime.page_groups`) reads the window group's slots (padding: -1) and block tables
from two more buffers.
"""

from __future__ import annotations

import numpy as np
import torch

from .linear_state_cache import LinearStateCache, LinearStepBuffers
from .staging import Layout
from .step_inputs import StepInputs

__all__ = ["GraphInputs"]


class GraphInputs:
    """Static step inputs for graphs of up to ``max_tokens`` tokens and ``max_batch`` sequences,
    all views of ONE device byte buffer, and a host staging twin of that buffer, so a step's
    inputs reach every buffer in one copy.

    Buffers: ids, positions, slots (int64, ``max_tokens``), logits_rows (int64, ``max_batch``),
    cu_seqlens (int32, ``max_batch + 1``), seq_lens and seq_order (int32, ``max_batch``), with
    `window` the window group's window_slots (int64, ``max_tokens``) and window_block_table (int32,
    ``[max_batch, max_blocks]``), then block_table (int32, ``[max_batch, max_blocks]``; last, so that
    a step copies only its rows; a window table's rows are copied apart).
    Works on any device (on CPU the "copy" is a memcpy), which keeps the host side testable.
    With `linear` (a model's gated-DeltaNet state cache) the step's plan over it too (``linear``:
    `LinearStepBuffers`, one more copy).
    """

    def __init__(self, max_tokens: int, max_batch: int, max_blocks: int, device: torch.device,
                 linear: LinearStateCache | None = None, window: bool = False) -> None:
        if max_tokens < max_batch:
            raise ValueError(f"GraphInputs: max_tokens={max_tokens} is below max_batch={max_batch} "
                             f"(every sequence has a token)")
        t, n = max_tokens, max_batch
        self.max_tokens, self.max_batch, self.max_blocks = t, n, max_blocks
        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        window_specs = [(i64, (t,)), (i32, (n, max_blocks))] if window else []
        self.layout = Layout([(i64, (t,)), (i64, (t,)), (i64, (t,)), (i64, (n,)), (i32, (n + 1,)), (i32, (n,)),
                              (i32, (n,)), *window_specs, (i32, (n, max_blocks))])
        cuda = device.type == "cuda"
        self.host = self.layout.allocate(torch.device("cpu"), pin=cuda)
        self.host.zero_()
        self.staged = self.layout.host_views(self.host)  # numpy views, in the buffers' order
        self.staged[2][:] = -1  # slots: no KV write
        if window:
            self.staged[7][:] = -1
        self.buffer = self.layout.allocate(device)
        self.buffer.copy_(self.host)
        (self.ids, self.positions, self.slots, self.logits_rows, self.cu_seqlens, self.seq_lens,
         self.seq_order, *window_views, self.block_table) = self.layout.views(self.buffer)
        #: the window group's slots and block tables (None without `window`)
        self.window_slots, self.window_block_table = window_views if window else (None, None)
        # The staging buffer is reused: before refilling it, wait for the last copy to have read
        # it (in practice the sampler's sync of an earlier step already did).
        self._copied = torch.cuda.Event() if cuda else None
        self.linear = None if linear is None else LinearStepBuffers(linear, max_tokens, max_batch, device)

    def fill(self, inputs: StepInputs, tokens: int, seqs: int) -> None:
        """Write a step's inputs into the first `tokens` token rows and `seqs` sequence rows,
        padded as the module docstring says. Only the table columns this step uses are
        refreshed: the kernels never read a row past its sequence's last page, so stale entries
        further right are never seen. Raises ValueError (writing nothing) when the step does
        not fit the bucket or the buffers."""
        t, s, r = len(inputs.ids), len(inputs.seq_lens), len(inputs.logits_rows)
        width = inputs.block_table.shape[1]
        if (inputs.window_block_table is None) != (self.window_slots is None):
            raise ValueError(f"GraphInputs: the step has {'no ' if inputs.window_block_table is None else ''}window "
                             f"group tables, the buffers {'none' if self.window_slots is None else 'some'}")
        if not (t <= tokens <= self.max_tokens and s <= seqs <= self.max_batch and r <= s
                and width <= self.max_blocks):
            raise ValueError(f"GraphInputs: a step of {t} tokens, {s} sequences ({r} sampling) and {width} table "
                             f"columns does not fit bucket ({tokens} tokens, {seqs} sequences) of buffers "
                             f"({self.max_tokens}, {self.max_batch}, {self.max_blocks} columns)")
        if self.linear is not None:  # validates the slots before anything is written
            if inputs.seq_rows is None:
                raise RuntimeError("GraphInputs: a model with gated-DeltaNet layers needs the BlockManager's block "
                                   "tables (EngineConfig.connect) for its state slots")
            counts = np.diff(inputs.cu_seqlens.astype(np.int64))
            self.linear.fill(inputs.seq_rows, inputs.seq_lens.astype(np.int64) - counts, counts, tokens, seqs)
        if self._copied is not None:
            self._copied.synchronize()
        ids, positions, slots, rows, cu, seq_lens, order, *window, table = self.staged
        ids[:t], ids[t:tokens] = inputs.ids, 0
        positions[:t], positions[t:tokens] = inputs.positions, 0
        slots[:t], slots[t:tokens] = inputs.slots, -1
        rows[:r], rows[r:seqs] = inputs.logits_rows, 0
        cu[:s + 1], cu[s + 1:seqs + 1] = inputs.cu_seqlens, t
        seq_lens[:s], seq_lens[s:seqs] = inputs.seq_lens, 0
        order[:s], order[s:seqs] = inputs.seq_order, np.arange(s, seqs)
        table[:s, :width] = inputs.block_table
        rows_bytes = s * self.max_blocks * 4
        offsets = self.layout.offsets
        if window:
            window[0][:t], window[0][t:tokens] = inputs.window_slots, -1
            window[1][:s, :width] = inputs.window_block_table
            copies = [(0, offsets[8] + rows_bytes), (offsets[9], offsets[9] + rows_bytes)]
        else:
            copies = [(0, offsets[7] + rows_bytes)]  # through the table's row s - 1
        for start, end in copies:
            self.buffer[start:end].copy_(self.host[start:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()
