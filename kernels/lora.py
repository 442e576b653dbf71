"""lora_add: ``base + (x A^T) B^T * scaling``, the LoRA update added to a base GEMM's output,
batch-invariant and shared by training and rollouts (docs/design.md section 8, drop-in).

One call adds the adapters of one linear layer, or of a fused projection group (q/k/v, gate/up):
then ``a`` is the members' A matrices stacked (``[G * r, K]``, one shrink over all of them),
``b`` their B matrices stacked (``[sum N_g, r]``) and ``base`` the group's fused output, whose
column slices ``sizes`` belong to the members in order; member g's columns read its own rank
slice ``u[:, g*r:(g+1)*r]`` and take its own ``scalings[g]``. The arithmetic, per output element:

1. shrink: ``u = x A^T`` with 16-bit operands and fp32 accumulation, as the base GEMM: A in
   x's dtype, or, for fp32 A (PEFT's default) under bf16 x, A split into ``hi + lo`` (both
   bf16; two MMAs into one accumulator), which keeps 17 of A's bits (2**-9 off in one bf16;
   tests/kernels/test_lora.py); K in fixed chunks of `CHUNK_K` columns (a function of K only, never of the
   batch), each chunk's partial sum accumulated in `BLOCK_K` steps into one fp32 accumulator
   with tiles of fixed shape (`SHRINK_BLOCK_M` x `BLOCK_R`), then the chunks' partials added
   in chunk order (``((p0 + p1) + p2) + ...``) in fp32. Splitting K is what keeps the shrink
   off the step's critical path (its N is the rank: without it one program per 16 rows would
   walk all of K); the order is fixed, so rule 1's reason to refuse split-K does not apply.
2. expand: ``acc = sum_j u[:, j] * B[:, j]`` in fp32, j = 0 .. r-1 in order (element-wise
   products, no tensor-core dot: the same operations whatever the tile), each product rounded
   before it is added (the launch turns the compiler's FMA contraction off, so the GPU's bits
   are the CPU reference's), plus B's bias.

Two launches a call: the shrink writes the partials ``p[s, rows, ranks]``; the expand adds each
u column it reads from them itself, in chunk order (the partials' sum of step 1, the same fp32
additions `_lora_reduce_kernel` makes), so no launch of its own sums them. An expand program
(`lora_expand.py`) reads u and B a block of `EXPAND_RANK_BLOCK` ranks at a time, as 2-D tiles, and walks the
block's ranks in registers: a rank loop that loaded its u and B columns from memory waited on
r rounds of loads (docs/performance.md section 10). A rollout's shrink beside the base GEMM
(`lora_partials`) sums the partials itself where K has `REDUCE_BESIDE_CHUNKS` chunks or more,
and the expand then reads u (``S = 1``). The training forward,
whose backward reads u, has the expand's first N tile of programs store u as well
(`lora_expand_triton`'s ``u_out``); `lora_shrink_triton` (u alone: the shrink, then
`_lora_reduce_kernel`) serves the GPU proofs and the tests that show the two launches equal the
three (tests/triton_checks/check_lora.py).
3. ``out = round(float(base) + acc * scaling)`` to base's dtype: PEFT's own order (the base
   layer's rounded output, plus the fp32 update times scaling, rounded once more).

Invariance contract: every output element is a function of its own row of ``x`` and ``base``
and of the weights only (rules 1 and 5): the tiles are fixed, K's chunks depend on K only, the
expand is element-wise. A stacked group's columns are bitwise the members' separate calls (the
training forward runs those): member g's u columns come from the same chunks and tiles, and its
B columns from the same per-element loop. `conformance/kernel_invariance.py --only lora` checks
both on the GPU. fp32 adapter weights (PEFT's default) are read as they are: A is split inside
the shrink, B is used in fp32; no activation is kept in fp32 but ``u`` (``[T, G * r]``).

The reference (CPU, `lora_reference.py`) runs the same steps with `exact_math.dot` per chunk. The backward (rule 8)
is torch matmuls in fp32: correct, not invariant.
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .lora_expand import lora_expand_triton
from .lora_reference import CHUNK_K, lora_expand_reference, lora_shrink_reference, shrink_operand, split_a
from .row_view import in_shape

BLOCK_K = 64  # K steps inside a chunk (rule 1's K tile)
SHRINK_BLOCK_M = 16  # rows per shrink program, for every batch
BLOCK_R = 16  # rank columns per shrink program
MAX_MEMBERS = 4  # members of one stacked group (the gated-DeltaNet's in_proj group has four)
#: K chunks from which `lora_partials` (the rollout's shrink beside the base GEMM) sums the
#: partials itself: at Qwen3-8B's K of 4,096 (8 chunks) an expand program of a gate/up tile read
#: 32 KB of partials for 16 KB of output (docs/performance.md section 10); Qwen3-0.6B's K of
#: 1,024-3,072 keeps its 2-6 partials in the expand, whose base GEMMs are too short to hide a
#: third launch beside them.
REDUCE_BESIDE_CHUNKS = 8


@triton.jit
def shrink_chunk(x_ptrs, a_ptrs, row_ok, rank_ok, start, K, INPUT_PRECISION: tl.constexpr, SPLIT_A: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """One K chunk's partial ``x A^T`` ``[BLOCK_M, BLOCK_R]`` fp32 from column `start` on: `x_ptrs`
    its rows' first columns, `a_ptrs` ``[BLOCK_K, BLOCK_R]`` the ranks' (step 1 of the module
    docstring; shared with the routed experts' shrink, `moe_lora.py`)."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k in range(0, CHUNK, BLOCK_K):
        k_ok = start + k + offs_k < K
        xt = tl.load(x_ptrs + start + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        at = tl.load(a_ptrs + start + k, mask=rank_ok[None, :] & k_ok[:, None], other=0.0)
        hi = at.to(xt.dtype)
        acc = tl.dot(xt, hi, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
        if SPLIT_A:  # fp32 A under 16-bit x: A = hi + lo, two 16-bit operands, both into the fp32 accumulator
            lo = (at - hi.to(tl.float32)).to(xt.dtype)
            acc = tl.dot(xt, lo, acc, input_precision=INPUT_PRECISION, out_dtype=tl.float32)
    return acc


@triton.jit(do_not_specialize=["T"])
def _lora_shrink_kernel(x_ptr, a_ptr, p_ptr, T, K, R, stride_x, stride_a,
                        INPUT_PRECISION: tl.constexpr, SPLIT_A: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    """Partial ``p[s, rows, ranks]`` of ``x A^T`` over K chunk s (program (m tile, r tile, s))."""
    wait_for_inputs(PDL)
    pid_m, pid_r, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    row_ok, rank_ok = rows < T, ranks < R
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    a_ptrs = a_ptr + ranks[None, :].to(tl.int64) * stride_a + offs_k[:, None]
    acc = shrink_chunk(x_ptrs, a_ptrs, row_ok, rank_ok, pid_s * CHUNK, K, INPUT_PRECISION, SPLIT_A, CHUNK, BLOCK_M,
                       BLOCK_R, BLOCK_K)
    out = p_ptr + (pid_s * T + rows[:, None]).to(tl.int64) * R + ranks[None, :]
    tl.store(out, acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit(do_not_specialize=["n"])
def _lora_reduce_kernel(p_ptr, u_ptr, n, S, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """``u = p[0] + p[1] + ...`` in chunk order."""
    wait_for_inputs(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.load(p_ptr + offs, mask=mask, other=0.0)
    for s in range(1, S):
        acc += tl.load(p_ptr + s * n + offs, mask=mask, other=0.0)
    tl.store(u_ptr + offs, acc, mask=mask)


def num_chunks(k: int) -> int:
    """The shrink's K chunks for `k` input features (`CHUNK_K` each, the last one partial)."""
    return max(1, -(-k // CHUNK_K))


def lora_partials_triton(x2d: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """The shrink's partials ``p[s] = x A^T`` over K chunk s, ``[num_chunks(K), T, R]`` fp32, by
    the Triton kernel: what `lora_expand_triton` adds up in chunk order."""
    require_triton("lora_add")
    t, k = x2d.shape
    rank = a.shape[0]
    s = num_chunks(k)
    partials = torch.empty(s, t, rank, device=x2d.device, dtype=torch.float32)
    if t == 0:
        return partials
    grid = (triton.cdiv(t, SHRINK_BLOCK_M), triton.cdiv(rank, BLOCK_R), s)
    _lora_shrink_kernel[grid](x2d, a, partials, t, k, rank, x2d.stride(0), a.stride(0),
                              INPUT_PRECISION="ieee" if x2d.dtype == torch.float32 else "tf32",
                              SPLIT_A=split_a(x2d.dtype, a.dtype), CHUNK=CHUNK_K,
                              BLOCK_M=SHRINK_BLOCK_M, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, num_warps=4, num_stages=3,
                              **dependent_launch_kwargs(x2d.device), enable_fp_fusion=True)
    return partials


def lora_partials(x: torch.Tensor, a: torch.Tensor) -> torch.Tensor | None:
    """The shrink of `x` ``[..., K]`` and `a` ``[G * r, K]`` as `lora_add`'s ``partials`` argument
    takes it, or None where `lora_add` runs the reference backend (which takes none). For a
    rollout that starts the shrink before the base GEMM, on another stream
    (`vexact_models.side_stream.shrink_beside`): the partials (`lora_partials_triton`), or, where
    K has `REDUCE_BESIDE_CHUNKS` chunks or more, u itself ``[1, T, G * r]`` (`lora_shrink_triton`:
    the same additions in the same order), so that every N tile of the expand reads one tile of u
    instead of adding up the partials again."""
    x2d = x.reshape(-1, x.shape[-1])
    if select("lora_add", x2d) != "triton":
        return None
    x2d = x2d if x2d.stride(-1) == 1 else x2d.contiguous()
    a = a if a.stride(-1) == 1 else a.contiguous()
    if num_chunks(x2d.shape[1]) >= REDUCE_BESIDE_CHUNKS:
        return lora_shrink_triton(x2d, a)[None]
    return lora_partials_triton(x2d, a)


def lora_shrink_triton(x2d: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``u = x A^T`` ``[T, R]`` fp32 alone by the Triton kernels: the partials per K chunk, then
    their sum in chunk order by `_lora_reduce_kernel` (the operations the expand performs when it
    reads the partials itself). Public for the GPU proofs (tests/triton_checks/check_lora.py)."""
    partials = lora_partials_triton(x2d, a)
    t, n = x2d.shape[0], partials[0].numel()
    u = torch.empty(t, a.shape[0], device=x2d.device, dtype=torch.float32)
    if t == 0:
        return u
    _lora_reduce_kernel[(triton.cdiv(n, 1024),)](partials, u, n, partials.shape[0], BLOCK=1024, num_warps=4,
                                                 **dependent_launch_kwargs(x2d.device), enable_fp_fusion=True)
    return u


def _forward(base, x2d, a, b, bias, sizes, scalings, out, keep_u, partials=None):
    """``(out, u)``: the update added into `out` (a new tensor unless given) and, with `keep_u`
    (the training forward, whose backward reads it), the shrink's u, else None from the Triton
    path (two launches: the shrink's partials, unless `partials` holds them already, then the
    expand, which adds them up itself)."""
    backend = select("lora_add", x2d)
    out = torch.empty_like(base) if out is None else out
    if backend == "triton":
        partials = lora_partials_triton(x2d, a) if partials is None else partials
        u = torch.empty(x2d.shape[0], a.shape[0], device=x2d.device, dtype=torch.float32) if keep_u else None
        return lora_expand_triton(base, partials, b, bias, sizes, scalings, out, u), u
    u = lora_shrink_reference(x2d, a)
    return lora_expand_reference(base, u, b, bias, sizes, scalings, out), u


class _LoraAddFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, x2d, a, b, bias, sizes, scalings):
        out, u = _forward(base, x2d, a, b, bias, sizes, scalings, None, True)
        ctx.save_for_backward(x2d, a, b, u)
        ctx.sizes, ctx.scalings, ctx.has_bias = sizes, scalings, bias is not None
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x2d, a, b, u = ctx.saved_tensors
        compute = torch.float64 if grad_out.dtype == torch.float64 else torch.float32
        scale = torch.cat([torch.full((size,), s, dtype=compute, device=grad_out.device)
                           for size, s in zip(ctx.sizes, ctx.scalings)])
        gs = grad_out.to(compute) * scale  # d(update before scaling)
        rank, col, grad_u, grad_b = b.shape[1], 0, [], torch.empty(b.shape, dtype=compute, device=b.device)
        for g, size in enumerate(ctx.sizes):
            cols = slice(col, col + size)
            grad_u.append(gs[:, cols] @ b[cols].to(compute))
            grad_b[cols] = gs[:, cols].t() @ u[:, g * rank:(g + 1) * rank].to(compute)
            col += size
        grad_u = torch.cat(grad_u, dim=1)
        grad_x = (grad_u @ shrink_operand(a, x2d.dtype).to(compute)).to(x2d.dtype) if ctx.needs_input_grad[1] else None
        grad_a = (grad_u.t() @ x2d.to(compute)).to(a.dtype) if ctx.needs_input_grad[2] else None
        grad_bias = gs.sum(0).to(b.dtype) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad_out, grad_x, grad_a, grad_b.to(b.dtype), grad_bias, None, None


def lora_add(base: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: tuple[float, ...],
             bias: torch.Tensor | None = None, sizes: tuple[int, ...] | None = None,
             inplace: bool = False, partials: torch.Tensor | None = None) -> torch.Tensor:
    """``base + (x a^T) b^T * scaling`` per member (the module docstring's arithmetic).

    Args:
        base: ``[..., N]`` the base GEMM's output (its dtype is the output's).
        x: ``[..., K]`` the layer's input, in the activations' dtype.
        a: ``[G * r, K]`` the stacked A matrices (x's dtype, or fp32: `shrink_operand`).
        b: ``[N, r]`` the stacked B matrices (used in fp32).
        scalings: one float per member (G of them, at most `MAX_MEMBERS`).
        bias: optional ``[N]``, B's bias (PEFT's ``lora_bias``).
        sizes: the members' output columns (default: one member of all N).
        inplace: write into `base` (no gradient may flow).
        partials: the shrink of `x` and `a` already computed (`lora_partials`: the partials
            ``[num_chunks(K), T, G * r]`` fp32, or u summed from them, ``[1, T, G * r]``; a rollout
            starts it beside the base GEMM, `vexact_models.adapters`): only the expand runs.
            Triton backend, no gradient.
    Returns:
        ``[..., N]`` in base's dtype. Differentiable in base, x, a, b and bias.
    """
    sizes = (base.shape[-1],) if sizes is None else tuple(sizes)
    scalings = tuple(float(s) for s in scalings)
    n, k, members = base.shape[-1], x.shape[-1], len(sizes)
    if not 1 <= members <= MAX_MEMBERS or len(scalings) != members:
        raise ValueError(f"lora_add: {members} members with {len(scalings)} scalings; want 1 to {MAX_MEMBERS} "
                         "members, one scaling each")
    if sum(sizes) != n or b.shape[0] != n or a.shape[1] != k or a.shape[0] != members * b.shape[1] \
            or base.shape[:-1] != x.shape[:-1] or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"lora_add: shapes do not match: base {tuple(base.shape)}, x {tuple(x.shape)}, a "
                         f"{tuple(a.shape)}, b {tuple(b.shape)}, sizes {sizes}, bias "
                         f"{None if bias is None else tuple(bias.shape)} (a: [members * r, K], b: [N, r])")
    shape = base.shape
    base2d, x2d = base.reshape(-1, n), x.reshape(-1, k)
    if partials is not None:
        _check_partials(partials, x2d, a, base, x, b, bias)
    if x2d.stride(-1) != 1:
        x2d = x2d.contiguous()
    a, b = (a if a.stride(-1) == 1 else a.contiguous()), (b if b.stride(-1) == 1 else b.contiguous())
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (base, x, a, b, bias))
    if needs_grad:
        if inplace:
            raise ValueError("lora_add: inplace=True while a gradient flows (the base output is needed)")
        return in_shape(_LoraAddFunction.apply(base2d, x2d, a, b, bias, sizes, scalings), shape)
    if base2d.stride(-1) != 1:
        base2d = base2d.contiguous()
    out = base2d if inplace and base2d.data_ptr() == base.data_ptr() else None
    result = in_shape(_forward(base2d, x2d, a, b, bias, sizes, scalings, out, False, partials)[0], shape)
    if inplace and result.data_ptr() != base.data_ptr():
        base.copy_(result)
        return base
    return result


def _check_partials(partials: torch.Tensor, x2d: torch.Tensor, a: torch.Tensor, *operands) -> None:
    """`lora_add`'s ``partials`` argument: the Triton backend's, of this shrink's shape (its
    partials, or u summed from them), no gradient."""
    want = (num_chunks(x2d.shape[1]), x2d.shape[0], a.shape[0])
    if tuple(partials.shape) not in (want, (1, *want[1:])) or partials.dtype != torch.float32:
        raise ValueError(f"lora_add: partials {tuple(partials.shape)} {partials.dtype} must be {want} or "
                         f"{(1, *want[1:])} float32 ([num_chunks(K), T, G * r], or u summed: [1, T, G * r])")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x2d, a, *operands)):
        raise ValueError("lora_add: partials while a gradient flows (the training forward runs its own shrink)")
    if select("lora_add", x2d) != "triton":
        raise ValueError("lora_add: partials are the Triton shrink's; this call runs the reference backend")
