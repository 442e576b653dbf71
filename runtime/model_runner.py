"""ModelRunner: owns the paged KV cache and runs one scheduled step of the inference variant.

Each step's flat batch is the scheduled sequences' new tokens back to back; the metadata
(positions, query offsets, total lengths, block tables, slots) is built on the host with
vectorised ops (`step_inputs`) and moved to the device in one pinned copy: packed into one
buffer for the eager forward, or straight into the step graphs' static buffers.

A step is always ONE forward over all its scheduled sequences (eager, or one graph replay,
`runtime.cuda_graphs`), and every layer writes all the step's new K/V before its attention reads the cache.
Prefix sharing relies on this: a sequence may read pages that another sequence of the same step
writes (see ``Scheduler._publish``). Splitting a step into several forwards would need the
scheduler to publish pages only after their step (in ``postprocess``).

Beside the cache the runner keeps what its forwards read that is derived from the weights: B of
each adapted expert tensor copied by expert (`kernels.KeptExpertB`), made with the cache and the
graphs that read it, refreshed once per engine call (`refresh_derived`) and dropped with them.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from vexact_models.adapters import expert_lora_b
from vexact_models.kernels import EXPERT_B, KeptExpertB, PagedLayout, current_backend, reading_kept_b
from vexact_models.layers import PagedContext

from .block_tables import BlockTables
from .cuda_graphs import DEFAULT_BUCKETS, StepGraphs
from .linear_state_cache import LinearStateCache, LinearStep, linear_state_spec
from .page_groups import WindowGroup
from .pipeline import StageModel
from .scheduled import ScheduledSeq
from .staging import to_device
from .step_inputs import StepInputs, build_step_inputs


def kv_bytes_per_block(spec: tuple[int, int, int, int], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of K and V for one page across all layers (K only when the spec's ``value_in_key``
    says V is a view of K's first dims: MLA's latent cache, `deepseek_v3.latent_attention`)."""
    layers, kv_heads, head_dim_k, head_dim_v = spec
    width = head_dim_k if getattr(spec, "value_in_key", False) else head_dim_k + head_dim_v
    return layers * block_size * kv_heads * width * torch.empty((), dtype=dtype).element_size()


#: torch's CUDA caching allocator gives a tensor of at least `CUDA_OWN_SEGMENT` bytes a segment of
#: its own, a whole number of `CUDA_SEGMENT_UNIT` (smaller ones share 2 or 20 MiB segments)
CUDA_SEGMENT_UNIT = 2 << 20
CUDA_OWN_SEGMENT = 10 << 20


def segment_bytes(nbytes: int) -> int:
    """The bytes to allocate for a CUDA tensor of `nbytes` so that it fills its allocator segment:
    `nbytes` rounded up to whole 2 MiB units from `CUDA_OWN_SEGMENT` on, else `nbytes`.

    Why (the KV cache, `ModelRunner`): the caching allocator rounds a large tensor's segment up
    to 2 MiB and lends the tail to later small allocations. One that outlives the cache there (an
    autograd graph, a trainer's optimizer state made while the engine is awake) pins the whole
    segment: when the cache is freed (`LLM.sleep`, a finished engine) ``empty_cache`` cannot
    return it, and the device's free memory reads tens of GB short (a second engine's budget came
    out negative at Llama-3.1-8B on the H200, 2026-11-25; tests/runtime/test_kv_cache_memory.py). A tensor that holds
    its tail leaves nothing to lend, and costs no memory the segment did not hold anyway."""
    if nbytes < CUDA_OWN_SEGMENT:
        return nbytes
    return -(-nbytes // CUDA_SEGMENT_UNIT) * CUDA_SEGMENT_UNIT


def _cache_zeros(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Zeros of `shape`; on CUDA, a view of a buffer of `segment_bytes` (see there why). On the
    CPU, numpy's zeros (calloc): the OS maps zero pages as they are first written, so a cache of
    the default 256 MiB costs the pages its sequences fill, where ``torch.zeros`` writes every
    byte (1.4 of the 10 seconds of Qwen3's tiny CPU conformance run)."""
    if device.type == "cpu":
        buffer = torch.from_numpy(np.zeros(math.prod(shape) * dtype.itemsize, dtype=np.uint8))
        return buffer.view(dtype).view(shape)
    if device.type != "cuda":
        return torch.zeros(shape, device=device, dtype=dtype)
    numel = math.prod(shape)
    buffer = torch.zeros(segment_bytes(numel * dtype.itemsize) // dtype.itemsize, device=device, dtype=dtype)
    return buffer[:numel].view(shape)


def kv_pair(shape: tuple, head_dim_k: int, head_dim_v: int, value_in_key: bool, device, dtype):
    """One layer's (K, V) caches; with `value_in_key` V is a view of K, not a second copy. Zeroed:
    FlashAttention-4 (`use_attention_forward("fa4")`) loads whole pages of ``block_size`` 128 by
    TMA and multiplies the masked rows' zero probabilities by their values, which must be finite."""
    k = _cache_zeros((*shape, head_dim_k), device, dtype)
    return (k, k[..., :head_dim_v]) if value_in_key else (k, _cache_zeros((*shape, head_dim_v), device, dtype))


def check_linear_state_support(spec, state_slots: int) -> None:
    """Raise ValueError, before anything is allocated, for a model (or pipeline stage) with
    gated-DeltaNet layers (`spec` not None) given a cache without state slots."""
    if spec is None:
        return
    if state_slots < 1:
        raise ValueError(f"ModelRunner: state_slots={state_slots} must be >= 1 (max_num_seqs) for a model with "
                         "gated-DeltaNet layers")


class ModelRunner:
    """Runs `InferenceModel` steps over a paged KV cache of ``num_blocks`` pages."""

    def __init__(self, model, num_blocks: int, block_size: int, device: torch.device, dtype: torch.dtype,
                 cuda_graph_batch: int = 0, max_model_len: int = 0, layers: range | None = None,
                 carry_width: int = 0, cuda_graph_tokens: int = 0, state_slots: int = 0, state_snapshots: int = 0,
                 window_group: WindowGroup | None = None, cuda_graph_sizes: tuple[int, ...] = DEFAULT_BUCKETS,
                 kept_b_limit: int | None = None) -> None:
        """`cuda_graph_batch` > 0 captures decode steps of up to that many sequences (CUDA only),
        one graph per batch size of `cuda_graph_sizes` below it and one at it, a step padded to the
        smallest that holds it; and with `cuda_graph_tokens` > 0 steps with prompt chunks of up
        to that many tokens and `cuda_graph_batch` sequences on their first use (not for a
        pipeline stage).

        A pipeline stage (`runtime.pipeline`) holds KV pages for its `layers` only (default: all;
        the others' entries in ``kv_caches`` are None) and, past the first stage, its model takes
        the previous stage's ``(hidden, residual)``, rows of `carry_width` values (0: token ids).

        A model with gated-DeltaNet layers (`linear_state_spec`) holds KV pages for its attention
        layers only and a `LinearStateCache` of `state_slots` sequences (``max_num_seqs``) and
        `state_snapshots` kept prompt states (`runtime.scheduler_prefix_states`) for the
        others (a pipeline stage: for its own `layers`' only, the step's slots and copies taken
        from the first stage's plan), and its step graphs stage each step's plan over it
        (`runtime.cuda_graphs`).

        A model mixing windowed and full attention layers with a `window_group` keeps those layers'
        K/V in caches of ``window_group.num_blocks`` pages, addressed by the window group's block
        tables (``window_tables``, `runtime.page_groups`; a pipeline stage: its own windowed
        layers', the step's window slots and table taken from the first stage's plan).

        `kept_b_limit`: the bytes the KV budget set aside for the adapted experts' B copied by expert
        (``kept_b``, `refresh_derived`; None: no limit, the cache's size was given)."""
        self.model = model
        self.window_group = window_group
        self.linear_spec = linear_state_spec(model.model if isinstance(model, StageModel) else model, layers)
        self.state_slots, self.state_snapshots = state_slots, state_snapshots
        check_linear_state_support(self.linear_spec, state_slots)
        self.linear_states: LinearStateCache | None = None
        self.layers = layers
        self.carry_width = carry_width
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        self.cuda_graph_batch = cuda_graph_batch if device.type == "cuda" else 0
        self.cuda_graph_tokens = cuda_graph_tokens if layers is None else 0
        self.cuda_graph_sizes = tuple(cuda_graph_sizes)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.graphs: StepGraphs | None = None
        #: The BlockManager's mirror of the block tables (the LLM sets it); without it the
        #: tables are read from the sequences' lists, which is slower and gives the same values.
        self.block_tables: BlockTables | None = None
        #: the window group's mirror (`runtime.page_groups`; the LLM sets it where there is one)
        self.window_tables: BlockTables | None = None
        #: the adapted expert tensors' B copied by expert, which the forwards read (None: none kept)
        self.kept_b: KeptExpertB | None = None
        self.kept_b_limit = kept_b_limit
        self.allocate_cache()

    def allocate_cache(self) -> None:
        spec = self.model.kv_cache_spec()
        layers, kv_heads, head_dim_k, head_dim_v = spec
        shape = (self.num_blocks, self.block_size, kv_heads)
        held = set(range(layers) if self.layers is None else self.layers)
        if self.linear_spec is not None:  # gated-DeltaNet layers keep per-sequence states, no pages
            held -= set(self.linear_spec.layers)
            self.linear_states = LinearStateCache(self.linear_spec, self.state_slots, self.device, self.dtype,
                                                  snapshots=self.state_snapshots)
        value_in_key = getattr(spec, "value_in_key", False)
        group = self.window_group
        windowed = set(() if group is None else group.layers)
        window_shape = (0 if group is None else group.num_blocks, *shape[1:])
        self.kv_caches = [kv_pair(window_shape if i in windowed else shape, head_dim_k, head_dim_v, value_in_key,
                                   self.device, self.dtype) if i in held else None for i in range(layers)]
        self.refresh_derived()
        if self.cuda_graph_batch:
            with reading_kept_b(self.kept_b):
                self.graphs = StepGraphs(self.model, self.kv_caches, self.block_size, self.max_blocks_per_seq,
                                         self.cuda_graph_batch, self.device, carry=(self.carry_width, self.dtype),
                                         max_tokens=self.cuda_graph_tokens, linear_states=self.linear_states,
                                         window_group=group, buckets=self.cuda_graph_sizes)

    def refresh_derived(self) -> None:
        """Copy the adapted expert tensors' B into the kept copies again, in place, and keep copies
        of any B adapted since: at the start of every engine call, since an optimizer step or a
        weight update changes B in place between calls (never during one). Only where the Triton
        experts run (the reference backend reads B itself), while the cache is allocated and
        ``VEXACT_EXPERT_B`` is ``kept`` (a change of either captures the graphs again first: the
        engine's `LLM._computed_under`); else the copies are dropped. The copies hold at most
        ``kept_b_limit`` bytes (adapters added after the engine budgeted its memory are copied by
        each forward instead); without CUDA graphs a B no longer adapted loses its copy."""
        if not self.kv_caches or current_backend(self.device) == "reference" or EXPERT_B.mode() != "kept":
            self.kept_b = None
            return
        sources = expert_lora_b(self.model)
        if self.kept_b is None and sources:
            self.kept_b = KeptExpertB()
        if self.kept_b is not None:
            self.kept_b.refresh(sources, only=self.graphs is None, limit=self.kept_b_limit)

    def free_cache(self) -> None:
        """Release the KV cache, the step graphs (which hold its and the weights' addresses, and a
        memory pool) and the kept B copies; `allocate_cache` makes them again."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.kv_caches = []
        self.linear_states = None
        self.kept_b = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def zero_cache(self) -> None:
        """Overwrite every K/V page with zeros, in place (the CUDA graphs keep their addresses):
        after a step wrote non-finite K/V. A freed page's stale positions are read again by
        kernels that load whole pages (`kv_pair`), where a NaN times a zero probability is NaN."""
        for pair in self.kv_caches:
            if pair is not None:
                for cache in pair:  # (a V that is a view of K's first dims is zeroed twice)
                    cache.zero_()
        if self.linear_states is not None:
            self.linear_states.zero_()

    def build_inputs(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """The host inputs of running `scheduled` (`build_step_inputs` over this runner's tables)."""
        if self.window_group is not None and self.window_tables is None:
            raise RuntimeError("ModelRunner: a window group needs the BlockManager's window tables "
                               "(EngineConfig.connect)")
        return build_step_inputs(scheduled, self.block_size, self.block_tables, self.window_tables)

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """The eager forward's arguments (ids, positions, context, logits rows) on the device."""
        return self._to_device(self.build_inputs(scheduled))

    def _to_device(self, inputs: StepInputs):
        arrays = [inputs.ids, inputs.positions, inputs.slots, inputs.logits_rows, inputs.cu_seqlens, inputs.seq_lens,
                  inputs.block_table, inputs.seq_order]
        group = self.window_group
        if group is not None:
            arrays += [inputs.window_slots, inputs.window_block_table]
        ids, positions, slots, rows, cu, lens, table, order, *window = to_device(arrays, self.device)
        layout = PagedLayout(cu, lens, table, self.block_size, inputs.max_seqlen_q, order)
        context = PagedContext(layout, slots, self.kv_caches, self._linear_step(inputs, cu),
                               None if group is None else group.step_pages(layout, window[1], window[0]))
        return ids, positions, context, rows

    def _linear_step(self, inputs: StepInputs, cu: torch.Tensor) -> LinearStep | None:
        """The step's plan over the gated-DeltaNet state cache (None without one): each sequence's
        slot is its block-table row (`runtime.linear_state_cache`)."""
        if self.linear_states is None:
            return None
        if inputs.seq_rows is None:
            raise RuntimeError("ModelRunner: a model with gated-DeltaNet layers needs the BlockManager's block tables "
                               "(EngineConfig.connect) for its state slots")
        counts = np.diff(inputs.cu_seqlens.astype(np.int64))
        starts = inputs.seq_lens.astype(np.int64) - counts
        return LinearStep(self.linear_states, inputs.seq_rows, starts, counts, cu, inputs.max_seqlen_q)

    def _copy_states(self, inputs: StepInputs) -> None:
        """Before the step: the gated-DeltaNet slot copies it carries (a sample taking its prompt's
        state from a sibling, `runtime.scheduler_siblings`; kept prompt states, into them and out
        of them, `runtime.scheduler_prefix_states`), on this runner's GDN layers. The indices travel
        in one pinned asynchronous copy (`staging.to_device`): a copy from pageable memory would
        wait for the stream, and a step scheduled ahead (a reply's state moving along it) must not."""
        if self.linear_states is None or not len(inputs.state_copies):
            return
        copies = np.asarray(inputs.state_copies, np.int64)
        src, dst = to_device([copies[:, 0], copies[:, 1]], self.device)
        self.linear_states.copy_slots(src, dst)

    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; return fp32 logits ``[num sampling sequences, vocab]`` in scheduled order."""
        return self.run(self.build_inputs(scheduled))

    def execute_scoring(self, scheduled: list[ScheduledSeq], hidden_rows: np.ndarray
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the step eagerly (CUDA graphs do not capture the extra rows): the sampling rows'
        fp32 logits as `execute` returns them, and the final hidden states of `hidden_rows` (flat
        token indices of the step's batch: prompt positions scored, `runtime.top_logprobs`)."""
        return self.run(self.build_inputs(scheduled), hidden_rows=np.asarray(hidden_rows, np.int64))

    def execute_ahead(self, scheduled: list[ScheduledSeq], in_flight: torch.Tensor) -> torch.Tensor:
        """Run a ``Scheduler.schedule_ahead`` step: its ``in_flight`` items (the first ones, one
        token each) take their input ids from `in_flight` (int64, on the device: sampled by the
        step before, not on the host yet); fp32 logits of the sampling rows, in order."""
        return self.run(self.build_inputs(scheduled), in_flight=in_flight)

    def run(self, inputs: StepInputs, carry: tuple[torch.Tensor, torch.Tensor] | None = None,
            in_flight: torch.Tensor | None = None, hidden_rows: np.ndarray | None = None):
        """Run a step given its inputs: the model's output (fp32 logits of the sampling rows; a
        pipeline stage before the last returns its ``(hidden, residual)``). `carry` is the
        previous stage's ``(hidden, residual)`` when the model takes them; `in_flight`, device
        token ids that replace the first ``len(in_flight)`` of ``inputs.ids``; `hidden_rows`
        (int64 flat token indices) runs the step eagerly and adds their final hidden states."""
        if not self.kv_caches:
            raise RuntimeError("ModelRunner: the KV cache is released (call wake_up())")
        self._copy_states(inputs)
        with reading_kept_b(self.kept_b):  # a graph's first use captures it
            return self._forward(inputs, carry, in_flight, hidden_rows)

    def _forward(self, inputs: StepInputs, carry: tuple[torch.Tensor, torch.Tensor] | None,
                 in_flight: torch.Tensor | None, hidden_rows: np.ndarray | None):
        bucket = None if self.graphs is None or hidden_rows is not None else self.graphs.step_bucket(inputs)
        if bucket is not None:
            return self.graphs.run(inputs, bucket, carry, in_flight)
        ids, positions, context, rows = self._to_device(inputs)
        if in_flight is not None:  # the staged ids are this step's own buffer: overwrite in place
            ids[:len(in_flight)].copy_(in_flight)
        if hidden_rows is not None:
            return self.model(ids, positions, context, rows, to_device([hidden_rows], self.device)[0])
        if carry is None:
            return self.model(ids, positions, context, rows)
        return self.model(ids, positions, context, rows, *carry)
