"""The experts' LoRA B regrouped by expert, for `moe_lora.py`'s expand: PEFT's ``[N, r * E]`` (expert
e's rank j at column ``j * E + e``) copied to ``[E, N, r]``, so that an expand tile of one expert's
rows reads its B in whole sectors (read in place, each value of a tile is a 32-byte sector of
its own). A copy: every value keeps its bits, so the expand's products are the same whichever
operand it reads (`ExpertLora.b_by_expert` is the reference, torch's copy of the permuted view).

One program moves a ``[BLOCK_N, r, BLOCK_E]`` block: read as PEFT lays it out (runs of `BLOCK_E`
experts side by side), written as ``[BLOCK_E, BLOCK_N, r]`` (runs of ``BLOCK_N * r`` values),
both in whole sectors; torch's copy of the permuted view ran at about a quarter of the HBM's
bandwidth (`benchmarks/moe_lora_launches.py`, "B copy by expert").
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

BLOCK_E = 32  # experts per program; its rows: 128 values of a rank row an expert (`rows_per_program`)


@triton.jit
def _b_by_expert_kernel(b_ptr, out_ptr, N, R, E, stride_bn, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """``out[e, n, j] = b[n, j * E + e]`` over a block of rows n and experts e (every rank)."""
    wait_for_inputs(PDL)
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    j = tl.arange(0, BLOCK_R).to(tl.int64)
    e = (tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    mask = (n < N)[:, None, None] & (j < R)[None, :, None] & (e < E)[None, None, :]
    values = tl.load(b_ptr + n[:, None, None] * stride_bn + j[None, :, None] * E + e[None, None, :], mask=mask)
    out = out_ptr + e[:, None, None] * (N * R) + n[None, :, None] * R + j[None, None, :]
    tl.store(out, tl.permute(values, (2, 0, 1)), mask=tl.permute(mask, (2, 0, 1)))


def b_by_expert_triton(b: torch.Tensor, experts: int) -> torch.Tensor:
    """PEFT's expert-tensor B ``[N, r * E]`` as a new ``[E, N, r]`` tensor (one launch), the values
    `ExpertLora.b_by_expert` gives; B's columns must be contiguous (a parameter's are)."""
    require_triton("fused_moe")
    n, columns = b.shape
    if columns % experts or b.stride(1) != 1:
        raise ValueError(f"b_by_expert_triton: b {tuple(b.shape)} with strides {b.stride()} is not PEFT's [N, r * E] "
                         f"layout over experts={experts} with contiguous columns")
    rank = columns // experts
    out = torch.empty(experts, n, rank, device=b.device, dtype=b.dtype)
    if out.numel():
        block_r = triton.next_power_of_2(rank)
        block_n = max(1, 128 // block_r)  # 128 values an expert: 32 per thread at any rank
        _b_by_expert_kernel[(triton.cdiv(n, block_n), triton.cdiv(experts, BLOCK_E))](
            b, out, n, rank, experts, b.stride(0), BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_E=BLOCK_E, num_warps=4,
            **dependent_launch_kwargs(b.device))
    return out
