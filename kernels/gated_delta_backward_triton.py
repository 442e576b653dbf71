"""The gated delta rule's Triton backward: the formulas of `gated_delta_backward_reference` (its
docstring derives them; docs/design.md rule 8, section 6b), in seven launches after the fold.

The fold (`gated_delta_triton.fold_prep_kernel`) has already solved every chunk: ``T``, ``w``, the
keys decayed to the chunk's end ``kd = k exp(G_last - G)``, ``u = T (v beta)`` and ``exp(G_last)``
are in memory (`gated_delta_launch.FoldChunks`), and nothing below solves again.

- `query_prep_kernel` (one program a chunk and head, all in parallel): ``P = lower(q k^T *
  decay)``, ``P^T dO`` and what the chunk adds to the state gradient whatever comes after it, ``X
  = (q exp(G))^T dO - w^T P^T dO``.
- `state_grad_kernel` (one program a value block of one head of one sequence, the state gradient
  of the block in registers): from the last chunk to the first, two products a chunk,
  ``dS = X + exp(G_last) dS' - w^T (kd dS')``; the gradient of every chunk's boundary state.
- `value_grad_kernel` (a chunk and head): ``v_new = u - w S`` and ``d_new = P^T dO + kd dS'``
  value block by value block (kept for the next launch), ``dv``, the ``[C, C]`` sums ``dP`` and
  ``dT`` and the value side of ``dbeta``.
- `key_sums_kernel` (a chunk and head): the ``[C, dk]`` sums over the value blocks, ``dO S^T``,
  ``v_new dS'^T`` and ``-d_new S^T``.
- `pair_grad_kernel` (a chunk and head): through ``T`` and the pair decays, ``M_L``, ``M_P`` and the
  pairs' part of ``dG``.
- `key_beta_grad_kernel` (a chunk and head): the gradient of ``k beta``, ``w``'s part of ``dG``
  and the key side of ``dbeta``. The two take the keys in column parts (`key_parts`).
- `key_grad_kernel` (a chunk and head): ``dq``, ``dk`` (at the value head, through the l2 norm)
  and ``dg``.

Split this way, no program holds every accumulator beside the key tiles: ptxas serialises no
wgmma, and each launch spills 0.1-3.9 KB a thread against the 35 KB of one kernel holding
everything (docs/design.md section 6b). The per-chunk tensors between launches are fp32 in
memory. No atomics: every output element is written by one program, every sum has one order
fixed by the code (a ``tl.sum`` over a tile, the value blocks one after another, the chunks in
reverse), so the same inputs give the same bits run to run. The dots run in each launch's
``DOT`` precision (`gated_delta_backward.dot_precision`): ``tf32`` where the inputs are 16-bit,
``tf32x3`` (as the fold's) where any is fp32.
"""

from __future__ import annotations

from ._triton import tl, triton
from .gated_delta_triton import (gate_cum, keys_decay, l2norm_rows, load_gates, load_rows, load_state, pair_decay,
                                 row_norms, store_state)
from .row_sum import row_sum_halves

WARPS = 8  # every launch's (`gated_delta_launch.SMALL_HEAD_WARPS` where dk or dv is 16)
CHUNK_GRAD_BV = 32  # value columns a chunk program's step takes
CHUNK_GRAD_STAGES = 1  # its value-block loop unpipelined: pipelined, value_grad_kernel asked 304 KB of shared memory
STATE_GRAD_BV = 32  # value columns a state_grad_kernel program carries: 4 programs a head of 128
STATE_GRAD_STAGES = 2


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    return tl.dot(a, b, input_precision=DOT)


@triton.jit
def _tile_ptrs(ptr, j, h, heads, col, R: tl.constexpr, W: tl.constexpr, ROW: tl.constexpr):
    """Pointers to rows ``0..R-1``, columns ``col..col+W-1`` of chunk `j`'s ``[R, ROW]`` matrix of
    head `h` in a contiguous ``[N, heads, R, ROW]`` per-chunk tensor."""
    base = ptr + (j.to(tl.int64) * heads + h) * (R * ROW)
    return base + tl.arange(0, R)[:, None] * ROW + (col + tl.arange(0, W))[None, :]


@triton.jit
def _query(q_ptr, start, n, hk, stride_qt, stride_qh, scale, C: tl.constexpr, DK: tl.constexpr,
           LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """The chunk's normalised, scaled queries ``[C, DK]``."""
    return l2norm_rows(load_rows(q_ptr, start, 0, n, hk, stride_qt, stride_qh, DK, C), L2NORM, LOG_DK) * scale


@triton.jit
def _chunk_program(kv_start_ptr, n_rows_ptr):
    """A chunk program's chunk `j`, head `h`, the heads of the launch and the chunk's first token
    and present rows."""
    j = tl.program_id(0)
    return j, tl.program_id(1), tl.num_programs(1), tl.load(kv_start_ptr + j), tl.load(n_rows_ptr + j)


@triton.jit
def _keys_query(q_ptr, k_ptr, g_ptr, start, n, h, hk, stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, scale,
                C: tl.constexpr, DK: tl.constexpr, LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """The chunk's normalised keys, ``G``, the pair decays and the normalised, scaled queries."""
    k, cum, decay = keys_decay(k_ptr, g_ptr, start, n, h, hk, stride_kt, stride_kh, stride_gt, C, DK, LOG_C, LOG_DK,
                               L2NORM)
    return k, cum, decay, _query(q_ptr, start, n, hk, stride_qt, stride_qh, scale, C, DK, LOG_DK, L2NORM)


@triton.jit
def query_prep_kernel(q_ptr, k_ptr, g_ptr, do_ptr, w_ptr, p_ptr, pd_ptr, x_ptr, kv_start_ptr, n_rows_ptr,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_dot, stride_doh, scale,
                      GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                      LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`: ``P`` ``[C, C]``, ``P^T dO`` ``[C, DV]`` and ``X`` ``[DK, DV]``."""
    j, h, heads, start, n = _chunk_program(kv_start_ptr, n_rows_ptr)
    rows = tl.arange(0, C)
    k, cum, decay, q = _keys_query(q_ptr, k_ptr, g_ptr, start, n, h, h // GROUP, stride_qt, stride_qh, stride_kt,
                                   stride_kh, stride_gt, scale, C, DK, LOG_C, LOG_DK, L2NORM)
    p = tl.where(rows[None, :] <= rows[:, None], _dot(q, tl.trans(k), DOT) * decay, 0.0)
    tl.store(_tile_ptrs(p_ptr, j, h, heads, 0, C, C, C), p)
    q_decayed = q * tl.exp(cum)[:, None]
    w = tl.load(_tile_ptrs(w_ptr, j, h, heads, 0, C, DK, DK))
    for vb in range(DV // BV):
        d_out = load_rows(do_ptr + vb * BV, start, 0, n, h, stride_dot, stride_doh, BV, C)
        pd = _dot(tl.trans(p), d_out, DOT)
        tl.store(_tile_ptrs(pd_ptr, j, h, heads, vb * BV, C, BV, DV), pd)
        x = _dot(tl.trans(q_decayed), d_out, DOT) - _dot(tl.trans(w), pd, DOT)
        tl.store(_tile_ptrs(x_ptr, j, h, heads, vb * BV, DK, BV, DV), x)


@triton.jit
def state_grad_kernel(x_ptr, w_ptr, kd_ptr, decay_ptr, dstate_ptr, first_ptr, length_ptr, base_ptr,
                      stride_s, stride_sh,
                      C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """One sequence (``length`` rows, its chunks at ``first ..`` of the per-chunk tensors), one head,
    one value block: from the gradient of its final state at ``dstate[base + chunks]``, the
    gradient of the state at the start of chunk ``c`` goes to ``dstate[base + c]``, ``c = chunks -
    1, .., 0``."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    heads = tl.num_programs(1)
    first = tl.load(first_ptr + seq)
    base = tl.load(base_ptr + seq)
    chunks = tl.cdiv(tl.load(length_ptr + seq), C)
    ds = load_state(dstate_ptr, base + chunks, h, vb, stride_s, stride_sh, DK, DV, BV)
    for i in range(0, chunks):
        c = chunks - 1 - i
        j = first + c
        w = tl.load(_tile_ptrs(w_ptr, j, h, heads, 0, C, DK, DK))
        kd = tl.load(_tile_ptrs(kd_ptr, j, h, heads, 0, C, DK, DK))
        x = tl.load(_tile_ptrs(x_ptr, j, h, heads, vb * BV, DK, BV, DV))
        total_decay = tl.load(decay_ptr + j.to(tl.int64) * heads + h)
        ds = x + ds * total_decay - _dot(tl.trans(w), _dot(kd, ds, DOT), DOT)
        store_state(dstate_ptr, base + c, h, vb, ds, stride_s, stride_sh, DK, DV, BV)


@triton.jit
def value_grad_kernel(v_ptr, b_ptr, do_ptr, state_ptr, dstate_ptr, t_ptr, w_ptr, kd_ptr, u_ptr, pd_ptr,
                      vnew_ptr, dnew_ptr, dp_ptr, dt_ptr, dsd_ptr, dv_ptr, db_ptr, kv_start_ptr, n_rows_ptr,
                      state_index_ptr, stride_vt, stride_vh, stride_bt, stride_dot, stride_doh, stride_s, stride_sh,
                      stride_dvt, stride_dvh, stride_dbt,
                      C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`, from its boundary state ``state[index]`` and the next one's gradient
    ``dstate[index + 1]``: ``v_new``, ``d_new`` ``[C, DV]`` (kept), ``dv`` (rows ``< n``), the
    sums ``dP``, ``dT`` ``[C, C]``, the value side of ``dbeta`` (in `db`) and ``sum(dS' * S)``."""
    j, h, heads, start, n = _chunk_program(kv_start_ptr, n_rows_ptr)
    index = tl.load(state_index_ptr + j)
    rows = tl.arange(0, C)
    beta = load_gates(b_ptr, start, n, h, stride_bt, C)
    t = tl.load(_tile_ptrs(t_ptr, j, h, heads, 0, C, C, C))
    w = tl.load(_tile_ptrs(w_ptr, j, h, heads, 0, C, DK, DK))
    kd = tl.load(_tile_ptrs(kd_ptr, j, h, heads, 0, C, DK, DK))
    d_p = tl.zeros((C, C), dtype=tl.float32)
    d_tmat = tl.zeros((C, C), dtype=tl.float32)
    d_beta = tl.zeros((C,), dtype=tl.float32)
    d_state_decay = 0.0
    for vb in range(DV // BV):
        s = load_state(state_ptr, index, h, vb, stride_s, stride_sh, DK, DV, BV)
        d_end = load_state(dstate_ptr, index + 1, h, vb, stride_s, stride_sh, DK, DV, BV)
        v = load_rows(v_ptr + vb * BV, start, 0, n, h, stride_vt, stride_vh, BV, C)
        d_out = load_rows(do_ptr + vb * BV, start, 0, n, h, stride_dot, stride_doh, BV, C)
        v_new = tl.load(_tile_ptrs(u_ptr, j, h, heads, vb * BV, C, BV, DV)) - _dot(w, s, DOT)
        d_new = tl.load(_tile_ptrs(pd_ptr, j, h, heads, vb * BV, C, BV, DV)) + _dot(kd, d_end, DOT)
        tl.store(_tile_ptrs(vnew_ptr, j, h, heads, vb * BV, C, BV, DV), v_new)
        tl.store(_tile_ptrs(dnew_ptr, j, h, heads, vb * BV, C, BV, DV), d_new)
        d_p += _dot(d_out, tl.trans(v_new), DOT)
        d_tmat += _dot(d_new, tl.trans(v * beta[:, None]), DOT)
        d_v_beta = _dot(tl.trans(t), d_new, DOT)
        dv_ptrs = dv_ptr + (start + rows).to(tl.int64)[:, None] * stride_dvt + h * stride_dvh + vb * BV
        tl.store(dv_ptrs + tl.arange(0, BV)[None, :], d_v_beta * beta[:, None], mask=(rows < n)[:, None])
        d_beta += tl.sum(d_v_beta * v, axis=1)
        d_state_decay += tl.sum(tl.sum(d_end * s, axis=1), axis=0)
    tl.store(_tile_ptrs(dp_ptr, j, h, heads, 0, C, C, C), d_p)
    tl.store(_tile_ptrs(dt_ptr, j, h, heads, 0, C, C, C), d_tmat)
    tl.store(db_ptr + (start + rows).to(tl.int64) * stride_dbt + h, d_beta, mask=rows < n)
    tl.store(dsd_ptr + j.to(tl.int64) * heads + h, d_state_decay)


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
def key_sums_kernel(do_ptr, state_ptr, dstate_ptr, vnew_ptr, dnew_ptr, dqd_ptr, dtail_ptr, dw_ptr, kv_start_ptr,
                    n_rows_ptr, state_index_ptr, stride_dot, stride_doh, stride_s, stride_sh,
                    C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`: the ``[C, DK]`` sums over the value blocks ``dO S^T``, ``v_new dS'^T``
    and ``-d_new S^T``."""
    j, h, heads, start, n = _chunk_program(kv_start_ptr, n_rows_ptr)
    index = tl.load(state_index_ptr + j)
    d_q_decayed = tl.zeros((C, DK), dtype=tl.float32)
    d_tail = tl.zeros((C, DK), dtype=tl.float32)
    d_w = tl.zeros((C, DK), dtype=tl.float32)
    for vb in range(DV // BV):
        s = load_state(state_ptr, index, h, vb, stride_s, stride_sh, DK, DV, BV)
        d_end = load_state(dstate_ptr, index + 1, h, vb, stride_s, stride_sh, DK, DV, BV)
        d_out = load_rows(do_ptr + vb * BV, start, 0, n, h, stride_dot, stride_doh, BV, C)
        v_new = tl.load(_tile_ptrs(vnew_ptr, j, h, heads, vb * BV, C, BV, DV))
        d_new = tl.load(_tile_ptrs(dnew_ptr, j, h, heads, vb * BV, C, BV, DV))
        d_q_decayed += _dot(d_out, tl.trans(s), DOT)
        d_tail += _dot(v_new, tl.trans(d_end), DOT)
        d_w -= _dot(d_new, tl.trans(s), DOT)
    tl.store(_tile_ptrs(dqd_ptr, j, h, heads, 0, C, DK, DK), d_q_decayed)
    tl.store(_tile_ptrs(dtail_ptr, j, h, heads, 0, C, DK, DK), d_tail)
    tl.store(_tile_ptrs(dw_ptr, j, h, heads, 0, C, DK, DK), d_w)


def key_parts(dk: int) -> int:
    """Column parts `pair_grad_kernel` and `key_beta_grad_kernel` take the ``[C, dk]`` tiles in:
    four, as long as a part keeps a dot's 16 columns (two at dk 32, one at 16). At Qwen3.5's heads
    (sm_90) four parts spill 1.8 KB and 84 bytes a thread in the two kernels, two parts 4.4 KB and
    240 bytes."""
    return 4 if dk >= 64 else 2 if dk >= 32 else 1


@triton.jit
def _key_parts_program(kv_start_ptr, n_rows_ptr, k_ptr, g_ptr, b_ptr, stride_kt, stride_kh, stride_gt, stride_bt,
                       GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, LOG_C: tl.constexpr,
                       LOG_DK: tl.constexpr):
    """A chunk program over key parts: `_chunk_program`'s chunk `j`, head `h`, heads, first token
    and rows, then the key head, the chunk's key rows' `row_norms` (whole rows, for `_key_part`),
    ``G`` and ``beta``."""
    j, h, heads, start, n = _chunk_program(kv_start_ptr, n_rows_ptr)
    hk = h // GROUP
    norms = row_norms(load_rows(k_ptr, start, 0, n, hk, stride_kt, stride_kh, DK, C), LOG_DK)
    cum = gate_cum(g_ptr, start, n, h, stride_gt, C, LOG_C)
    return j, h, heads, start, n, hk, norms, cum, load_gates(b_ptr, start, n, h, stride_bt, C)


@triton.jit
def _key_part(k_ptr, start, n, hk, stride_kt, stride_kh, norms, col, L2NORM: tl.constexpr, KW: tl.constexpr,
              C: tl.constexpr):
    """Columns ``col..col+KW-1`` of the chunk's normalised keys ``[C, KW]`` (`norms`: the full rows'
    `row_norms`): each element as `l2norm_rows` makes it."""
    k = load_rows(k_ptr + col, start, 0, n, hk, stride_kt, stride_kh, KW, C)
    if L2NORM:
        k = k / norms[:, None]
    return k


@triton.jit
def pair_grad_kernel(k_ptr, g_ptr, b_ptr, t_ptr, p_ptr, dp_ptr, dt_ptr, dw_ptr, ml_ptr, mp_ptr, dcum_ptr,
                     kv_start_ptr, n_rows_ptr, stride_kt, stride_kh, stride_gt, stride_bt,
                     GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, KEY_PARTS: tl.constexpr,
                     LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`: the gradients through ``T`` and ``P`` (`gated_delta_backward_reference.
    chunk_grads`), ``M_L = dL * decay`` and ``M_P = dP * decay`` ``[C, C]`` and the pairs' part of
    the gradient of ``G`` ``[C]``. ``dT`` and ``L`` sum products over dk, taken in `KEY_PARTS`
    column parts of the keys and ``dw`` (`key_parts`) so that no ``[C, dk]`` tile is held whole."""
    j, h, heads, start, n, hk, norms, cum, beta = _key_parts_program(
        kv_start_ptr, n_rows_ptr, k_ptr, g_ptr, b_ptr, stride_kt, stride_kh, stride_gt, stride_bt, GROUP, C, DK, LOG_C,
        LOG_DK)
    KW: tl.constexpr = DK // KEY_PARTS
    rows = tl.arange(0, C)
    decay = pair_decay(cum, C)
    exp_cum = tl.exp(cum)
    d_tmat = tl.load(_tile_ptrs(dt_ptr, j, h, heads, 0, C, C, C))
    lmat = tl.zeros((C, C), dtype=tl.float32)
    for part in tl.static_range(KEY_PARTS):
        k = _key_part(k_ptr, start, n, hk, stride_kt, stride_kh, norms, part * KW, L2NORM, KW, C)
        k_beta = k * beta[:, None]
        d_tmat += _dot(tl.load(_tile_ptrs(dw_ptr, j, h, heads, part * KW, C, KW, DK)),
                       tl.trans(k_beta * exp_cum[:, None]), DOT)
        lmat += _dot(k_beta, tl.trans(k), DOT)
    t = tl.load(_tile_ptrs(t_ptr, j, h, heads, 0, C, C, C))
    strict = rows[None, :] < rows[:, None]
    d_l = tl.where(strict, -_dot(tl.trans(t), _dot(d_tmat, tl.trans(t), DOT), DOT), 0.0)
    d_p = tl.where(rows[None, :] <= rows[:, None], tl.load(_tile_ptrs(dp_ptr, j, h, heads, 0, C, C, C)), 0.0)
    h_pairs = d_l * tl.where(strict, lmat * decay, 0.0) + d_p * tl.load(_tile_ptrs(p_ptr, j, h, heads, 0, C, C, C))
    tl.store(dcum_ptr + (j.to(tl.int64) * heads + h) * C + rows, tl.sum(h_pairs, axis=1) - tl.sum(h_pairs, axis=0))
    tl.store(_tile_ptrs(ml_ptr, j, h, heads, 0, C, C, C), d_l * decay)
    tl.store(_tile_ptrs(mp_ptr, j, h, heads, 0, C, C, C), d_p * decay)


@triton.jit
def key_beta_grad_kernel(k_ptr, g_ptr, b_ptr, t_ptr, dw_ptr, ml_ptr, dkb_ptr, dcum_ptr, db_ptr, kv_start_ptr,
                         n_rows_ptr, stride_kt, stride_kh, stride_gt, stride_bt, stride_dbt,
                         GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, KEY_PARTS: tl.constexpr,
                         LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`, from `pair_grad_kernel`'s ``M_L``: the gradient of ``k beta`` ``[C,
    DK]`` (``M_L k + (T^T dw) exp(G)``), ``w``'s part of the gradient of ``G`` (added to the pairs'
    in `dcum`) and ``k``'s part of ``dbeta`` (added to `value_grad_kernel`'s in `db`), in
    `KEY_PARTS` column parts."""
    j, h, heads, start, n, hk, norms, cum, beta = _key_parts_program(
        kv_start_ptr, n_rows_ptr, k_ptr, g_ptr, b_ptr, stride_kt, stride_kh, stride_gt, stride_bt, GROUP, C, DK, LOG_C,
        LOG_DK)
    KW: tl.constexpr = DK // KEY_PARTS
    rows = tl.arange(0, C)
    exp_cum = tl.exp(cum)
    t = tl.load(_tile_ptrs(t_ptr, j, h, heads, 0, C, C, C))
    m_l = tl.load(_tile_ptrs(ml_ptr, j, h, heads, 0, C, C, C))
    w_terms = tl.zeros((C,), dtype=tl.float32)
    d_beta = tl.zeros((C,), dtype=tl.float32)
    for part in tl.static_range(KEY_PARTS):
        k = _key_part(k_ptr, start, n, hk, stride_kt, stride_kh, norms, part * KW, L2NORM, KW, C)
        d_w_t = _dot(tl.trans(t), tl.load(_tile_ptrs(dw_ptr, j, h, heads, part * KW, C, KW, DK)), DOT)
        d_k_beta = _dot(m_l, k, DOT) + d_w_t * exp_cum[:, None]
        tl.store(_tile_ptrs(dkb_ptr, j, h, heads, part * KW, C, KW, DK), d_k_beta)
        w_terms += tl.sum(d_w_t * k * beta[:, None], axis=1)
        d_beta += tl.sum(d_k_beta * k, axis=1)
    d_cum = dcum_ptr + (j.to(tl.int64) * heads + h) * C + rows
    tl.store(d_cum, tl.load(d_cum) + w_terms * exp_cum)
    b_rows = db_ptr + (start + rows).to(tl.int64) * stride_dbt + h
    tl.store(b_rows, tl.load(b_rows, mask=rows < n, other=0.0) + d_beta, mask=rows < n)


@triton.jit
def key_grad_kernel(q_ptr, k_ptr, g_ptr, b_ptr, ml_ptr, mp_ptr, dkb_ptr, dcum_ptr, dsd_ptr, dqd_ptr, dtail_ptr,
                    dq_ptr, dk_ptr, dg_ptr, kv_start_ptr, n_rows_ptr,
                    stride_qt, stride_qh, stride_kt, stride_kh, stride_gt, stride_bt, stride_dkt, stride_dkh,
                    stride_dgt, scale,
                    GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr,
                    LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr, DOT: tl.constexpr):
    """Chunk `j`, head `h`, from `pair_grad_kernel`'s: dq, dk ``[T, Hv, dk]`` (one per value head,
    through the l2 norm) and dg ``[T, Hv]``, fp32, rows ``< n`` only."""
    j, h, heads, start, n = _chunk_program(kv_start_ptr, n_rows_ptr)
    hk = h // GROUP
    rows = tl.arange(0, C)
    k, cum, decay, q = _keys_query(q_ptr, k_ptr, g_ptr, start, n, h, hk, stride_qt, stride_qh, stride_kt, stride_kh,
                                   stride_gt, scale, C, DK, LOG_C, LOG_DK, L2NORM)
    beta = load_gates(b_ptr, start, n, h, stride_bt, C)
    exp_cum = tl.exp(cum)
    m_p = tl.load(_tile_ptrs(mp_ptr, j, h, heads, 0, C, C, C))
    d_q_decayed = tl.load(_tile_ptrs(dqd_ptr, j, h, heads, 0, C, DK, DK))
    d_qn = _dot(m_p, k, DOT) + d_q_decayed * exp_cum[:, None]
    d_cum = tl.load(dcum_ptr + (j.to(tl.int64) * heads + h) * C + rows) + tl.sum(d_q_decayed * q, axis=1) * exp_cum
    d_q = _l2norm_backward(q_ptr, start, n, hk, stride_qt, stride_qh, d_qn * scale, L2NORM, C, DK, LOG_DK)
    _store_rows(dq_ptr, start, n, h, d_q, stride_dkt, stride_dkh, C, DK)
    last = tl.sum(tl.where(rows == C - 1, cum, 0.0), axis=0)  # G of the tile's last row (absent rows add g = 0)
    exp_tail = tl.exp(last - cum)
    d_tail = tl.load(_tile_ptrs(dtail_ptr, j, h, heads, 0, C, DK, DK))
    m_l = tl.load(_tile_ptrs(ml_ptr, j, h, heads, 0, C, C, C))
    d_kn = (_dot(tl.trans(m_l), k * beta[:, None], DOT) + _dot(tl.trans(m_p), q, DOT)
            + tl.load(_tile_ptrs(dkb_ptr, j, h, heads, 0, C, DK, DK)) * beta[:, None] + d_tail * exp_tail[:, None])
    tail_terms = tl.sum(d_tail * k * exp_tail[:, None], axis=1)
    d_last = tl.sum(tail_terms, axis=0) + tl.exp(last) * tl.load(dsd_ptr + j.to(tl.int64) * heads + h)
    d_cum += tl.where(rows == C - 1, d_last, 0.0) - tail_terms
    d_g = row_sum_halves(tl.where(rows[None, :] >= rows[:, None], d_cum[None, :], 0.0), LOG_C, False)
    tl.store(dg_ptr + (start + rows).to(tl.int64) * stride_dgt + h, d_g, mask=rows < n)
    d_k = _l2norm_backward(k_ptr, start, n, hk, stride_kt, stride_kh, d_kn, L2NORM, C, DK, LOG_DK)
    _store_rows(dk_ptr, start, n, h, d_k, stride_dkt, stride_dkh, C, DK)
