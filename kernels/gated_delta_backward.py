"""gated_delta_backward: the chunked backward of `gated_delta_rule`'s training forward
(docs/design.md rule 8, section 6b "Backward").

`training_backward` recomputes the forward's chunk boundary states with the fold
(`gated_delta_launch.training_states`, which keeps every chunk's solve for the Triton launches;
nothing but the inputs is kept between the forward and the backward), runs the reverse recurrence
of the state gradient over every sequence's chunks, then every chunk's gradients, and sums the
query/key gradients of each key head's value heads (one ``torch.sum`` over the group, a fixed
order). Two backends: ``"triton"`` (`gated_delta_backward_triton`'s kernels, CUDA or the
interpreter) and ``"reference"``
(`gated_delta_backward_reference`'s torch formulas, chunk by chunk; the kernels' test oracle).
Deterministic: no atomics, one program per output element; the same inputs give the same bits.

Which backward `gated_delta_rule` runs on the Triton backend is a switch
(``VEXACT_GATED_DELTA_BACKWARD=triton|autograd``, default ``triton``; `use_gated_delta_backward`):
``autograd`` recomputes the forward in torch and differentiates it (`gated_delta_reference.AUTOGRAD`),
the CPU path. Both are correct to rounding (rule 8 asks no invariance of a backward).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from . import gated_delta_backward_reference as bref
from ._triton import require_triton
from .gated_delta_backward_triton import (CHUNK_GRAD_BV, CHUNK_GRAD_STAGES, STATE_GRAD_BV, STATE_GRAD_STAGES, WARPS,
                                          key_beta_grad_kernel, key_grad_kernel, key_parts, key_sums_kernel,
                                          pair_grad_kernel, query_prep_kernel, state_grad_kernel, value_grad_kernel)
from .gated_delta_launch import (FoldChunks, RowsPlan, Shapes, check_triton_shapes, chunk_inputs, device_ints,
                                 expand_heads, gather_chunks, launch_warps, prepare_rows, training_states)
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


def dot_precision(*inputs: torch.Tensor) -> str:
    """The Triton backward's product precision for these inputs: ``"tf32"`` (one tensor-core product
    a dot, operands of 11 significant bits) where every one is 16-bit, whose gradients are returned
    with bf16's 8 or fp16's 11 significant bits; ``"tf32x3"`` (three products, near fp32) where
    any is fp32. Rule 8 asks a backward to be correct only, not invariant."""
    return "tf32" if all(x.element_size() == 2 for x in inputs) else "tf32x3"


def _row_grads(t: int, shapes: Shapes, device) -> list[torch.Tensor]:
    """fp32 dq, dk ``[T, Hv, dk]`` (per value head), dv ``[T, Hv, dv]``, dg, dbeta ``[T, Hv]``."""
    dims = (shapes.dk, shapes.dk, shapes.dv)
    return [torch.empty(t, shapes.hv, d, dtype=torch.float32, device=device) for d in dims] + [
        torch.empty(t, shapes.hv, dtype=torch.float32, device=device) for _ in range(2)]


@dataclass(frozen=True)
class _Launch:
    """What every launch of one backward shares: the grid, the rows plan on the device, the
    constexprs and the launch options."""
    n_chunks: int
    hv: int
    rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # kv_start, n_rows, state_index
    sizes: dict
    keys: dict
    staged: dict
    dot: str  # the products' input precision (`dot_precision`)

    def per_chunk(self, *shape: int) -> torch.Tensor:
        return torch.empty(self.n_chunks, self.hv, *shape, dtype=torch.float32, device=self.rows[0].device)


def _state_grads(q, k, g, d_out, dstates, kept: FoldChunks, seqs, scale: float, at: _Launch):
    """`query_prep_kernel` then `state_grad_kernel`: every boundary state's gradient into
    `dstates`; returns ``P`` and ``P^T dO``."""
    chunk, dk, dv = at.sizes["C"], at.sizes["DK"], at.sizes["DV"]
    p, pd, x = at.per_chunk(chunk, chunk), at.per_chunk(chunk, dv), at.per_chunk(dk, dv)
    query_prep_kernel[(at.n_chunks, at.hv)](
        q, k, g, d_out, kept.w, p, pd, x, *at.rows[:2], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        g.stride(0), d_out.stride(0), d_out.stride(1), scale, BV=min(CHUNK_GRAD_BV, dv), **at.sizes, **at.keys,
        DOT=at.dot, **at.staged, enable_fp_fusion=True)
    bv = min(STATE_GRAD_BV, dv)
    state_grad_kernel[(len(seqs[0]), at.hv, dv // bv)](
        x, kept.w, kept.kd, kept.total_decay, dstates, *(device_ints(a, k.device) for a in seqs), dstates.stride(0),
        dstates.stride(1), BV=bv, **at.sizes, DOT=at.dot, num_warps=at.staged["num_warps"], num_stages=STATE_GRAD_STAGES,
        enable_fp_fusion=True)
    return p, pd


def _chunk_grads(q, k, v, g, beta, d_out, states, dstates, kept: FoldChunks, p, pd, grads, scale: float,
                 at: _Launch) -> None:
    """`value_grad_kernel`, `key_sums_kernel`, `pair_grad_kernel`, `key_beta_grad_kernel`,
    `key_grad_kernel`: every chunk's gradients into `grads`; each scratch tensor dropped once its
    last reader is queued."""
    dq, dk, dv, dg, db = grads
    chunk, dkh, dvh = at.sizes["C"], at.sizes["DK"], at.sizes["DV"]
    bv = min(CHUNK_GRAD_BV, dvh)
    v_new, d_new = at.per_chunk(chunk, dvh), at.per_chunk(chunk, dvh)
    d_p, d_tmat = at.per_chunk(chunk, chunk), at.per_chunk(chunk, chunk)
    d_state_decay = at.per_chunk()
    value_grad_kernel[(at.n_chunks, at.hv)](
        v, beta, d_out, states, dstates, kept.t, kept.w, kept.kd, kept.u, pd, v_new, d_new, d_p, d_tmat,
        d_state_decay, dv, db, *at.rows, v.stride(0), v.stride(1), beta.stride(0), d_out.stride(0), d_out.stride(1),
        states.stride(0), states.stride(1), dv.stride(0), dv.stride(1), db.stride(0), BV=bv, **at.sizes, DOT=at.dot,
        **at.staged, enable_fp_fusion=True)
    del pd
    d_q_decayed, d_tail, d_w = (at.per_chunk(chunk, dkh) for _ in range(3))
    key_sums_kernel[(at.n_chunks, at.hv)](
        d_out, states, dstates, v_new, d_new, d_q_decayed, d_tail, d_w, *at.rows, d_out.stride(0), d_out.stride(1),
        states.stride(0), states.stride(1), BV=bv, **at.sizes, DOT=at.dot, **at.staged, enable_fp_fusion=True)
    del v_new, d_new
    m_l, m_p = at.per_chunk(chunk, chunk), at.per_chunk(chunk, chunk)
    d_k_beta, d_cum = at.per_chunk(chunk, dkh), at.per_chunk(chunk)
    parts = key_parts(dkh)
    pair_grad_kernel[(at.n_chunks, at.hv)](
        k, g, beta, kept.t, p, d_p, d_tmat, d_w, m_l, m_p, d_cum, *at.rows[:2], k.stride(0), k.stride(1),
        g.stride(0), beta.stride(0), C=chunk, DK=dkh, KEY_PARTS=parts, **at.keys, DOT=at.dot, **at.staged, enable_fp_fusion=True)
    del p, d_p, d_tmat
    key_beta_grad_kernel[(at.n_chunks, at.hv)](
        k, g, beta, kept.t, d_w, m_l, d_k_beta, d_cum, db, *at.rows[:2], k.stride(0), k.stride(1), g.stride(0),
        beta.stride(0), db.stride(0), C=chunk, DK=dkh, KEY_PARTS=parts, **at.keys, DOT=at.dot,
        **at.staged, enable_fp_fusion=True)
    del d_w
    key_grad_kernel[(at.n_chunks, at.hv)](
        q, k, g, beta, m_l, m_p, d_k_beta, d_cum, d_state_decay, d_q_decayed, d_tail, dq, dk, dg, *at.rows[:2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), beta.stride(0), dq.stride(0), dq.stride(1),
        dg.stride(0), scale, C=chunk, DK=dkh, **at.keys, DOT=at.dot, **at.staged, enable_fp_fusion=True)


def _backward_triton(q, k, v, g, beta, d_out, states, dstates, rows: RowsPlan, seqs, shapes: Shapes, chunk: int,
                     scale: float, l2norm: bool, kept: FoldChunks | None) -> list[torch.Tensor]:
    """`gated_delta_backward_triton`'s launches on the fold's `kept` chunks (every chunk of `rows`,
    in its order); `seqs` are the sequences' first chunks, lengths and state bases."""
    require_triton("gated_delta_rule backward")
    check_triton_shapes(shapes)
    grads = _row_grads(k.shape[0], shapes, k.device)
    if not rows.kv_start:
        return grads
    at = _Launch(len(rows.kv_start), shapes.hv,
                 tuple(device_ints(x, k.device) for x in (rows.kv_start, rows.n_rows, rows.state_index)),
                 dict(C=chunk, DK=shapes.dk, DV=shapes.dv),
                 dict(GROUP=shapes.hv // shapes.hk, LOG_C=chunk.bit_length() - 1, LOG_DK=shapes.dk.bit_length() - 1,
                      L2NORM=l2norm),
                 dict(num_warps=launch_warps(shapes, WARPS), num_stages=CHUNK_GRAD_STAGES),
                 dot_precision(q, k, v, d_out))
    # P and P^T dO pass straight on, so that `_chunk_grads` holds their only references and frees them
    _chunk_grads(q, k, v, g, beta, d_out, states, dstates, kept, *_state_grads(q, k, g, d_out, dstates, kept, seqs,
                                                                              scale, at), grads, scale, at)
    return grads


def _backward_reference(q, k, v, g, beta, d_out, states, dstates, rows: RowsPlan, seqs, shapes: Shapes, chunk: int,
                        scale: float, l2norm: bool, kept: None) -> list[torch.Tensor]:
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
    states, rows, bases, kept = training_states(k, v, g, beta, initial_state, lengths, chunk, l2norm, backend)
    chunks = [-(-n // chunk) for n in lengths]
    dstates = torch.empty_like(states)
    top = [base + c for base, c in zip(bases, chunks)]
    dstates[top] = 0.0 if d_final is None else d_final.to(states.dtype)
    firsts = [base - i for i, base in enumerate(bases)]  # a sequence's first chunk: its base less the bases before
    run = _backward_triton if backend == "triton" else _backward_reference
    dq, dk, dv, dg, db = run(q, k, v, g, beta, d_out, states, dstates, rows, (firsts, lengths, bases), shapes, chunk,
                             scale, l2norm, kept)
    group = shapes.hv // shapes.hk
    dq, dk = (x.reshape(x.shape[0], shapes.hk, group, shapes.dk).sum(2) for x in (dq, dk))
    d_initial = None if initial_state is None else dstates[bases].to(initial_state.dtype)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype), d_initial
