"""Fused MoE forward and backward beside a per-expert loop of torch.matmul and beside cuBLAS on
a dense GEMM of the same FLOPs, in the same run (CUDA only).

Shapes: Qwen3-30B-A3B's MoE layer (hidden 2048, 128 experts, top-8, expert intermediate 768),
random weights, uniformly random routing, bf16; 1, 64, 512, 4096 and 16384 tokens.
- loop: HF's way: for each expert with tokens, gather, two matmuls, SiLU-and-mul, scale, index_add.
- dense: a [T*k, 2048] x [2048, 3*768]-FLOP-equivalent cuBLAS GEMM pair (same FLOPs as the experts).
Targets: forward >= 5x the loop at 4096 tokens; >= 50% of the dense cuBLAS TFLOP/s at 16384.

Usage: python benchmarks/moe.py [--sweep | --decode 64,128,256 | --lora 16]
  --sweep: time each MoE kernel's tile configs (tiles, K tile, TMA descriptors) at 16384 tokens,
           with whether their rows equal the config the model runs there bit for bit;
  --decode: the same at decode batches of the Moonlight and Qwen3-30B-A3B layers, in CUDA graphs;
  --lora: LoRA of that rank (fp32, PEFT's layout) on both expert tensors of the Qwen3-30B-A3B
          layer: fused_moe with the adapters (kernels/moe_lora.py) beside fused_moe without them
          and beside PEFT's way (each expert's effective weight ``W + s B A`` rebuilt by
          ``baddbmm`` every call, then fused_moe), forward and forward + backward (host
          launches: at 64-256 tokens the host's time shows); then the adapters' launches one by
          one in CUDA graphs at 8, 32, 256 and 4096 tokens beside the base GEMMs
          (moe_lora_launches.py).
"""

from __future__ import annotations

import sys

import torch

from bench_utils import bench, positive_ints, table
from moe_lora_launches import launch_rows


def loop_moe(x, gate_up, down, weights, ids):
    inter = down.shape[2]
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        t, r = (ids == expert).nonzero(as_tuple=True)
        gu = x[t] @ gate_up[expert].t()
        act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
        out.index_add_(0, t, (act @ down[expert].t()) * weights[t, r, None].to(x.dtype))
    return out


#: (block_m, block_n, warps, stages, block_k, TMA descriptors) candidates of `sweep`
SWEEP = ((128, 128, 8, 3, 64, False), (128, 128, 8, 4, 64, False), (128, 64, 4, 4, 64, False),
         (128, 256, 8, 3, 64, False), (64, 128, 4, 4, 64, False), (128, 128, 8, 2, 128, False),
         (128, 128, 8, 3, 64, True), (128, 128, 8, 4, 64, True), (128, 64, 4, 4, 64, True), (128, 256, 8, 3, 64, True),
         (64, 128, 4, 4, 64, True), (128, 128, 4, 4, 64, True), (128, 256, 8, 4, 64, True))


def _reference_rows(x, gate_up, down, ids, top_k: int, cfg):
    """Each (token, rank) pair's gate/up and down rows under `cfg`, in pair order: what a
    candidate config's rows must equal bit for bit."""
    from vexact_models.kernels.moe import gate_up_act, moe_align
    from vexact_models.kernels.moe_grouped_gemm import grouped_gemm

    layout = moe_align(ids, down.shape[0], cfg.block_m)
    pos = layout.pair_pos.long()
    act = gate_up_act(x, gate_up, layout, top_k, cfg)[0]
    y = grouped_gemm(act, down, layout, down.shape[1], down.shape[2], down.stride(1), down.stride(2), x.dtype, cfg,
                     down_tiles=True)
    return act[pos], y[pos]


def _placed(rows: torch.Tensor, layout) -> torch.Tensor:
    """Pair-ordered `rows` placed where `layout` puts each pair (padding rows zero): a down-kernel
    input for that layout."""
    out = torch.zeros(layout.sorted_pairs.shape[0], rows.shape[1], device=rows.device, dtype=rows.dtype)
    out[layout.pair_pos.long()] = rows
    return out


def sweep() -> None:
    """Each grouped kernel alone at 16384 tokens under candidate tile configs, and whether its rows
    equal `LARGE`'s (what the model runs there) bit for bit."""
    from vexact_models.kernels.moe import gate_up_act, moe_align
    from vexact_models.kernels.moe_grouped_gemm import grouped_gemm
    from vexact_models.kernels.moe_config import LARGE, MoeConfig

    hidden, experts, inter, top_k, tokens = 2048, 128, 768, 8, 16384
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, -1).indices
    ref_act, ref_y = _reference_rows(x, gate_up, down, ids, top_k, LARGE)
    for bm, bn, warps, stages, bk, tma in SWEEP:
        cfg = MoeConfig(bm, bn, warps, stages, bn, warps, stages, bk, bk, tma)
        layout = moe_align(ids, experts, bm)
        pos = layout.pair_pos.long()
        act = _placed(ref_act, layout)  # down's input: the reference rows
        line = f"BM={bm} BN={bn} BK={bk} warps={warps} stages={stages}{' TMA' if tma else ''}:"
        for name, fn, want, flops in (
                ("gate_up", lambda: gate_up_act(x, gate_up, layout, top_k, cfg)[0], ref_act,
                 2 * tokens * top_k * hidden * 2 * inter),
                ("down", lambda: grouped_gemm(act, down, layout, hidden, inter, down.stride(1), down.stride(2),
                                              torch.bfloat16, cfg), ref_y, 2 * tokens * top_k * hidden * inter)):
            try:
                same = torch.equal(fn()[pos], want)
                t = bench(fn)
                line += f"  {name} {t * 1e3:.0f} us {flops / t / 1e9:.0f} TFLOP/s {'same bits' if same else 'BITS DIFFER'}"
            except Exception as exc:  # out of shared memory / registers
                line += f"  {name} {type(exc).__name__}"
        print(line, flush=True)


#: (name, hidden, experts, expert intermediate, top-k) of the decode sweep's MoE layers
DECODE_SHAPES = (("moonlight", 2048, 64, 1408, 6), ("30b-a3b", 2048, 128, 768, 8))
#: (block_m, block_n, warps, stages, block_k[, TMA descriptors]) candidates of each kernel in the decode sweep
DECODE_GATE_UP = ((64, 64, 4, 3, 64), (64, 64, 4, 4, 64), (64, 128, 4, 4, 64), (64, 128, 8, 4, 64),
                  (32, 64, 4, 4, 64), (16, 64, 4, 4, 64), (16, 128, 4, 4, 64),
                  (64, 64, 4, 3, 128), (64, 64, 4, 2, 128), (32, 64, 4, 3, 128), (16, 64, 4, 3, 128),
                  (16, 64, 4, 4, 128), (16, 128, 4, 3, 128), (64, 64, 8, 3, 128),
                  (16, 64, 4, 3, 128, True), (32, 64, 4, 3, 128, True), (64, 64, 4, 3, 64, True))
DECODE_DOWN = ((64, 64, 4, 3, 64), (64, 128, 4, 3, 64), (64, 128, 8, 3, 64), (32, 64, 4, 4, 64), (16, 64, 4, 4, 64),
               (16, 128, 4, 4, 64),
               (64, 64, 4, 3, 128), (64, 64, 4, 2, 128), (64, 64, 4, 4, 128), (64, 128, 4, 3, 128), (64, 128, 8, 3, 128),
               (32, 64, 4, 3, 128), (32, 64, 4, 4, 128), (32, 128, 4, 3, 128), (16, 64, 4, 3, 128),
               (16, 64, 4, 4, 128), (16, 128, 4, 3, 128), (64, 64, 8, 3, 128),
               (16, 128, 4, 3, 128, True), (32, 64, 4, 4, 128, True), (64, 64, 4, 3, 64, True))


def decode_sweep(token_counts: list[int]) -> None:
    """Each grouped kernel alone at decode batches under candidate tiles, in CUDA graphs: microseconds,
    GB/s of the expert weights the batch touches, and whether the rows equal the current config's
    bit for bit (a config the model may take must)."""
    for name, hidden, experts, inter, top_k in DECODE_SHAPES:
        _decode_sweep_layer(name, hidden, experts, inter, top_k, token_counts)
        torch.cuda.empty_cache()


def _decode_sweep_layer(name: str, hidden: int, experts: int, inter: int, top_k: int, token_counts: list[int]) -> None:
    from bench_utils import bench_graph
    from vexact_models.kernels.moe import gate_up_act, moe_align
    from vexact_models.kernels.moe_grouped_gemm import grouped_gemm
    from vexact_models.kernels.moe_config import MoeConfig, pick_config

    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, device="cuda").bfloat16()
        ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, -1).indices
        touched = int(torch.unique(ids).numel())
        now = pick_config(tokens, top_k, experts)
        ref_act, ref_y = _reference_rows(x, gate_up, down, ids, top_k, now)
        rows = []
        for kernel, candidates, nbytes in (("gate_up", DECODE_GATE_UP, 2 * inter * hidden * 2),
                                          ("down", DECODE_DOWN, hidden * inter * 2)):
            for bm, bn, warps, stages, bk, *tma in candidates:
                if inter % bk or hidden % bk:  # a masked K tail could turn a -0.0 sum into +0.0
                    continue
                cfg = MoeConfig(bm, bn, warps, stages, bn, warps, stages, bk, bk, bool(tma))
                tiles = f"{bm}x{bn}x{bk}{' TMA' if tma else ''} w{warps} s{stages}"
                layout = moe_align(ids, experts, bm)
                pos = layout.pair_pos.long()
                if kernel == "gate_up":
                    fn = lambda: gate_up_act(x, gate_up, layout, top_k, cfg)  # noqa: E731
                    rows_of, want = (lambda: fn()[0][pos]), ref_act
                else:
                    act = _placed(ref_act, layout)
                    fn = lambda: grouped_gemm(act, down, layout, hidden, inter, down.stride(1),  # noqa: E731
                                              down.stride(2), torch.bfloat16, cfg)
                    rows_of, want = (lambda: fn()[pos]), ref_y
                try:
                    same = torch.equal(rows_of(), want)
                    ms = bench_graph([fn])
                except Exception as exc:  # out of shared memory / registers
                    rows.append([kernel, tiles, type(exc).__name__, "", ""])
                    continue
                rows.append([kernel, tiles, f"{ms * 1e3:.1f}",
                             f"{touched * nbytes / ms / 1e6:.0f}", "yes" if same else "NO"])
        table(f"{name} MoE at {tokens} tokens ({touched} of {experts} experts touched; now "
              f"{now.block_m}x{now.block_n} / down {now.block_m}x{now.down_block_n})",
              ["kernel", "tiles", "us", "GB/s", "same bits"], rows)


def peft_effective(w: torch.Tensor, lora) -> torch.Tensor:
    """PEFT ``ParamWrapper``'s effective expert tensor: ``W + scaling * B_e A_e`` by one
    ``baddbmm`` in W's dtype (its `_LoraFactorsProxy`)."""
    experts, n, k = w.shape
    rank = lora.a.shape[0] // experts
    b = lora.b.view(n, rank, experts).permute(2, 0, 1).to(w.dtype)
    return torch.baddbmm(w, b, lora.a.view(experts, rank, k).to(w.dtype), alpha=lora.scaling)


def lora_table(rank: int) -> None:
    """The ``--lora`` table (module docstring)."""
    from vexact_models.kernels import ExpertLora
    from vexact_models.kernels.moe import fused_moe

    torch.manual_seed(0)
    hidden, experts, inter, top_k = 2048, 128, 768, 8
    gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden ** 0.5).bfloat16()
    down = (torch.randn(experts, hidden, inter, device="cuda") / inter ** 0.5).bfloat16()

    def adapter(n: int, k: int) -> ExpertLora:
        return ExpertLora((torch.randn(experts * rank, k, device="cuda") / k ** 0.5).requires_grad_(),
                          (torch.randn(n, rank * experts, device="cuda") * 0.01).requires_grad_(), 2.0)
    gu_lora, down_lora = adapter(2 * inter, hidden), adapter(hidden, inter)
    leaves = (gu_lora.a, gu_lora.b, down_lora.a, down_lora.b)
    print(f"{torch.cuda.get_device_name()}; Qwen3-30B-A3B MoE layer, bf16, LoRA r={rank} (fp32) on gate_up and down")
    rows = []
    for tokens in (64, 256, 4096, 16384):
        x = torch.randn(tokens, hidden, device="cuda").bfloat16().requires_grad_()
        w, ids = torch.softmax(torch.randn(tokens, experts, device="cuda"), -1).topk(top_k, -1)
        g = torch.randn(tokens, hidden, device="cuda").bfloat16()

        def plain():
            return fused_moe(x, gate_up, down, w, ids)

        def ours():
            return fused_moe(x, gate_up, down, w, ids, gate_up_lora=gu_lora, down_lora=down_lora)

        def peft():
            return fused_moe(x, peft_effective(gate_up, gu_lora), peft_effective(down, down_lora), w, ids)

        with torch.no_grad():
            fwd = [bench(f) for f in (plain, ours, peft)]
        step = [bench(lambda f=f, extra=extra: torch.autograd.grad(f(), (x, *extra), g))
                for f, extra in ((plain, ()), (ours, leaves), (peft, leaves))]
        rows.append([tokens, *(f"{t * 1e3:.1f}" for t in fwd), f"{fwd[1] / fwd[0]:.2f}x", f"{fwd[2] / fwd[1]:.2f}x",
                     *(f"{t * 1e3:.1f}" for t in step), f"{step[2] / step[1]:.2f}x"])
    table(f"fused_moe with LoRA r={rank} on the experts (us; ratios: time over time)",
          ["tokens", "fwd plain us", "fwd LoRA us", "fwd PEFT-way us", "LoRA / plain", "PEFT-way / LoRA",
           "fwd+bwd plain us", "fwd+bwd LoRA us", "fwd+bwd PEFT-way us", "PEFT-way / LoRA"], rows)


def main(argv=None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true", help="time each MoE kernel's tile configs at 16384 tokens")
    parser.add_argument("--decode", type=positive_ints, metavar="TOKENS",
                        help="time each MoE kernel's tile configs at these decode batches (e.g. 64,128,256) of the "
                             "Moonlight and Qwen3-30B-A3B layers")
    parser.add_argument("--lora", type=int, metavar="RANK",
                        help="time LoRA of this rank on the experts beside fused_moe without it and PEFT's way")
    args = parser.parse_args(argv)
    if args.lora is not None and args.lora < 1:
        parser.error(f"--lora={args.lora} must be a rank >= 1")
    if not torch.cuda.is_available():
        print("benchmarks/moe.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.sweep:
        sweep()
        return 0
    if args.decode:
        decode_sweep(args.decode)
        return 0
    if args.lora:
        lora_table(args.lora)
        table(f"the experts' LoRA r={args.lora} launch by launch (GPU us in a CUDA graph; moe_lora_launches.py)",
              ["tokens", "pairs an expert", "tensor", "launch", "us", "bits == other B operand", "picked"],
              launch_rows(args.lora, [8, 32, 256, 4096]))
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
