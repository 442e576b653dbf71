"""The gated delta rule's Triton backward: the reverse recurrence of the state gradient
(`state_grad_kernel`) and each chunk's gradients (`chunk_grad_kernel`), the formulas of
`gated_delta_backward_reference` (its docstring derives them; docs/design.md rule 8, section 6b).

Both recompute a chunk's key side with the forward's `gated_delta_triton.chunk_keys` (normalised
keys, ``G``, the pair decays, ``T``, ``w``) rather than reading it from memory. A
`state_grad_kernel` program takes one value block of one head of one sequence and walks its chunks
from the last to the first, carrying ``dS [dk, BV]`` in registers and writing the gradient of every
chunk's boundary state; a `chunk_grad_kernel` program takes one chunk of one head, reads the
forward's boundary state (recomputed by the fold) and the gradient of the next one, and writes the
chunk's ``dq, dk`` (at the value head, through the l2 norm), ``dv``, ``dg``, ``dbeta`` in fp32. No
atomics: every output element is written by one program, every sum has one order fixed by the
code (a ``tl.sum`` over a tile, the value blocks one after another, the chunks in reverse), so the
same inputs give the same bits run to run. The dots run in ``tf32x3`` on fp32 operands, as the
forward's.
"""

from __future__ import annotations

from ._triton import tl, triton
from .gated_delta_triton import chunk_keys, l2norm_rows, load_rows, load_state, store_state
from .row_sum import row_sum_halves

STATE_GRAD_WARPS = 8
CHUNK_GRAD_WARPS = 8
CHUNK_GRAD_BV = 32  # value columns a chunk_grad_kernel step takes


@triton.jit
def _dot(a, b):
    return tl.dot(a, b, input_precision="tf32x3")


@triton.jit
def _query_side(q_ptr, start, n, hk, stride_qt, stride_qh, k, cum, decay, scale,
                C: tl.constexpr, DK: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """The normalised, scaled queries ``q``, ``P = lower(q k^T * decay)``, ``exp(G_last)`` and
    ``exp(G_last - G)``."""
    rows = tl.arange(0, C)
    q = l2norm_rows(load_rows(q_ptr, start, 0, n, hk, stride_qt, stride_qh, DK, C), L2NORM, LOG_DK) * scale
    p = tl.where(rows[None, :] <= rows[:, None], _dot(q, tl.trans(k)) * decay, 0.0)
    last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)  # G of the tile's last row (absent rows add g = 0)
    return q, p, tl.exp(last), tl.exp(last - cum)


@triton.jit
def state_grad_kernel(q_ptr, k_ptr, g_ptr, b_ptr, do_ptr, dstate_ptr, start_ptr, length_ptr, base_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_bt, stride_dot, stride_doh,
                      stride_s, stride_sh, scale,
                      GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """One sequence (``length`` rows from token ``start``), one head, one value block: from the
    gradient of its final state at ``dstate[base + chunks]``, the gradient of the state at the
    start of chunk ``c`` goes to ``dstate[base + c]``, ``c = chunks - 1, .., 0``."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    hk = h // GROUP
    start = tl.load(start_ptr + seq)
    length = tl.load(length_ptr + seq)
    base = tl.load(base_ptr + seq)
    chunks = tl.cdiv(length, C)
    ds = load_state(dstate_ptr, base + chunks, h, vb, stride_s, stride_sh, DK, DV, BV)
    for i in range(0, chunks):
        c = chunks - 1 - i
        n = tl.minimum(length - c * C, C)
        k, cum, beta, decay, t, w = chunk_keys(k_ptr, g_ptr, b_ptr, start + c * C, n, h, hk, stride_kt, stride_kh,
                                                stride_gt, stride_bt, C, DK, LOG_C, LOG_DK, L2NORM)
        q, p, exp_last, exp_tail = _query_side(q_ptr, start + c * C, n, hk, stride_qt, stride_qh, k, cum, decay, scale,
                                               C, DK, LOG_DK, L2NORM)
        d_out = load_rows(do_ptr + vb * BV, start + c * C, 0, n, h, stride_dot, stride_doh, BV, C)
        d_new = _dot(tl.trans(p), d_out) + _dot(k * exp_tail[:, None], ds)
        ds = _dot(tl.trans(q * tl.exp(cum)[:, None]), d_out) + ds * exp_last - _dot(tl.trans(w), d_new)
        store_state(dstate_ptr, base + c, h, vb, ds, stride_s, stride_sh, DK, DV, BV)


@triton.jit
def _l2norm_backward(x_ptr, start, n, hk, stride_t, stride_h, dy, L2NORM: tl.constexpr, C: tl.constexpr,
                     D: tl.constexpr, LOG_D: tl.constexpr):
    """``dx = (dy - y (y . dy)) / |x|`` for ``y = x / |x|`` (``|x| = sqrt(sum(x * x) + 1e-6)``)."""
    if L2NORM:
        x = load_rows(x_ptr, start, 0, n, hk, stride_t, stride_h, D, C)
        norm = tl.sqrt_rn(row_sum_halves(x * x, LOG_D, False) + 1e-6)
        y = x / norm[:, None]
        dy = (dy - y * tl.sum(y * dy, axis=1)[:, None]) / norm[:, None]
    return dy


@triton.jit
def _store_rows(ptr, start, n, h, x, stride_t, stride_h, C: tl.constexpr, D: tl.constexpr):
    rows = tl.arange(0, C)
    ptrs = ptr + (start + rows).to(tl.int64)[:, None] * stride_t + h * stride_h + tl.arange(0, D)[None, :]
    tl.store(ptrs, x, mask=(rows < n)[:, None])


@triton.jit
def chunk_grad_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, do_ptr, state_ptr, dstate_ptr,
                      dq_ptr, dk_ptr, dv_ptr, dg_ptr, db_ptr, kv_start_ptr, n_rows_ptr, state_index_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                      stride_dot, stride_doh, stride_s, stride_sh, stride_dkt, stride_dkh, stride_dvt, stride_dvh,
                      stride_dgt, scale,
                      GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """One chunk, one head: the boundary state ``state[index]`` and the next one's gradient
    ``dstate[index + 1]`` give the gradients of the chunk's rows (`gated_delta_backward_reference.
    chunk_grads`); dq, dk ``[T, Hv, dk]`` (one per value head), dv ``[T, Hv, dv]``, dg, dbeta
    ``[T, Hv]``, fp32, rows ``< n`` only."""
    chunk = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    start = tl.load(kv_start_ptr + chunk)
    n = tl.load(n_rows_ptr + chunk)
    index = tl.load(state_index_ptr + chunk)
    rows = tl.arange(0, C)
    k, cum, beta, decay, t, w = chunk_keys(k_ptr, g_ptr, b_ptr, start, n, h, hk, stride_kt, stride_kh, stride_gt,
                                            stride_bt, C, DK, LOG_C, LOG_DK, L2NORM)
    q, p, exp_last, exp_tail = _query_side(q_ptr, start, n, hk, stride_qt, stride_qh, k, cum, decay, scale,
                                           C, DK, LOG_DK, L2NORM)
    exp_cum = tl.exp(cum)
    k_tail = k * exp_tail[:, None]
    d_q_decayed = tl.zeros((C, DK), dtype=tl.float32)
    d_p = tl.zeros((C, C), dtype=tl.float32)
    d_tail = tl.zeros((C, DK), dtype=tl.float32)
    d_w = tl.zeros((C, DK), dtype=tl.float32)
    d_tmat = tl.zeros((C, C), dtype=tl.float32)
    d_beta = tl.zeros((C,), dtype=tl.float32)
    d_state_decay = 0.0
    for vb in tl.static_range(DV // BV):
        s = load_state(state_ptr, index, h, vb, stride_s, stride_sh, DK, DV, BV)
        d_end = load_state(dstate_ptr, index + 1, h, vb, stride_s, stride_sh, DK, DV, BV)
        v = load_rows(v_ptr + vb * BV, start, 0, n, h, stride_vt, stride_vh, BV, C)
        v_beta = v * beta[:, None]
        v_new = _dot(t, v_beta) - _dot(w, s)
        d_out = load_rows(do_ptr + vb * BV, start, 0, n, h, stride_dot, stride_doh, BV, C)
        d_new = _dot(tl.trans(p), d_out) + _dot(k_tail, d_end)
        d_q_decayed += _dot(d_out, tl.trans(s))
        d_p += _dot(d_out, tl.trans(v_new))
        d_tail += _dot(v_new, tl.trans(d_end))
        d_w -= _dot(d_new, tl.trans(s))
        d_tmat += _dot(d_new, tl.trans(v_beta))
        d_v_beta = _dot(tl.trans(t), d_new)
        _store_rows(dv_ptr + vb * BV, start, n, h, d_v_beta * beta[:, None], stride_dvt, stride_dvh, C, BV)
        d_beta += tl.sum(d_v_beta * v, axis=1)
        d_state_decay += tl.sum(tl.sum(d_end * s, axis=1), axis=0)
    k_beta = k * beta[:, None]
    d_w_t = _dot(tl.trans(t), d_w)  # the gradient of w's k beta exp(G)
    d_tmat += _dot(d_w, tl.trans(k_beta * exp_cum[:, None]))
    strict = rows[None, :] < rows[:, None]
    d_l = tl.where(strict, -_dot(tl.trans(t), _dot(d_tmat, tl.trans(t))), 0.0)
    d_p = tl.where(rows[None, :] <= rows[:, None], d_p, 0.0)
    lmat = tl.where(strict, _dot(k_beta, tl.trans(k)) * decay, 0.0)
    h_pairs = d_l * lmat + d_p * p
    m_l = d_l * decay
    m_p = d_p * decay
    d_k_beta = _dot(m_l, k) + d_w_t * exp_cum[:, None]
    d_qn = _dot(m_p, k) + d_q_decayed * exp_cum[:, None]
    d_kn = _dot(tl.trans(m_l), k_beta) + _dot(tl.trans(m_p), q) + d_k_beta * beta[:, None] + d_tail * exp_tail[:, None]
    d_beta += tl.sum(d_k_beta * k, axis=1)
    tail_terms = tl.sum(d_tail * k_tail, axis=1)
    d_cum = (tl.sum(h_pairs, axis=1) - tl.sum(h_pairs, axis=0) + tl.sum(d_q_decayed * q, axis=1) * exp_cum
             + tl.sum(d_w_t * k_beta, axis=1) * exp_cum - tail_terms)
    d_last = tl.sum(tail_terms, axis=0) + exp_last * d_state_decay
    d_cum += tl.where(rows == C - 1, d_last, 0.0)
    d_g = row_sum_halves(tl.where(rows[None, :] >= rows[:, None], d_cum[None, :], 0.0), LOG_C, False)
    g_rows = (start + rows).to(tl.int64) * stride_dgt + h
    tl.store(dg_ptr + g_rows, d_g, mask=rows < n)
    tl.store(db_ptr + g_rows, d_beta, mask=rows < n)
    d_q = _l2norm_backward(q_ptr, start, n, hk, stride_qt, stride_qh, d_qn * scale, L2NORM, C, DK, LOG_DK)
    _store_rows(dq_ptr, start, n, h, d_q, stride_dkt, stride_dkh, C, DK)
    d_k = _l2norm_backward(k_ptr, start, n, hk, stride_kt, stride_kh, d_kn, L2NORM, C, DK, LOG_DK)
    _store_rows(dk_ptr, start, n, h, d_k, stride_dkt, stride_dkh, C, DK)
