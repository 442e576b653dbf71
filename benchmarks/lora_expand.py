"""The LoRA expand's launch tiles at decode and prefill rows, beside the group's base GEMM (CUDA only).

At the projection groups of Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B (`conformance.lora_invariance.
LORA_GROUPS`: q/k/v and gate/up stacked, o and down alone), rank `--rank`, fp32 adapters (PEFT's
default) under bf16 activations, for each of `--rows`: the expand (`kernels.lora_expand.
lora_expand_triton`, adding the shrink's partials itself) at every tile of `--tiles`, the shrink
(`lora_partials_triton`) and, as the peer measured in the same run, the group's base GEMM
(`kernels.linear` over the fused weight, weights rotated so that they come from HBM). Every time is
GPU microseconds of the launch alone in a CUDA graph (`bench_graph`), as the engine's decode step
replays it. "expand of u" is the same tile reading u already summed (``[1, T, R]``: the shrink and
`_lora_reduce_kernel`, "shrink + reduce", which the rollout runs beside the base GEMM where
K has `REDUCE_BESIDE_CHUNKS` chunks or more, `kernels.lora_partials`).
"x default" is a tile's time over the default tile's (`ExpandTile()`); "bits" says
whether its output is the default tile's, bitwise (the expand is element-wise: any difference is
a bug, and `kernel_invariance --only lora` checks the same tiles); "picked" marks the tile the
engine takes for the call (`expand_tile`; it is timed only when `--tiles` lists it).

Usage: ``python benchmarks/lora_expand.py [--rows 32,256] [--rank 16] [--tiles 32x128x4,16x32x4,32x32x4]
[--groups 0.6b]``
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from bench_utils import bench_graph, gluon_candidates, positive_int, positive_ints, rotating_copies, table

DEFAULT_TILES = "32x128x4,16x32x4,32x32x4,32x64x4,64x64x4,32x64x2"


def _tiles(launches: list[tuple[int, ...]]):
    from vexact_models.kernels.lora_expand import ExpandTile

    return [ExpandTile(*launch) for launch in launches]


def tile_rows(groups: list[tuple], rows: list[int], rank: int, tiles: list, device: str = "cuda",
              graph_timer=None) -> list[list]:
    """Rows ``[model, group, M, tile, expand us, x default, bits, expand of u us, shrink us, shrink +
    reduce us, base GEMM us, picked]`` per
    group of `groups` (`LORA_GROUPS`' entries), row count of `rows` and tile of `tiles` (the first
    row of each case is the default `ExpandTile()`, the reference for the ratio and the bits).
    `graph_timer` (`bench_graph` by default) is the clock; the tests pass a CPU one."""
    from vexact_models.kernels import linear
    from vexact_models.kernels.lora import lora_partials_triton, lora_shrink_triton
    from vexact_models.kernels.lora_expand import ExpandTile, expand_tile, lora_expand_triton

    graph_timer = graph_timer or bench_graph
    out = []
    for model, group, k, sizes in groups:
        n = sum(sizes)
        gen = torch.Generator().manual_seed(k + n)
        weight = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16().to(device)
        a = (torch.randn(len(sizes) * rank, k, generator=gen) / k ** 0.5).to(device)
        b = (torch.randn(n, rank, generator=gen) * 0.1).to(device)
        scalings = (2.0,) * len(sizes)
        weights = rotating_copies(weight) if device == "cuda" else [weight]
        for m in rows:
            x = torch.randn(m, k, generator=gen).bfloat16().to(device)
            base = linear(x, weight)
            partials, u = lora_partials_triton(x, a), lora_shrink_triton(x, a)[None]
            base_us = graph_timer([lambda w=w: linear(x, w) for w in weights]) * 1e3
            shrink_us = graph_timer([lambda: lora_partials_triton(x, a)]) * 1e3
            reduce_us = graph_timer([lambda: lora_shrink_triton(x, a)]) * 1e3
            first = None
            for tile in [ExpandTile(), *[t for t in tiles if t != ExpandTile()]]:
                result, result_u = torch.empty_like(base), torch.empty_like(base)

                def expand(tile=tile, result=result, p=partials):
                    return lora_expand_triton(base, p, b, None, sizes, scalings, result, tile=tile)

                expand(), expand(result=result_u, p=u)
                us = graph_timer([expand]) * 1e3
                u_us = graph_timer([functools.partial(expand, result=result_u, p=u)]) * 1e3
                first = (us, result) if first is None else first
                same = torch.equal(result, first[1]) and torch.equal(result_u, first[1])
                out.append([model, group, m, f"{tile.block_m}x{tile.block_n}x{tile.warps}", f"{us:.1f}",
                            f"{us / first[0]:.2f}x", "yes" if same else "NO", f"{u_us:.1f}", f"{shrink_us:.1f}",
                            f"{reduce_us:.1f}", f"{base_us:.1f}", "yes" if tile == expand_tile(m, n, len(sizes)) else ""])
        del weights
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_ints, default=[32, 256], help="rows (tokens) of the call")
    parser.add_argument("--rank", type=positive_int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--tiles", default=DEFAULT_TILES,
                        type=functools.partial(gluon_candidates, form="BLOCK_MxBLOCK_NxWARPS", example="32x128x4"),
                        help=f"expand tiles to time beside the default (32x128x4); default {DEFAULT_TILES}")
    parser.add_argument("--groups", default="",
                        help="only the groups whose model name contains this (e.g. 0.6b); default every group")
    args = parser.parse_args(argv)
    for block_m, block_n, warps in args.tiles:
        if min(block_m, block_n) < 16 or block_m & (block_m - 1) or block_n & (block_n - 1) or warps & (warps - 1):
            parser.error(f"--tiles: {block_m}x{block_n}x{warps} must be powers of two with BLOCK_M, BLOCK_N >= 16")
    from vexact_models.conformance.lora_invariance import LORA_GROUPS

    groups = [g for g in LORA_GROUPS if args.groups in g[0]]
    if not groups:
        parser.error(f"--groups {args.groups!r}: no group's model contains it (models: "
                     f"{sorted({g[0] for g in LORA_GROUPS})})")
    if not torch.cuda.is_available():
        print("lora_expand.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; rank {args.rank}, fp32 adapters, bf16 rows")
    table("LoRA expand tiles (GPU us in a CUDA graph)",
          ["model", "group", "M", "tile MxNxwarps", "expand us", "x default", "bits == default", "expand of u us",
           "shrink us", "shrink + reduce us", "base GEMM us", "picked"],
          tile_rows(groups, args.rows, args.rank, _tiles(args.tiles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
