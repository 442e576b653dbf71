"""CUDA graphs of decode steps at bucketed batch sizes.

A decode step (every sequence adds one token) is captured once per bucket size B with static
input buffers; a step of b <= B sequences fills the first b rows and pads the rest with
harmless dummies: query count 0 (their attention programs exit at once), slot -1 (no KV
write), token 0. The graph replays exactly the kernels (and tile configs, chosen from M = B)
the eager path would launch at batch B, and every kernel is row-invariant, so the real rows'
logits are bitwise those of the eager path at any batch size: graphs on or off cannot change a
logprob (conformance checks it).
"""

from __future__ import annotations

import torch

from vexact_models.kernels import PagedLayout
from vexact_models.layers import PagedContext

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class DecodeGraphs:
    """Captured decode steps for batch sizes `buckets` (up to ``max_batch``)."""

    def __init__(self, model, kv_caches, block_size: int, max_blocks_per_seq: int, max_batch: int,
                 device: torch.device, buckets=DEFAULT_BUCKETS) -> None:
        self.buckets = sorted({b for b in buckets if b < max_batch} | {max_batch})
        self.max_batch = max_batch
        self.max_blocks = max_blocks_per_seq
        n = max_batch
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.cu_seqlens = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        pool = None
        for b in reversed(self.buckets):  # largest first: the smaller graphs reuse its memory pool
            context = PagedContext(PagedLayout(self.cu_seqlens[:b + 1], self.seq_lens[:b], self.block_table[:b],
                                               block_size, 1), self.slots[:b], kv_caches)
            args = (self.ids[:b], self.positions[:b], context, self.rows[:b])
            model(*args)  # warm-up: compiles the kernels outside the capture
            torch.cuda.synchronize(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = model(*args)
            pool = graph.pool()
            self.graphs[b] = graph

    def bucket(self, batch: int) -> int | None:
        """The smallest captured batch size >= `batch`, or None when too large."""
        for b in self.buckets:
            if b >= batch:
                return b
        return None

    def run(self, ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Replay the decode step for these sequences; fp32 logits ``[len(ids), vocab]``."""
        b, n = self.bucket(len(ids)), len(ids)
        pad = b - n
        # Only the table columns this batch uses are refreshed: the kernel never reads a row
        # past its sequence's last page, so stale entries further right are never seen.
        width = max(len(t) for t in tables)
        flat_tables = [x for t in tables for x in t + [0] * (width - len(t))]
        host = torch.tensor(ids + [0] * pad + positions + [0] * pad + slots + [-1] * pad
                            + list(range(n + 1)) + [n] * pad + [p + 1 for p in positions] + [0] * pad
                            + flat_tables, dtype=torch.int64)
        dev = host.pin_memory().to(self.ids.device, non_blocking=True)
        parts = torch.split(dev, [b, b, b, b + 1, b, n * width])
        self.ids[:b].copy_(parts[0])
        self.positions[:b].copy_(parts[1])
        self.slots[:b].copy_(parts[2])
        self.cu_seqlens[:b + 1].copy_(parts[3])
        self.seq_lens[:b].copy_(parts[4])
        self.block_table[:n, :width].copy_(parts[5].view(n, width))
        self.graphs[b].replay()
        return self.logits[b][:n]
