"""CUDA graphs of decode steps at bucketed batch sizes.

A decode step (every sequence adds one token) is captured once per bucket size B with static
input buffers; a step of b <= B sequences fills the first b rows and pads the rest with
harmless dummies: query count 0 (their attention programs exit at once), slot -1 (no KV
write), token 0. The graph replays exactly the kernels (and tile configs, chosen from M = B)
the eager path would launch at batch B, and every kernel is row-invariant, so the real rows'
logits are bitwise those of the eager path at any batch size: graphs on or off cannot change a
logprob (conformance checks it).

A pipeline stage after the first (`runtime.pipeline`) takes the previous stage's ``(hidden,
residual)`` instead of token ids: its graphs read them from two more static buffers (rows past
the batch keep earlier finite values, as harmless as the dummies), and a stage before the last
returns its own ``(hidden, residual)`` rows instead of logits.
"""

from __future__ import annotations

import numpy as np
import torch

from vexact_models.kernels import PagedLayout
from vexact_models.layers import PagedContext

from .staging import Layout
from .step_inputs import StepInputs

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeInputs:
    """The graphs' static input buffers, all views of ONE device byte buffer, and a host
    staging twin of that buffer, so a step's inputs reach every buffer in one copy.

    Buffers (``max_batch`` rows): ids, positions, slots (int64), cu_seqlens (int32,
    ``max_batch + 1``), seq_lens (int32), block_table (int32, ``[max_batch, max_blocks]``).
    Works on any device (on CPU the "copy" is a memcpy), which keeps the host side testable.
    """

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device) -> None:
        n = max_batch
        self.max_batch, self.max_blocks = n, max_blocks
        i64, i32 = np.dtype(np.int64), np.dtype(np.int32)
        self.layout = Layout([(i64, (n,)), (i64, (n,)), (i64, (n,)), (i32, (n + 1,)), (i32, (n,)),
                              (i32, (n, max_blocks))])
        cuda = device.type == "cuda"
        self.host = self.layout.allocate(torch.device("cpu"), pin=cuda)
        self.host.zero_()
        self.staged = self.layout.host_views(self.host)  # numpy views, in the buffers' order
        slots = self.staged[2]
        slots[:] = -1  # no KV write
        self.buffer = self.layout.allocate(device)
        self.buffer.copy_(self.host)
        self.ids, self.positions, self.slots, self.cu_seqlens, self.seq_lens, self.block_table = \
            self.layout.views(self.buffer)
        # The staging buffer is reused: before refilling it, wait for the last copy to have read
        # it (in practice the sampler's sync of the last step already did).
        self._copied = torch.cuda.Event() if cuda else None

    def fill(self, inputs: StepInputs, bucket: int) -> None:
        """Write a decode step's inputs into the first ``bucket`` rows: its n sequences, then
        harmless padding (token 0, position 0, slot -1, query count 0, length 0). Only the
        table columns this batch uses are refreshed: the kernel never reads a row past its
        sequence's last page, so stale entries further right are never seen."""
        n, b = len(inputs.ids), bucket
        if not n <= b <= self.max_batch:
            raise ValueError(f"DecodeInputs: {n} sequences do not fit bucket {b} of max {self.max_batch}")
        if self._copied is not None:
            self._copied.synchronize()
        ids, positions, slots, cu, seq_lens, table = self.staged
        ids[:n], ids[n:b] = inputs.ids, 0
        positions[:n], positions[n:b] = inputs.positions, 0
        slots[:n], slots[n:b] = inputs.slots, -1
        cu[:n + 1], cu[n + 1:b + 1] = inputs.cu_seqlens, n
        seq_lens[:n], seq_lens[n:b] = inputs.seq_lens, 0
        table[:n, :inputs.block_table.shape[1]] = inputs.block_table
        end = self.layout.offsets[5] + n * self.max_blocks * 4  # through the table's row n - 1
        self.buffer[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()


class DecodeGraphs:
    """Captured decode steps for batch sizes `buckets` (up to ``max_batch``)."""

    def __init__(self, model, kv_caches, block_size: int, max_blocks_per_seq: int, max_batch: int,
                 device: torch.device, buckets=DEFAULT_BUCKETS, carry: tuple[int, torch.dtype | None] = (0, None)) -> None:
        """`carry`: ``(width, dtype)`` of the previous pipeline stage's hidden and residual rows
        that `model` takes after the token inputs (width 0: it takes none)."""
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        self.inputs = DecodeInputs(max_batch, max_blocks_per_seq, device)
        x = self.inputs
        self.rows = torch.arange(max_batch, dtype=torch.int64, device=device)
        width, dtype = carry
        self.carry = (None if not width else
                      tuple(torch.zeros(max_batch, width, dtype=dtype, device=device) for _ in range(2)))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor | tuple[torch.Tensor, ...]] = {}
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            context = PagedContext(PagedLayout(x.cu_seqlens[:b + 1], x.seq_lens[:b], x.block_table[:b],
                                               block_size, 1), x.slots[:b], kv_caches)
            args = (x.ids[:b], x.positions[:b], context, self.rows[:b])
            if self.carry is not None:
                args += tuple(t[:b] for t in self.carry)
            model(*args)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = model(*args)
            pool = graph.pool()
            self.graphs[b] = graph

    def release(self) -> None:
        """Free the graphs and their memory pool (the outputs live in it: dropped first). The
        caller empties the allocator's cache to hand the pool back to the device."""
        self.logits.clear()
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size >= `batch`, or None when too large."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, inputs: StepInputs, carry: tuple[torch.Tensor, torch.Tensor] | None = None,
            in_flight: torch.Tensor | None = None):
        """Replay the decode step for a decode-only batch; fp32 logits ``[n, vocab]`` (a
        pipeline stage before the last: its ``(hidden, residual)`` rows). `carry`: the previous
        stage's ``(hidden, residual)`` rows when the graphs take them; `in_flight`: device token
        ids in place of the first ``len(in_flight)`` of ``inputs.ids`` (copied after the host
        inputs, in stream order)."""
        n = len(inputs.ids)
        b = self.bucket(n)
        self.inputs.fill(inputs, b)
        if in_flight is not None:
            self.inputs.ids[:len(in_flight)].copy_(in_flight)
        if self.carry is not None:
            for static, rows in zip(self.carry, carry):
                static[:n].copy_(rows)
        self.graphs[b].replay()
        out = self.logits[b]
        return tuple(t[:n] for t in out) if isinstance(out, tuple) else out[:n]
