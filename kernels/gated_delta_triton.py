"""The gated delta rule's chunk kernels, for the backward: the fold (`fold_prep_kernel`, `fold_kernel`)
and the chunk helpers the backward kernels share (`keys_decay`, the row loads and the state tiles).

The forward runs token by token (`gated_delta_recurrent`); the backward (rule 8) works on chunks
of ``C`` rows and recomputes the states at the chunk boundaries with the fold. A chunk is
computed as `gated_delta_reference.chunk_forward` does (its docstring lists the steps), at the
fixed tile ``[C, ...]``, with every row past the chunk's present rows loaded as an exact zero
(masked loads, `tl.where`): sums by `row_sum.row_sum_halves`, products by `tl.dot`.

The dots run with ``input_precision="tf32x3"`` (three TF32 products, about fp32's precision) on
fp32 operands: the inputs are widened to fp32 on load, the state and every intermediate stay in
fp32. The fold is two launches: `fold_prep_kernel` (one program a chunk and head, all in
parallel) computes what a chunk gives the state update whatever the state is (``w``, ``u = T (v
beta)``, the keys decayed to the chunk's end and the chunk's total decay) and stores it in fp32;
`fold_kernel` (one program a value block of one head of a run of chunks, the state of the block
in registers across the chunks) then takes two products a chunk, ``v_new = u - w S`` and
``S exp(G_last) + kd^T v_new``: only those are serial along a sequence.
"""

from __future__ import annotations

from ._triton import tl, triton
from .row_sum import row_sum_halves

FOLD_WARPS = 8
#: both kernels' warps where dk or dv is 16. With 8 warps the two warpgroups of a ``[64, 16]``
#: product (chunk 64) take 8 columns each, TF32 wgmma ``m64n8k8``, and Triton 3.6's sm_90 fold
#: built so read shared memory out of bounds at dk = 16: an illegal memory access (compute-sanitizer:
#: invalid __shared__ reads of 1024 bytes). With 4 warps one warpgroup takes all 16 columns
#: (``m64n16k8``); dk, dv, chunk = 16, 16, 16/32/64/128; 16, 64, 64; 64, 16, 16 and 128, 16, 64
#: matched the reference (H200, 2026-12-02). docs/design.md section 6b.
SMALL_HEAD_WARPS = 4
SOLVE_BLOCK = tl.constexpr(16)  # rows of the solve's diagonal blocks (gated_delta_reference.SOLVE_BLOCK)


@triton.jit
def _load_rows(ptr, start, first, n, h, stride_t, stride_h, D: tl.constexpr, C: tl.constexpr):
    """Rows ``first..n-1`` of a chunk (``[C, D]`` fp32, row ``r`` at token ``start + r - first``
    of head ``h``); other rows exact zeros."""
    rows = tl.arange(0, C)
    cols = tl.arange(0, D)
    present = (rows >= first) & (rows < n)
    ptrs = ptr + (start + rows - first).to(tl.int64)[:, None] * stride_t + h * stride_h + cols[None, :]
    return tl.load(ptrs, mask=present[:, None], other=0.0).to(tl.float32)


@triton.jit
def _load_gates(ptr, start, n, h, stride_t, C: tl.constexpr):
    rows = tl.arange(0, C)
    return tl.load(ptr + (start + rows).to(tl.int64) * stride_t + h, mask=rows < n, other=0.0).to(tl.float32)


@triton.jit
def _row_norms(x, LOG_D: tl.constexpr):
    """``sqrt(sum(x * x) + 1e-6)`` of each row of ``x`` (the l2 norm's divisor)."""
    return tl.sqrt_rn(row_sum_halves(x * x, LOG_D, False) + 1e-6)


@triton.jit
def _l2norm(x, L2NORM: tl.constexpr, LOG_D: tl.constexpr):
    if L2NORM:
        x = x / _row_norms(x, LOG_D)[:, None]
    return x


@triton.jit
def _gate_cum(g_ptr, start, n, h, stride_gt, C: tl.constexpr, LOG_C: tl.constexpr):
    """A chunk's ``G``: the prefix sums of ``g`` (``[C]``)."""
    rows = tl.arange(0, C)
    g = _load_gates(g_ptr, start, n, h, stride_gt, C)
    return row_sum_halves(tl.where(rows[None, :] <= rows[:, None], g[None, :], 0.0), LOG_C, False)


@triton.jit
def _pair_decay(cum, C: tl.constexpr):
    """``decay[i, j] = exp(G_i - G_j)`` (``j <= i``, else 0) ``[C, C]`` from ``G``."""
    rows = tl.arange(0, C)
    lower = rows[None, :] <= rows[:, None]
    return tl.where(lower, tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0)), 0.0)


@triton.jit
def _keys_decay(k_ptr, g_ptr, start, n, h, hk, stride_kt, stride_kh, stride_gt,
                C: tl.constexpr, DK: tl.constexpr, LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """A chunk's normalised keys ``k``, ``G`` (prefix sums of ``g``) and ``decay[i, j] = exp(G_i -
    G_j)`` (``j <= i``, else 0)."""
    k = _l2norm(_load_rows(k_ptr, start, 0, n, hk, stride_kt, stride_kh, DK, C), L2NORM, LOG_DK)
    cum = _gate_cum(g_ptr, start, n, h, stride_gt, C, LOG_C)
    return k, cum, _pair_decay(cum, C)


@triton.jit
def _chunk_lower(k_ptr, g_ptr, b_ptr, start, n, h, hk, stride_kt, stride_kh, stride_gt, stride_bt,
                 C: tl.constexpr, DK: tl.constexpr, LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """A chunk's keys, gates and betas up to the solve: the normalised keys ``k``, ``G`` (prefix sums
    of ``g``), ``beta``, ``decay[i, j] = exp(G_i - G_j)`` (``j <= i``, else 0), ``k beta`` and
    ``L = strict_lower((k beta) k^T * decay)``."""
    rows = tl.arange(0, C)
    k, cum, decay = _keys_decay(k_ptr, g_ptr, start, n, h, hk, stride_kt, stride_kh, stride_gt, C, DK, LOG_C, LOG_DK,
                                L2NORM)
    beta = _load_gates(b_ptr, start, n, h, stride_bt, C)
    strict = rows[None, :] < rows[:, None]
    k_beta = k * beta[:, None]
    lmat = tl.where(strict, tl.dot(k_beta, tl.trans(k), input_precision="tf32x3") * decay, 0.0)
    return k, cum, beta, decay, k_beta, lmat


@triton.jit
def _diagonal_step(ldiag, dinv, eye, sel):
    """Forward substitution's step for the rows `sel` (row ``r`` of every 16-row block):
    ``e_r - L[r, :] D^-1`` from the rows ``< r`` of ``dinv`` (``I`` on the others); the other rows
    of ``dinv`` kept."""
    return tl.where(sel[:, None], eye - tl.dot(tl.where(sel[:, None], ldiag, 0.0), dinv, input_precision="tf32x3"),
                    dinv)


@triton.jit
def _block_row_step(lmat, dinv, t, blk, b):
    """Block row `b` of ``T``: ``T_b -= D_b^-1 (L_b,<b T)`` (exact zero products on the other rows)."""
    lower_b = tl.where((blk == b)[:, None] & (blk[None, :] < b), lmat, 0.0)
    return t - tl.dot(dinv, tl.dot(lower_b, t, input_precision="tf32x3"), input_precision="tf32x3")


@triton.jit
def _keys_w(t, k_beta, cum):
    """``w = T (k beta exp(G))``."""
    return tl.dot(t, k_beta * tl.exp(cum)[:, None], input_precision="tf32x3")


@triton.jit
def _solve(lmat, C: tl.constexpr):
    """``T = (I + L)^-1`` by 16-row blocks: the diagonal blocks' inverses by forward substitution
    (row r of every block at once), then block rows b = 1, 2, ...: ``T_b -= D_b^-1 (L_b,<b T)``."""
    rows = tl.arange(0, C)
    blk = rows // SOLVE_BLOCK
    same = blk[:, None] == blk[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    ldiag = tl.where(same, lmat, 0.0)
    dinv = eye
    for r in range(1, SOLVE_BLOCK):
        dinv = _diagonal_step(ldiag, dinv, eye, (rows % SOLVE_BLOCK) == r)
    t = dinv
    for b in range(1, C // SOLVE_BLOCK):
        t = _block_row_step(lmat, dinv, t, blk, b)
    return t


@triton.jit
def _load_state(ptr, index, h, vb, stride_s, stride_sh, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """``[DK, BV]`` columns ``vb * BV ..`` of state ``index`` (head `h`); zeros where ``index < 0``."""
    rk = tl.arange(0, DK)
    cv = vb * BV + tl.arange(0, BV)
    ptrs = ptr + index.to(tl.int64) * stride_s + h * stride_sh + rk[:, None] * DV + cv[None, :]
    return tl.load(ptrs, mask=(index >= 0) & (rk[:, None] < DK), other=0.0)


@triton.jit
def _store_state(ptr, index, h, vb, s, stride_s, stride_sh, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    rk = tl.arange(0, DK)
    cv = vb * BV + tl.arange(0, BV)
    tl.store(ptr + index.to(tl.int64) * stride_s + h * stride_sh + rk[:, None] * DV + cv[None, :], s)


@triton.jit
def fold_prep_kernel(k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, kd_ptr, decay_ptr, t_ptr, start_ptr, n_rows_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                     stride_wj, stride_wh, stride_uj, stride_uh,
                     GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                     LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """One chunk (``n`` rows from token ``start``), one head: ``w`` and the keys decayed to the
    chunk's last row ``kd = k exp(G_last - G)`` (``[C, DK]``), ``u = T (v beta)`` (``[C, DV]``, value
    block by value block) and ``exp(G_last)``, all fp32, for `fold_kernel`, and ``T`` (``[C, C]``
    at ``t_ptr + (j * heads + h) * C * C``) for the backward."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    start = tl.load(start_ptr + j)
    n = tl.load(n_rows_ptr + j)
    rows = tl.arange(0, C)
    k, cum, beta, decay, k_beta, lmat = _chunk_lower(k_ptr, g_ptr, b_ptr, start, n, h, hk, stride_kt, stride_kh,
                                                     stride_gt, stride_bt, C, DK, LOG_C, LOG_DK, L2NORM)
    last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)  # G of the tile's last row (absent rows add g = 0)
    at = rows[:, None] * DK + tl.arange(0, DK)[None, :]
    # kd and the decay before the solve, and the keys loaded again after it: nothing [C, DK] is
    # held across the solve's chain of products (sm_90: 3.9 KB of spills a thread, 11.8 with k held)
    tl.store(kd_ptr + j.to(tl.int64) * stride_wj + h * stride_wh + at, k * tl.exp(last - cum)[:, None])
    tl.store(decay_ptr + j.to(tl.int64) * tl.num_programs(1) + h, tl.exp(last))
    t = _solve(lmat, C)
    k = _l2norm(_load_rows(k_ptr, start, 0, n, hk, stride_kt, stride_kh, DK, C), L2NORM, LOG_DK)
    tl.store(w_ptr + j.to(tl.int64) * stride_wj + h * stride_wh + at, _keys_w(t, k * beta[:, None], cum))
    tl.store(t_ptr + (j.to(tl.int64) * tl.num_programs(1) + h) * C * C + rows[:, None] * C + rows[None, :], t)
    for vb in tl.static_range(DV // BV):
        v = _load_rows(v_ptr + vb * BV, start, 0, n, h, stride_vt, stride_vh, BV, C)
        u = tl.dot(t, v * beta[:, None], input_precision="tf32x3")
        cv = vb * BV + tl.arange(0, BV)
        tl.store(u_ptr + j.to(tl.int64) * stride_uj + h * stride_uh + rows[:, None] * DV + cv[None, :], u)


@triton.jit
def fold_kernel(w_ptr, u_ptr, kd_ptr, decay_ptr, state_in_ptr, state_out_ptr,
                prep_ptr, length_ptr, state_index_ptr, out_index_ptr,
                stride_wj, stride_wh, stride_uj, stride_uh, stride_si, stride_sih, stride_so, stride_soh,
                C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr):
    """One run of consecutive chunks of one sequence (``length`` rows; its chunks prepared by
    `fold_prep_kernel` at ``prep .. prep + chunks - 1``), one head, one value block: from state
    ``state_index`` (zeros if < 0), the state after each chunk goes to ``state_out[out_index + c]``.
    Every chunk is the same loop body, so a run folded in one call and the same chunks folded one
    call each give the same bits."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    prep = tl.load(prep_ptr + seq)
    length = tl.load(length_ptr + seq)
    out_index = tl.load(out_index_ptr + seq)
    s = _load_state(state_in_ptr, tl.load(state_index_ptr + seq), h, vb, stride_si, stride_sih, DK, DV, BV)
    rows = tl.arange(0, C)
    at = rows[:, None] * DK + tl.arange(0, DK)[None, :]
    at_u = rows[:, None] * DV + (vb * BV + tl.arange(0, BV))[None, :]
    for c in range(0, tl.cdiv(length, C)):
        j = (prep + c).to(tl.int64)
        w = tl.load(w_ptr + j * stride_wj + h * stride_wh + at)
        kd = tl.load(kd_ptr + j * stride_wj + h * stride_wh + at)
        u = tl.load(u_ptr + j * stride_uj + h * stride_uh + at_u)
        v_new = u - tl.dot(w, s, input_precision="tf32x3")
        s = s * tl.load(decay_ptr + j * tl.num_programs(1) + h) + tl.dot(tl.trans(kd), v_new, input_precision="tf32x3")
        _store_state(state_out_ptr, out_index + c, h, vb, s, stride_so, stride_soh, DK, DV, BV)


# Public names of the helpers the backward kernels share (`gated_delta_backward_triton`), beside the
# private ones the forward's kernels call.
keys_decay, l2norm_rows, load_gates, load_rows, load_state, store_state = (_keys_decay, _l2norm, _load_gates, _load_rows,
                                                                          _load_state, _store_state)
gate_cum, pair_decay, row_norms = _gate_cum, _pair_decay, _row_norms
