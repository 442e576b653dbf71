"""The latent MLA decode's absorbed per-head projections (`kernels.head_linear`) under candidate
tiles at decode batches, beside cuBLAS's batched GEMM on the same views, in CUDA graphs (CUDA only).

A latent-mode decode step of DeepSeek-V3 and Moonlight runs two `head_linear` launches a layer:
each head's no-rope query into the latent space through ``W_uk^T`` (N = kv_lora_rank 512, K = 128)
and each head's latent attention output back through ``W_uv`` (N = 128, K = 512), both strided
views of ``kv_b_proj.weight``. The models run one tile for every row count (`head_linear.config`);
rule 1 (docs/design.md) says any tile gives the same bits, since each output is the same K loop in
64-wide steps into one fp32 accumulator. This times each candidate tile and says whether its
output equals the current tile's bit for bit ("same bits" must read "yes" for a tile to be
taken), with cuBLAS (`torch.bmm`, not batch-invariant) as the peer.

Usage: python benchmarks/investigations/head_linear.py [--tokens 16,64,128,256] [--tiles 16x64x4x3,32x64x4x3]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

# bench_utils lives one folder up, in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import positive_ints, table  # noqa: E402

#: (model, heads); both have 128 no-rope query dims, a 512-dim latent and 128 value dims
SHAPES = (("moonlight", 16), ("deepseek-v3", 128))
NOPE, RANK, V_DIM = 128, 512, 128
#: (BLOCK_M, BLOCK_N, warps, stages) candidates; the first is what the models run for bf16
TILES = ((64, 64, 4, 3), (16, 64, 2, 3), (16, 64, 4, 3), (16, 128, 4, 3), (32, 64, 4, 3), (32, 128, 4, 3),
         (64, 128, 4, 3), (64, 64, 8, 3), (16, 32, 2, 4), (32, 32, 2, 4), (64, 32, 4, 3), (16, 64, 4, 4))


def tile_specs(text: str) -> list[tuple[int, int, int, int]]:
    """``"16x64x4x3,32x64x4x3"`` -> the tiles (argparse type: errors name the value and the form)."""
    tiles = []
    for part in text.split(","):
        fields = part.strip().split("x")
        if len(fields) != 4 or not all(f.isdigit() and int(f) > 0 for f in fields):
            raise argparse.ArgumentTypeError(f"tile {part!r} must be BLOCK_MxBLOCK_NxWARPSxSTAGES, e.g. 16x64x4x3")
        tiles.append(tuple(int(f) for f in fields))
    return tiles


def absorbed_views(heads: int, device, dtype=torch.bfloat16, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_uk^T ``[H, RANK, NOPE]``, W_uv ``[H, V_DIM, RANK]``): strided views of one random
    ``kv_b_proj.weight``, as `deepseek_v3.latent_attention.absorbed_weights` takes them."""
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(heads * (NOPE + V_DIM), RANK, generator=gen) / RANK ** 0.5).to(device=device, dtype=dtype)
    weight = weight.view(heads, NOPE + V_DIM, RANK)
    return weight[:, :NOPE].transpose(1, 2), weight[:, NOPE:]


def sweep_rows(x: torch.Tensor, weight: torch.Tensor, tiles, time_us: Callable) -> list[list]:
    """One table row per tile: microseconds by `time_us(fn)`, the speed-up over cuBLAS's
    `torch.bmm`, and whether the output equals the first tile's (the reference: by default the
    tile the models run); a tile that does not fit the GPU gets its error's name instead."""
    from vexact_models.kernels.head_linear import head_linear_triton

    peer_us = time_us(lambda: torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)))
    rows = [["cuBLAS bmm (peer)", f"{peer_us:.1f}", "1.00x", ""]]
    want = head_linear_triton(x, weight, tiles[0])
    for tile in tiles:
        label = "x".join(map(str, tile)) + (" (reference)" if tile == tiles[0] else "")
        try:
            same = "yes" if torch.equal(head_linear_triton(x, weight, tile), want) else "NO"
            us = time_us(lambda: head_linear_triton(x, weight, tile))  # timed here, before `tile` moves on
        except Exception as exc:  # a tile out of shared memory or registers
            rows.append([label, type(exc).__name__, "", ""])
            continue
        rows.append([label, f"{us:.1f}", f"{peer_us / us:.2f}x", same])
    return rows


def _graph_us(fn) -> float:
    from bench_utils import bench_graph

    return bench_graph([fn]) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=positive_ints, default=[16, 64, 128, 256], metavar="T,T,...",
                        help="decode batches (tokens per step) to time (default 16,64,128,256)")
    parser.add_argument("--tiles", type=tile_specs, default=None, metavar="MxNxWxS,...",
                        help="candidate tiles (default: the built-in list); the first is the reference for bits")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("head_linear.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.kernels.head_linear import config

    tiles = args.tiles or [config(torch.bfloat16)] + [t for t in TILES if t != config(torch.bfloat16)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, heads in SHAPES:
        w_uk_t, w_uv = absorbed_views(heads, "cuda")
        for tokens in args.tokens:
            for what, weight, k in (("q_nope -> latent (W_uk^T)", w_uk_t, NOPE), ("latent -> v (W_uv)", w_uv, RANK)):
                x = torch.randn(tokens, heads, k, device="cuda").bfloat16()
                table(f"{name}, {tokens} tokens x {heads} heads: {what}, N={weight.shape[1]} K={k} (microseconds, CUDA graph)",
                      ["tile (BLOCK_M x BLOCK_N x warps x stages)", "us", "vs cuBLAS", "same bits"],
                      sweep_rows(x, weight, tiles, _graph_us))
    return 0


if __name__ == "__main__":
    sys.exit(main())
