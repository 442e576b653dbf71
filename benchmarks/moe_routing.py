"""The MoE routing kernels of a decode step, each launch shape beside the torch ops HF runs, in
CUDA graphs (CUDA only).

A decode step of an MoE model runs, per layer, the router's top-k (`sigmoid_grouped_topk` for
DeepSeek-V3 and Moonlight, `softmax_topk` for Qwen3-MoE) and `moe_align` (the pairs grouped by
expert for the grouped GEMMs) between the router GEMM and the experts: a few kilobytes of work
whose launches sit on the step's critical path. This times each kernel at the decode batches of
the published shapes under every warp count (and, for `moe_align`, pairs per program), and says
whether the outputs equal the current launch's bit for bit: `grouped_topk` and `moe_align` must
("yes" in every row: their picks and layouts are exact); `softmax_topk`'s sum follows the
program's layout, so another warp count is another set of bits, shown for what it would cost to
change. The peer is the torch ops HF's routers run (sigmoid / softmax, topk, gather, normalize)
and `moe_align_reference` (sort, cumsum, searchsorted, ...), timed in the same graphs.

Usage: python benchmarks/moe_routing.py [--tokens 16,64,128,256]
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import bench_graph, graph_us_or_none, positive_ints, table

#: (model, experts, top_k, n_group, topk_group, routed_scaling_factor); n_group None: softmax routing
SHAPES = (("moonlight", 64, 6, 1, 1, 2.446), ("deepseek-v3", 256, 8, 8, 4, 2.5), ("qwen3-30b-a3b", 128, 8, None, None, 1.0))
WARPS = (1, 2, 4, 8)
PAIRS = (8, 16, 32, 64)


def hf_grouped_topk(logits, bias, top_k: int, n_group: int, topk_group: int, scale: float):
    """HF `DeepseekV3TopkRouter`'s selection after its logits, in torch ops (the peer)."""
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(logits.shape[0], n_group, -1).topk(min(2, logits.shape[1] // n_group), dim=-1)[0].sum(-1)
    group_idx = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    mask = group_mask.unsqueeze(-1).expand(-1, n_group, logits.shape[1] // n_group).reshape(logits.shape[0], -1)
    ids = choice.masked_fill(~mask.bool(), 0.0).topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    return weights / (weights.sum(-1, keepdim=True) + 1e-20) * scale, ids


def hf_softmax_topk(logits, top_k: int):
    """HF `Qwen3MoeSparseMoeBlock`'s routing after its logits, in torch ops (the peer)."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = probs.topk(top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids


def _row(kernel: str, candidate: str, us, peer_us: float, same: str) -> list:
    if us is None:
        return [kernel, candidate, "-", "-", same]
    return [kernel, candidate, f"{us:.1f}", f"{peer_us / us:.2f}x", same]


def router_rows(experts: int, top_k: int, n_group, topk_group, scale: float, tokens: int) -> list[list]:
    """The router's candidates at `tokens` rows: time, speed-up over the torch peer, same bits."""
    from vexact_models.kernels.grouped_topk import ROUTER_WARPS as GROUPED_WARPS
    from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk_triton
    from vexact_models.kernels.moe_routing import ROUTER_WARPS as SOFTMAX_WARPS
    from vexact_models.kernels.moe_routing import softmax_topk_triton

    gen = torch.Generator(device="cuda").manual_seed(tokens * 7 + experts)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen).bfloat16()
    if n_group is None:
        kernel, default = "softmax_topk", SOFTMAX_WARPS
        run = lambda w: softmax_topk_triton(logits, top_k, True, num_warps=w)[:2]  # noqa: E731
        peer = lambda: hf_softmax_topk(logits, top_k)  # noqa: E731
    else:
        kernel, default = "grouped_topk", GROUPED_WARPS
        bias = (torch.rand(experts, device="cuda", generator=gen) * 0.1).bfloat16()
        run = lambda w: sigmoid_grouped_topk_triton(logits, bias, top_k, n_group, topk_group, True, scale,  # noqa: E731
                                                    num_warps=w)[:2]
        peer = lambda: hf_grouped_topk(logits.float(), bias.float(), top_k, n_group, topk_group, scale)  # noqa: E731
    peer_us = bench_graph([peer]) * 1e3  # the torch ops always launch: a failure here is a real one
    rows = [[f"{kernel} (torch peer)", "HF ops", f"{peer_us:.1f}", "1.00x", ""]]
    want = run(default)
    for warps in WARPS:
        got = run(warps)
        same = "yes" if all(torch.equal(a, b) for a, b in zip(got, want)) else "NO"
        us = graph_us_or_none(lambda: run(warps))
        rows.append(_row(kernel, f"{warps} warps{' (now)' if warps == default else ''}", us,
                         peer_us, same))
    return rows


def align_rows(experts: int, top_k: int, tokens: int) -> list[list]:
    """`moe_align`'s candidates at `tokens` rows of `top_k` ids of `experts`, tiles as the model picks."""
    from vexact_models.kernels.moe_align import ALIGN_WARPS, PAIRS_PER_PROGRAM, moe_align_reference, moe_align_triton
    from vexact_models.kernels.moe_config import pick_config

    block_m = pick_config(tokens, top_k, experts).block_m
    gen = torch.Generator(device="cuda").manual_seed(tokens * 13 + experts)
    ids = torch.rand(tokens, experts, device="cuda", generator=gen).topk(top_k, dim=-1).indices
    fields = ("sorted_pairs", "pair_pos", "block_expert", "expert_offsets")
    want = moe_align_reference(ids, experts, block_m)
    peer_us = bench_graph([lambda: moe_align_reference(ids, experts, block_m)]) * 1e3
    rows = [["moe_align (torch peer)", f"torch ops, block_m {block_m}", f"{peer_us:.1f}", "1.00x", ""]]
    for warps in WARPS:
        for pairs in PAIRS:
            got = moe_align_triton(ids, experts, block_m, num_warps=warps, pairs_per_program=pairs)
            same = "yes" if all(torch.equal(getattr(got, f), getattr(want, f)) for f in fields) else "NO"
            now = " (now)" if (warps, pairs) == (ALIGN_WARPS, PAIRS_PER_PROGRAM) else ""
            us = graph_us_or_none(lambda: moe_align_triton(ids, experts, block_m, num_warps=warps,
                                                           pairs_per_program=pairs))
            rows.append(_row("moe_align", f"{warps} warps, {pairs} pairs{now}", us, peer_us, same))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_ints, default=[16, 64, 128, 256], metavar="T,T,...",
                        help="decode batches (tokens per step) to time (default 16,64,128,256)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe_routing.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, experts, top_k, n_group, topk_group, scale in SHAPES:
        for tokens in args.tokens:
            rows = router_rows(experts, top_k, n_group, topk_group, scale, tokens)
            rows += align_rows(experts, top_k, tokens)
            table(f"{name}: {tokens} tokens, top-{top_k} of {experts} experts (microseconds in a CUDA graph)",
                  ["kernel", "launch", "us", "vs torch", "same bits"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
