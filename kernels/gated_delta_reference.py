"""The gated delta rule's chunk arithmetic in torch: the backward's recompute and the reference of
its chunk kernels (the forward itself is token by token, `gated_delta_recurrent`).

One chunk of ``C`` rows (docs/design.md section 6b) is computed by `chunk_forward` from its
boundary state and its raw rows, zero-padded to ``C``. Every quantity of row ``i`` is a function of
rows ``0..i`` alone, computed at the fixed shape ``C`` in a fixed order:

1. ``q, k`` l2-normalised (``x / sqrt(sum(x*x) + 1e-6)``; the Triton kernels sum by halves,
   `row_sum.row_sum_halves`, the reference by `exact_math.row_sum`, which takes any width),
   ``q`` scaled by ``scale``;
2. ``G_i = sum_{j <= i} g_j`` (a masked ``[C, C]`` tile summed by halves: a row's prefix sum
   reads nothing past it);
3. ``L = strict_lower((k beta) k^T * exp(G_i - G_j))`` and ``T = (I + L)^-1`` by blocks of 16
   rows: the diagonal blocks by forward substitution, then block rows by block products (the
   WY / UT transform of the DeltaNet papers; fla's ``solve_tril`` order). ``T`` is lower
   triangular with an upper part of exact zeros, and row ``i`` of every step reads rows ``<= i``,
   later rows only through exact zero products;
4. ``u = T (v beta)``, ``w = T (k beta exp(G))``, ``v_new = u - w S``;
5. ``o = (q exp(G)) S + lower((q k^T) * exp(G_i - G_j)) v_new``;
6. the fold: ``S' = S exp(G_last) + (k exp(G_last - G))^T v_new``.

Rows past the last present one are exact zeros (``torch.where``, never a multiplication by a
mask), so they reach row ``i`` only as exact zero products: row ``i``'s bits are the same
whatever number of the chunk's rows exist.

`EXACT` computes it batch-invariantly on the CPU (docs/design.md rules 1, 3, 5): products as
per-output reductions (`exact_math.dot`), `exact_math.exp`, sums by halves; the result of a
chunk does not depend on how many chunks, heads or sequences share the call. `AUTOGRAD` computes
the same formulas with torch's matmul, exp and triangular solve, differentiably: the backward
recomputes the forward with it (rule 8: gradients must be correct, not invariant).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from . import exact_math
from .row_sum import row_sum_reference

L2NORM_EPS = 1e-6  # transformers' and fla's l2norm epsilon
SOLVE_BLOCK = 16  # rows of the solve's diagonal blocks


@dataclass(frozen=True)
class ChunkOps:
    """The primitives `chunk_forward` runs on: ``mm(a [.., M, K], b [.., N, K]) -> [.., M, N]``,
    ``exp``, ``prefix_sum`` over the last dim, ``row_sum`` over the last dim and ``solve(L)``
    giving ``(I + L)^-1`` of a strictly lower triangular ``L [.., C, C]``."""

    mm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    exp: Callable[[torch.Tensor], torch.Tensor]
    row_sum: Callable[[torch.Tensor], torch.Tensor]
    prefix_sum: Callable[[torch.Tensor], torch.Tensor]
    solve: Callable[[torch.Tensor], torch.Tensor]


def _exact_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # each output one reduction over its own row and column (rule 1's reference form)
    return exact_math.dot(a.unsqueeze(-2).contiguous(), b.unsqueeze(-3).contiguous())


def _lower(c: int, device, strict: bool) -> torch.Tensor:
    i = torch.arange(c, device=device)
    return (i[None, :] < i[:, None]) if strict else (i[None, :] <= i[:, None])


def _halves_prefix_sum(x: torch.Tensor) -> torch.Tensor:
    """``out[.., i] = sum_{j <= i} x[.., j]``: a masked ``[C, C]`` tile summed by halves (the
    Triton kernel's order)."""
    c = x.shape[-1]
    tile = torch.where(_lower(c, x.device, strict=False), x.unsqueeze(-2), torch.zeros((), dtype=x.dtype))
    return row_sum_reference(tile.contiguous())


def _block_solve(lower: torch.Tensor) -> torch.Tensor:
    """``(I + L)^-1`` by blocks of `SOLVE_BLOCK` rows: the diagonal blocks' inverses ``D^-1`` by
    forward substitution (row ``r`` of a block: ``e_r - L[r, :] D^-1``, over the block's 16
    columns), then each block row ``b`` after the first: ``T_b,<b = -D_b^-1 (L_b,<b T_<b,<b)``.
    Each output is one reduction over its own row and column (the columns before the block, or the
    block's 16 rows); a row past the last present one enters only as exact zero products."""
    c = lower.shape[-1]
    bs = min(SOLVE_BLOCK, c)
    eye = torch.eye(bs, dtype=lower.dtype, device=lower.device)
    diag = torch.stack([lower[..., b * bs:(b + 1) * bs, b * bs:(b + 1) * bs] for b in range(c // bs)], dim=-3)
    dinv = eye.expand(diag.shape).clone()
    for r in range(1, bs):
        dinv[..., r, :] = eye[r] - _exact_mm(diag[..., r:r + 1, :], dinv.transpose(-1, -2))[..., 0, :]
    t = torch.zeros_like(lower)
    for b in range(c // bs):
        rows, before = slice(b * bs, (b + 1) * bs), slice(0, b * bs)
        t[..., rows, rows] = dinv[..., b, :, :]
        if b:
            x = _exact_mm(lower[..., rows, before], t[..., before, before].transpose(-1, -2))  # L_b,<b T_<b,<b
            t[..., rows, before] = -_exact_mm(dinv[..., b, :, :], x.transpose(-1, -2))
    return t


def _torch_solve(lower: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    return torch.linalg.solve_triangular(eye + lower, eye.expand(lower.shape), upper=False, unitriangular=True)


EXACT = ChunkOps(mm=_exact_mm, exp=exact_math.exp, row_sum=exact_math.row_sum, prefix_sum=_halves_prefix_sum,
                 solve=_block_solve)
AUTOGRAD = ChunkOps(mm=lambda a, b: a @ b.transpose(-1, -2), exp=torch.exp, row_sum=lambda x: x.sum(-1),
                    prefix_sum=lambda x: x.cumsum(-1), solve=_torch_solve)


def _pair_decay(cum: torch.Tensor, lower: torch.Tensor, ops: ChunkOps) -> torch.Tensor:
    """``exp(G_i - G_j)`` where ``j <= i``, exact zeros above; the exponential of the lower triangle
    only (an element's exponential does not depend on its neighbours, rule 5)."""
    zero = torch.zeros((), dtype=cum.dtype, device=cum.device)
    if ops is AUTOGRAD:
        return torch.where(lower, ops.exp(torch.where(lower, cum.unsqueeze(-1) - cum.unsqueeze(-2), zero)), zero)
    i, j = torch.tril_indices(*lower.shape, device=cum.device)
    out = cum.new_zeros(*cum.shape, cum.shape[-1])
    out[..., i, j] = ops.exp(cum[..., i] - cum[..., j])
    return out


def l2norm(x: torch.Tensor, ops: ChunkOps) -> torch.Tensor:
    """``x / sqrt(sum(x * x) + 1e-6)`` over the last dim (transformers' ``l2norm``; a division by an
    IEEE square root rather than torch's ``rsqrt``, whose vector and scalar paths may differ)."""
    return x / torch.sqrt(ops.row_sum((x * x).contiguous()) + L2NORM_EPS).unsqueeze(-1)


def chunk_forward(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, ops: ChunkOps, *, scale: float, use_qk_l2norm: bool,
                  fold: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunk per leading index: ``q, k [.., C, dk]``, ``v [.., C, dv]``, ``g, beta [.., C]``
    (fp32, absent rows exact zeros), ``state [.., dk, dv]`` the boundary state. Returns the rows'
    outputs ``[.., C, dv]`` (None when `q` is None: a fold alone) and, when `fold`, the state
    after the chunk (steps in the module docstring)."""
    c = k.shape[-2]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    if use_qk_l2norm:
        k = l2norm(k, ops)
    cum = ops.prefix_sum(g)  # G [.., C]
    lower = _lower(c, k.device, strict=False)
    strict = _lower(c, k.device, strict=True)
    decay = _pair_decay(cum, lower, ops)  # exp(G_i - G_j) for j <= i, else 0
    k_beta = k * beta.unsqueeze(-1)
    t = ops.solve(torch.where(strict, ops.mm(k_beta, k) * decay, zero))
    u = ops.mm(t, (v * beta.unsqueeze(-1)).transpose(-1, -2))
    w = ops.mm(t, (k_beta * ops.exp(cum).unsqueeze(-1)).transpose(-1, -2))
    state_t = state.transpose(-1, -2)  # [.., dv, dk]
    v_new = u - ops.mm(w, state_t)
    out = None
    if q is not None:
        q = (l2norm(q, ops) if use_qk_l2norm else q) * scale
        attn = torch.where(lower, ops.mm(q, k) * decay, zero)
        out = ops.mm(q * ops.exp(cum).unsqueeze(-1), state_t) + ops.mm(attn, v_new.transpose(-1, -2))
    if not fold:
        return out, None
    last = cum[..., -1:]
    k_decayed = k * ops.exp(last - cum).unsqueeze(-1)
    new_state = state * ops.exp(last).unsqueeze(-1) + ops.mm(k_decayed.transpose(-1, -2), v_new.transpose(-1, -2))
    return out, new_state


# Public names of the masks and decays the backward's reference shares (`gated_delta_backward_reference`).
lower_mask, pair_decay = _lower, _pair_decay
