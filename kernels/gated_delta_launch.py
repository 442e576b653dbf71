"""The gated delta rule's chunk launches, for the backward (docs/design.md section 6b): the plans
(which rows and states each chunk or run of chunks uses), the training batch's boundary states
(`training_states`, by the fold) and the fold's two backends.

`_fold_reference` gathers each chunk's rows into zero-padded ``[C, ...]`` tensors and runs
`gated_delta_reference.chunk_forward` with its batch-invariant `EXACT` primitives; `_fold_triton`
launches `gated_delta_triton`'s kernels. A plan is built on the host from python ints, which the
Triton launchers copy to the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gated_delta_reference as ref
from ._triton import require_triton
from .gated_delta_triton import FOLD_WARPS, SMALL_HEAD_WARPS, fold_kernel, fold_prep_kernel

@dataclass(frozen=True)
class Shapes:
    hk: int
    hv: int
    dk: int
    dv: int



def state_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Launch plans: which rows, states and outputs each chunk (rows) or run of chunks (fold) uses.


@dataclass(frozen=True)
class RowsPlan:
    kv_start: list[int]  # token of the chunk's row 0 in k, v, g, beta
    n_rows: list[int]  # rows present (<= C)
    state_index: list[int]  # the boundary state (-1: zeros)


@dataclass(frozen=True)
class FoldPlan:
    start: list[int]  # token of the run's first row
    length: list[int]  # rows of the run (a multiple of C but for the last chunk)
    state_index: list[int]  # the state before the run (-1: zeros)
    out_index: list[int]  # where the state after the run's first chunk goes; chunk c at + c


def training_plans(lengths: list[int], chunk: int) -> tuple[FoldPlan, RowsPlan, list[int], int]:
    """Plans of a packed batch of sequences starting at position 0. States buffer: per sequence,
    its initial state at ``base`` and the state after chunk ``c`` at ``base + 1 + c``; returns the
    plans, the bases and the buffer's size."""
    fold = FoldPlan([], [], [], [])
    rows = RowsPlan([], [], [])
    bases, start, base = [], 0, 0
    for length in lengths:
        chunks = -(-length // chunk)
        bases.append(base)
        fold.start.append(start), fold.length.append(length), fold.state_index.append(base)
        fold.out_index.append(base + 1)
        for c in range(chunks):
            rows.kv_start.append(start + c * chunk), rows.n_rows.append(min(chunk, length - c * chunk))
            rows.state_index.append(base + c)
        start += length
        base += chunks + 1
    return fold, rows, bases, base


# ---------------------------------------------------------------------------------------------
# The two backends of the two launches.


def gather_chunks(x: torch.Tensor, start: list[int], first: list[int], n: list[int], chunk: int) -> torch.Tensor:
    """``[N, C, ...]``: row ``r`` of chunk ``b`` is ``x[start_b + r - first_b]`` for ``first_b <= r
    < n_b``, an exact zero otherwise."""
    r = torch.arange(chunk)
    s, f, m = (torch.tensor(a, dtype=torch.int64).unsqueeze(1) for a in (start, first, n))
    present = (r >= f) & (r < m)
    index = torch.where(present, s + r - f, 0).to(x.device)
    rows = x[index.reshape(-1)].reshape(len(start), chunk, *x.shape[1:])
    mask = present.to(x.device).reshape(len(start), chunk, *([1] * (x.dim() - 1)))
    return torch.where(mask, rows, torch.zeros((), dtype=rows.dtype, device=rows.device))


def expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``[N, C, H, d]`` -> ``[N, Hv, C, d]``, query/key head ``h // (Hv // H)`` for value head ``h``."""
    group = hv // x.shape[2]
    if group > 1:
        x = x.repeat_interleave(group, dim=2)
    return x.transpose(1, 2)


def chunk_inputs(start: list[int], n: list[int], k, v, g, beta, shapes: Shapes, chunk: int, compute):
    """The chunks' key-side tensors: k ``[N, Hv, C, dk]``, v ``[N, Hv, C, dv]``, g, beta
    ``[N, Hv, C]``, in `compute` dtype, from rows ``start..start + n - 1``."""
    zeros = [0] * len(start)
    kk = expand_heads(gather_chunks(k, start, zeros, n, chunk).to(compute), shapes.hv)
    vv = gather_chunks(v, start, zeros, n, chunk).to(compute).transpose(1, 2)
    gg, bb = (gather_chunks(x, start, zeros, n, chunk).to(compute).transpose(1, 2) for x in (g, beta))
    return kk, vv, gg, bb


def boundary_states(states: torch.Tensor, index: list[int], compute: torch.dtype) -> torch.Tensor:
    """``states[index]`` in `compute` dtype, zeros where an index is -1 (a chunk at position 0)."""
    at = torch.tensor(index, dtype=torch.long)
    return torch.where((at >= 0).reshape(-1, 1, 1, 1), states[at.clamp(min=0)].to(compute),
                       torch.zeros((), dtype=compute))


def _fold_reference(k, v, g, beta, states_in, states_out, plan: FoldPlan, shapes: Shapes, chunk: int,
                    l2norm: bool) -> None:
    compute = state_dtype(k)
    s = boundary_states(states_in, plan.state_index, compute)
    chunks = [-(-n // chunk) for n in plan.length]
    for c in range(max(chunks, default=0)):
        live = [b for b, count in enumerate(chunks) if count > c]
        start = [plan.start[b] + c * chunk for b in live]
        n = [min(chunk, plan.length[b] - c * chunk) for b in live]
        kk, vv, gg, bb = chunk_inputs(start, n, k, v, g, beta, shapes, chunk, compute)
        _, new = ref.chunk_forward(None, kk, vv, gg, bb, s[live], ref.EXACT, scale=1.0, use_qk_l2norm=l2norm)
        s[live] = new
        for j, b in enumerate(live):
            states_out[plan.out_index[b] + c] = new[j].to(states_out.dtype)


def _device_ints(values: list[int] | torch.Tensor, device) -> torch.Tensor:
    """A plan's field on the device: host ints copied, or an int32 tensor there already (a rollout
    step's staged plan, `gated_delta_step`: no copy, so a CUDA graph can capture the launch)."""
    if isinstance(values, torch.Tensor):
        return values
    return torch.tensor(values, dtype=torch.int32).to(device, non_blocking=True)


def _value_block(dv: int) -> int:
    return min(64, dv)


def _warps(shapes: Shapes, warps: int) -> int:
    """A launch's warps: `warps`, or `SMALL_HEAD_WARPS` where dk or dv is 16 (no product split
    into 8-column TF32 wgmma; `gated_delta_triton`)."""
    return SMALL_HEAD_WARPS if min(shapes.dk, shapes.dv) == 16 else warps


def _check_triton_shapes(shapes: Shapes) -> None:
    for name, d in (("dk", shapes.dk), ("dv", shapes.dv)):
        if d < 16 or d & (d - 1) or d > 256:
            raise ValueError(f"gated_delta_rule: the Triton kernels take {name}={d} only as a power of two in 16..256")


def fold_chunks(plan: FoldPlan, chunk: int) -> tuple[list[int], list[int], list[int]]:
    """The chunks a fold plan's runs cover, in run order (host lists, one entry a chunk): each
    chunk's first token and rows, and per run the index of its first chunk."""
    starts, n_rows, firsts = [], [], []
    for start, length in zip(plan.start, plan.length):
        firsts.append(len(starts))
        for c in range(0, length, chunk):
            starts.append(start + c)
            n_rows.append(min(chunk, length - c))
    return starts, n_rows, firsts


@dataclass(frozen=True)
class FoldChunks:
    """What `fold_prep_kernel` computed of every chunk of a fold, in the plan's run order (fp32):
    ``w``, ``kd`` ``[N, Hv, C, dk]``, ``u`` ``[N, Hv, C, dv]``, ``total_decay = exp(G_last)`` ``[N,
    Hv]`` and ``t = T`` ``[N, Hv, C, C]``; the backward reads them instead of solving again."""
    w: torch.Tensor
    kd: torch.Tensor
    u: torch.Tensor
    total_decay: torch.Tensor
    t: torch.Tensor


def _fold_triton(k, v, g, beta, states_in, states_out, plan: FoldPlan, shapes: Shapes, chunk: int,
                 l2norm: bool) -> FoldChunks | None:
    """`fold_prep_kernel` over every chunk of the plan's runs in parallel, then `fold_kernel`'s
    two products a chunk along each run (`gated_delta_triton`); returns the chunks' prepared
    tensors (`FoldChunks`, None for a plan of no chunk)."""
    require_triton("gated_delta_rule")
    _check_triton_shapes(shapes)
    chunks = fold_chunks(plan, chunk)
    capacity = len(chunks[0])
    if capacity == 0:
        return None
    dev = k.device
    starts, n_rows, firsts, length, state_index, out_index = (
        _device_ints(x, dev) for x in (*chunks, plan.length, plan.state_index, plan.out_index))
    bv = _value_block(shapes.dv)
    consts = dict(C=chunk, DK=shapes.dk, DV=shapes.dv, BV=bv)
    w = torch.empty(capacity, shapes.hv, chunk, shapes.dk, dtype=torch.float32, device=dev)
    kd = torch.empty_like(w)
    u = torch.empty(capacity, shapes.hv, chunk, shapes.dv, dtype=torch.float32, device=dev)
    total_decay = torch.empty(capacity, shapes.hv, dtype=torch.float32, device=dev)
    t = torch.empty(capacity, shapes.hv, chunk, chunk, dtype=torch.float32, device=dev)
    fold_prep_kernel[(capacity, shapes.hv)](
        k, v, g, beta, w, u, kd, total_decay, t, starts, n_rows,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        GROUP=shapes.hv // shapes.hk, LOG_C=chunk.bit_length() - 1, LOG_DK=shapes.dk.bit_length() - 1, L2NORM=l2norm,
        num_warps=_warps(shapes, FOLD_WARPS), **consts, enable_fp_fusion=True)
    fold_kernel[(len(plan.start), shapes.hv, shapes.dv // bv)](
        w, u, kd, total_decay, states_in, states_out, firsts, length, state_index, out_index,
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        states_in.stride(0), states_in.stride(1), states_out.stride(0), states_out.stride(1),
        num_warps=_warps(shapes, FOLD_WARPS), **consts, enable_fp_fusion=True)
    return FoldChunks(w, kd, u, total_decay, t)


def launch_fold(backend: str, *args) -> FoldChunks | None:
    """The fold on `backend`: the Triton fold returns its chunks' `FoldChunks`, the reference
    (which keeps nothing) None."""
    if backend == "triton":
        return _fold_triton(*args)
    _fold_reference(*args)
    return None


def prepare_rows(x: torch.Tensor, backend: str) -> torch.Tensor:
    """Unit stride along the last dim (the kernels take row and head strides) for Triton."""
    return x if backend != "triton" or x.stride(-1) == 1 else x.contiguous()


def training_states(k, v, g, beta, initial_state: torch.Tensor | None, lengths: list[int], chunk: int, l2norm: bool,
                    backend: str) -> tuple[torch.Tensor, RowsPlan, list[int], FoldChunks | None]:
    """The fold over every chunk of a packed batch (rows prepared by `prepare_rows`): the states
    buffer of `training_plans` (each sequence's initial state at ``base``, the state before its
    chunk ``c`` at ``base + c``, after its last chunk at ``base + chunks``), the rows plan, the
    bases and, on the Triton backend, the fold's `FoldChunks` (every chunk of the rows plan, in its
    order). The backward's recompute."""
    shapes = Shapes(k.shape[1], v.shape[1], k.shape[2], v.shape[2])
    fold, rows, bases, n_states = training_plans(lengths, chunk)
    # each sequence's slot `base` holds its initial state; the folds write the others before any read
    states = torch.empty(n_states, shapes.hv, shapes.dk, shapes.dv, dtype=state_dtype(k), device=k.device)
    states[bases] = 0.0 if initial_state is None else initial_state.to(states.dtype)
    kept = launch_fold(backend, k, v, g, beta, states, states, fold, shapes, chunk, l2norm)
    return states, rows, bases, kept


# Public names of the launch helpers the backward's launches share (`gated_delta_backward`).
check_triton_shapes, device_ints, value_block, launch_warps = _check_triton_shapes, _device_ints, _value_block, _warps
