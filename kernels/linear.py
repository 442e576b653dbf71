"""linear: y = x @ W.T (+ b), batch-invariant.

Invariance contract: row i of the output is a function of row i of `x`, `W` and `b` only, never
of how many rows share the launch. The Triton kernel accumulates K sequentially into one fp32
accumulator (``acc = tl.dot(x, w, acc)`` over K tiles), with one BLOCK_K (`BLOCK_K`) and wgmma
tile shapes (BLOCK_M >= 64) for every M, and no split-K or stream-K. Tile M/N sizes are picked
from M by `pick_config`; conformance/kernel_invariance.py proves on the GPU that every config
gives the same rows (docs/design.md rule 1). The reference computes each output as a per-output
reduction (`exact_math.dot`), which is row-invariant on CPU where BLAS GEMM is not.

Decode batches may run quack's Hopper GEMM instead (`linear_quack`, ``VEXACT_LINEAR``): its rows
are bitwise ours, checked on the GPU like the tile configs.

The backward (grad_x = g @ W, grad_W = g.T @ x) uses torch.matmul: it must be correct and fast,
not invariant (rule 8).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import exact_math, linear_quack
from ._triton import has_tma, num_sms, require_triton, tl, tma_rows_aligned, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .row_view import in_shape

BLOCK_K = 64  # the one K tile for every M and every config


@dataclass(frozen=True)
class LinearConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    group_m: int = 8
    tma: bool = False  # operands through TMA tensor descriptors (Hopper) instead of pointer loads
    persistent: bool = False  # with tma: one program per SM looping over output tiles


def pick_config(m: int, n: int, k: int, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> LinearConfig:
    """Tile shape for an (m, n, k) problem; depends on shapes and dtypes only.

    Chosen from `benchmarks/kernel_peers.py --sweep-linear` (H100 for large M; H200, CUDA graphs,
    weights from HBM, for the decode shapes of every bundled model: docs/performance.md). Every
    config gives bitwise the same rows (conformance/kernel_invariance.py, "linear configs").
    """
    if dtype == torch.float32:  # ieee fp32 dot: registers and shared memory are the limit
        return LinearConfig(64, 64, 4, 3)
    wide_out = out_dtype == torch.float32  # an fp32 output tile takes twice the shared memory
    if m <= 64:  # decode: weight-bandwidth bound; narrow N tiles give enough programs
        if k <= 2048 and 8192 < n <= 65536:  # short K, wide N (DeepSeek-V3's q_b, kv_b): enough programs anyway
            return LinearConfig(64, 128, 4, 4)
        block_n = 16 if n <= 1024 else 32 if n <= 8192 else 64
        return LinearConfig(64, block_n, 4, 8 if block_n <= 32 else 6)
    if n > 65536:  # LM heads: one persistent program per SM over wide tiles
        return LinearConfig(128, 128, 8, 4, tma=True, persistent=True) if wide_out else \
            LinearConfig(128, 256, 8, 3, tma=True, persistent=True)
    if m <= 128:
        if n <= 8192:
            return LinearConfig(64, 64, 4, 6)
        return LinearConfig(64, 128, 4, 4, tma=True)
    if m <= 256:  # TMA loads win once 4 row tiles share each weight tile
        if m % 64 and n > 2048 and not wide_out:  # a partly filled row tile (the 160 and 224 buckets)
            partial = _partial_row_tile_config(m, n, k)
            if partial is not None:
                return partial
        if n <= 2048:
            return LinearConfig(64, 64, 4, 6)
        if n <= 4096:
            return LinearConfig(64, 64, 4, 6, tma=True)
        if n < 16384 or wide_out:
            return LinearConfig(64, 128, 4, 4, tma=True)
        return LinearConfig(128, 128, 8, 4, tma=True, persistent=True)
    if wide_out:
        return LinearConfig(128, 128, 8, 4, tma=True, persistent=True)
    return LinearConfig(128, 256, 8, 3, tma=True, persistent=True)


def _partial_row_tile_config(m: int, n: int, k: int) -> LinearConfig | None:
    """Pointer loads where a 129-255-row decode batch leaves its last 64-row tile part empty: with
    TMA descriptors those launches took up to 1.3x longer (Qwen3-8B at 160 and 224 rows: down
    68-80 -> 60-65 us, o 22-26 -> 22, gate/up 125 -> 96 at 160; `benchmarks/kernel_peers.py
    --sweep-linear --sweep-m 160,224`, H200, 2026-11-25). None: the usual
    choice (short-K weights, not measured or faster with TMA; wide weights at 193-255 rows, faster
    with their persistent tiles)."""
    if k < 4096:
        return None
    if n >= 16384:
        return LinearConfig(128, 128, 8, 4) if m < 192 else None
    return LinearConfig(64, 64, 4, 6) if n <= 4096 else None


@triton.jit
def _tile_coords(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped ordering of output tiles so that consecutive programs share W tiles in L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_size = GROUP_M * num_pid_n
    first_m = (tile // group_size) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % group_size) % group_m
    pid_n = (tile % group_size) // group_m
    return pid_m, pid_n


# M is not specialized: Triton would otherwise compile a separate kernel for M == 1 (and for M
# divisible by 16), and every row must come from the same code whatever the batch.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_om, stride_on,
    HAS_BIAS: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PDL: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past M load zeros (no memory traffic: decode tiles are mostly padding); columns past
    # N read a valid column (mod N). Neither is stored.
    row_ok = offs_m < M
    cols = offs_n % N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=row_ok[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit(do_not_specialize=["M", "num_programs"])
def _linear_tma_kernel(x_desc, w_desc, out_desc, b_ptr, M, N, K,
                       num_programs, HAS_BIAS: tl.constexpr, PERSISTENT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                       PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    # TMA zero-fills out-of-bounds rows/cols/K on load and clips them on store: no masks.
    num_tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    step = num_programs if PERSISTENT else num_tiles
    for tile in range(tl.program_id(0), num_tiles, step):
        pid_m, pid_n = _tile_coords(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        out_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], acc.to(out_desc.dtype))


def _tma_ok(x2d: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> bool:
    """TMA needs 16-byte aligned bases and row strides (and is Hopper+ only)."""
    if not has_tma(x2d.device):
        return False
    n = weight.shape[0]
    return tma_rows_aligned(x2d, weight) and (n * torch.empty((), dtype=out_dtype).element_size()) % 16 == 0


def _linear_triton_tma(x2d, weight, bias, out, cfg: LinearConfig) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = x2d.shape
    n = weight.shape[0]
    x_desc = TensorDescriptor.from_tensor(x2d, [cfg.block_m, BLOCK_K])
    w_desc = TensorDescriptor.from_tensor(weight, [cfg.block_n, BLOCK_K])
    out_desc = TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n])
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    programs = min(tiles, num_sms(x2d.device)) if cfg.persistent else tiles
    _linear_tma_kernel[(programs,)](
        x_desc, w_desc, out_desc, bias if bias is not None else x2d, m, n, k, programs,
        HAS_BIAS=bias is not None, PERSISTENT=cfg.persistent,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **dependent_launch_kwargs(x2d.device), enable_fp_fusion=True)


def linear_triton(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  out_dtype: torch.dtype, config: LinearConfig | None = None) -> torch.Tensor:
    """The Triton GEMM ``x2d @ weight.T (+ bias)`` in `out_dtype`, forward only, with `config`
    (default `pick_config`'s). Public for the GPU proofs and benchmarks that run every tile
    config against each other (conformance/kernel_invariance.py, benchmarks/kernel_peers.py); models
    call `linear`."""
    require_triton("linear")
    m, k = x2d.shape
    n = weight.shape[0]
    out = torch.empty((m, n), device=x2d.device, dtype=out_dtype)
    if m == 0:
        return out
    cfg = config or pick_config(m, n, k, x2d.dtype, out_dtype)
    if cfg.tma and _tma_ok(x2d, weight, out_dtype):
        _linear_triton_tma(x2d, weight, bias, out, cfg)
        return out
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _linear_kernel[grid](
        x2d, weight, bias if bias is not None else x2d, out,
        m, n, k,
        x2d.stride(0), x2d.stride(1), weight.stride(0), weight.stride(1), out.stride(0), out.stride(1),
        HAS_BIAS=bias is not None,
        INPUT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32",
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=BLOCK_K, GROUP_M=cfg.group_m,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=True, **dependent_launch_kwargs(x2d.device),
    )
    return out


def linear_reference(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """Each output element is its own reduction over K (row-invariant on CPU)."""
    compute = torch.float64 if x2d.dtype == torch.float64 else torch.float32
    out = exact_math.dot_rows(x2d.to(compute), weight.to(compute))
    if bias is not None:
        out += bias.to(compute)
    return out.to(out_dtype)


def _linear_forward(x2d, weight, bias, out_dtype):
    backend = select("linear", x2d, fast=True)
    if weight.dtype != x2d.dtype:
        raise ValueError(f"linear: weight dtype {weight.dtype} must equal input dtype {x2d.dtype}")
    if backend == "fast":  # cuBLAS: kernels chosen by M, not batch-invariant
        return torch.nn.functional.linear(x2d, weight, bias).to(out_dtype)
    if backend == "triton":
        quack_config = linear_quack.choose(x2d, weight, bias, out_dtype)
        if quack_config is not None:  # the same bits, faster at decode batches (linear_quack.py)
            return linear_quack.linear_quack(x2d, weight, bias, out_dtype, quack_config)
        return linear_triton(x2d, weight, bias, out_dtype)
    return linear_reference(x2d, weight, bias, out_dtype)


class _LinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2d, weight, bias, out_dtype):
        ctx.save_for_backward(x2d, weight)
        ctx.has_bias = bias is not None
        return _linear_forward(x2d, weight, bias, out_dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x2d, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.to(weight.dtype) @ weight
        if ctx.needs_input_grad[1]:
            grad_w = grad_out.t().to(x2d.dtype) @ x2d
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_out.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b, None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` over the last dim of `x`, with rows independent of the batch.

    Args:
        x: ``[..., K]`` activations.
        weight: ``[N, K]`` (the layout of ``nn.Linear.weight``), same dtype as `x`.
        bias: optional ``[N]``.
        out_dtype: output dtype (default: ``x.dtype``); float32 keeps the fp32 accumulator, as
            the LM head does for logits.
    Returns:
        ``[..., N]`` tensor of `out_dtype`. Differentiable in `x`, `weight` and `bias`.
    """
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x has {x.shape[-1]} features but weight expects {weight.shape[1]}")
    out_dtype = out_dtype or x.dtype
    x2d = x.reshape(-1, x.shape[-1])
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad:
        out = _LinearFunction.apply(x2d, weight, bias, out_dtype)
    else:
        out = _linear_forward(x2d, weight, bias, out_dtype)
    return in_shape(out, (*x.shape[:-1], weight.shape[0]))
