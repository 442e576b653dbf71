"""ModelRunner: owns the paged KV cache and runs one scheduled step of the inference variant.

Each step's flat batch is the scheduled sequences' new tokens back to back; the metadata
(positions, query offsets, total lengths, block tables, slots) is built on the host with
vectorised ops (`step_inputs`) and moved to the device in one pinned copy: packed into one
buffer for the eager forward, or straight into the decode graphs' static buffers.

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

from .block_tables import BlockTables
from .cuda_graphs import DecodeGraphs
from .scheduler import ScheduledSeq
from .staging import to_device
from .step_inputs import StepInputs, build_step_inputs


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
        #: The BlockManager's mirror of the block tables (the LLM sets it); without it the
        #: tables are read from the sequences' lists, which is slower and gives the same values.
        self.block_tables: BlockTables | None = None
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
        """Release the KV cache and the decode graphs (which hold its and the weights'
        addresses, and a memory pool); `allocate_cache` captures them again."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """The eager forward's arguments (ids, positions, context, logits rows) on the device."""
        return self._to_device(build_step_inputs(scheduled, self.block_size, self.block_tables))

    def _to_device(self, inputs: StepInputs):
        ids, positions, slots, rows, cu, lens, table = to_device(
            [inputs.ids, inputs.positions, inputs.slots, inputs.logits_rows, inputs.cu_seqlens,
             inputs.seq_lens, inputs.block_table], self.device)
        layout = PagedLayout(cu, lens, table, self.block_size, inputs.max_seqlen_q)
        return ids, positions, PagedContext(layout, slots, self.kv_caches), rows

    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; return fp32 logits ``[num sampling sequences, vocab]`` in scheduled order."""
        if not self.kv_caches:
            raise RuntimeError("ModelRunner: the KV cache is released (call wake_up())")
        inputs = build_step_inputs(scheduled, self.block_size, self.block_tables)
        if self.graphs is not None and len(scheduled) <= self.graphs.max_batch and inputs.decode_only:
            return self.graphs.run(inputs)
        ids, positions, context, rows = self._to_device(inputs)
        return self.model(ids, positions, context, rows)
