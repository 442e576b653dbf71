"""The gated delta rule on a GPU: our chunk kernels beside transformers' torch path and fla's kernels.

At Qwen3.5's / Qwen3-Next's GDN heads (16 q/k heads, 32 value heads, 128 x 128), bf16:

- training forward (and forward + backward, gradients of q, k, v, g and beta) over packed
  sequences of `--tokens` tokens each: ours (`kernels.gated_delta_rule`; with `--backward` also
  its autograd backward, ``VEXACT_GATED_DELTA_BACKWARD=autograd``), transformers'
  ``torch_chunk_gated_delta_rule`` and, where the ``flash-linear-attention`` package is
  installed, fla's ``chunk_gated_delta_rule``;
- one rollout decode step of `--batch` sequences (one new token each, row 36 of its chunk of 64),
  GPU time in a CUDA graph as the engine's decode step replays it: the rows launch (the chunk's
  rows 0..36 recomputed, the path before `kernels.gated_delta_decode`) beside the decode launch
  (row 36 from the rows of T the chunk keeps), with whether their outputs are the same bits; and
  at the chunk's last row, the rows launch plus the fold launches (prep and fold) beside the
  decode launch that folds in its own program; the decode launch both ways (one program a head,
  the step's; "split": one program a value block, ``split_values``).

Prints median milliseconds per call (docs/design.md section 6b, "Decode cost"). Usage:
``python benchmarks/gated_delta.py [--tokens 4096,16384] [--seqs 4] [--batch 64,256] [--backward] [--decode-only]``.
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch
from bench_utils import bench, bench_graph, positive_int, positive_ints, table

HK, HV, DK, DV = 16, 32, 128, 128


def _inputs(t: int, gen: torch.Generator):
    def rand(*shape):
        return torch.randn(*shape, generator=gen).cuda().bfloat16()

    g = -torch.rand(t, HV, generator=gen).cuda() * 0.5 - 0.001
    return rand(t, HK, DK), rand(t, HK, DK), rand(t, HV, DV), g, torch.rand(t, HV, generator=gen).cuda().bfloat16()


def _stock(name: str):
    """transformers' torch path (unwrapped from its fla fallback) and fla's kernel, where installed."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    torch_path = inspect.unwrap(getattr(modeling_qwen3_next, f"torch_{name}_gated_delta_rule"))
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        fla_chunk = None
    return torch_path, fla_chunk


def training_rows(tokens: list[int], seqs: int, backward: bool) -> list[list]:
    from vexact_models.kernels import gated_delta_rule
    from vexact_models.kernels.gated_delta_backward import use_gated_delta_backward

    torch_chunk, fla_chunk = _stock("chunk")
    rows = []
    for t in tokens:
        gen = torch.Generator().manual_seed(t)
        inputs = _inputs(t * seqs, gen)
        cu = [i * t for i in range(seqs + 1)]

        def batched(x):
            return x.reshape(seqs, t, *x.shape[1:])

        def ours(mode):
            def run(q, k, v, g, beta):
                with use_gated_delta_backward(mode):  # read when the backward runs: inside the timed call
                    out = gated_delta_rule(q, k, v, g, beta, cu)[0]
                    return out.float().sum().backward() if q.requires_grad else out
            return run

        runs = {"ours": ours("triton")}
        if backward:
            runs["ours, autograd backward"] = ours("autograd")
        runs["transformers torch"] = lambda q, k, v, g, beta: torch_chunk(
            *map(batched, (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0]
        if fla_chunk is not None:
            cu_t = torch.tensor(cu, device="cuda", dtype=torch.int32)
            runs["fla"] = lambda q, k, v, g, beta: fla_chunk(q[None], k[None], v[None], g[None], beta[None],
                                                             cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)[0]
        for name, run in runs.items():
            forward_ms = bench(lambda run=run: run(*inputs), warmup=3, rep=20)
            cells = [f"{seqs} x {t}", name, f"{forward_ms:.3f}"]
            print(f"  {seqs} x {t} {name}: forward {forward_ms:.3f} ms", file=sys.stderr, flush=True)
            if backward:
                leaves = [x.detach().requires_grad_() for x in inputs]

                def step(run=run, name=name):
                    out = run(*leaves)
                    if not name.startswith("ours"):
                        out.float().sum().backward()

                try:
                    cells.append(f"{bench(step, warmup=2, rep=10):.3f}")
                except RuntimeError as error:  # fla 0.6 refuses its backward on Hopper under Triton < 3.7.1
                    cells.append(f"refused: {str(error).splitlines()[0][:70]}")
            rows.append(cells)
            print("  " + "  ".join(cells), file=sys.stderr, flush=True)  # progress: the torch path is slow
    return rows


def decode_rows(batches: list[int]) -> list[list]:
    from vexact_models.kernels.gated_delta_decode import DecodePlan, launch_decode
    from vexact_models.kernels.gated_delta_launch import FoldPlan, RowsPlan, Shapes, launch_fold, launch_rows

    c, shapes, scale = 64, Shapes(HK, HV, DK, DV), DK ** -0.5
    rows = []
    for b in batches:
        gen = torch.Generator().manual_seed(b)
        q = _inputs(b, gen)[0]
        k, _, v, g, beta = _inputs(b * c, gen)  # slot s's chunk at rows [s * c, (s + 1) * c), as in the state pool
        states = torch.randn(2 * b, HV, DK, DV, generator=gen).cuda() * 0.1  # folds go to states b..2b-1
        pool_t = torch.zeros(b * c, HV, c, device="cuda")
        slot = torch.arange(b, dtype=torch.int32, device="cuda")
        base, folded = slot * c, slot + b

        def plans(row: int):
            fill = torch.full_like(slot, row)
            return (RowsPlan(base, fill + 1, fill, slot, slot), DecodePlan(base, fill, slot, slot, base),
                    FoldPlan(base, torch.full_like(slot, c), slot, folded))

        launch_rows("triton", q, k, v, g, beta, states, torch.empty(b * c, HV, DV, dtype=q.dtype, device="cuda"),
                    RowsPlan(base, torch.full_like(slot, c), 0 * slot, base, slot, base), shapes, c, scale, True,
                    t_cache=pool_t)  # every chunk's rows of T kept, as its earlier steps would have
        out_rows, out_decode = (torch.empty(b, HV, DV, dtype=q.dtype, device="cuda") for _ in range(2))
        cells = [b]
        for row in (36, c - 1):
            rows_plan, decode_plan, fold_plan = plans(row)
            fold = [] if row < c - 1 else [  # a completed chunk: the fold launch after either
                lambda p=fold_plan: launch_fold("triton", k, v, g, beta, states, states, p, shapes, c, True,
                                                most_chunks=b)]

            def new(p=decode_plan, split=False):
                launch_decode("triton", q, k, v, g, beta, pool_t, states, out_decode, p, shapes, c, scale, True,
                              split_values=split)

            launches = 1 + len(fold)
            old_ms = bench_graph([lambda p=rows_plan: launch_rows("triton", q, k, v, g, beta, states, out_rows, p, shapes,
                                                                  c, scale, True)] + fold) * launches
            new_ms = bench_graph([new] + fold) * launches
            same = torch.equal(out_rows, out_decode)
            split_ms = bench_graph([lambda: new(split=True)] + fold) * launches
            same = same and torch.equal(out_rows, out_decode)
            cells += [f"{old_ms:.3f}", f"{new_ms:.3f}", f"{split_ms:.3f}", f"{old_ms / min(new_ms, split_ms):.1f}x",
                      "yes" if same else "NO"]
        rows.append(cells)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_ints, default=[4096, 16384], help="tokens per sequence (training)")
    parser.add_argument("--seqs", type=positive_int, default=1, help="sequences per training batch")
    parser.add_argument("--batch", type=positive_ints, default=[64, 256], help="sequences per decode step")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward (training)")
    parser.add_argument("--decode-only", action="store_true", help="time the rollout decode step alone")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gated_delta.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if not args.decode_only:
        header = ["batch", "kernel", "forward ms"] + (["fwd+bwd ms"] if args.backward else [])
        table(f"training at Hk={HK} Hv={HV} dk={DK} dv={DV}, bf16", header, training_rows(args.tokens, args.seqs,
                                                                                          args.backward))
    table("rollout decode step, one GDN layer (ours; CUDA graph)",
          ["sequences", "row 36: rows ms", "decode ms", "split ms", "speedup", "same bits",
           "row 63: rows + fold ms", "decode + fold ms", "split ms", "speedup", "same bits"], decode_rows(args.batch))
    return 0


if __name__ == "__main__":
    sys.exit(main())
