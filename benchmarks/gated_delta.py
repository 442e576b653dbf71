"""The gated delta rule on a GPU: our recurrent kernel beside transformers' torch path and fla's kernels.

At Qwen3.5's / Qwen3-Next's GDN heads (16 q/k heads, 32 value heads, 128 x 128), bf16. Ours is
one recurrent kernel (`kernels.gated_delta_recurrent`: token by token, a program per value block
of 8-32 columns of a head of a sequence, `walk_shape`) that training and rollout share
(docs/design.md section 6b):

- training forward (and with `--backward` forward + backward, gradients of q, k, v, g and beta)
  of `--seqs` packed sequences of `--tokens` tokens each: ours (`kernels.gated_delta_rule`; the
  backward is the chunked Triton one, and with `--backward` also its autograd twin,
  ``VEXACT_GATED_DELTA_BACKWARD=autograd``) beside transformers' ``torch_chunk_gated_delta_rule``
  and, where the ``flash-linear-attention`` package is installed, fla's ``chunk_gated_delta_rule``
  and ``fused_recurrent_gated_delta_rule`` (forward only: fla's recurrent form has no backward);
  "x ours" is each row's time over ours;
- one rollout decode step of `--batch` sequences (one new token each, fp32 states in a pool),
  GPU time in a CUDA graph as the engine's decode step replays it, the pools rotated so that the
  states come from HBM: ours (`kernels.gated_delta_step` on a staged plan) beside fla's
  ``fused_recurrent_gated_delta_rule`` (``[B, 1]`` rows, the states its initial and final state)
  where installed, and the state roofline: the bytes of the states read and written (2 x B x 32 x
  128 x 128 x 4) at `--roofline-tbps` TB/s; "x roofline" and "x fla" are our time over theirs.
  "max |ours - fla|" is the largest output difference (the two round differently; they compute
  the same step).

Prints median milliseconds (microseconds for the decode step) per call (docs/design.md section
6b, "The kernel"). Usage:
``python benchmarks/gated_delta.py [--tokens 4096,16384] [--seqs 1] [--batch 64,256] [--backward] [--decode-only]
[--roofline-tbps 4.2]``; with ``--profile``, instead, each kernel's GPU time in one of our forward + backward;
with ``--walk-launches 16x1,8x1,64x4``, instead, the training forward (`--seqs` sequences of each
`--tokens`) and the decode step at each of the walk's launch shapes (value columns a program,
warps), and whether the bits are the first shape's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys

import torch
from bench_utils import (bench, bench_graph, gluon_candidates, kernel_seconds, positive_int, positive_ints, rotating_copies,
                         table)
from stock_peers import plain_function

HK, HV, DK, DV = 16, 32, 128, 128


def _inputs(t: int, gen: torch.Generator, device: str = "cuda"):
    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device).bfloat16()

    g = -torch.rand(t, HV, generator=gen).to(device) * 0.5 - 0.001
    return rand(t, HK, DK), rand(t, HK, DK), rand(t, HV, DV), g, torch.rand(t, HV, generator=gen).to(device).bfloat16()


def _stock():
    """transformers' torch chunk path (unwrapped from its fla fallback) and fla's chunk and
    recurrent kernels, None where fla is not installed."""
    from transformers.models.qwen3_next import modeling_qwen3_next

    torch_chunk = plain_function(modeling_qwen3_next.torch_chunk_gated_delta_rule)
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_recurrent
    except ImportError:
        fla_chunk = fla_recurrent = None
    return torch_chunk, fla_chunk, fla_recurrent


def _ratio(ms: float, base: float) -> str:
    return f"{ms / base:.2f}x"


def training_rows(tokens: list[int], seqs: int, backward: bool) -> list[list]:
    from vexact_models.kernels import gated_delta_rule
    from vexact_models.kernels.gated_delta_backward import use_gated_delta_backward

    torch_chunk, fla_chunk, fla_recurrent = _stock()
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

        runs = {"ours (recurrent)": ours("triton")}
        if backward:
            runs["ours, autograd backward"] = ours("autograd")
        # transformers before 5.24 repeats the q/k heads in the layer, not in the function: so do we
        runs["transformers torch chunk"] = lambda q, k, v, g, beta: torch_chunk(
            *map(batched, (*_value_heads(q, k, v), v, g, beta)), use_qk_l2norm_in_kernel=True)[0]
        if fla_chunk is not None:
            cu_t = torch.tensor(cu, device="cuda", dtype=torch.long)
            runs["fla chunk"] = lambda q, k, v, g, beta: fla_chunk(q[None], k[None], v[None], g[None], beta[None],
                                                                   cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)[0]
            runs["fla recurrent"] = lambda q, k, v, g, beta: fla_recurrent(
                q[None], k[None], v[None], g=g[None], beta=beta[None], cu_seqlens=cu_t, use_qk_l2norm_in_kernel=True)[0]
        base = {}
        for name, run in runs.items():
            forward_ms = bench(lambda run=run: run(*inputs), warmup=3, rep=20)
            base.setdefault("forward", forward_ms)
            cells = [f"{seqs} x {t}", name, f"{forward_ms:.3f}", _ratio(forward_ms, base["forward"])]
            print(f"  {seqs} x {t} {name}: forward {forward_ms:.3f} ms", file=sys.stderr, flush=True)
            if backward:
                leaves = [x.detach().requires_grad_() for x in inputs]

                def step(run=run, name=name):
                    out = run(*leaves)
                    if not name.startswith("ours"):
                        out.float().sum().backward()

                if name == "fla recurrent":
                    cells += ["-", "-"]
                else:
                    try:
                        ms = bench(step, warmup=2, rep=10)
                        base.setdefault("fwd+bwd", ms)
                        cells += [f"{ms:.3f}", _ratio(ms, base["fwd+bwd"])]
                    except RuntimeError as error:  # fla 0.6 refuses its backward on Hopper under Triton < 3.7.1
                        cells += [f"refused: {str(error).splitlines()[0][:70]}", "-"]
            rows.append(cells)
            print("  " + "  ".join(cells), file=sys.stderr, flush=True)  # progress: the torch path is slow
    return rows


def _decode_case(b: int, device: str = "cuda"):
    """A decode step of `b` sequences, every one past a 100-token prompt: its rows (q, k, v, g,
    beta), a pool of `b` states and the padding state, and the step's staged plan."""
    from vexact_models.kernels.gated_delta_step import StepPlan, plan_step

    rows = _inputs(b, torch.Generator().manual_seed(b), device)
    pool = torch.randn(b + 1, HV, DK, DV, generator=torch.Generator().manual_seed(b)).to(device) * 0.1
    plan = plan_step(list(range(b)), [100] * b, [1] * b, b, b, b)
    return rows, pool, StepPlan({name: torch.from_numpy(a).to(device) for name, a in plan.items()})


def decode_rows(batches: list[int], roofline_tbps: float) -> list[list]:
    from vexact_models.kernels.gated_delta_step import gated_delta_step

    _, _, fla_recurrent = _stock()
    rows = []
    for b in batches:
        (q, k, v, g, beta), pool, step_plan = _decode_case(b)
        pools = rotating_copies(pool)  # each call reads another copy: the states come from HBM
        with torch.no_grad():
            ours_ms = bench_graph([lambda p=p: gated_delta_step(q, k, v, g, beta, p, step_plan) for p in pools])
            ours_out = gated_delta_step(q, k, v, g, beta, pool.clone(), step_plan)
        state_bytes = 2 * b * HV * DK * DV * 4
        roof_ms = state_bytes / (roofline_tbps * 1e12) * 1e3
        cells = [b, f"{ours_ms * 1e3:.1f}", f"{roof_ms * 1e3:.1f}", _ratio(ours_ms, roof_ms)]
        if fla_recurrent is None:
            cells += ["not installed", "-", "-"]
        else:
            def fla(p):
                return fla_recurrent(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None],
                                     initial_state=p[:b], output_final_state=True, use_qk_l2norm_in_kernel=True)

            with torch.no_grad():
                fla_ms = bench_graph([lambda p=p: fla(p) for p in pools])
                fla_out = fla(pool)[0][:, 0]
            diff = (ours_out.float() - fla_out.float()).abs().max().item()
            cells += [f"{fla_ms * 1e3:.1f}", _ratio(ours_ms, fla_ms), f"{diff:.2e}"]
        rows.append(cells)
        del pools
    return rows


@contextlib.contextmanager
def walk_launch(columns: int, warps: int):
    """The walk's launch shape (`gated_delta_recurrent.WalkShape`: value columns a program owns,
    warps) set for every launch inside the block, in place of `WALK_SHAPES`' and
    `LONG_WALK_SHAPES`' choice: launch parameters, never a bit of the result (every column's sums
    run in the same order whatever program and warp hold it)."""
    from vexact_models.kernels import gated_delta_recurrent as walk

    old = walk.WALK_SHAPES, walk.LONG_WALK_SHAPES
    walk.WALK_SHAPES = walk.LONG_WALK_SHAPES = ((0, walk.WalkShape(columns, warps)),)
    try:
        yield
    finally:
        walk.WALK_SHAPES, walk.LONG_WALK_SHAPES = old


def walk_launch_rows(launches: list[tuple[int, int]], tokens: list[int], batches: list[int], device: str = "cuda",
                     timer=None, graph_timer=None, seqs: int = 1) -> list[list]:
    """One row per launch shape ``(columns, warps)`` of the walk: the training forward's
    milliseconds at each of `tokens` (`seqs` packed sequences of that many tokens), the decode
    step's microseconds at each of `batches` (a CUDA graph, states from HBM) and whether every
    output and state has the first shape's bits. `timer` / `graph_timer` (`bench` / `bench_graph`
    by default) are the clocks; the tests pass CPU ones."""
    from vexact_models.kernels import gated_delta_rule
    from vexact_models.kernels.gated_delta_step import gated_delta_step

    timer, graph_timer = timer or bench, graph_timer or bench_graph
    rows, first = [], None
    for columns, warps in launches:
        cells, outputs = [f"{columns}x{warps}"], []
        with walk_launch(columns, warps), torch.no_grad():
            for t in tokens:
                inputs, cu = _inputs(seqs * t, torch.Generator().manual_seed(t), device), list(range(0, seqs * t + 1, t))
                cells.append(f"{timer(lambda: gated_delta_rule(*inputs, cu), warmup=3, rep=20):.3f}")
                outputs.append(gated_delta_rule(*inputs, cu)[0])
            for b in batches:
                (q, k, v, g, beta), pool, plan = _decode_case(b, device)
                pools = rotating_copies(pool) if device == "cuda" else [pool.clone()]
                cells.append(f"{graph_timer([lambda p=p: gated_delta_step(q, k, v, g, beta, p, plan) for p in pools]) * 1e3:.1f}")
                state = pool.clone()
                outputs += [gated_delta_step(q, k, v, g, beta, state, plan), state]
                del pools
        first = outputs if first is None else first
        cells.append("yes" if all(torch.equal(a, b) for a, b in zip(outputs, first)) else "NO")
        rows.append(cells)
    return rows


def _value_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k (``[T, Hk, D]``) with each head repeated to v's head count, as the stock layer does."""
    repeat = v.shape[1] // k.shape[1]
    return q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)


def profile_rows(tokens: list[int], seqs: int, device: str = "cuda") -> list[list]:
    """Rows ``[batch, kernel, ms, share]`` of torch's profiler over one of our forward + backward
    (after a warm-up) per length, the kernels by their GPU time (on a CPU `device`: the ops by
    their CPU time), then the total."""
    from vexact_models.kernels import gated_delta_rule

    rows = []
    for t in tokens:
        leaves = [x.requires_grad_(x.is_floating_point())
                  for x in _inputs(t * seqs, torch.Generator().manual_seed(t), device)]
        cu = [i * t for i in range(seqs + 1)]

        def step():
            gated_delta_rule(*leaves, cu)[0].float().sum().backward()

        step()
        times = sorted(((name, s * 1e3) for name, s in kernel_seconds(step, device).items()), key=lambda x: -x[1])
        total = sum(ms for _, ms in times)
        rows += [[f"{seqs} x {t}", name[:48], f"{ms:.3f}", f"{ms / total:.1%}"] for name, ms in times]
        rows.append([f"{seqs} x {t}", "total", f"{total:.3f}", "100.0%"])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_ints, default=[4096, 16384], help="tokens per sequence (training)")
    parser.add_argument("--seqs", type=positive_int, default=1, help="sequences per training batch")
    parser.add_argument("--batch", type=positive_ints, default=[64, 256], help="sequences per decode step")
    parser.add_argument("--backward", action="store_true", help="also time forward + backward (training)")
    parser.add_argument("--decode-only", action="store_true", help="time the rollout decode step alone")
    parser.add_argument("--walk-launches", type=functools.partial(gluon_candidates, form="COLUMNSxWARPS",
                                                                  example="16x1"), default=None, metavar="CxW,CxW",
                        help="instead of the timings: the walk's training forward (--tokens) and decode step "
                             "(--batch) at each launch shape, value columns a program (a power of two up to 128) x "
                             "warps (a power of two); the first is the reference for the bits. E.g. 16x1,8x1,64x4")
    parser.add_argument("--profile", action="store_true",
                        help="instead of the timings: each kernel's GPU time in one of our forward + backward per "
                             "--tokens (torch's profiler)")
    parser.add_argument("--roofline-tbps", type=float, default=4.2,
                        help="HBM bytes per second (TB/s, read + written) of the decode step's state roofline "
                             "(default 4.2: an H200's device-to-device copy; an H100's is about 3.0)")
    args = parser.parse_args(argv)
    if args.roofline_tbps <= 0:
        parser.error(f"--roofline-tbps must be > 0, got {args.roofline_tbps}")
    for columns, warps in args.walk_launches or []:
        if columns & (columns - 1) or columns > DV or warps & (warps - 1):
            parser.error(f"--walk-launches: {columns}x{warps} must be a power of two <= {DV} (dv) columns x a "
                         "power of two warps")
    if not torch.cuda.is_available():
        print("gated_delta.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    if args.profile:
        table("our forward + backward by kernel (torch profiler)", ["batch", "kernel", "GPU ms", "share"],
              profile_rows(args.tokens, args.seqs))
        return 0
    if args.walk_launches:
        first = "x".join(map(str, args.walk_launches[0]))
        header = (["columns x warps"] + [f"forward {args.seqs} x {t} ms" for t in args.tokens]
                  + [f"decode {b} us" for b in args.batch] + [f"bits == {first}'s"])
        table("the walk's launch shapes", header, walk_launch_rows(args.walk_launches, args.tokens, args.batch,
                                                                         seqs=args.seqs))
        return 0
    if not args.decode_only:
        header = ["batch", "kernel", "forward ms", "x ours"] + (["fwd+bwd ms", "x ours"] if args.backward else [])
        table(f"training at Hk={HK} Hv={HV} dk={DK} dv={DV}, bf16", header, training_rows(args.tokens, args.seqs,
                                                                                          args.backward))
    table(f"rollout decode step, one GDN layer (CUDA graph; roofline: state bytes at {args.roofline_tbps} TB/s)",
          ["sequences", "ours us", "roofline us", "x roofline", "fla us", "x fla", "max |ours - fla|"],
          decode_rows(args.batch, args.roofline_tbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
