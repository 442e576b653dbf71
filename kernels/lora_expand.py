"""The LoRA expand (`lora.lora_add`'s step 2 and 3, docs/design.md section 8): ``out = base + (u
B^T + bias) * scaling`` per member of a stacked group, u the shrink's partials added in chunk
order inside the launch. Element-wise: every output element's operations are the same whatever
tile holds it (`ExpandTile`), so the tile is a speed choice only. The arithmetic, the partials'
sum and the training forward's kept u are described in `lora.py`'s docstring; the experts'
expand (`moe_lora.py`) shares `u_tile_kept` and `rank_column`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import require_triton, tl, triton
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

EXPAND_BLOCK_M = 32
EXPAND_BLOCK_N = 128
EXPAND_RANK_BLOCK = 16  # ranks whose u and B columns an expand program holds at once


@triton.jit
def u_tile(p_rows, row_ok, step, ranks, r, g, S):
    """Member g's u at `ranks` ``[BLOCK_M, RANK_BLOCK]`` (ranks past r zero): those columns of the
    shrink's `S` partials (`p_rows` the rows of ``p[0]``, `step` = T * R apart) added in chunk
    order, ``((p0 + p1) + p2) + ...`` in fp32, as `_lora_reduce_kernel` adds them. Unrolled by 4, so that four partials'
    loads are in flight at once (the additions keep their order)."""
    ptrs = p_rows[:, None] + g * r + ranks[None, :]
    mask = row_ok[:, None] & (ranks < r)[None, :]
    u = tl.load(ptrs, mask=mask, other=0.0)
    for _ in tl.range(1, S, loop_unroll_factor=4):
        ptrs += step
        u += tl.load(ptrs, mask=mask, other=0.0)
    return u


@triton.jit
def u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, r, g: tl.constexpr, S, WRITE_U: tl.constexpr):
    """`u_tile`, with `WRITE_U` also stored into ``u[rows, g*r + ranks]`` (the training forward's
    u for the backward) by the programs of the first N tile."""
    u = u_tile(p_rows, row_ok, step, ranks, r, g, S)
    if WRITE_U:
        keep = row_ok[:, None] & (ranks < r)[None, :] & (tl.program_id(1) == 0)
        tl.store(u_ptr + rows[:, None].to(tl.int64) * R + g * r + ranks[None, :], u, mask=keep)
    return u


@triton.jit
def rank_column(tile, ranks, j):
    """Column j of `tile` ``[rows, RANK_BLOCK]`` (`ranks` its columns) out of registers: the sum of that one value and zeros,
    which is the value itself but for -0.0, read as +0.0. The expand's products never see the
    difference: ``acc`` starts at +0.0 and a sum that is exactly zero rounds to +0.0, so ``acc``
    is never -0.0, and ``acc + (+/-0.0) * b`` is then ``acc`` (NaN and infinity pass through)."""
    return tl.sum(tl.where(ranks[None, :] == j, tile, 0.0), axis=1)


@triton.jit
def _member_of(col, n1, n2, n3):
    """The member whose columns hold column `col` (members 1..3 start at `n1`, `n2`, `n3`)."""
    return (col >= n1).to(tl.int32) + (col >= n2).to(tl.int32) + (col >= n3).to(tl.int32)


@triton.jit
def _ranks_one_member(acc, bt, u, ranks, first, r, RANK_BLOCK: tl.constexpr):
    """`acc` plus one rank block's products where every column of the tile is one member's, `u`
    that member's u tile: ``acc += u[:, j] * B[:, j]`` for the block's ranks j in order."""
    for j in range(first, tl.minimum(first + RANK_BLOCK, r)):
        acc += rank_column(u, ranks, j)[:, None] * rank_column(bt, ranks, j)[None, :]
    return acc


@triton.jit
def _ranks_any_members(acc, bt, u_ptr, p_rows, row_ok, step, rows, ranks, member, first, R, r, S,
                       G: tl.constexpr, WRITE_U: tl.constexpr, RANK_BLOCK: tl.constexpr):
    """`_ranks_one_member` where the tile's columns may be several members' (`member` per column):
    every member's u tile (stored too, with `WRITE_U`), and at each rank each column picks its
    member's u column."""
    u0 = u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, r, 0, S, WRITE_U)
    u1 = u0
    u2 = u0
    u3 = u0
    if G > 1:
        u1 = u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, r, 1, S, WRITE_U)
    if G > 2:
        u2 = u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, r, 2, S, WRITE_U)
    if G > 3:
        u3 = u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, r, 3, S, WRITE_U)
    for j in range(first, tl.minimum(first + RANK_BLOCK, r)):
        uj = tl.broadcast_to(rank_column(u0, ranks, j)[:, None], acc.shape)
        if G > 1:
            uj = tl.where(member[None, :] == 1, rank_column(u1, ranks, j)[:, None], uj)
        if G > 2:
            uj = tl.where(member[None, :] == 2, rank_column(u2, ranks, j)[:, None], uj)
        if G > 3:
            uj = tl.where(member[None, :] == 3, rank_column(u3, ranks, j)[:, None], uj)
        acc += uj * rank_column(bt, ranks, j)[None, :]
    return acc


@triton.jit(do_not_specialize=["T"])
def _lora_expand_kernel(base_ptr, p_ptr, b_ptr, bias_ptr, out_ptr, u_ptr, T, N, R, r, S,
                        stride_base, stride_out, stride_b, n1, n2, n3, s0, s1, s2, s3,
                        G: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_U: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``out = base + (u_g B^T (+ bias)) * s_g`` for the columns of member g, u the sum of the
    shrink's `S` partials ``p[S, T, R]`` in chunk order (S = 1: p is u itself); with `WRITE_U`
    the first N tile's programs also store u ``[T, R]`` (the backward's). Per block of
    `RANK_BLOCK` ranks, the program reads its members' u tiles and B's ``[BLOCK_N, RANK_BLOCK]``
    tile at once, then walks the block's ranks in order in registers (`rank_column`): no global
    load waits inside the rank loop. Outside the training forward, a tile inside one member's
    columns (every tile of Qwen3's groups, whose members are multiples of 128 wide) reads only
    that member's u tile and picks no member per rank (`_ranks_one_member`); the products and
    sums are the same either way."""
    wait_for_inputs(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < T, cols < N
    step = T.to(tl.int64) * R
    p_rows = p_ptr + rows.to(tl.int64) * R
    member = _member_of(cols, n1, n2, n3)
    m0 = _member_of(tl.program_id(1) * BLOCK_N, n1, n2, n3)
    one_member = m0 == _member_of(tl.minimum(tl.program_id(1) * BLOCK_N + BLOCK_N, N) - 1, n1, n2, n3)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, r, RANK_BLOCK):
        ranks = first + tl.arange(0, RANK_BLOCK)
        bt = tl.load(b_ptr + cols[:, None].to(tl.int64) * stride_b + ranks[None, :],
                     mask=col_ok[:, None] & (ranks < r)[None, :], other=0.0).to(tl.float32)
        if WRITE_U:  # the training forward: every member's u is stored by the first N tile
            acc = _ranks_any_members(acc, bt, u_ptr, p_rows, row_ok, step, rows, ranks, member, first, R, r, S,
                                     G, WRITE_U, RANK_BLOCK)
        elif one_member:
            acc = _ranks_one_member(acc, bt, u_tile(p_rows, row_ok, step, ranks, r, m0, S), ranks, first, r,
                                    RANK_BLOCK)
        else:
            acc = _ranks_any_members(acc, bt, u_ptr, p_rows, row_ok, step, rows, ranks, member, first, R, r, S,
                                     G, WRITE_U, RANK_BLOCK)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    scale = tl.where(member == 0, s0, tl.where(member == 1, s1, tl.where(member == 2, s2, s3)))
    mask = row_ok[:, None] & col_ok[None, :]
    base = tl.load(base_ptr + rows[:, None].to(tl.int64) * stride_base + cols[None, :], mask=mask, other=0.0)
    out = base.to(tl.float32) + acc * scale[None, :]
    tl.store(out_ptr + rows[:, None].to(tl.int64) * stride_out + cols[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask)


def _expand_args(sizes: tuple[int, ...], scalings: tuple[float, ...]) -> tuple[list[int], list[float]]:
    """Column starts of members 1..3 (past the end when absent) and the four scalings."""
    starts, col = [], 0
    for size in sizes[:-1]:
        col += size
        starts.append(col)
    big = 2 ** 31 - 1
    return starts + [big] * (3 - len(starts)), list(scalings) + [0.0] * (4 - len(scalings))


@dataclass(frozen=True)
class ExpandTile:
    """An expand launch's output tile and warps. Every tile gives the same bits (the expand is
    element-wise: docs/design.md section 8); the tile only sets how the work is cut."""

    block_m: int = EXPAND_BLOCK_M
    block_n: int = EXPAND_BLOCK_N
    warps: int = 4


#: Programs the decode tile aims at: with fewer, a 32-row step leaves most of the 132 SMs idle.
EXPAND_MIN_PROGRAMS = 96
SMALL_ROWS = 64  # steps of at most this many rows take `expand_tile`'s decode tiles
MID_ROWS = 512  # and steps of at most this many its per-member width


def expand_tile(rows: int, n: int, members: int) -> ExpandTile:
    """The expand's tile for `rows` x `n` outputs of a group of `members` (a speed choice only:
    every tile gives the same bits). Up to `SMALL_ROWS` rows (decode steps) the widest of 128, 64
    and 32 columns that still makes `EXPAND_MIN_PROGRAMS` programs; up to `MID_ROWS`, 128 columns
    for a stacked group (each program reads every member's u, so wider tiles share it) and 64
    for one member; the default tile above. H200, r 16, Qwen3-0.6B / 8B / 30B-A3B groups at 32
    and 256 rows (`benchmarks/lora_expand.py`, docs/performance.md section 10): 16.7 us a
    Qwen3-0.6B layer's four expands at 32 rows against 23.7 with the default tile, 88.1 against
    91.8 at Qwen3-8B and 256 rows."""
    if rows <= SMALL_ROWS:
        m_tiles = triton.cdiv(max(rows, 1), EXPAND_BLOCK_M)
        block_n = next((w for w in (128, 64) if m_tiles * triton.cdiv(n, w) >= EXPAND_MIN_PROGRAMS), 32)
        return ExpandTile(EXPAND_BLOCK_M, block_n, 4)
    if rows <= MID_ROWS:
        return ExpandTile(EXPAND_BLOCK_M, EXPAND_BLOCK_N if members > 1 else 64, 4)
    return ExpandTile()


def lora_expand_triton(base: torch.Tensor, partials: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None,
                       sizes: tuple[int, ...], scalings: tuple[float, ...], out: torch.Tensor,
                       u_out: torch.Tensor | None = None, tile: ExpandTile | None = None) -> torch.Tensor:
    """``out = base + (u B^T + bias) * scaling`` by the Triton kernel (`out` may be `base`), with
    u the shrink's partials ``[S, T, R]`` (`lora_partials_triton`) added in chunk order inside
    the kernel (a ``[1, T, R]`` u is taken as it is); `u_out` ``[T, R]`` fp32, when given,
    receives u (the training backward's). `tile`: the launch's tile (default `expand_tile`'s for
    the call's shape; `benchmarks/lora_expand.py` times others, which must give the same bits)."""
    require_triton("lora_add")
    t, n = base.shape
    if t == 0:
        return out
    tile = tile or expand_tile(t, n, len(sizes))
    if tile.block_m < 16 or tile.block_n < 16 or tile.warps < 1:
        raise ValueError(f"lora_expand_triton: tile {tile} must have block_m, block_n >= 16 and warps >= 1")
    starts, scales = _expand_args(sizes, scalings)
    grid = (triton.cdiv(t, tile.block_m), triton.cdiv(n, tile.block_n))
    _lora_expand_kernel[grid](base, partials, b, bias if bias is not None else b, out,
                              u_out if u_out is not None else partials, t, n, partials.shape[2], b.shape[1],
                              partials.shape[0], base.stride(0), out.stride(0), b.stride(0), *starts, *scales,
                              G=len(sizes), HAS_BIAS=bias is not None, WRITE_U=u_out is not None,
                              BLOCK_M=tile.block_m, BLOCK_N=tile.block_n, RANK_BLOCK=EXPAND_RANK_BLOCK,
                              num_warps=tile.warps, enable_fp_fusion=False, **dependent_launch_kwargs(base.device))
    return out
