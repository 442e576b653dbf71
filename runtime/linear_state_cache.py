"""The per-sequence state of gated-DeltaNet layers beside the paged KV cache (docs/design.md section 6b).

A gated DeltaNet (GDN) layer keeps no K/V per position; a rollout keeps per sequence slot and GDN
layer (`LinearStateCache`):

- the conv state: the last ``K - 1`` inputs of the causal conv1d (`kernels.causal_conv1d`), in the
  model dtype;
- the delta rule's state after the sequence's last token (fp32, ``[Hv, dk, dv]``).

A slot is the sequence's row of the BlockManager's block-table mirror (`BlockTables`): taken with
its first page, given back when its pages are freed (finished, preempted), so at most
``max_num_seqs`` are held at once and a preempted sequence, re-prefilled from position 0, starts
from zeros: a step from position 0 reads neither the conv state nor the state (`LinearStep`), so
a slot is never cleared.

`LinearStep` is one step's plan (`kernels.gated_delta_step`: fixed-shape index arrays, planned on
the host and staged on the device), shared by every GDN layer of the step (the model reads it from
``PagedContext.linear_states``): per sequence the slot, the first new position and the count. A
GDN layer's step (`LinearStep.delta_rule`) walks each sequence's new rows from its slot's state
with the training forward's recurrent kernel and leaves the last state in the slot: every output
is bitwise the training forward's, whatever the split of a prompt into pieces. The launch's grid
follows the step's capacity, not its values, and nothing syncs with the host, so a CUDA graph
captures the step (`runtime.cuda_graphs`), its plan staged in `LinearStepBuffers` before each
replay.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.gated_deltanet import GatedDeltaNet
from vexact_models.kernels import causal_conv1d
from vexact_models.kernels.gated_delta_step import StepPlan, dry_run, gated_delta_step, plan_sizes, plan_step

from .staging import Layout, to_device

__all__ = ["LinearStateCache", "LinearStateSpec", "LinearStep", "LinearStepBuffers", "linear_state_spec", "snapshot_slot"]


@dataclass(frozen=True)
class LinearStateSpec:
    """The GDN layers of a model and the shapes of their per-sequence state."""

    layers: tuple[int, ...]  #: the decoder layer indices of the GDN layers
    heads: tuple[int, int]  #: (key heads Hk, value heads Hv)
    dims: tuple[int, int]  #: (key head dim dk, value head dim dv)
    conv_channels: int  #: the conv1d's channels (q, k and v together)
    conv_kernel: int  #: the conv1d's kernel size K

    def part_bytes(self, dtype: torch.dtype) -> tuple[int, int]:
        """Bytes of one layer's conv state (in `dtype`) and fp32 state (benchmarks/decode_floor.py
        counts a decode step's reads with them)."""
        (_, hv), (dk, dv) = self.heads, self.dims
        size = torch.empty((), dtype=dtype).element_size()
        return (self.conv_kernel - 1) * self.conv_channels * size, hv * dk * dv * 4

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state over all GDN layers: conv state and fp32 state."""
        return len(self.layers) * sum(self.part_bytes(dtype))

    def cache_bytes(self, slots: int, dtype: torch.dtype, snapshots: int = 0) -> int:
        """Bytes of a `LinearStateCache` of `slots` sequences and `snapshots` prompt states:
        theirs, and per layer the padding state that takes a dry run's writes
        (`kernels.gated_delta_step`; with snapshots, a padding conv state beside it)."""
        conv, state = self.part_bytes(dtype)
        padding = len(self.layers) * (state + (conv if snapshots else 0))
        return (slots + snapshots) * self.bytes_per_slot(dtype) + padding


def linear_state_spec(model: torch.nn.Module, layers: range | None = None) -> LinearStateSpec | None:
    """The `LinearStateSpec` of an inference (or training) model's GDN layers, or None when it has
    none (or is no module); with `layers` (a pipeline stage's decoder layers), of those among them
    only. Raises ValueError when its GDN layers differ in shape (one pool serves them all)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    found = [m for m in modules if isinstance(m, GatedDeltaNet) and (layers is None or m.layer_idx in layers)]
    if not found:
        return None
    shapes = {((m.num_k_heads, m.num_v_heads), (m.head_k_dim, m.head_v_dim), m.conv_dim, m.conv_kernel_size)
              for m in found}
    if len(shapes) != 1:
        raise ValueError(f"linear_state_spec: the gated DeltaNet layers differ in shape {sorted(shapes)}; one state "
                         "pool needs one shape")
    heads, dims, channels, kernel = shapes.pop()
    return LinearStateSpec(tuple(sorted(m.layer_idx for m in found)), heads, dims, channels, kernel)


def snapshot_slot(slots: int, index: int) -> int:
    """The slot of prompt state `index` in a `LinearStateCache` of `slots` sequence slots (after
    them and the padding state), as slot copies address it."""
    return slots + 1 + index


class LinearStateCache:
    """The GDN state of `slots` sequences for every GDN layer of `spec`, on `device`; conv states in
    `dtype` (the model's), delta-rule states in fp32: slot ``s``'s at ``states[s]``, then one
    padding state (`kernels.gated_delta_step`), then `snapshots` prompt states kept for later
    requests (at `snapshot_slot`; `runtime.scheduler_prefix_states`), which only slot copies
    read and write. Contents are undefined until a sequence's first step writes them (see the module
    docstring)."""

    def __init__(self, spec: LinearStateSpec, slots: int, device: torch.device, dtype: torch.dtype,
                 snapshots: int = 0) -> None:
        if slots < 1 or snapshots < 0:
            raise ValueError(f"LinearStateCache: slots={slots} must be >= 1 and snapshots={snapshots} >= 0")
        (_, hv), (dk, dv) = spec.heads, spec.dims
        self.spec, self.slots, self.snapshots = spec, slots, snapshots
        rows = slots + 1 + snapshots if snapshots else slots  # (the padding row, then the snapshots)
        self.conv = {i: torch.zeros(rows, spec.conv_kernel - 1, spec.conv_channels, dtype=dtype, device=device)
                     for i in spec.layers}
        self.states = {i: torch.zeros(slots + 1 + snapshots, hv, dk, dv, dtype=torch.float32, device=device)
                       for i in spec.layers}


    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[i]``'s state (conv state and delta-rule state) into slot ``dst[i]`` in every
        GDN layer (int64 index tensors on the cache's device; `dst` distinct and disjoint from
        `src`): a sample taking its prompt's state from a sibling (`runtime.scheduler_siblings`).
        The copy is the data itself, so the slot continues bitwise as the source would."""
        for i in self.spec.layers:
            for pool in (self.conv[i], self.states[i]):
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def zero_(self) -> None:
        """Overwrite every state with zeros, in place (after a step that wrote non-finite values)."""
        for pools in (self.conv.values(), self.states.values()):
            for t in pools:
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
        plan = plan_step(slots, starts, counts, cache.slots, int(counts.sum()), len(counts))
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
        self.plan = StepPlan(arrays)

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
        layer's states (`kernels.gated_delta_step`)."""
        return gated_delta_step(q, k, v, g, beta, self.cache.states[layer], self.plan, scale=scale,
                                use_qk_l2norm=use_qk_l2norm)


class LinearStepBuffers:
    """Fixed device buffers of the plans of steps of up to `max_tokens` tokens and `max_batch`
    sequences over `cache`, and their host twin: a CUDA graph captured at a bucket reads views of
    them (`views`), and each step's plan is written into them before the replay (`fill`), in one
    copy (as `runtime.graph_inputs.GraphInputs` stages the attention metadata)."""

    def __init__(self, cache: LinearStateCache, max_tokens: int, max_batch: int, device: torch.device) -> None:
        self.cache = cache
        self.sizes = plan_sizes(max_tokens, max_batch)
        self.layout = Layout(list(self.sizes.values()))
        cuda = device.type == "cuda"
        self.host = self.layout.allocate(torch.device("cpu"), pin=cuda)
        self.staged = dict(zip(self.sizes, self.layout.host_views(self.host)))
        self.buffer = self.layout.allocate(device)
        self.full = dict(zip(self.sizes, self.layout.views(self.buffer)))
        self._copied = torch.cuda.Event() if cuda else None
        #: the last plan filled (first: a step of no sequences, every entry padding)
        self.plan = plan_step([], [], [], cache.slots, max_tokens, max_batch)
        self._stage(self.plan)

    def views(self, tokens: int, seqs: int) -> dict[str, torch.Tensor]:
        """The device arrays of a bucket of `tokens` tokens and `seqs` sequences (prefixes of the buffers)."""
        return {name: self.full[name][..., :shape[-1]]
                for name, (_, shape) in plan_sizes(tokens, seqs).items()}

    def fill(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, tokens: int, seqs: int) -> None:
        """Write the plan of a step (`LinearStep`'s arguments) at bucket (`tokens`, `seqs`). Raises
        ValueError (writing nothing) for a step that does not fit."""
        self.plan = plan_step(slots, starts, counts, self.cache.slots, tokens, seqs)
        self._stage(self.plan)

    def dry_run(self) -> None:
        """Stage the last plan's `kernels.gated_delta_step.dry_run` (an eager warm-up before a
        capture reads the step's inputs and advances no state); `restage` puts the plan back."""
        self._stage(dry_run(self.plan, self.cache.slots))

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
