"""head_linear: one small GEMM per attention head, ``y[t, h] = x[t, h] @ W[h].T``, batch-invariant.

MLA's latent KV cache (docs/mla-kv-cache.md) absorbs ``kv_b_proj`` into the attention: each
head's no-rope query goes through its own ``W_uk[h]`` into the latent space, and each head's
latent attention output through its own ``W_uv[h]`` back to the value dims. Both are this op,
with the weights as strided views of ``kv_b_proj.weight`` (no copy).

Invariance contract (docs/design.md rule 1): output element ``(t, h, n)`` is the K loop over
``x[t, h, :]`` and ``W[h, n, :]`` accumulated sequentially in fp32 in `BLOCK_K` steps, by one
kernel configuration per dtype (`config`; it never depends on the number of rows) with no
split-K: row ``t`` is the same whatever the number of tokens in the launch and wherever it sits
in its tile. The reference computes each output as a per-output reduction (`exact_math.dot`).
The ``fast`` backend is ``torch.bmm`` (cuBLAS: not invariant). The backward uses torch matmuls:
correct, not invariant (rule 8).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

BLOCK_K = 64  # the one K tile


def config(dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages): one per dtype, never a function of the row count."""
    if dtype == torch.float32:  # ieee fp32 dot: registers and shared memory are the limit
        return 32, 64, 4, 2
    return 64, 64, 4, 3


# M is not specialized: every row must come from the same compiled code whatever the batch.
@triton.jit(do_not_specialize=["M"])
def _head_linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                        stride_xm, stride_xh, stride_xk, stride_wh, stride_wn, stride_wk, stride_om, stride_oh,
                        INPUT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    head = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok = offs_m < M
    cols = offs_n % N  # columns past N read a valid column; never stored
    x_ptrs = x_ptr + head * stride_xh + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + head * stride_wh + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    out_ptrs = out_ptr + head * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & (offs_n[None, :] < N))


def head_linear_triton(x: torch.Tensor, weight: torch.Tensor,
                       tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`head_linear`'s forward by the Triton kernel (no autograd). `tile` is (BLOCK_M, BLOCK_N,
    warps, stages), None: `config` (what the models run). Rule 1 says any tile gives the same bits
    (each output is the same K loop in `BLOCK_K` steps); `benchmarks/investigations/head_linear.py` times tiles at
    decode batches and checks that, so that a decode tile could be chosen by measurement."""
    require_triton("head_linear")
    if tile is not None:
        block_m, block_n, warps, stages = tile
        powers_of_two = all(v >= 1 and (v & (v - 1)) == 0 for v in (block_m, block_n, warps))
        if not powers_of_two or min(block_m, block_n) < 16 or warps > 8 or not 1 <= stages <= 6:
            raise ValueError(f"head_linear_triton: tile={tile} must be (BLOCK_M, BLOCK_N, warps, stages) with "
                             f"powers of two, BLOCK_M and BLOCK_N >= 16, warps <= 8 and 1 <= stages <= 6")
    m, heads, k = x.shape
    n = weight.shape[1]
    out = torch.empty((m, heads, n), device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    block_m, block_n, warps, stages = config(x.dtype) if tile is None else tile
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), heads)
    _head_linear_kernel[grid](
        x, weight, out, m, n, k, x.stride(0), x.stride(1), x.stride(2),
        weight.stride(0), weight.stride(1), weight.stride(2), out.stride(0), out.stride(1),
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K, num_warps=warps, num_stages=stages,
        **dependent_launch_kwargs(x.device), enable_fp_fusion=True)
    return out


def head_linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each output element is its own reduction over K (row-invariant on CPU)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return exact_math.dot_rows(x.to(compute), weight.to(compute)).to(x.dtype)


def _forward(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    backend = select("head_linear", x, fast=True)
    if backend == "fast":  # cuBLAS batched GEMM over the heads: not batch-invariant
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1).contiguous()
    if backend == "triton":
        return head_linear_triton(x, weight)
    return head_linear_reference(x, weight)


class _HeadLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return _forward(x, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.to(weight.dtype).transpose(0, 1)  # [H, T, N]
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.bmm(g, weight).transpose(0, 1)  # [T, H, K]
        if ctx.needs_input_grad[1]:
            grad_w = torch.bmm(g.transpose(1, 2), x.to(weight.dtype).transpose(0, 1))  # [H, N, K]
        return grad_x, grad_w


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[t, h] = x[t, h] @ weight[h].T`` with rows independent of the batch.

    Args:
        x: ``[T, H, K]`` (any strides, e.g. a slice of the per-head query).
        weight: ``[H, N, K]``, x's dtype, any strides (e.g. a per-head slice of ``kv_b_proj.weight``,
            or its transpose).
    Returns:
        ``[T, H, N]`` contiguous, in x's dtype. Differentiable in both.
    """
    if x.dim() != 3 or weight.dim() != 3:
        raise ValueError(f"head_linear: x must be [T, H, K] and weight [H, N, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if weight.shape[0] != x.shape[1] or weight.shape[2] != x.shape[2]:
        raise ValueError(f"head_linear: weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} "
                         f"(want [{x.shape[1]}, N, {x.shape[2]}])")
    if weight.dtype != x.dtype:
        raise ValueError(f"head_linear: weight dtype {weight.dtype} must equal input dtype {x.dtype}")
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return _HeadLinearFunction.apply(x, weight)
    return _forward(x, weight)
