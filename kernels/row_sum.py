"""row_sum: each row's sum of a tile in one fixed order, whatever the tile's register layout.

`tl.sum(x, axis=1)` adds each row's elements in an order that follows the layout the compiler
gives the tile: first the elements a thread holds, then across lanes, then across warps. That
layout follows the tile's shape and warp count, so an attention kernel launched with 16-row
tiles (mma.sync on Hopper) summed its softmax denominators in a different order than with
64-row tiles (wgmma) and its outputs differed in the last bits. `row_sum_halves` fixes the
order by logical position instead: for a row of width ``2**LEVELS`` it adds the second half
onto the first, elementwise, and repeats, ``x[j] + x[j + W/2]`` for ``W = 2**LEVELS, ..., 2``.
Elementwise adds round the same everywhere, so the sum is the same bits for every tile shape,
warp count and stage count (docs/design.md rule 2). Its cost on the H200 (docs/gpu-results.md,
sixth session): none in the 64-row latent tiles (faster than `tl.sum` there), ~16% of the
128-row GQA training forward; an adder tree by pairs and a tensor-core dot with a ones tile
were also exact across tiles, and slower.

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


@triton.jit
def row_sum_halves(x, LEVELS: tl.constexpr):
    """``[M]`` sums of the rows of ``x [M, 2**LEVELS]``, adding halves: ``x[:, :W/2] + x[:, W/2:]``
    until one column is left."""
    for _ in tl.static_range(LEVELS):
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
def _row_sum_kernel(x_ptr, out_ptr, m, stride_m, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, LEVELS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, WIDTH)
    x = tl.load(x_ptr + rows[:, None] * stride_m + cols[None, :], mask=(rows < m)[:, None], other=0.0)
    tl.store(out_ptr + rows, row_sum_halves(x, LEVELS), mask=rows < m)


def row_sum_triton(x: torch.Tensor, block_m: int = 16, num_warps: int = 4) -> torch.Tensor:
    """``[M]`` row sums of the fp32 ``x [M, W]`` (W a power of two, >= 2) by `row_sum_halves`, with
    `block_m` rows per program and `num_warps` warps (which must not change the result)."""
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
                              LEVELS=levels, num_warps=num_warps)
    return out
