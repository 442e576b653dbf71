"""Registers, spills and shared memory of the latent MLA decode kernel's launch candidates on
Hopper, read without a GPU: each candidate is compiled for sm_90 through the real launcher
(`sm90_compile.compile_only`) and measured by the Triton wheel's ``ptxas -v``.

A decode launch reads the cache at the speed its programs can keep copies in flight, and a
program whose registers spill, or that holds an SM alone, keeps fewer. The row-major 16-row
tiles (mma.sync) hold the 16 x 576 query operand in every warp's registers; the key-major ones
(`LatentConfig.key_major`, wgmma) read both operands from shared memory. Timings and bitwise
checks are the GPU's: `attention_configs.py`, `conformance/kernel_invariance.py --only latent`.

Usage:
    python benchmarks/kernel_resources.py                   # Moonlight's latent decode shape
    python benchmarks/kernel_resources.py --shape deepseek-v3
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import table
from sm90_compile import compile_only, resources

# name: (query heads per KV head, latent dims, rope dims)
SHAPES = {"moonlight": (16, 512, 64), "deepseek-v3": (128, 512, 64), "tiny": (4, 64, 16)}


def candidates():
    """Row-major launches `pick_config` takes today beside the key-major ones (TMA decode)."""
    from vexact_models.kernels.latent_attention import LatentConfig

    return [LatentConfig(16, 64, 8, 3), LatentConfig(16, 64, 4, 3, 4), LatentConfig(16, 64, 8, 2, 1, True),
            LatentConfig(16, 64, 4, 2, 1, True), LatentConfig(16, 64, 4, 2, 4, True)]


def decode_inputs(heads: int, lat: int, rope: int, seqs: int = 4, context: int = 528, page: int = 64):
    """CPU stand-ins of a decode launch's tensors (zeros: nothing runs) with the engine's layout:
    pages of 64, one query token a sequence, the longest-first order buffer."""
    from vexact_models.kernels import PagedLayout

    pages = -(-context // page)
    kv = torch.zeros(seqs * pages * page, 1, lat + rope, dtype=torch.bfloat16)
    q = torch.zeros(seqs, heads, lat + rope, dtype=torch.bfloat16)
    table_ = torch.arange(seqs * pages, dtype=torch.int32).view(seqs, pages)
    layout = PagedLayout(torch.arange(seqs + 1, dtype=torch.int32), torch.full((seqs,), context, dtype=torch.int32),
                         table_, page, 1, seq_order=torch.arange(seqs, dtype=torch.int32))
    return q, kv, layout


def measure(shape: str) -> list[list]:
    """One row per candidate: its resources compiled for sm_90 at `shape`."""
    from vexact_models.kernels.latent_attention import latent_attention_triton

    heads, lat, rope = SHAPES[shape]
    q, kv, layout = decode_inputs(heads, lat, rope)
    rows = []
    with compile_only() as compiled:
        for cfg in candidates():
            latent_attention_triton(q, kv, lat, layout, lat ** -0.5, cfg, kv_descriptors=True)
            res = resources(compiled[-1])
            label = (f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                     + (f" v{cfg.value_chunks}" if cfg.value_chunks > 1 else ""))
            rows.append([label, "key" if cfg.key_major else "row", res.mma, res.registers, res.spill_bytes,
                         f"{res.shared_bytes / 1024:.0f}", res.programs_per_sm()])
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="moonlight",
                   help="the latent attention shape: query heads, 512 latent + 64 rope dims (tiny: 4, 64 + 16)")
    args = p.parse_args(argv)
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_resources.py needs triton (pip install triton==3.6.0); no GPU is needed", file=sys.stderr)
        return 2
    heads, lat, rope = SHAPES[args.shape]
    table(f"latent decode launches, {args.shape} ({heads} heads, {lat} + {rope} dims), compiled for sm_90",
          ["config", "major", "dots", "registers", "spill bytes", "shared KB", "programs/SM"], measure(args.shape))
    return 0


if __name__ == "__main__":
    sys.exit(main())
