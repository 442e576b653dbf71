"""ModelRunner: owns the paged KV cache and runs one scheduled step of the inference variant.

Each step's flat batch is the scheduled sequences' new tokens back to back; the metadata
(positions, query offsets, total lengths, block tables, slots) is built on the host in one
pass and moved to the device in one copy.

A step is always ONE forward over all its scheduled sequences (eager, or one decode graph
replay), and every layer writes all the step's new K/V before its attention reads the cache.
Prefix sharing relies on this: a sequence may read pages that another sequence of the same step
writes (see ``Scheduler._publish``). Splitting a step into several forwards would need the
scheduler to publish pages only after their step (in ``postprocess``).
"""

from __future__ import annotations

import torch

from vexact_models.kernels import PagedLayout
from vexact_models.layers import PagedContext

from .cuda_graphs import DecodeGraphs
from .scheduler import ScheduledSeq


def kv_bytes_per_block(spec: tuple[int, int, int, int], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page across all layers."""
    layers, kv_heads, head_dim_k, head_dim_v = spec
    return layers * block_size * kv_heads * (head_dim_k + head_dim_v) * torch.empty((), dtype=dtype).element_size()


class ModelRunner:
    """Runs `InferenceModel` steps over a paged KV cache of ``num_blocks`` pages."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 cuda_graph_batch: int = 0, max_model_len: int = 0) -> None:
        """`cuda_graph_batch` > 0 captures decode steps of up to that many sequences (CUDA only)."""
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.cuda_graph_batch = cuda_graph_batch if device.type == "cuda" else 0
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self.allocate_cache()

    def allocate_cache(self) -> None:
        layers, kv_heads, head_dim_k, head_dim_v = self.model.kv_cache_spec()
        shape = (self.num_blocks, self.block_size, kv_heads)
        self.kv_caches = [(torch.empty(*shape, head_dim_k, device=self.device, dtype=self.dtype),
                           torch.empty(*shape, head_dim_v, device=self.device, dtype=self.dtype))
                          for _ in range(layers)]
        if self.cuda_graph_batch:
            self.graphs = DecodeGraphs(self.model, self.kv_caches, self.block_size, self.max_blocks_per_seq,
                                       self.cuda_graph_batch, self.device)

    def free_cache(self) -> None:
        self.graphs = None  # the graphs hold the cache's addresses
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _prepare(self, scheduled: list[ScheduledSeq]):
        ids, positions, slots, cu, seq_lens, logits_rows = [], [], [], [0], [], []
        bs = self.block_size
        max_blocks = max(len(s.seq.block_table) for s in scheduled)
        tables = []
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            cu.append(cu[-1] + n)
            seq_lens.append(start + n)
            tables.append(table + [0] * (max_blocks - len(table)))
            if item.samples:
                logits_rows.append(cu[-1] - 1)
        n_seq = len(scheduled)
        # one host buffer, one (pinned, asynchronous) copy to the device
        flat = [ids, positions, slots, logits_rows, cu, seq_lens, [x for t in tables for x in t]]
        host = torch.tensor([x for part in flat for x in part], dtype=torch.int64)
        if self.device.type == "cuda":
            host = host.pin_memory()
        dev = host.to(self.device, non_blocking=True)
        sizes = [len(part) for part in flat]
        parts = list(torch.split(dev, sizes))
        ids_t, pos_t, slot_t, rows_t = parts[0], parts[1], parts[2], parts[3]
        cu_t, lens_t = parts[4].to(torch.int32), parts[5].to(torch.int32)
        table_t = parts[6].to(torch.int32).view(n_seq, max_blocks)
        max_q = max(item.num_new_tokens for item in scheduled)
        layout = PagedLayout(cu_t, lens_t, table_t, bs, max_q)
        return ids_t, pos_t, PagedContext(layout, slot_t, self.kv_caches), rows_t

    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; return fp32 logits ``[num sampling sequences, vocab]`` in scheduled order."""
        if not self.kv_caches:
            raise RuntimeError("ModelRunner: the KV cache is released (call wake_up())")
        if self.graphs is not None and len(scheduled) <= self.graphs.max_batch and \
                all(item.num_new_tokens == 1 and item.samples for item in scheduled):
            return self._replay_decode(scheduled)
        ids, positions, context, rows = self._prepare(scheduled)
        return self.model(ids, positions, context, rows)

    def _replay_decode(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        bs = self.block_size
        ids, positions, slots, tables = [], [], [], []
        for item in scheduled:
            seq = item.seq
            p = seq.num_computed_tokens
            ids.append(seq.token_ids[p])
            positions.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            tables.append(seq.block_table)
        return self.graphs.run(ids, positions, slots, tables)
