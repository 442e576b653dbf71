"""The per-sequence state of gated-DeltaNet layers beside the paged KV cache (docs/design.md section 6b).

A gated DeltaNet (GDN) layer keeps no K/V per position; a rollout keeps per sequence slot and GDN
layer (`LinearStateCache`):

- the conv state: the last ``K - 1`` inputs of the causal conv1d (`kernels.causal_conv1d`), in the
  model dtype;
- the boundary state: the delta rule's state at the sequence's last chunk boundary (fp32,
  ``[Hv, dk, dv]``);
- the current chunk's raw rows ``k, v, g, beta`` (``C`` rows a slot; never ``q``: a row's output
  reads no other row's query);
- the current chunk's rows of ``T = (I + L)^-1`` (fp32, ``[Hv, C]`` a row), which the step that
  computes a row writes beside its raw rows: a decode token's row is computed from them
  (`kernels.gated_delta_decode`) instead of from its whole chunk.

A slot is the sequence's row of the BlockManager's block-table mirror (`BlockTables`): taken with
its first page, given back when its pages are freed (finished, preempted), so at most
``max_num_seqs`` are held at once and a preempted sequence, re-prefilled from position 0, starts
from zeros: a step whose chunk starts at position 0 reads neither the conv state nor the boundary
state (`LinearStep`), so a slot is never cleared.

`LinearStep` is one step's plan (`kernels.gated_delta_step`: fixed-shape index arrays, planned on
the host and staged on the device), shared by every GDN layer of the step (the model reads it from
``PagedContext.linear_states``): per sequence the slot, the first new position and the count. A
GDN layer's step (`LinearStep.delta_rule`, `kernels.gated_delta_step`) writes the new rows of each
sequence's current chunk into its slot, computes that chunk's rows from the rows and the boundary
state in the pools (no gather), folds it into the slot's state where it completes, computes the
later chunks' rows from the step's own rows, and keeps the new partial chunk: the protocol of
`kernels.gated_delta_rollout.GatedDeltaRollout`, on pooled tensors. Every output is bitwise the
training forward's (the kernels' contract), whatever the split of a prompt into pieces, at chunk
boundaries or not. The launches' grids follow the step's capacity, not its values, and nothing
syncs with the host, so a CUDA graph captures the step (`runtime.cuda_graphs`), its plan staged in
`LinearStepBuffers` before each replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.gated_deltanet import GatedDeltaNet
from vexact_models.kernels import causal_conv1d
from vexact_models.kernels.gated_delta_rule import CHUNK
from vexact_models.kernels.gated_delta_step import StepPlan, dry_run, gated_delta_step, plan_sizes, plan_step

from .staging import Layout, to_device

__all__ = ["LinearStateCache", "LinearStateSpec", "LinearStep", "LinearStepBuffers", "linear_state_spec"]


@dataclass(frozen=True)
class LinearStateSpec:
    """The GDN layers of a model and the shapes of their per-sequence state."""

    layers: tuple[int, ...]  #: the decoder layer indices of the GDN layers
    heads: tuple[int, int]  #: (key heads Hk, value heads Hv)
    dims: tuple[int, int]  #: (key head dim dk, value head dim dv)
    conv_channels: int  #: the conv1d's channels (q, k and v together)
    conv_kernel: int  #: the conv1d's kernel size K
    chunk: int = CHUNK  #: rows of a chunk C

    def part_bytes(self, dtype: torch.dtype) -> tuple[int, int, int, int]:
        """Bytes of one layer's conv state, fp32 boundary state, chunk row (k, v, g, beta; k, v and
        beta in `dtype`) and fp32 row of ``T`` (benchmarks/decode_floor.py counts a decode step's
        reads with them)."""
        (hk, hv), (dk, dv) = self.heads, self.dims
        size = torch.empty((), dtype=dtype).element_size()
        return ((self.conv_kernel - 1) * self.conv_channels * size, hv * dk * dv * 4,
                (hk * dk + hv * dv + hv) * size + hv * 4, hv * self.chunk * 4)

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state over all GDN layers: conv state, fp32 boundary state and
        the ``C`` rows of its current chunk: k, v (model dtype), g (fp32), beta (model dtype) and
        their rows of ``T`` (fp32, ``Hv x C`` a row)."""
        conv, state, row, t_row = self.part_bytes(dtype)
        return len(self.layers) * (conv + state + self.chunk * (row + t_row))

    def cache_bytes(self, slots: int, dtype: torch.dtype) -> int:
        """Bytes of a `LinearStateCache` of `slots` sequences: theirs, and per layer the padding
        state and row that take a step's writes of no sequence (`kernels.gated_delta_step`)."""
        _, state, row, _ = self.part_bytes(dtype)
        return slots * self.bytes_per_slot(dtype) + len(self.layers) * (state + row)


def linear_state_spec(model: torch.nn.Module, layers: range | None = None) -> LinearStateSpec | None:
    """The `LinearStateSpec` of an inference (or training) model's GDN layers, or None when it has
    none (or is no module); with `layers` (a pipeline stage's decoder layers), of those among them
    only. Raises ValueError when its GDN layers differ in shape (one pool serves them all)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    found = [m for m in modules if isinstance(m, GatedDeltaNet) and (layers is None or m.layer_idx in layers)]
    if not found:
        return None
    shapes = {((m.num_k_heads, m.num_v_heads), (m.head_k_dim, m.head_v_dim), m.conv_dim, m.conv_kernel_size,
               m.chunk_size) for m in found}
    if len(shapes) != 1:
        raise ValueError(f"linear_state_spec: the gated DeltaNet layers differ in shape {sorted(shapes)}; one state "
                         "pool needs one shape")
    heads, dims, channels, kernel, chunk = shapes.pop()
    return LinearStateSpec(tuple(sorted(m.layer_idx for m in found)), heads, dims, channels, kernel, chunk)


class LinearStateCache:
    """The GDN state of `slots` sequences for every GDN layer of `spec`, on `device`; conv state
    and chunk rows k, v, beta in `dtype` (the model's), boundary states and g rows in fp32. The
    pools' layout is `kernels.gated_delta_step`'s: slot ``s``'s state at ``states[s]``, its chunk's
    rows at ``[s * C, (s + 1) * C)`` (and its rows of ``T`` at the same rows of `t_rows`), then one
    padding state and row (``T`` has none: a step keeps no row of ``T`` of a padding entry).
    Contents are undefined until a sequence's first step writes them (see the module docstring)."""

    def __init__(self, spec: LinearStateSpec, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        if slots < 1:
            raise ValueError(f"LinearStateCache: slots={slots} must be >= 1")
        (hk, hv), (dk, dv) = spec.heads, spec.dims
        rows = slots * spec.chunk + 1
        self.spec, self.slots = spec, slots
        empty = dict(device=device)
        self.conv = {i: torch.zeros(slots, spec.conv_kernel - 1, spec.conv_channels, dtype=dtype, **empty)
                     for i in spec.layers}
        self.states = {i: torch.zeros(slots + 1, hv, dk, dv, dtype=torch.float32, **empty) for i in spec.layers}
        #: the current chunks' rows, slot s's at [s * C, (s + 1) * C): k, v, g, beta
        self.rows = {i: (torch.zeros(rows, hk, dk, dtype=dtype, **empty), torch.zeros(rows, hv, dv, dtype=dtype, **empty),
                         torch.zeros(rows, hv, dtype=torch.float32, **empty), torch.zeros(rows, hv, dtype=dtype, **empty))
                     for i in spec.layers}
        #: the current chunks' rows of T = (I + L)^-1, slot s's at [s * C, (s + 1) * C)
        self.t_rows = {i: torch.zeros(slots * spec.chunk, hv, spec.chunk, dtype=torch.float32, **empty)
                       for i in spec.layers}

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[i]``'s state (conv state, boundary state, kept rows and rows of ``T``) into slot
        ``dst[i]`` in every GDN layer (int64 index tensors on the cache's device; `dst` distinct
        and disjoint from `src`): a sample taking its prompt's state from a sibling
        (`runtime.scheduler_siblings`). The copy is the data itself, so the slot continues
        bitwise as the source would."""
        width = self.spec.chunk  # slot s's rows are [s * C, (s + 1) * C)
        offsets = torch.arange(width, device=src.device)
        rows_src, rows_dst = ((s[:, None] * width + offsets).reshape(-1) for s in (src, dst))
        for i in self.spec.layers:
            for pool, (a, b) in ((self.conv[i], (src, dst)), (self.states[i], (src, dst)),
                                 *((t, (rows_src, rows_dst)) for t in (*self.rows[i], self.t_rows[i]))):
                pool.index_copy_(0, b, pool.index_select(0, a))

    def zero_(self) -> None:
        """Overwrite every state with zeros, in place (after a step that wrote non-finite values)."""
        for tensors in (self.conv.values(), self.states.values(), (t for r in self.rows.values() for t in r),
                        self.t_rows.values()):
            for t in tensors:
                t.zero_()


class LinearStep:
    """One step's plan over the `cache` (`kernels.gated_delta_step`'s arrays, on the step's
    device), shared by every GDN layer of the step: sequence ``b`` adds ``counts[b]`` tokens from
    position ``starts[b]`` in slot ``slots[b]`` (host int arrays, in the step's order); `cu_seqlens`
    (int32, on the device) and `max_seqlen` as the step's layout has them. Planned on the host and
    moved in one copy; a CUDA graph's step is `from_arrays` over `LinearStepBuffers`' views."""

    def __init__(self, cache: LinearStateCache, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        counts = np.asarray(counts, np.int64)
        plan = plan_step(slots, starts, counts, cache.spec.chunk, cache.slots, int(counts.sum()), len(counts))
        arrays = dict(zip(plan, to_device(list(plan.values()), cu_seqlens.device)))
        self._init(cache, arrays, cu_seqlens, max_seqlen)

    @classmethod
    def from_arrays(cls, cache: LinearStateCache, arrays: dict[str, torch.Tensor], cu_seqlens: torch.Tensor,
                    max_seqlen: int) -> LinearStep:
        """A step over plan arrays staged already (a CUDA graph's fixed buffers, `LinearStepBuffers`),
        for steps of up to `max_seqlen` tokens per sequence."""
        step = cls.__new__(cls)
        step._init(cache, arrays, cu_seqlens, max_seqlen)
        return step

    def _init(self, cache: LinearStateCache, arrays: dict[str, torch.Tensor], cu_seqlens: torch.Tensor,
              max_seqlen: int) -> None:
        self.cache, self.cu_seqlens, self.max_seqlen = cache, cu_seqlens, max_seqlen
        self.plan = StepPlan(arrays, cache.spec.chunk, max_seqlen)

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None = "silu") -> torch.Tensor:
        """`causal_conv1d` of the step's rows `x` reading and moving on layer `layer`'s conv states."""
        arrays = self.plan.arrays
        return causal_conv1d(x, weight, bias, self.cu_seqlens, self.max_seqlen, activation,
                             conv_state=self.cache.conv[layer], state_indices=arrays["slot"],
                             context_lens=arrays["context"])

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, *, scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
        """The outputs ``[T, Hv, dv]`` of the step's new rows (q, k ``[T, Hk, dk]``, v ``[T, Hv,
        dv]``, g, beta ``[T, Hv]``) for layer `layer`, bitwise `gated_delta_rule`'s; advances the
        layer's boundary states and chunk rows (`kernels.gated_delta_step`)."""
        return gated_delta_step(q, k, v, g, beta, self.cache.rows[layer], self.cache.states[layer], self.plan,
                                pool_t=self.cache.t_rows[layer], scale=scale, use_qk_l2norm=use_qk_l2norm)


class LinearStepBuffers:
    """Fixed device buffers of the plans of steps of up to `max_tokens` tokens and `max_batch`
    sequences over `cache`, and their host twin: a CUDA graph captured at a bucket reads views of
    them (`views`), and each step's plan is written into them before the replay (`fill`), in one
    copy (as `runtime.graph_inputs.GraphInputs` stages the attention metadata)."""

    def __init__(self, cache: LinearStateCache, max_tokens: int, max_batch: int, device: torch.device) -> None:
        self.cache = cache
        self.sizes = plan_sizes(max_tokens, max_batch, cache.spec.chunk)
        self.layout = Layout(list(self.sizes.values()))
        cuda = device.type == "cuda"
        self.host = self.layout.allocate(torch.device("cpu"), pin=cuda)
        self.staged = dict(zip(self.sizes, self.layout.host_views(self.host)))
        self.buffer = self.layout.allocate(device)
        self.full = dict(zip(self.sizes, self.layout.views(self.buffer)))
        self._copied = torch.cuda.Event() if cuda else None
        #: the last plan filled (first: a step of no sequences, every entry padding)
        self.plan = plan_step([], [], [], cache.spec.chunk, cache.slots, max_tokens, max_batch)
        self._stage(self.plan)

    def views(self, tokens: int, seqs: int) -> dict[str, torch.Tensor]:
        """The device arrays of a bucket of `tokens` tokens and `seqs` sequences (prefixes of the buffers)."""
        return {name: self.full[name][..., :shape[-1]]
                for name, (_, shape) in plan_sizes(tokens, seqs, self.cache.spec.chunk).items()}

    def fill(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, tokens: int, seqs: int) -> None:
        """Write the plan of a step (`LinearStep`'s arguments) at bucket (`tokens`, `seqs`). Raises
        ValueError (writing nothing) for a step that does not fit."""
        self.plan = plan_step(slots, starts, counts, self.cache.spec.chunk, self.cache.slots, tokens, seqs)
        self._stage(self.plan)

    def dry_run(self) -> None:
        """Stage the last plan's `kernels.gated_delta_step.dry_run` (an eager warm-up before a
        capture reads the step's inputs and advances no state); `restage` puts the plan back."""
        self._stage(dry_run(self.plan, self.cache.spec.chunk, self.cache.slots))

    def restage(self) -> None:
        self._stage(self.plan)

    def _stage(self, plan: dict[str, np.ndarray]) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the last copy has read the host twin
        for name, array in plan.items():
            self.staged[name][..., :array.shape[-1]] = array
        self.buffer.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
