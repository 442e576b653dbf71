"""The gated MLP's gate/up GEMM with SwiGLU in quack's epilogue (`kernels.linear_silu_and_mul_quack`)
against the two launches the decode step runs today (quack's GEMM, then `silu_and_mul`), and
HF's ops (cuBLAS ``x @ w.T``, ``F.silu(g) * u``) as the peer (docs/design.md rule 5).

For each model's fused ``[gate; up]`` weight, each row count and each quack config:
- same bits: is every output element equal to ``silu_and_mul(*linear(x, w).split(I, 1))``, our
  `linear` (Triton, so quack's alignment is checked too) then our `silu_and_mul`? Rows 1 .. 1,000;
- time: one launch in a CUDA graph, weights from HBM (`bench_utils.rotating_copies`), beside
  today's two launches and HF's.

quack is not a dependency: the script says what it cannot import. Usage (Hopper only):
``cd benchmarks && python3 gate_up_silu.py [--shapes 0.6b,8b] [--ms 128,256]
[--configs 64x96p:2x1,64x192p:2x1]``.
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import bench_graph, bits_at_row_counts, config_label, parse_config, positive_ints, rotating_copies, table

#: (name, K, I): the gated MLPs timed (the fused weight is [2I, K])
SHAPES = [("0.6b", 1024, 3072), ("8b", 4096, 12288), ("llama-3.1-8b", 4096, 14336)]
BITS_MS = [1, 7, 64, 65, 128, 129, 256, 1000]
DEFAULT_CONFIGS = "64x96p:2x1,64x64p:2x1,64x192p:2x1,128x64p:2x1,128x192p:2x1"


def separate(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Today's two launches: the gate/up GEMM (`linear`, which runs quack's table config inside a
    graph capture), then `silu_and_mul` on its halves."""
    from vexact_models.kernels import linear, silu_and_mul

    gate, up = linear(x, weight).split(weight.shape[0] // 2, dim=1)
    return silu_and_mul(gate, up)


def reference_bits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What training computes: our Triton `linear`, then `silu_and_mul`."""
    from vexact_models.kernels.linear import linear_triton
    from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

    gate, up = linear_triton(x, weight, None, x.dtype).split(weight.shape[0] // 2, dim=1)
    return silu_and_mul_triton(gate, up)


def hf_ops(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The peer: HF's Qwen3/Llama MLP ops on the fused weight (cuBLAS GEMM, torch's SiLU and multiply)."""
    gate, up = (x @ weight.t()).split(weight.shape[0] // 2, dim=1)
    return torch.nn.functional.silu(gate) * up


def bits_rows(configs, shapes) -> list[list]:
    """One row per (config, shape): elements compared and how many differ from `reference_bits`."""
    from vexact_models.kernels.linear_silu_and_mul_quack import linear_silu_and_mul_quack

    rows = []
    for label, cfg in configs:
        for name, k, inter in shapes:
            weight = (torch.randn(2 * inter, k, device="cuda") / k ** 0.5).bfloat16()
            x = torch.randn(max(BITS_MS), k, device="cuda").bfloat16()
            want = reference_bits(x, weight)
            rows_compared, _, differing, error = bits_at_row_counts(
                lambda m: linear_silu_and_mul_quack(x[:m], weight, cfg), want, BITS_MS)
            rows.append([label, name, rows_compared * inter, "-" if error else differing,
                         error or ("yes" if differing == 0 else "NO")])
    return rows


def speed_rows(configs, shapes, ms: list[int]) -> list[list]:
    """One row per (shape, rows): us of today's launches, HF's ops, and every config's fused launch."""
    from vexact_models.kernels.linear_silu_and_mul_quack import linear_silu_and_mul_quack

    rows = []
    for name, k, inter in shapes:
        weights = rotating_copies((torch.randn(2 * inter, k, device="cuda") / k ** 0.5).bfloat16())
        for m in ms:
            x = torch.randn(m, k, device="cuda").bfloat16()
            today = bench_graph([lambda w=w: separate(x, w) for w in weights]) * 1e3
            peer = bench_graph([lambda w=w: hf_ops(x, w) for w in weights]) * 1e3
            fused = []
            for _, cfg in configs:
                try:
                    fused.append(bench_graph([lambda w=w: linear_silu_and_mul_quack(x, w, cfg) for w in weights]) * 1e3)
                except Exception as exc:  # noqa: BLE001 - reported in the row
                    print(f"{name} M={m} {config_label(cfg)}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
                    fused.append(None)
            best = min((t for t in fused if t is not None), default=None)
            rows.append([name, m, f"{today:.1f}", f"{peer:.1f}"] + [f"{t:.1f}" if t else "-" for t in fused]
                        + [f"{today / best:.2f}" if best else "-", f"{peer / best:.2f}" if best else "-"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="0.6b,8b", help="comma-separated model names of SHAPES to run")
    parser.add_argument("--ms", type=positive_ints, default="128,256", help="comma-separated row counts to time")
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help="comma-separated quack configs TMxTN{p|c}[:CMxCN] (no swap-AB: the gated epilogue "
                             "has none)")
    parser.add_argument("--skip-speed", action="store_true", help="only the same-bits table")
    args = parser.parse_args(argv)
    try:
        parsed = [parse_config(spec) for spec in args.configs.split(",")]
    except ValueError as exc:
        parser.error(f"--configs: {exc}")
    if any(cfg.swap_ab for cfg in parsed):
        parser.error(f"--configs {args.configs!r}: swap-AB configs have no gated epilogue in quack")
    wanted = [part.strip() for part in args.shapes.split(",")]
    shapes = [s for s in SHAPES if s[0] in wanted]
    if not shapes:
        parser.error(f"--shapes {args.shapes!r} names none of {[s[0] for s in SHAPES]}")
    if not torch.cuda.is_available():
        print("benchmarks/gate_up_silu.py needs a CUDA GPU (Hopper: quack's SM90 GEMM)", file=sys.stderr)
        return 2
    if torch.cuda.get_device_capability()[0] != 9:
        print(f"benchmarks/gate_up_silu.py needs a Hopper (SM90) GPU, got {torch.cuda.get_device_name()}",
              file=sys.stderr)
        return 2
    from vexact_models.kernels.linear_silu_and_mul_quack import unavailable_reason

    probe = torch.zeros(16, 16, device="cuda", dtype=torch.bfloat16)
    reason = unavailable_reason(probe, probe)
    if reason is not None:
        print(f"the fused epilogue cannot run: {reason}", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    configs = [(config_label(c), c) for c in parsed]
    table("fused gate/up + SwiGLU vs linear_triton then silu_and_mul (bf16 elements that differ)",
          ["config", "model", "elements", "differing", "same bits"], bits_rows(configs, shapes))
    if not args.skip_speed:
        table("us per launch in a CUDA graph, weights from HBM",
              ["model", "M", "today (GEMM + silu_and_mul)", "HF ops"] + [label for label, _ in configs]
              + ["today / best", "HF / best"], speed_rows(configs, shapes, args.ms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
