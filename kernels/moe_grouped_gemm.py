"""The grouped GEMM and the combine of `fused_moe` (moe.py) and its backward (moe_backward.py),
which both launch them: ``out[p] = a[p] @ W[e(p)]^T`` over rows sorted by expert (`moe_align`),
each expert's weight read through strides (the backward's transposed reads) or, on Hopper, one TMA
descriptor; and the combine, each token's k rows summed in rank order in fp32 (docs/design.md rules
1 and 4; the backward's launches need rule 8 only).
"""

from __future__ import annotations

import torch

from ._triton import has_tma, next_power_of_2, tl, tma_rows_aligned, triton
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .moe_align import MoeLayout
from .moe_config import MoeConfig, k_tile


@triton.jit
def _moe_grouped_gemm_kernel(a_ptr, w_ptr, a_desc, w_desc, out_ptr, block_expert_ptr, N, K, stride_am, stride_we,
                             stride_wn, stride_wk, stride_om, INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DESCS: tl.constexpr,
                             PDL: tl.constexpr = False, bias_ptr=None, stride_be=0, BIAS: tl.constexpr = False):
    """out[rows] = a[rows] @ W[e]^T for each block of permuted rows (W[e] element (n, k) via strides;
    with `DESCS`, the rows and ``W`` as ``[E * N, K]`` through TMA descriptors); with `BIAS`, the
    rounded product plus ``bias[e]``, rounded again (stock's ``x @ W + b``)."""
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + expert * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    w_row = expert.to(tl.int32) * N + pid_n * BLOCK_N  # DESCS: the tile's first row in [E * N, K]
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if DESCS:  # the same tiles (zero past K; columns past N read the next rows, never stored)
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([w_row, k * BLOCK_K]).T
        else:
            k_ok = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * stride_wk
    out = acc.to(out_ptr.dtype.element_ty)
    if BIAS:
        b = tl.load(bias_ptr + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        out = (out.to(tl.float32) + b[None, :]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], out, mask=n_ok[None, :])


@triton.jit
def _moe_combine_kernel(y_ptr, weights_ptr, pair_pos_ptr, add_ptr, out_ptr, H, stride_y, stride_add, stride_out,
                        TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = offs < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for r in tl.static_range(TOP_K):  # rank order, fp32
        pos = tl.load(pair_pos_ptr + token * TOP_K + r)
        w = tl.load(weights_ptr + token * TOP_K + r)
        acc += w * tl.load(y_ptr + pos * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    out = acc.to(out_ptr.dtype.element_ty)
    if ADD:  # torch's `out + add` in the output dtype: both widened to fp32, added once, rounded
        add = tl.load(add_ptr + token * stride_add + offs, mask=mask, other=0.0)
        out = (out.to(tl.float32) + add.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + token * stride_out + offs, out, mask=mask)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, layout: MoeLayout, n: int, k: int, stride_n: int,
                 stride_k: int, out_dtype: torch.dtype, cfg: MoeConfig, down_tiles: bool = False,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out[p] = a[p] @ W[e(p)]^T`` over the padded permuted rows (W element (n, k) by strides),
    with the down kernel's tiles (`down_tiles`) or the gate/up kernel's; plus ``bias[e(p)]``
    (``[E, n]``) rounded as stock's ``x @ W + b`` when given (GPT-OSS's down bias)."""
    out = torch.empty(a.shape[0], n, device=a.device, dtype=out_dtype)
    block_n, block_k, warps, stages = (
        (cfg.down_block_n, k_tile(cfg.down_block_k, k), cfg.down_num_warps, cfg.down_num_stages) if down_tiles
        else (cfg.block_n, k_tile(cfg.block_k, k), cfg.num_warps, cfg.num_stages))
    grid = (a.shape[0] // cfg.block_m, triton.cdiv(n, block_n))
    descs = cfg.tma and weights_by_tma(w, n, k, stride_n, stride_k) and tma_rows_aligned(a) and a.stride(1) == 1
    a_desc = tile_descriptor(a, cfg.block_m, block_k) if descs else None
    w_desc = tile_descriptor(weight_rows(w, n, k), block_n, block_k) if descs else None
    _moe_grouped_gemm_kernel[grid](a, w, a_desc, w_desc, out, layout.block_expert, n, k, a.stride(0), w.stride(0),
                                   stride_n, stride_k, out.stride(0), INPUT_PRECISION=input_precision(a.dtype),
                                   BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, DESCS=descs,
                                   num_warps=warps, num_stages=stages,
                                   **({} if bias is None else dict(bias_ptr=bias.contiguous(), stride_be=n, BIAS=True)),
                                   **dependent_launch_kwargs(a.device), enable_fp_fusion=True)
    return out


def tile_descriptor(t: torch.Tensor, block_rows: int, block_cols: int):
    """A TMA descriptor over the 2-D `t` loading `block_rows` x `block_cols` tiles."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(t, [block_rows, block_cols])


def weight_rows(w: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Expert weights that pass `tma_weight_layout` as the ``[E * n, k]`` matrix a TMA descriptor
    reads (row ``e * n + i`` is expert e's row i): the same memory, whether `w` is ``[E, n, k]``
    contiguous or a transposed view of it (GPT-OSS's down weight in the backward), which `view`
    refuses."""
    return w.as_strided((w.shape[0] * n, k), (k, 1))


def weights_by_tma(w: torch.Tensor, n: int, k: int, stride_n: int, stride_k: int) -> bool:
    """Whether expert weights `w` ``[E, ...]`` whose element (n, k) of expert e lies at strides
    (``w.stride(0)``, `stride_n`, `stride_k`) can be read through one TMA descriptor over
    ``[E * n, k]``: a Hopper GPU and `tma_weight_layout`."""
    return has_tma(w.device) and tma_weight_layout(w, n, k, stride_n, stride_k)


def tma_weight_layout(w: torch.Tensor, n: int, k: int, stride_n: int, stride_k: int) -> bool:
    """The layout half of `weights_by_tma`: a 16-bit dtype, rows of `k` contiguous elements one
    after the other (``[E, n, k]`` contiguous; the backward's transposed reads are not) and
    16-byte aligned."""
    return (w.dtype in (torch.bfloat16, torch.float16) and stride_k == 1 and stride_n == k
            and w.stride(0) == n * k and tma_rows_aligned(w) and (k * w.element_size()) % 16 == 0)


def input_precision(dtype: torch.dtype) -> str:
    """The dots' ``input_precision`` for `dtype`."""
    return "ieee" if dtype == torch.float32 else "tf32"  # fp32 stays fp32 (no TF32 rounding)


def combine(y: torch.Tensor, weights: torch.Tensor, layout: MoeLayout, tokens: int, out_dtype: torch.dtype,
            add: torch.Tensor | None = None):
    """``out[t] = sum_r weights[t, r] * y[pair_pos[t*k + r]]`` in rank order, fp32, rounded to
    `out_dtype`; then, with `add` (``[tokens, H]``, `out_dtype`), ``out + add`` rounded as torch
    rounds it (the shared experts' output: one launch fewer per MoE layer)."""
    hidden = y.shape[1]
    out = torch.empty(tokens, hidden, device=y.device, dtype=out_dtype)
    if tokens:
        block_h = min(1024, next_power_of_2(hidden))
        _moe_combine_kernel[(tokens, triton.cdiv(hidden, block_h))](
            y, weights.float().contiguous(), layout.pair_pos, out if add is None else add, out, hidden, y.stride(0),
            0 if add is None else add.stride(0), out.stride(0), TOP_K=weights.shape[1], BLOCK_H=block_h,
            ADD=add is not None, num_warps=4, **dependent_launch_kwargs(y.device), enable_fp_fusion=True)
    return out
