"""A rollout decode token of the gated delta rule: row ``i`` of its chunk from the rows of ``T`` the
chunk keeps, bitwise the rows launch's row (docs/design.md section 6b, "Decode cost").

The rows launch (`gated_delta_triton.rows_kernel`) computes a decode token's row ``i`` by
recomputing its whole chunk: 15 dependent forward-substitution products and 6 block-row products
for ``T = (I + L)^-1`` alone. Row ``i`` of ``T`` needs only ``T``'s rows ``< i``, and those are
what the chunk's earlier rows computed: the step that computes a row keeps its row of ``T``
(fp32, ``C`` values a value head) beside its raw ``k, v, g, beta`` (`LinearStateCache.t_rows`).
`decode_kernel` then rebuilds, from the kept rows, every tile the rows launch of the chunk's first
``i + 1`` rows reads on its way to row ``i``, and runs the same products on them:

- ``L`` (one product: the chunk's rows are at hand), as the rows launch computes it;
- the diagonal blocks' inverses ``D^-1`` before forward substitution's step ``r = i % 16``: the
  kept rows ``< i`` of ``T`` restricted to their diagonal block where their offset in the block is
  ``< r`` (``T``'s diagonal blocks are ``D^-1`` exactly: the block rows subtract exact zero
  products there), ``I``'s rows elsewhere (rows ``>= i`` are absent: their substitution gives
  ``I``'s rows exactly); then step ``r`` itself, one product;
- ``T`` before block row ``b = i // 16``: the kept rows of the blocks ``< b``, ``D^-1`` from row
  ``b * 16`` on; then block row ``b``, two products. The result is the rows launch's whole ``T``
  (its other block rows change only by exact zero products);
- ``w``, ``v_new`` and the outputs by the rows launch's own code (`gated_delta_triton`'s helpers):
  the same ``[C, ...]`` tiles, so the same MMA instructions (tile shapes and warps decide them).

So every product is the rows launch's at the same shape on the same operands, and row ``i``'s
bits are the rows launch's: 5 dependent products to ``T`` instead of 22 (2 in block 0). A kept row of ``T``
equals the one any launch computes for that row (rows past it are exact zeros, the rows launch's
contract), so it does not matter which launch kept it. The program never writes a state: where row
``i`` completes its chunk (``i = C - 1``), the step's fold launch (`fold_prep_kernel`, `fold_kernel`:
the training forward's kernels) folds the chunk after this launch has read the boundary state
(`gated_delta_step`). A fold inside this program, on the same operands and the same products
written out again, did not give the fold launch's bits on sm_90 (H200: every output row and row of
``T`` equal, the folded state not), and a state has one kernel that advances it (docs/design.md section 6b).

`decode_reference` is the CPU twin: `gated_delta_reference.chunk_forward` with `decode_solve`
in place of the block solve, which takes the kept rows of ``T`` and computes row ``i`` by the
reference's own reductions (each over the width the block solve reduces over).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import gated_delta_reference as ref
from ._triton import require_triton, tl, triton
from .gated_delta_launch import (Shapes, boundary_states, check_triton_shapes, chunk_inputs, device_ints, expand_heads,
                                 gather_chunks, launch_warps, state_dtype, value_block)
from .gated_delta_triton import (ROWS_WARPS, SOLVE_BLOCK, block_row_step, chunk_lower, diagonal_step, keys_w,
                                 query_side, store_t_rows, value_block_outputs)

__all__ = ["DecodePlan", "decode_kernel", "decode_reference", "decode_solve", "launch_decode"]


@dataclass(frozen=True)
class DecodePlan:
    """One entry per decoding sequence (lists of ints, or int32 tensors on the device: a rollout
    step's plan, `gated_delta_step`)."""

    kv_start: list[int]  # row of the chunk's row 0 in k, v, g, beta and in the T pool
    row: list[int]  # the new row i (its k, v, g, beta at kv_start + i already); -1: no work
    q_start: list[int]  # its query's row in q, and its output's
    state_index: list[int]  # the boundary state (-1: zeros)
    t_out: list[int]  # row i of T goes to t_out + i of the T pool (-1: nowhere)


# ---------------------------------------------------------------------------------------------
# The kernel.


@triton.jit
def _decode_solve(t_ptr, start, i, h, lmat, stride_tt, stride_th, C: tl.constexpr):
    """The rows launch's ``T`` for the chunk's first ``i + 1`` rows, from the kept rows ``< i`` of
    ``T`` (``t[start + r, h]``) and `lmat`: forward substitution's step ``i % 16`` and block row
    ``i // 16``, on the tiles the rows launch reads there (the module docstring)."""
    rows = tl.arange(0, C)
    blk = rows // SOLVE_BLOCK
    offset = rows % SOLVE_BLOCK
    same = blk[:, None] == blk[None, :]
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    known = rows < i
    kept = tl.load(t_ptr + (start + rows).to(tl.int64)[:, None] * stride_tt + h * stride_th + rows[None, :],
                   mask=known[:, None], other=0.0)
    dinv = tl.where(same & known[:, None], kept, eye)  # D^-1's rows < i, I's rows from i
    r = i % SOLVE_BLOCK
    step = diagonal_step(tl.where(same, lmat, 0.0), tl.where((offset < r)[:, None], dinv, eye), eye, offset == r)
    dinv = tl.where((rows == i)[:, None], step, dinv)
    b = i // SOLVE_BLOCK
    t = dinv  # block 0: T's rows are D^-1's (the block rows subtract exact zero products there)
    if b > 0:
        t = block_row_step(lmat, dinv, tl.where((blk < b)[:, None], kept, dinv), blk, b)
    return t


@triton.jit
def decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t_ptr, state_ptr, out_ptr,
                  kv_start_ptr, row_ptr, q_start_ptr, state_index_ptr, t_out_ptr,
                  stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
                  stride_tt, stride_th, stride_s, stride_sh, stride_ot, stride_oh, scale,
                  GROUP: tl.constexpr, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  LOG_C: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr, BLOCKS: tl.constexpr):
    """Row ``i`` of one chunk, one head, `BLOCKS` value blocks (from ``program_id(2) * BLOCKS``):
    its output at ``out[q_start]`` and its row of ``T`` at ``t[t_out + i]``; the boundary state is
    only read."""
    seq = tl.program_id(0)
    h = tl.program_id(1)
    hk = h // GROUP
    i = tl.load(row_ptr + seq)
    if i < 0:  # a padding entry (kernels/gated_delta_step.py): exit at once
        return
    start = tl.load(kv_start_ptr + seq)
    q_start = tl.load(q_start_ptr + seq)
    index = tl.load(state_index_ptr + seq)
    n = i + 1
    k, cum, beta, decay, k_beta, lmat = chunk_lower(k_ptr, g_ptr, b_ptr, start, n, h, hk, stride_kt, stride_kh,
                                                    stride_gt, stride_bt, C, DK, LOG_C, LOG_DK, L2NORM)
    t = _decode_solve(t_ptr, start, i, h, lmat, stride_tt, stride_th, C)
    store_t_rows(t_ptr, tl.load(t_out_ptr + seq), i, n, h, t, stride_tt, stride_th, C)
    w = keys_w(t, k_beta, cum)
    q_decayed, attn = query_side(q_ptr, q_start, i, n, hk, stride_qt, stride_qh, k, cum, decay, scale, C, DK, LOG_DK,
                                 L2NORM)
    for j in tl.static_range(BLOCKS):
        vb = tl.program_id(2) * BLOCKS + j
        value_block_outputs(v_ptr, state_ptr, out_ptr, start, i, n, q_start, index, h, vb, t, w, beta, q_decayed, attn,
                            stride_vt, stride_vh, stride_s, stride_sh, stride_ot, stride_oh, C, DK, DV, BV)


# ---------------------------------------------------------------------------------------------
# The launch on both backends.


def _decode_triton(q, k, v, g, beta, t_cache, states, out, plan: DecodePlan, shapes: Shapes, chunk: int, scale: float,
                   l2norm: bool, split_values: bool = False) -> None:
    require_triton("gated_delta_decode")
    check_triton_shapes(shapes)
    if len(plan.row) == 0:
        return
    meta = [device_ints(x, k.device) for x in (plan.kv_start, plan.row, plan.q_start, plan.state_index, plan.t_out)]
    blocks = shapes.dv // value_block(shapes.dv)
    decode_kernel[(len(plan.row), shapes.hv, blocks if split_values else 1)](
        q, k, v, g, beta, t_cache, states, out, *meta,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        t_cache.stride(0), t_cache.stride(1), states.stride(0), states.stride(1), out.stride(0), out.stride(1), scale,
        GROUP=shapes.hv // shapes.hk, C=chunk, DK=shapes.dk, DV=shapes.dv, BV=value_block(shapes.dv),
        LOG_C=chunk.bit_length() - 1, LOG_DK=shapes.dk.bit_length() - 1, L2NORM=l2norm,
        BLOCKS=1 if split_values else blocks, num_warps=launch_warps(shapes, ROWS_WARPS))


def decode_solve(lower: torch.Tensor, kept: torch.Tensor, i: int) -> torch.Tensor:
    """`gated_delta_reference`'s block solve of ``lower`` (``L [.., C, C]`` of the chunk's first
    ``i + 1`` rows) for row ``i``, from the kept rows ``< i`` of ``T`` (`kept [.., C, C]`; its rows
    from ``i`` are not read): forward substitution's step ``i % 16`` over the block's 16 columns,
    then ``T_i,<b = -(D_b^-1)_i (L_b,<b T_<b,<b)``, each output one reduction as the block solve
    reduces it. Rows ``< i`` of the result are `kept`'s, row ``i`` the block solve's, later rows zero."""
    c = lower.shape[-1]
    bs = min(ref.SOLVE_BLOCK, c)
    b, r = divmod(i, bs)
    block, before = slice(b * bs, (b + 1) * bs), slice(0, b * bs)
    eye = torch.eye(bs, dtype=lower.dtype, device=lower.device)
    dinv = eye.expand(lower[..., block, block].shape).clone()  # the block's D^-1 as step r reads it
    dinv[..., :r, :] = kept[..., b * bs:i, block]
    dinv[..., r, :] = eye[r] - ref.exact_mm(lower[..., i:i + 1, block], dinv.transpose(-1, -2))[..., 0, :]
    t = torch.zeros_like(lower)
    t[..., :i, :] = kept[..., :i, :]
    t[..., i, block] = dinv[..., r, :]
    if b:
        x = ref.exact_mm(lower[..., block, before], kept[..., before, before].transpose(-1, -2))  # L_b,<b T_<b,<b
        t[..., i, before] = -ref.exact_mm(dinv[..., r:r + 1, :], x.transpose(-1, -2))[..., 0, :]
    return t


def decode_reference(q, k, v, g, beta, t_cache, states, out, plan: DecodePlan, shapes: Shapes, chunk: int,
                     scale: float, l2norm: bool) -> None:
    """The CPU launch: each entry's chunk (rows ``0..i`` from ``kv_start``, zero-padded) through
    `gated_delta_reference.chunk_forward` with `decode_solve`; host lists."""
    compute = state_dtype(k)
    for b, i in enumerate(plan.row):
        if i < 0:
            continue
        start, q_start = plan.kv_start[b], plan.q_start[b]
        kk, vv, gg, bb = chunk_inputs([start], [i + 1], k, v, g, beta, shapes, chunk, compute)
        qq = expand_heads(gather_chunks(q, [q_start], [i], [i + 1], chunk).to(compute), shapes.hv)
        kept = t_cache[start:start + chunk].transpose(0, 1).to(compute)  # [Hv, C, C]; rows < i read
        solved: list[torch.Tensor] = []
        o, _ = ref.chunk_forward(qq, kk, vv, gg, bb, boundary_states(states, [plan.state_index[b]], compute), ref.EXACT,
                                 scale=scale, use_qk_l2norm=l2norm, fold=False,
                                 solve=lambda lower: solved.append(decode_solve(lower, kept, i)) or solved[-1])
        out[q_start] = o[0, :, i].to(out.dtype)
        if plan.t_out[b] >= 0:
            t_cache[plan.t_out[b] + i] = solved[0][0, :, i].to(t_cache.dtype)


def launch_decode(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  t_cache: torch.Tensor, states: torch.Tensor, out: torch.Tensor, plan: DecodePlan, shapes: Shapes,
                  chunk: int, scale: float, l2norm: bool, *, split_values: bool = False) -> None:
    """Row ``plan.row[b]`` of each entry's chunk on `backend` (``"triton"`` or ``"reference"``):
    rows ``0..i`` of the chunk in k, v, g, beta from ``kv_start`` (row i written already), q's row
    at ``q_start``, the kept rows of ``T`` in `t_cache` (``[rows, Hv, C]``, state dtype) from
    ``kv_start``, the boundary state in `states` (``[S, Hv, dk, dv]``). Writes the output row of
    `out` (``[T, Hv, dv]``) and row i of ``T``; `states` are only read (a completed chunk is the
    fold launch's: `gated_delta_launch.launch_fold`).
    `split_values` (Triton): one program a value block of a head (its key side computed again in
    each: twice the programs, fewer registers held across the blocks), the same bits; the step
    takes one program a head (`benchmarks/gated_delta.py` times both)."""
    if backend == "triton":
        _decode_triton(q, k, v, g, beta, t_cache, states, out, plan, shapes, chunk, scale, l2norm, split_values)
    else:
        decode_reference(q, k, v, g, beta, t_cache, states, out, plan, shapes, chunk, scale, l2norm)
