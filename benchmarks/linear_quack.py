"""quack-kernels' Hopper GEMM (``quack.gemm_interface``) as a candidate linear backend (docs/design.md rule 1):
is it faster than ours, and are its rows aligned with ours?

A GEMM can serve training and the rollout engine only if a row's output never depends on how
many rows share the launch (docs/design.md rule 1). Our Triton `linear` gives the same bits for
every tile config and every M. This script asks, for each quack config (a fixed `GemmConfig`,
no split-K, no autotuning, which would pick configs by M; `kernels.linear_quack` runs it):

- alignment: is every row of an M-row quack GEMM bitwise equal to the same row from our
  `linear` (which is M-invariant), for M from 1 to 8,192? If so, quack could replace our kernel
  wherever it is faster, on both paths;
- speed: CUDA-graph time (weights from HBM, `bench_graph`) at the decode row counts and at
  training row counts, beside our `linear` and cuBLAS (``torch.matmul``), on each model's fused
  decode weights (`kernel_peers.py`'s sweep shapes). LM heads write fp32 logits as the engine's do
  (cuBLAS's column writes bf16 there: a lower bound for it).

quack is not a dependency: the script reports what it cannot import. Usage (CUDA, Hopper only):
``cd benchmarks && python3 linear_quack.py [--shapes "8b qkv,8b o"] [--ms 128,256,8192] [--configs
64x64p:2x1,128x64ps] [--per-config] [--eager] [--skip-speed]``; ``--configs`` takes
``TMxTN{p|c}[:CMxCN][s]`` specs (tile, pingpong or cooperative, cluster, swap-AB).
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import (bench_graph, bits_at_row_counts, config_label, copy_bandwidth, parse_config,
                         positive_ints, rotating_copies, table)

#: (name, K, N) of the weights timed: each model's decode GEMMs as the engine fuses them
#: (LM heads write fp32 logits, as the engine's do)
SHAPES = [("0.6b qkv", 1024, 4096), ("0.6b o", 2048, 1024), ("0.6b gate_up", 1024, 6144),
          ("0.6b down", 3072, 1024), ("0.6b lm_head", 1024, 151936), ("8b qkv", 4096, 6144), ("8b o", 4096, 4096),
          ("8b gate_up", 4096, 24576), ("8b down", 12288, 4096), ("8b lm_head", 4096, 151936),
          ("30b-a3b qkv", 2048, 5120), ("30b-a3b o", 4096, 2048),
          ("moonlight q+kv_a", 2048, 3648), ("moonlight o", 2048, 2048), ("moonlight shared gate_up", 2048, 5632),
          ("moonlight shared down", 2816, 2048), ("moonlight lm_head", 2048, 163840)]
ALIGN_MS = [1, 7, 64, 128, 129, 256, 1000, 4096, 8192]


#: the configs timed by default: quack's SM90 default and the nine of the first H200 table (2026-11-24)
DEFAULT_SPECS = "128x192p:2x1,128x128p,128x64p,64x128c,128x128c:1x2,128x192p:1x2,128x128ps,128x64ps,256x128c:2x1"
def quack_configs(configs):
    """(label, config) for each `linear_quack.QuackConfig` of `configs`, or None (why quack cannot
    run printed)."""
    from vexact_models.kernels.linear_quack import device_unavailable_reason

    reason = device_unavailable_reason()
    if reason is not None:
        print(f"quack cannot run: {reason}")
        return None
    return [(config_label(c), c) for c in configs]


def out_dtype(name: str, x: torch.Tensor) -> torch.dtype:
    """The output dtype the engine asks of weight `name`: fp32 logits for LM heads, else `x`'s."""
    return torch.float32 if "lm_head" in name else x.dtype


def quack_linear(x: torch.Tensor, weight: torch.Tensor, config, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x @ weight.T`` in `dtype` (default `x`'s) by quack's SM90 GEMM with `config` (`kernels.linear_quack`)."""
    from vexact_models.kernels.linear_quack import linear_quack

    return linear_quack(x, weight, None, dtype or x.dtype, config)


def ours(x: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Our Triton GEMM with its own config, in `dtype` (default `x`'s); `linear` itself may run
    quack (``VEXACT_LINEAR=auto``), this does not."""
    from vexact_models.kernels.linear import linear_triton

    return linear_triton(x, weight, None, dtype or x.dtype)


def alignment(configs, shapes) -> list[str]:
    """Rows of quack GEMMs against our `linear` rows, bitwise; returns the labels that matched."""
    rows, aligned = [], []
    for label, cfg in configs:
        bad_total, compared, error = 0, 0, ""
        for name, k, n in shapes:
            w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
            x = torch.randn(max(ALIGN_MS), k, device="cuda").bfloat16()
            rows_compared, rows_differing, _, error = bits_at_row_counts(
                lambda m, x=x, w=w: quack_linear(x[:m], w, cfg), ours(x, w), ALIGN_MS)
            compared += rows_compared
            bad_total += rows_differing
            if error:
                break
        rows.append([label, compared, bad_total if not error else "-", error or ("yes" if bad_total == 0 else "NO")])
        if not error and bad_total == 0:
            aligned.append(label)
    table("quack rows vs our linear rows (bitwise; rows that differ)", ["config", "rows", "rows differing", "aligned"],
          rows)
    return aligned


def speed(configs, shapes, ms: list[int], hbm: float, per_config: bool = False, warm_l2: bool = False) -> None:
    """CUDA-graph time per GEMM: ours (pick_config), cuBLAS, the fastest quack config, and what
    ``VEXACT_LINEAR=auto`` runs (`linear_quack.pick_config`'s config, else ours); with
    `per_config`, also a table of every config's time. `warm_l2`: one weight copy read again
    and again (L2-resident where it fits) instead of rotating copies from HBM."""
    from vexact_models.kernels.linear_quack import pick_config

    rows, every = [], []
    source = "weights warm in L2 where they fit" if warm_l2 else "weights from HBM"
    for name, k, n in shapes:
        weight = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        weights = [weight] if warm_l2 else rotating_copies(weight)
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            dtype = out_dtype(name, x)
            nbytes = 2 * (m * k + n * k) + dtype.itemsize * m * n
            t_ours = bench_graph([lambda w=w: ours(x, w, dtype) for w in weights])
            t_cublas = bench_graph([lambda w=w: torch.matmul(x, w.t()) for w in weights])
            best, times = ("-", float("inf")), {}
            for label, cfg in configs:
                try:
                    quack_linear(x, weights[0], cfg, dtype)  # compiles outside the graph
                    t = bench_graph([lambda w=w: quack_linear(x, w, cfg, dtype) for w in weights])
                except Exception:  # noqa: BLE001 - skipped configs are the ones alignment reported
                    continue
                times[cfg] = t
                every.append([name, m, label, f"{t * 1e3:.1f}", f"{100 * nbytes / t / 1e6 / hbm:.0f}%",
                              f"{t_ours / t:.2f}", f"{t_cublas / t:.2f}"])
                if t < best[1]:
                    best = (label, t)
            auto = pick_config(m, n, k)
            t_auto = t_ours if auto is None else times.get(auto) or \
                bench_graph([lambda w=w: quack_linear(x, w, auto, dtype) for w in weights])
            rows.append([name, m, f"{t_ours * 1e3:.1f}", f"{t_cublas * 1e3:.1f}", best[0], f"{best[1] * 1e3:.1f}",
                         "ours" if auto is None else config_label(auto), f"{t_auto * 1e3:.1f}",
                         f"{t_ours / t_auto:.2f}", f"{100 * nbytes / t_auto / 1e6 / hbm:.0f}%"])
        del weights
    if per_config:
        table(f"every quack config (us, CUDA graphs, {source})",
              ["weight", "M", "config", "quack", "% HBM", "ours / quack", "cuBLAS / quack"], every)
    table(f"linear: ours, cuBLAS, the fastest quack config and auto's choice (us, CUDA graphs, {source})",
          ["weight", "M", "ours", "cuBLAS", "best quack config", "quack", "auto runs", "auto", "ours / auto",
           "auto % HBM"], rows)


def sustained(configs, shapes, ms: list[int], hbm: float, seconds: float) -> None:
    """Each config's time per GEMM when the GEMM runs back to back for `seconds` (CUDA graphs
    over rotating weight copies, `weight_gemms.time_weight_gemms`), with the SM clock and power
    sampled meanwhile. `speed` times bursts, at the card's full clock; a decode step at Qwen3-8B
    shape holds the card at its power limit (H200, 2026-11-27), where a config that draws
    less power per byte keeps a higher clock. ``auto`` is `linear_quack.pick_config`'s config;
    a config outside `table_configs` is marked unproven (``kernel_invariance --only quack`` has
    not checked its bits)."""
    from vexact_models.kernels.linear_quack import pick_config, table_configs
    from weight_gemms import time_weight_gemms

    proven, rows = table_configs(), []
    for name, k, n in shapes:
        weights = rotating_copies((torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16())
        for m in ms:
            dtype = out_dtype(name, weights[0])
            auto = pick_config(m, n, k)
            candidates = ([("auto " + config_label(auto), auto)] if auto is not None else []) + \
                [(label, cfg) for label, cfg in configs if cfg != auto]
            for label, cfg in candidates:
                try:
                    peer = time_weight_gemms(weights, m, seconds,
                                             gemm=lambda x, w, cfg=cfg: quack_linear(x, w, cfg, dtype))
                except Exception as exc:  # noqa: BLE001 - a config quack refuses for this shape
                    rows.append([name, m, label, type(exc).__name__, "", "", "", ""])
                    continue
                per_gemm = peer.seconds / len(weights)
                clocks = peer.clock_summary
                rows.append([name, m, label, f"{per_gemm * 1e6:.1f}", f"{100 * peer.bandwidth_gbs / hbm:.0f}%",
                             f"{clocks.sm_median:.0f}" if clocks else "-", f"{clocks.power_median:.0f}" if clocks else "-",
                             "yes" if cfg in proven else "unproven"])
        del weights
    table(f"quack configs run back to back for {seconds:g} s (us per GEMM, weights from HBM, % of the copy "
          "bandwidth, median SM clock MHz and power W)",
          ["weight", "M", "config", "us", "% copy", "MHz", "W", "bits proven"], rows)


def eager_call_time(shapes, m: int = 1, calls: int = 300) -> None:
    """Wall time per eager `linear` call (no CUDA graph: the host launch shows) at `m` rows under
    each ``VEXACT_LINEAR`` mode: why ``auto`` runs quack only while a CUDA graph captures (forced
    ``quack`` shows what eager calls through it would cost)."""
    import time

    from vexact_models.kernels import linear, use_linear_backend

    rows = []
    for name, k, n in shapes:
        x = torch.randn(m, k, device="cuda").bfloat16()
        w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
        per_call = {}
        for mode in ("triton", "auto", "quack"):
            with use_linear_backend(mode):
                for _ in range(10):  # compile and warm up
                    linear(x, w)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(calls):
                    linear(x, w)
                torch.cuda.synchronize()
                per_call[mode] = (time.perf_counter() - t0) / calls
        rows.append([name, m] + [f"{per_call[mode] * 1e6:.1f}" for mode in ("triton", "auto", "quack")] +
                    [f"{per_call['triton'] / per_call['quack']:.2f}"])
    table(f"eager linear calls, {calls} back to back (us per call, host launch included)",
          ["weight", "M", "triton", "auto", "quack", "triton / quack"], rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="",
                        help="comma-separated: only the weights whose name contains one of these (default: all)")
    parser.add_argument("--ms", type=positive_ints, default="128,256,8192",
                        help="comma-separated row counts for the speed table")
    parser.add_argument("--skip-speed", action="store_true", help="only the alignment table")
    parser.add_argument("--all-configs", action="store_true",
                        help="time every config, not only the aligned ones")
    parser.add_argument("--configs", default=DEFAULT_SPECS,
                        help="comma-separated quack configs TMxTN{p|c}[:CMxCN][s] (tile M x N, pingpong or "
                             "cooperative, cluster, s = swap-AB); default: quack's default and the nine of the "
                             "first H200 table, 2026-11-24")
    parser.add_argument("--per-config", action="store_true", help="also print every config's time, not only the best")
    parser.add_argument("--eager", action="store_true",
                        help="also time eager one-row `linear` calls (host launch included) under each VEXACT_LINEAR mode")
    parser.add_argument("--warm-l2", action="store_true",
                        help="time one weight copy read again and again (L2-resident where it fits: what a "
                             "prefetch into L2 could gain) instead of rotating copies from HBM")
    parser.add_argument("--sustained", type=float, metavar="SECONDS", default=0.0,
                        help="instead of the alignment and speed tables: each config (and auto's) run back to "
                             "back for SECONDS per weight and row count, with the SM clock and power "
                             "(a power-limited card's speed)")
    args = parser.parse_args(argv)
    ms = args.ms
    if args.sustained < 0:
        parser.error(f"--sustained: SECONDS must be >= 0, got {args.sustained}")
    try:
        parsed = [parse_config(spec) for spec in args.configs.split(",")]
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("benchmarks/linear_quack.py needs a Hopper (SM90) GPU", file=sys.stderr)
        return 2
    configs = quack_configs(parsed)
    if configs is None:
        return 1
    shapes = [s for s in SHAPES if any(part in s[0] for part in args.shapes.split(","))]
    if not shapes:
        parser.error(f"--shapes {args.shapes!r} matches none of {[s[0] for s in SHAPES]}")
    torch.manual_seed(0)
    hbm = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; measured copy bandwidth {hbm:.0f} GB/s")
    if args.sustained:
        sustained(configs, shapes, ms, hbm, args.sustained)
        return 0
    aligned = alignment(configs, [s for s in shapes if "lm_head" not in s[0]])
    if not args.skip_speed:
        timed = configs if args.all_configs else [c for c in configs if c[0] in aligned]
        if timed:
            speed(timed, shapes, ms, hbm, args.per_config, args.warm_l2)
        else:
            print("no quack config is aligned with our linear; --all-configs times them anyway")
    if args.eager:
        eager_call_time(shapes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
