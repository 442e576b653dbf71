"""moe_routing: softmax top-k expert selection (Qwen3-MoE / Mixtral style).

``probs = softmax(router_logits)`` in fp32, the ``top_k`` largest (ties: lowest expert index,
then in decreasing order), renormalised to sum 1 when ``norm_topk_prob``. Returns fp32
weights ``[T, k]`` and int64 expert ids ``[T, k]``, rank 0 first.

Invariance contract: per token (docs/design.md rules 3, 4): one program per row with a block over
the experts fixed by their count; selection by repeated argmax. The reference uses
`exact_math.softmax` and the same selection rule. The backward (through the weights to the
router logits) is analytic, in fp32 torch ops.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import launch_warps, next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs


@triton.jit
def _softmax_topk_kernel(logits_ptr, weights_ptr, ids_ptr, probs_ptr, E, stride, TOP_K: tl.constexpr,
                         NORM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    x = tl.load(logits_ptr + row * stride + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    probs = e / tl.sum(e, axis=0)
    tl.store(probs_ptr + row * E + cols, probs, mask=cols < E)
    remaining = tl.where(cols < E, probs, -1.0)
    # the k picks stay in registers (BLOCK_K lanes, any k) and are stored once
    ranks = tl.arange(0, BLOCK_K)
    weights = tl.zeros([BLOCK_K], dtype=tl.float32)
    ids = tl.zeros([BLOCK_K], dtype=tl.int64)
    total = 0.0
    for r in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        idx = tl.argmax(remaining, axis=0)  # lowest index among equal maxima
        weights = tl.where(ranks == r, best, weights)
        ids = tl.where(ranks == r, idx.to(tl.int64), ids)
        total += best
        remaining = tl.where(cols == idx, -1.0, remaining)
    if NORM:
        weights = weights / total
    tl.store(ids_ptr + row * TOP_K + ranks, ids, mask=ranks < TOP_K)
    tl.store(weights_ptr + row * TOP_K + ranks, weights, mask=ranks < TOP_K)


def softmax_topk_reference(logits: torch.Tensor, top_k: int, norm: bool):
    probs = exact_math.softmax(logits)
    remaining = probs.clone()
    weights = torch.empty(logits.shape[0], top_k, dtype=probs.dtype)
    ids = torch.empty(logits.shape[0], top_k, dtype=torch.int64)
    total = torch.zeros(logits.shape[0], dtype=probs.dtype)
    for r in range(top_k):
        best, idx = remaining.max(dim=1)  # CPU max returns the first index of the maximum
        weights[:, r], ids[:, r] = best, idx
        total = total + best  # sequential over ranks
        remaining.scatter_(1, idx[:, None], -1.0)
    if norm:
        weights = weights / total[:, None]
    return weights, ids, probs


class _RoutingFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, norm):
        weights, ids, probs = _route(logits, top_k, norm)
        ctx.save_for_backward(probs, weights, ids)
        ctx.norm = norm
        ctx.mark_non_differentiable(ids)
        return weights, ids

    @staticmethod
    def backward(ctx, grad_weights, _grad_ids):
        probs, weights, ids = ctx.saved_tensors
        g = grad_weights.to(probs.dtype)
        if ctx.norm:  # w_j = s_j / S: dL/ds_j = (g_j - sum_i g_i w_i) / S
            selected = probs.gather(1, ids)
            g = (g - (g * weights).sum(1, keepdim=True)) / selected.sum(1, keepdim=True)
        grad_probs = torch.zeros_like(probs).scatter_(1, ids, g)
        grad_logits = probs * (grad_probs - (grad_probs * probs).sum(1, keepdim=True))
        return grad_logits, None, None


#: warps of a routing program (one token's experts). Unlike `grouped_topk`'s picks, the softmax's
#: sum follows the program's layout, so the warps are part of the bits: fixed here, never by batch.
#: One warp (4 until 2026-11-28): 4.2 -> 2.6 us a launch at Qwen3-30B-A3B's 128-256
#: decode tokens (`benchmarks/moe_routing.py`), with `kernel_invariance --only moe` at 0
#: mismatches and the MoE tests passing on the H200 under the new bits.
ROUTER_WARPS = 1


def _route(logits: torch.Tensor, top_k: int, norm: bool):
    if select("moe_routing", logits) == "reference":
        return softmax_topk_reference(logits, top_k, norm)
    return softmax_topk_triton(logits, top_k, norm)


def softmax_topk_triton(logits: torch.Tensor, top_k: int, norm: bool, num_warps: int | None = None):
    """(weights, ids, probs) by the Triton kernel, one program per token of `num_warps` warps
    (None: `ROUTER_WARPS`, what the models run). Another warp count sums the softmax in another
    order: for `benchmarks/moe_routing.py` to time, not for a model to mix with the default."""
    require_triton("moe_routing")
    warps = launch_warps("softmax_topk_triton", num_warps, ROUTER_WARPS)
    rows, experts = logits.shape
    weights = torch.empty(rows, top_k, device=logits.device, dtype=torch.float32)
    ids = torch.empty(rows, top_k, device=logits.device, dtype=torch.int64)
    probs = torch.empty(rows, experts, device=logits.device, dtype=torch.float32)
    if rows:
        _softmax_topk_kernel[(rows,)](logits, weights, ids, probs, experts, logits.stride(0), TOP_K=top_k,
                                      NORM=norm, BLOCK_E=next_power_of_2(experts), BLOCK_K=next_power_of_2(top_k),
                                      num_warps=warps, **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
    return weights, ids, probs


def softmax_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights fp32 ``[T, k]``, expert ids int64 ``[T, k]``) from router logits ``[T, E]``.

    Differentiable in the logits through the weights.
    """
    if router_logits.dim() != 2 or not 1 <= top_k <= router_logits.shape[1]:
        raise ValueError(f"softmax_topk: need [tokens, experts] logits and 1 <= top_k <= experts; got shape "
                         f"{tuple(router_logits.shape)} and top_k={top_k}")
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    if torch.is_grad_enabled() and logits.requires_grad:
        return _RoutingFunction.apply(logits, top_k, norm_topk_prob)
    weights, ids, _ = _route(logits, top_k, norm_topk_prob)
    return weights, ids
