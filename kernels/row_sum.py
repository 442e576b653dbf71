"""row_sum: each row's sum of a tile in one fixed order, whatever the tile's register layout.

`tl.sum(x, axis=1)` adds each row's elements in an order that follows the layout the compiler
gives the tile: first the elements a thread holds, then across lanes, then across warps. That
layout follows the tile's shape and warp count, so an attention kernel launched with 16-row
tiles (mma.sync on Hopper) summed its softmax denominators in a different order than with
64-row tiles (wgmma) and its outputs differed in the last bits. `row_sum_halves` fixes the
order by logical position instead: for a row of width ``2**LEVELS`` it adds the second half
onto the first, elementwise, and repeats, ``x[j] + x[j + W/2]`` for ``W = 2**LEVELS, ..., 2``.
Elementwise adds round the same everywhere, so the sum is the same bits for every tile shape,
warp count and stage count (docs/design.md rule 2). An adder tree by pairs and a tensor-core dot
with a ones tile were also exact across tiles, and slower (H200, 2026-11-24).

Each level can be written two ways, with the same single add per output element and so the same
bits (`LANE_SUMS`): split the halves apart and add them, or ``tl.sum`` over a reshaped axis of
two. The compiler lowers them differently. The split needs both halves in one thread, so where a
half sits in another lane it moves the tile through shared memory (a stmatrix/load round trip per
register, on the critical path between the score and value dots). The two-element sum is an
in-thread add or one lane shuffle while a row lives in one warp, which is the case for the wgmma
tiles (16 rows or more per warp, `lane_sums`); where the warps split a row's columns (the 16-row
mma.sync decode tiles) it crosses warps through shared memory at every level and the split is
faster (H200, 2026-11-24: GQA training forward 1-3% faster with sums, decode ~20% slower).

`row_sum_reference` is the same order in torch; `row_sum_triton` runs the helper on a 2-D tensor
(for the checks).
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton


def row_sum_levels(width: int) -> int:
    """The ``LEVELS`` argument of `row_sum_halves` for rows of `width` (a power of two)."""
    if width < 1 or width & (width - 1):
        raise ValueError(f"row_sum_levels: width={width} must be a power of two >= 1")
    return width.bit_length() - 1


def lane_sums(block_m: int, num_warps: int) -> bool:
    """`row_sum_halves`'s ``LANE_SUMS`` for a tile of `block_m` rows run by `num_warps` warps:
    True when every row lives in one warp (the warps split the rows only, 16 or more each)."""
    return block_m >= 16 * num_warps


@triton.jit
def row_sum_halves(x, LEVELS: tl.constexpr, LANE_SUMS: tl.constexpr):
    """``[M]`` sums of the rows of ``x [M, 2**LEVELS]``, adding halves: ``x[:, :W/2] + x[:, W/2:]``
    until one column is left. `LANE_SUMS` picks the lowering (the module docstring; `lane_sums`),
    never the bits."""
    for _ in tl.static_range(LEVELS):
        if LANE_SUMS:  # one add per element, as below: a sum of two is the same either way round
            x = tl.sum(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), axis=1)
        else:
            a, b = tl.split(tl.permute(tl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), (0, 2, 1)))
            x = a + b
    return tl.reshape(x, (x.shape[0],))


def row_sum_reference(x: torch.Tensor) -> torch.Tensor:
    """`row_sum_halves`'s order in torch: rows of ``x [M, W]`` (W a power of two), halves added
    elementwise in ``x``'s dtype."""
    row_sum_levels(x.shape[-1])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x[..., 0]


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, m, stride_m, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr,
                    LANE_SUMS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, WIDTH)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=(rows < m)[:, None], other=0.0)
    tl.store(out_ptr + rows, row_sum_halves(x, LEVELS, LANE_SUMS), mask=rows < m)


def row_sum_triton(x: torch.Tensor, block_m: int = 16, num_warps: int = 4, lane_sums: bool = False) -> torch.Tensor:
    """``[M]`` row sums of the fp32 ``x [M, W]`` (W a power of two, >= 2) by `row_sum_halves`, with
    `block_m` rows per program, `num_warps` warps and its ``LANE_SUMS`` lowering `lane_sums` (none
    of which may change the result)."""
    require_triton("row_sum")
    if x.dim() != 2 or x.dtype != torch.float32:
        raise ValueError(f"row_sum_triton: x must be a 2-D float32 tensor, got {x.dim()}-D {x.dtype}")
    width = x.shape[1]
    levels = row_sum_levels(width)
    x = x.contiguous()
    out = torch.empty(x.shape[0], device=x.device, dtype=x.dtype)
    if x.shape[0]:
        grid = (triton.cdiv(x.shape[0], block_m),)
        _row_sum_kernel[grid](x, out, x.shape[0], x.stride(0), BLOCK_M=next_power_of_2(block_m), WIDTH=width,
                              LEVELS=levels, LANE_SUMS=lane_sums, num_warps=num_warps, enable_fp_fusion=True)
    return out
