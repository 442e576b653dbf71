"""gated_delta_backward: the chunked backward of `gated_delta_rule`'s training forward
(docs/design.md rule 8, section 6b "Backward").

`training_backward` recomputes the forward's chunk boundary states with the fold (the same launch as
the forward, `gated_delta_launch.training_states`; nothing but the inputs is kept between the
forward and the backward), runs the reverse recurrence of the state gradient over every sequence's
chunks, then every chunk's gradients, and sums the query/key gradients of each key head's value
heads (one ``torch.sum`` over the group, a fixed order). Two backends: ``"triton"``
(`gated_delta_backward_triton`'s kernels, CUDA or the interpreter) and ``"reference"``
(`gated_delta_backward_reference`'s torch formulas, chunk by chunk; the kernels' test oracle).
Deterministic: no atomics, one program per output element; the same inputs give the same bits.

Which backward `gated_delta_rule` runs on the Triton backend is a switch
(``VEXACT_GATED_DELTA_BACKWARD=triton|autograd``, default ``triton``; `use_gated_delta_backward`):
``autograd`` recomputes the forward in torch and differentiates it (`gated_delta_reference.AUTOGRAD`),
the CPU path. Both are correct to rounding (rule 8 asks no invariance of a backward).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from . import gated_delta_backward_reference as bref
from ._triton import require_triton
from .gated_delta_backward_triton import CHUNK_GRAD_BV, CHUNK_GRAD_WARPS, STATE_GRAD_WARPS, chunk_grad_kernel, state_grad_kernel
from .gated_delta_launch import (RowsPlan, Shapes, check_triton_shapes, chunk_inputs, device_ints, expand_heads,
                                 gather_chunks, launch_warps, prepare_rows, training_states, value_block)
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_GATED_DELTA_BACKWARD"
_switch = KernelSwitch(ENV_VAR, ("triton", "autograd"), "triton", "gated delta rule backward")


def backward_mode() -> str:
    """``"triton"`` or ``"autograd"``: `use_gated_delta_backward`'s choice if set, else
    ``VEXACT_GATED_DELTA_BACKWARD`` (``triton`` when unset); read at every backward call."""
    return _switch.mode()


def use_gated_delta_backward(mode: str | None) -> AbstractContextManager[None]:
    """Within the block, `gated_delta_rule`'s backward on the Triton backend is `mode`
    (``"triton"``: the chunked kernels, ``"autograd"``: torch autograd through the recomputed
    forward); None hands the choice back to the environment."""
    return _switch.use(mode)


def _row_grads(t: int, shapes: Shapes, device) -> list[torch.Tensor]:
    """fp32 dq, dk ``[T, Hv, dk]`` (per value head), dv ``[T, Hv, dv]``, dg, dbeta ``[T, Hv]``."""
    dims = (shapes.dk, shapes.dk, shapes.dv)
    return [torch.empty(t, shapes.hv, d, dtype=torch.float32, device=device) for d in dims] + [
        torch.empty(t, shapes.hv, dtype=torch.float32, device=device) for _ in range(2)]


def _backward_triton(q, k, v, g, beta, d_out, states, dstates, rows: RowsPlan, seqs, shapes: Shapes, chunk: int,
                     scale: float, l2norm: bool) -> list[torch.Tensor]:
    require_triton("gated_delta_rule backward")
    check_triton_shapes(shapes)
    grads = _row_grads(k.shape[0], shapes, k.device)
    if not rows.kv_start:
        return grads
    dev, bv = k.device, value_block(shapes.dv)
    consts = dict(GROUP=shapes.hv // shapes.hk, C=chunk, DK=shapes.dk, DV=shapes.dv, BV=bv,
                  LOG_C=chunk.bit_length() - 1, LOG_DK=shapes.dk.bit_length() - 1, L2NORM=l2norm)
    state_grad_kernel[(len(seqs[0]), shapes.hv, shapes.dv // bv)](
        q, k, g, beta, d_out, dstates, *(device_ints(x, dev) for x in seqs),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), beta.stride(0), d_out.stride(0),
        d_out.stride(1), dstates.stride(0), dstates.stride(1), scale, **consts,
        num_warps=launch_warps(shapes, STATE_GRAD_WARPS))
    dq, dk, dv, dg, db = grads
    consts["BV"] = min(CHUNK_GRAD_BV, shapes.dv)
    chunk_grad_kernel[(len(rows.kv_start), shapes.hv)](
        q, k, v, g, beta, d_out, states, dstates, *grads,
        *(device_ints(x, dev) for x in (rows.kv_start, rows.n_rows, rows.state_index)),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        d_out.stride(0), d_out.stride(1), states.stride(0), states.stride(1), dq.stride(0), dq.stride(1),
        dv.stride(0), dv.stride(1), dg.stride(0), scale, **consts, num_warps=launch_warps(shapes, CHUNK_GRAD_WARPS))
    return grads


def _backward_reference(q, k, v, g, beta, d_out, states, dstates, rows: RowsPlan, seqs, shapes: Shapes, chunk: int,
                        scale: float, l2norm: bool) -> list[torch.Tensor]:
    compute = states.dtype
    start, n = rows.kv_start, rows.n_rows
    kk, vv, gg, bb = chunk_inputs(start, n, k, v, g, beta, shapes, chunk, compute)
    zeros = [0] * len(start)
    qq = expand_heads(gather_chunks(q, start, zeros, n, chunk).to(compute), shapes.hv)
    dd = gather_chunks(d_out, start, zeros, n, chunk).to(compute).transpose(1, 2)
    keys = bref.chunk_keys(qq, kk, gg, bb, scale=scale, use_qk_l2norm=l2norm)
    for i in reversed(range(len(start))):  # a sequence's chunks are consecutive: the last one first
        one = bref.ChunkKeys(*(x[i] for x in vars(keys).values()))
        index = rows.state_index[i]
        dstates[index] = bref.state_grad_step(one, dd[i], dstates[index + 1])
    index = torch.tensor(rows.state_index, dtype=torch.long, device=k.device)
    grads = bref.chunk_grads(qq, kk, vv, gg, bb, states[index], dd, dstates[index + 1], scale=scale,
                             use_qk_l2norm=l2norm)
    present = torch.arange(chunk, device=k.device)[None, :] < torch.tensor(n, device=k.device)[:, None]
    return [x.transpose(1, 2)[present] for x in grads]  # [chunks, Hv, C, ..] -> [T, Hv, ..]


def training_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      initial_state: torch.Tensor | None, d_out: torch.Tensor, d_final: torch.Tensor | None,
                      lengths: list[int], chunk: int, scale: float, l2norm: bool,
                      backend: str) -> tuple[torch.Tensor | None, ...]:
    """The gradients of `gated_delta_rule`'s inputs ``(dq, dk, dv, dg, dbeta, d_initial_state)``
    (each in its input's dtype; ``d_initial_state`` None without an initial state) from ``d_out
    [T, Hv, dv]`` and ``d_final [B, Hv, dk, dv]`` (None: no gradient of the final states), on
    checked inputs, on `backend` (``"triton"`` or ``"reference"``)."""
    shapes = Shapes(k.shape[1], v.shape[1], k.shape[2], v.shape[2])
    q, k, v, g, beta, d_out = (prepare_rows(x, backend) for x in (q, k, v, g, beta, d_out))
    states, rows, bases = training_states(k, v, g, beta, initial_state, lengths, chunk, l2norm, False, backend)
    chunks = [-(-n // chunk) for n in lengths]
    dstates = torch.empty_like(states)
    top = [base + c for base, c in zip(bases, chunks)]
    dstates[top] = 0.0 if d_final is None else d_final.to(states.dtype)
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    run = _backward_triton if backend == "triton" else _backward_reference
    dq, dk, dv, dg, db = run(q, k, v, g, beta, d_out, states, dstates, rows, (starts, lengths, bases), shapes, chunk,
                             scale, l2norm)
    group = shapes.hv // shapes.hk
    dq, dk = (x.reshape(x.shape[0], shapes.hk, group, shapes.dk).sum(2) for x in (dq, dk))
    d_initial = None if initial_state is None else dstates[bases].to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), d_initial
