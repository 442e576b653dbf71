"""Fused MoE forward and backward beside a per-expert loop of torch.matmul and beside cuBLAS on
a dense GEMM of the same FLOPs, in the same run (CUDA only).

Shapes: Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert intermediate 768),
random weights, uniformly random routing, bf16; 1, 64, 512, 4096 and 16384 tokens.
- loop: HF's way: for each expert with tokens, gather, two matmuls, SiLU-and-mul, scale, index_add.
- dense: a [T*k, 2048] x [2048, 3*768]-FLOP-equivalent cuBLAS GEMM pair (same FLOPs as the experts).
Targets (issue 4): forward >= 5x the loop at 4096 tokens; >= 50% of the dense cuBLAS TFLOP/s at 16384.

Usage: python benchmarks/moe.py [--sweep]   (--sweep: time each MoE kernel's tile configs at 16384 tokens)
"""

from __future__ import annotations

import sys

import torch

from bench_utils import bench


def loop_moe(x, gate_up, down, weights, ids):
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        t, r = (ids == expert).nonzero(as_tuple=True)
        gu = x[t] @ gate_up[expert].t()
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, t, (act @ down[expert].t()) * weights[t, r, None].to(x.dtype))
    return out


def sweep() -> None:
    """Each grouped kernel alone at 16384 tokens under candidate tile configs."""
    from vexact_models.kernels.moe import MoeConfig, grouped_gemm, moe_align, moe_gate_up_kernel
    import triton

    hidden, experts, inter, top_k, tokens = 2048, 128, 768, 8, 16384
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, -1).indices
    for bm, bn, warps, stages in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 4), (128, 256, 8, 3),
                                  (64, 128, 4, 4), (128, 128, 4, 3)):
        cfg = MoeConfig(bm, bn, warps, stages, bn, warps, stages)
        layout = moe_align(ids, experts, bm)
        rows = layout.sorted_pairs.shape[0]
        act = torch.empty(rows, inter, device="cuda", dtype=torch.bfloat16)

        def gate_up_kernel():
            moe_gate_up_kernel[(rows // bm, triton.cdiv(inter, bn))](
                x, gate_up, act, act, layout.sorted_pairs, layout.block_expert, layout.num_pairs, hidden, inter,
                x.stride(0), gate_up.stride(0), gate_up.stride(1), gate_up.stride(2), act.stride(0), act.stride(0),
                TOP_K=top_k, SAVE_PREACT=False, INPUT_PRECISION="tf32", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64,
                num_warps=warps, num_stages=stages)

        line = f"BM={bm} BN={bn} warps={warps} stages={stages}:"
        for name, fn, flops in (
                ("gate_up", gate_up_kernel, 2 * tokens * top_k * hidden * 2 * inter),
                ("down", lambda: grouped_gemm(act, down, layout, hidden, inter, down.stride(1), down.stride(2),
                                              torch.bfloat16, cfg), 2 * tokens * top_k * hidden * inter)):
            try:
                t = bench(fn)
                line += f"  {name} {t * 1e3:.0f} us {flops / t / 1e9:.0f} TFLOP/s"
            except Exception as exc:  # out of shared memory / registers
                line += f"  {name} {type(exc).__name__}"
        print(line, flush=True)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time each MoE kernel's tile configs at 16384 tokens")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sweep:
        sweep()
        return 0
    from vexact_models.kernels.moe import fused_moe

    torch.manual_seed(0)
    hidden, experts, inter, top_k = 2048, 128, 768, 8
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16().requires_grad_()
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16().requires_grad_()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; MoE hidden {hidden}, {experts} experts, "
          f"top-{top_k}, expert intermediate {inter}, bf16")
    print(f"{'tokens':>7} {'fused fwd us':>13} {'loop fwd us':>12} {'fwd vs loop':>12} {'fused TFLOP/s':>14} "
          f"{'dense TFLOP/s':>14} {'vs dense':>9} {'fused fwd+bwd us':>17} {'loop fwd+bwd us':>16} {'bwd vs loop':>12}")
    for tokens in (1, 64, 512, 4096, 16384):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16().requires_grad_()
        logits = torch.randn(tokens, experts, device="cuda")
        probs = torch.softmax(logits, -1)
        w, ids = probs.topk(top_k, -1)
        w = (w / w.sum(-1, keepdim=True)).requires_grad_()
        with torch.no_grad():
            t_fused = bench(lambda: fused_moe(x, gate_up, down, w, ids))
            t_loop = bench(lambda: loop_moe(x, gate_up, down, w, ids))
        flops = 2 * tokens * top_k * hidden * 3 * inter
        a = torch.randn(tokens * top_k, hidden, device="cuda").bfloat16()
        b1 = torch.randn(2 * inter, hidden, device="cuda").bfloat16()
        b2 = torch.randn(hidden, inter, device="cuda").bfloat16()
        c = torch.randn(tokens * top_k, inter, device="cuda").bfloat16()
        t_dense = bench(lambda: (a @ b1.t(), c @ b2.t()))
        g = torch.randn(tokens, hidden, device="cuda").bfloat16()

        def fused_step():
            torch.autograd.grad(fused_moe(x, gate_up, down, w, ids), (x, gate_up, down, w), g)

        def loop_step():
            torch.autograd.grad(loop_moe(x, gate_up, down, w, ids), (x, gate_up, down, w), g)

        t_fused_bwd = bench(fused_step)
        t_loop_bwd = bench(loop_step)
        print(f"{tokens:>7} {t_fused * 1e3:>13.1f} {t_loop * 1e3:>12.1f} {t_loop / t_fused:>11.1f}x "
              f"{flops / t_fused / 1e9:>14.0f} {flops / t_dense / 1e9:>14.0f} {t_dense / t_fused:>8.2f}x "
              f"{t_fused_bwd * 1e3:>17.1f} {t_loop_bwd * 1e3:>16.1f} {t_loop_bwd / t_fused_bwd:>11.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
