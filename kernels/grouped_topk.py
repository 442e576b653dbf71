"""grouped_topk: sigmoid group-limited top-k expert selection (DeepSeek-V3 "noaux_tc").

``scores = sigmoid(router_logits)`` in fp32 and ``choice = scores + e_score_correction_bias``
(the bias only steers selection). The experts split into ``n_group`` contiguous groups; a
group's score is the sum of its 2 largest ``choice`` (its one value for single-expert groups);
the ``topk_group`` best groups are kept, and the ``top_k`` largest ``choice`` among their
experts are picked. Weights are the picked *scores*, divided by their sum + 1e-20 when
``norm_topk_prob``, times ``routed_scaling_factor``: HF's ``DeepseekV3TopkRouter`` after its
logits. Returns fp32 weights ``[T, k]`` and int64 expert ids ``[T, k]``, rank 0 (the highest
``choice``) first; ties, for groups and for experts, go to the lowest index.

Invariance contract: per token (docs/design.md rules 3, 4): one program per row over an
``[n_group, group size]`` tile, padded to powers of two fixed by the model; element-wise
sigmoid; selection by repeated max with the lowest index among ties; the picked scores are
summed sequentially over ranks. Nothing depends on the number of rows. The reference uses
`exact_math.sigmoid` and the same rules. The backward (through the weights to the router
logits; the bias gets none) is analytic, in element-wise torch ops over ranks.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import launch_warps, next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

_EPS = 1e-20  # HF's denominator guard


@triton.jit
def _grouped_topk_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, sel_ptr, stride, n_group, group_size,
                         scale, TOP_K: tl.constexpr, TOPK_GROUP: tl.constexpr, NORM: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_GS: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_GS)
    valid = (g[:, None] < n_group) & (j[None, :] < group_size)
    # [BLOCK_G, BLOCK_GS] tile of expert indices; padding cells alias the next group's: mask with `valid`
    expert = g[:, None] * group_size + j[None, :]
    x = tl.load(logits_ptr + row * stride + expert, mask=valid, other=0.0).to(tl.float32)
    # a NaN row (a CUDA-graph padding row attends over nothing) must still pick in-range experts
    x = tl.where(x == x, x, float("-inf"))
    s = 1.0 / (1.0 + tl.exp(-x))
    bias = tl.load(bias_ptr + expert, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, s + bias, float("-inf"))
    # group score: the two largest choices of each group (the first, for groups of one)
    first = tl.max(choice, axis=1)
    j1 = tl.argmax(choice, axis=1)
    second = tl.max(tl.where(j[None, :] == j1[:, None], float("-inf"), choice), axis=1)
    group_score = first + tl.where(second == float("-inf"), 0.0, second)
    kept = g < 0
    for _ in tl.static_range(TOPK_GROUP):
        gi = tl.argmax(group_score, axis=0)  # lowest index among equal maxima
        kept = kept | (g == gi)
        group_score = tl.where(g == gi, float("-inf"), group_score)
    remaining = tl.where(kept[:, None], choice, float("-inf"))
    k = tl.arange(0, BLOCK_K)
    sel = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    total = 0.0
    for r in tl.static_range(TOP_K):
        best = tl.max(tl.max(remaining, axis=1), axis=0)
        idx = tl.min(tl.min(tl.where(remaining == best, expert, 1 << 30), axis=1), axis=0)  # lowest index
        picked = tl.sum(tl.sum(tl.where(valid & (expert == idx), s, 0.0), axis=1), axis=0)
        sel = tl.where(k == r, picked, sel)
        ids = tl.where(k == r, idx.to(tl.int64), ids)
        total += picked  # sequential over ranks
        remaining = tl.where(expert == idx, float("-inf"), remaining)
    w = sel
    if NORM:
        w = sel / (total + 1e-20)
    out = row * TOP_K + k
    tl.store(sel_ptr + out, sel, mask=k < TOP_K)
    tl.store(ids_ptr + out, ids, mask=k < TOP_K)
    tl.store(weights_ptr + out, w * scale, mask=k < TOP_K)


def _rank_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last (rank) dimension, sequentially: element-wise ops only."""
    total = torch.zeros_like(x[:, 0])
    for r in range(x.shape[1]):
        total = total + x[:, r]
    return total


def _pick(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest of each row by repeated max (CPU max returns the first index)."""
    remaining = values.clone()
    ids = torch.empty(values.shape[0], k, dtype=torch.int64)
    for r in range(k):
        ids[:, r] = remaining.argmax(dim=1)
        remaining.scatter_(1, ids[:, r:r + 1], float("-inf"))
    return ids


def sigmoid_grouped_topk_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                                   topk_group: int, norm: bool, scale: float):
    """CPU reference: (weights, ids, picked sigmoid scores), each ``[T, k]``. NaN logits count
    as -inf (score 0), as in the kernel."""
    scores = exact_math.sigmoid(logits.masked_fill(logits.isnan(), float("-inf")))
    choice = scores + bias.to(scores.dtype)
    rows, experts = choice.shape
    grouped = choice.view(rows, n_group, experts // n_group)
    first, j1 = grouped.max(dim=2)
    group_score = first
    if grouped.shape[2] > 1:
        group_score = first + grouped.scatter(2, j1[..., None], float("-inf")).amax(dim=2)
    kept = torch.zeros(rows, n_group, dtype=torch.bool).scatter_(1, _pick(group_score, topk_group), True)
    choice = grouped.masked_fill(~kept[..., None], float("-inf")).view(rows, experts)
    ids = _pick(choice, top_k)
    sel = scores.gather(1, ids)
    weights = sel / (_rank_sum(sel)[:, None] + _EPS) if norm else sel
    return weights * scale, ids, sel


class _GroupedTopkFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, norm, scale):
        weights, ids, sel = _route(logits, bias, top_k, n_group, topk_group, norm, scale)
        ctx.save_for_backward(sel, weights, ids)
        ctx.norm, ctx.scale, ctx.experts = norm, scale, logits.shape[1]
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids):
        sel, weights, ids = ctx.saved_tensors
        g = grad_weights.to(sel.dtype)
        if ctx.norm:  # w_j = c s_j / D, D = S + eps: dL/ds_j = (c g_j - sum_i g_i w_i) / D
            denom = _rank_sum(sel) + _EPS
            ds = (ctx.scale * g - _rank_sum(g * weights)[:, None]) / denom[:, None]
        else:  # w_j = c s_j
            ds = ctx.scale * g
        grad = torch.zeros(sel.shape[0], ctx.experts, dtype=sel.dtype, device=sel.device)
        grad.scatter_(1, ids, ds * sel * (1.0 - sel))  # d sigmoid = s (1 - s)
        return grad, None, None, None, None, None, None


#: warps of a routing program: its tile is one token's experts (64 for Moonlight, 256 for
#: DeepSeek-V3), and every pick is a chain of reductions; across warps each goes through shared
#: memory and a barrier, within one warp through shuffles. The picks are exact (max, min, a sum of
#: one nonzero score), so the warps change no bit. One warp: 1.5-1.8x four at 16-256 tokens of
#: Moonlight and DeepSeek-V3 (`benchmarks/moe_routing.py`, H200, 2026-11-28).
ROUTER_WARPS = 1


def _route(logits, bias, top_k, n_group, topk_group, norm, scale):
    if select("grouped_topk", logits) == "reference":
        return sigmoid_grouped_topk_reference(logits, bias, top_k, n_group, topk_group, norm, scale)
    return sigmoid_grouped_topk_triton(logits, bias, top_k, n_group, topk_group, norm, scale)


def sigmoid_grouped_topk_triton(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                                norm: bool, scale: float, num_warps: int | None = None):
    """(weights, ids, picked sigmoid scores), each ``[T, k]``, by the Triton kernel: one program
    per token of `num_warps` warps (None: `ROUTER_WARPS`; every choice gives the same bits, which
    `benchmarks/moe_routing.py` checks as it times them)."""
    require_triton("grouped_topk")
    warps = launch_warps("sigmoid_grouped_topk_triton", num_warps, ROUTER_WARPS)
    rows, experts = logits.shape
    weights, sel = (torch.empty(rows, top_k, device=logits.device, dtype=torch.float32) for _ in range(2))
    ids = torch.empty(rows, top_k, device=logits.device, dtype=torch.int64)
    if rows:
        _grouped_topk_kernel[(rows,)](logits, bias, weights, ids, sel, logits.stride(0), n_group,
                                      experts // n_group, float(scale), TOP_K=top_k, TOPK_GROUP=topk_group,
                                      NORM=norm, BLOCK_G=next_power_of_2(n_group),
                                      BLOCK_GS=next_power_of_2(experts // n_group),
                                      BLOCK_K=next_power_of_2(top_k), num_warps=warps,
                                      **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
    return weights, ids, sel


def _validate(logits, bias, top_k, n_group, topk_group) -> None:
    if logits.dim() != 2:
        raise ValueError(f"sigmoid_grouped_topk: router_logits must be [tokens, experts]; got shape "
                         f"{tuple(logits.shape)}")
    experts = logits.shape[1]
    if tuple(bias.shape) != (experts,):
        raise ValueError(f"sigmoid_grouped_topk: e_score_correction_bias must have shape ({experts},) "
                         f"(one per expert); got {tuple(bias.shape)}")
    if n_group < 1 or experts % n_group:
        raise ValueError(f"sigmoid_grouped_topk: n_group={n_group} must be >= 1 and divide the {experts} experts")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"sigmoid_grouped_topk: topk_group={topk_group} must be in [1, n_group={n_group}]")
    limit = topk_group * (experts // n_group)
    if not 1 <= top_k <= limit:
        raise ValueError(f"sigmoid_grouped_topk: top_k={top_k} must be in [1, {limit}] (topk_group={topk_group} "
                         f"groups of {experts // n_group} experts)")


def sigmoid_grouped_topk(router_logits: torch.Tensor, e_score_correction_bias: torch.Tensor, top_k: int,
                         n_group: int, topk_group: int, norm_topk_prob: bool,
                         routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 ``[T, k]``, expert ids int64 ``[T, k]``) from router logits ``[T, E]``.

    DeepSeek-V3 selection (see the module docstring); ids in rank order. Differentiable in
    the logits through the weights; the bias gets no gradient. Raises ValueError on shapes or
    group settings that do not fit.
    """
    _validate(router_logits, e_score_correction_bias, top_k, n_group, topk_group)
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    # the bias in its own dtype: the kernel widens it to fp32 as it loads it, the reference to the
    # scores' dtype, so a bf16 bias (a model cast whole) costs no cast launch per layer
    bias = e_score_correction_bias.detach().to(device=logits.device).contiguous()
    args = (top_k, n_group, topk_group, bool(norm_topk_prob), float(routed_scaling_factor))
    if torch.is_grad_enabled() and logits.requires_grad:
        return _GroupedTopkFunction.apply(logits, bias, *args)
    weights, ids, _ = _route(logits, bias, *args)
    return weights, ids
