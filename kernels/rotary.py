"""rotary: NeoX-style rotary position embedding from one fp32 cos/sin table.

``out[..., :D/2] = x1 * cos - x2 * sin`` and ``out[..., D/2:] = x2 * cos + x1 * sin`` with
``x1, x2`` the two halves of the last dim, computed in fp32 and rounded once to x's dtype.
The Triton kernel writes each output as one fused multiply-add of a rounded product
(`rotate_halves`): the form every kernel that rotates must share, bit for bit.

Partial rotary (Qwen3-Next, Qwen3.5: ``partial_rotary_factor`` 0.25 of head dim 256): a table of
``R/2 < D/2`` frequencies rotates the first ``R`` dims as NeoX halves (``x[..., :R/2]`` and
``x[..., R/2:R]``) and copies the other ``D - R`` unchanged, as HF's ``apply_rotary_pos_emb`` does.

Invariance contract: element-wise; cos/sin come from one fp32 table ``[max_positions, R/2]``
indexed by each token's absolute position (docs/design.md rule 5), built once per model by
`rope_table` on CPU so that every process and device reads the same values. The backward is
the rotation by -theta (the same kernel with the sin sign flipped).
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select


def rope_table(inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_positions, D/2]`` (fp32, CPU) for inverse frequencies ``[D/2]``.

    ``scaling`` multiplies both tables (YaRN's attention factor; 1.0 for default RoPE). The
    angle is ``position * inv_freq`` in fp32, as HF computes it.
    """
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = positions[:, None] * inv_freq.detach().to("cpu", torch.float32)[None, :]
    return (freqs.cos() * scaling).contiguous(), (freqs.sin() * scaling).contiguous()


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """DeepSeek's interleaved rope pairs ``(x0, x1), (x2, x3), ...`` -> ``[x0, x2, ..., x1, x3, ...]``,
    the NeoX halves `apply_rotary` rotates (a copy; HF's interleaved rotation is this plus
    rotate-half)."""
    return x.unflatten(-1, (x.shape[-1] // 2, 2)).transpose(-1, -2).flatten(-2)


@triton.jit
def rotate_halves(x1, x2, cos, sin):
    """``(x1 cos - x2 sin, x2 cos + x1 sin)`` in fp32 with explicit fused multiply-adds, so that
    no compiler choice of where to contract tells two kernels apart (`rotary_cache_write`'s
    kernel calls this too, on tiles of another shape)."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def rotate_rows_into(src_ptr, src_row, dest_ptr, dest_row, ok, pos, cos_ptr, sin_ptr, stride_table,
                     HALF: tl.constexpr, INTERLEAVED: tl.constexpr, CACHE: tl.constexpr):
    """Rotate the rows ``src_ptr + src_row`` (``[ROWS]`` offsets; rows `ok` only) at positions
    `pos` into ``dest_ptr + dest_row`` as NeoX halves, with `rotate_halves`: the fused kernels'
    shared rotation (`rotary_cache_write`, `latent_cache_write`). `INTERLEAVED` de-interleaves
    DeepSeek's pairs on the way in (the first half is the even dims, the second the odd ones);
    `CACHE` is the loads' cache modifier (".cg" to read rows this program just stored)."""
    d = tl.arange(0, HALF)
    cos = tl.load(cos_ptr + pos[:, None] * stride_table + d[None, :])
    sin = tl.load(sin_ptr + pos[:, None] * stride_table + d[None, :])
    if INTERLEAVED:
        at1 = src_ptr + src_row[:, None] + 2 * d[None, :]
        at2 = at1 + 1
    else:
        at1 = src_ptr + src_row[:, None] + d[None, :]
        at2 = at1 + HALF
    x1 = tl.load(at1, mask=ok[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
    x2 = tl.load(at2, mask=ok[:, None], other=0.0, cache_modifier=CACHE).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos, sin)
    out = dest_ptr + dest_row[:, None] + d[None, :]
    tl.store(out, o1.to(dest_ptr.dtype.element_ty), mask=ok[:, None])
    tl.store(out + HALF, o2.to(dest_ptr.dtype.element_ty), mask=ok[:, None])


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, out_ptr, n_heads,
                   stride_xt, stride_xh, stride_ot, stride_oh, stride_table,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, SIGN: tl.constexpr,
                   PASS: tl.constexpr = 0, BLOCK_PASS: tl.constexpr = 1):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    dmask = d < HALF
    cos = tl.load(cos_ptr + pos * stride_table + d, mask=dmask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_table + d, mask=dmask, other=0.0) * SIGN
    mask = (heads[:, None] < n_heads) & dmask[None, :]
    base = x_ptr + token.to(tl.int64) * stride_xt + heads[:, None] * stride_xh + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    o1, o2 = rotate_halves(x1, x2, cos[None, :], sin[None, :])
    out = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(out, o1.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)
    if PASS > 0:  # partial rotary: the dims past the rotated 2 * HALF, copied
        p = tl.arange(0, BLOCK_PASS)
        pmask = (heads[:, None] < n_heads) & (p < PASS)[None, :]
        src = x_ptr + token.to(tl.int64) * stride_xt + heads[:, None] * stride_xh + 2 * HALF + p[None, :]
        dest = out_ptr + token.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + 2 * HALF + p[None, :]
        tl.store(dest, tl.load(src, mask=pmask, other=0.0), mask=pmask)


def _rotary_triton(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   sign: float) -> torch.Tensor:
    require_triton("rotary")
    n_tokens, n_heads, head_dim = x.shape
    out = torch.empty((n_tokens, n_heads, head_dim), device=x.device, dtype=x.dtype)
    if n_tokens == 0:
        return out
    half = cos.shape[-1]
    block_d = next_power_of_2(half)
    block_h = max(1, min(next_power_of_2(n_heads), 4096 // block_d))
    grid = (n_tokens, triton.cdiv(n_heads, block_h))
    rest = head_dim - 2 * half
    _rotary_kernel[grid](x, positions, cos, sin, out, n_heads, x.stride(0), x.stride(1),
                         out.stride(0), out.stride(1), cos.stride(0),
                         HALF=half, BLOCK_H=block_h, BLOCK_D=block_d, SIGN=sign, PASS=rest,
                         BLOCK_PASS=next_power_of_2(max(rest, 1)), num_warps=4, enable_fp_fusion=True)
    return out


def rotary_reference(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     sign: float = 1.0) -> torch.Tensor:
    """The CPU reference (partial rotary: the dims past the table's ``2 * R/2`` copied)."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    half = cos.shape[-1]
    c = cos[positions.long()].to(compute)[:, None, :]
    s = sin[positions.long()].to(compute)[:, None, :] * sign
    x1, x2 = x[..., :half].to(compute), x[..., half:2 * half].to(compute)
    return torch.cat([(x1 * c - x2 * s).to(x.dtype), (x2 * c + x1 * s).to(x.dtype), x[..., 2 * half:]], dim=-1)


def _rotary_forward(x, positions, cos, sin, sign):
    if select("rotary", x) == "triton":
        return _rotary_triton(x, positions, cos, sin, sign)
    return rotary_reference(x, positions, cos, sin, sign)


class _RotaryFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, positions, cos, sin):
        ctx.save_for_backward(positions, cos, sin)
        return _rotary_forward(x, positions, cos, sin, 1.0)

    @staticmethod
    def backward(ctx, grad_out):
        positions, cos, sin = ctx.saved_tensors
        return _rotary_forward(grad_out.contiguous(), positions, cos, sin, -1.0), None, None, None


def apply_rotary(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` (``[tokens, heads, head_dim]``) by the angles of `positions` (``[tokens]``).

    `cos`/`sin` are the ``[max_positions, rotary_dim/2]`` fp32 tables from `rope_table`, on x's
    device: ``rotary_dim = head_dim`` rotates the whole head, a smaller even ``rotary_dim`` its
    first dims only (partial rotary; the module docstring). Positions are not range-checked here
    (that would sync the GPU on every layer): callers validate them once per forward. Returns a
    new tensor of x's dtype; differentiable in `x`.
    """
    if x.dim() != 3 or x.shape[-1] % 2:
        raise ValueError(f"apply_rotary: x must be [tokens, heads, even head_dim], got {tuple(x.shape)}")
    if not 1 <= cos.shape[-1] <= x.shape[-1] // 2:
        raise ValueError(f"apply_rotary: table has {cos.shape[-1]} frequencies, head_dim {x.shape[-1]} takes 1 to "
                         f"{x.shape[-1] // 2}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if torch.is_grad_enabled() and x.requires_grad:
        return _RotaryFunction.apply(x, positions, cos, sin)
    return _rotary_forward(x, positions, cos, sin, 1.0)
