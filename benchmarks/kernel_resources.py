"""Registers, spills and shared memory of the decode attention kernels' launch candidates on
Hopper, read without a GPU: each candidate is compiled for sm_90 through the real launcher
(`sm90_compile.compile_only`) and measured by the Triton wheel's ``ptxas -v``.

A decode launch reads the cache at the speed its programs can keep copies in flight, and a program
whose registers spill, or that holds an SM alone, keeps fewer. The latent MLA kernel's 16-row decode
tiles (mma.sync) hold the 16 x 576 query operand in every warp's registers and spill (a key-major
Triton variant was built, measured on the H200 and removed, 2026-11-27: docs/design.md rule 2); the
Gluon launch (`kernels.latent_decode_gluon`, the default decode where it fits) runs warpgroup MMAs
with both operands in shared memory and is listed after them, then the prefill/training launches
(64-row tiles): the Triton kernel's (255 registers, spills) and the Gluon prefill kernel's
(`kernels.latent_prefill_gluon`) candidates, rows x warps x key stages. The GQA kernel's decode tiles
(`--kernel gqa`) are listed with pointer loads and with TMA pages, then a prompt step's launch:
the Triton kernel's 128-row tile and the Gluon prefill/training kernel's (`kernels.attention_gluon`)
candidates, stages x consumer x producer registers. Timings and bitwise checks
are the GPU's: `attention_configs.py`, `conformance/kernel_invariance.py`.

Usage:
    python benchmarks/kernel_resources.py                   # Moonlight's latent decode shape
    python benchmarks/kernel_resources.py --shape deepseek-v3
    python benchmarks/kernel_resources.py --kernel gqa --shape qwen3-8b
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from bench_utils import decode_layout, table
from sm90_compile import compile_only, resources

# latent: (query heads, latent dims, rope dims); gqa: (query heads, KV heads, head dim)
SHAPES = {"latent": {"moonlight": (16, 512, 64), "deepseek-v3": (128, 512, 64), "tiny": (4, 64, 16)},
          "gqa": {"qwen3-0.6b": (16, 8, 128), "qwen3-8b": (32, 8, 128), "tiny": (4, 2, 64)}}


def candidates():
    """The TMA decode launches `pick_config` takes (one value chunk; four for few programs) and
    their two-stage variants."""
    from vexact_models.kernels.latent_attention import LatentConfig

    return [LatentConfig(16, 64, 8, 3), LatentConfig(16, 64, 4, 3, 4), LatentConfig(16, 64, 8, 2),
            LatentConfig(16, 64, 4, 2, 4)]


def decode_inputs(heads: int, lat: int, rope: int, seqs: int = 4, context: int = 528, page: int = 64,
                  kv_heads: int = 1):
    """CPU stand-ins of a decode launch's tensors (zeros: nothing runs) with the engine's layout:
    pages of 64, one query token a sequence, the longest-first order buffer; `lat` + `rope` dims
    a head (a GQA head: `lat` dims, no rope)."""
    layout = decode_layout(seqs, context, page, device="cpu")
    layout = dataclasses.replace(layout, seq_order=torch.arange(seqs, dtype=torch.int32))
    kv = torch.zeros(int(layout.block_table.max()) + 1, page, kv_heads, lat + rope, dtype=torch.bfloat16)
    q = torch.zeros(seqs, heads, lat + rope, dtype=torch.bfloat16)
    return q, kv, layout


def _row(label: str, loads: str, res) -> list:
    return [label, loads, res.mma, res.registers, res.spill_bytes, f"{res.shared_bytes / 1024:.0f}",
            res.programs_per_sm(), res.loop_instructions]


def measure_latent(shape: str) -> list[list]:
    """One row per latent candidate: its resources compiled for sm_90 at `shape`."""
    from vexact_models.kernels.latent_attention import latent_attention_triton

    heads, lat, rope = SHAPES["latent"][shape]
    q, kv, layout = decode_inputs(heads, lat, rope)
    rows = []
    with compile_only() as compiled:
        for cfg in candidates():
            latent_attention_triton(q, kv, lat, layout, lat ** -0.5, cfg, kv_descriptors=True)
            label = (f"m{cfg.block_m} n{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages}"
                     + (f" v{cfg.value_chunks}" if cfg.value_chunks > 1 else ""))
            rows.append(_row(label, "TMA", resources(compiled[-1])))
    return rows + measure_gluon(q, kv, lat, layout) + measure_prefill(heads, lat, rope)


PREFILL_CANDIDATES = ((64, 8, 1), (64, 8, 2), (32, 4, 2))  # (rows, warps, stages); the first is the default


def prefill_inputs(heads: int, lat: int, rope: int, seqs: int = 2, length: int = 1024, page: int = 64):
    """CPU stand-ins of a prefill launch (zeros: nothing runs): `seqs` whole prompts of `length`
    tokens over pages of `page`, each sequence's pages in order."""
    from vexact_models.kernels import PagedLayout

    pages = -(-length // page)
    layout = PagedLayout(torch.arange(seqs + 1, dtype=torch.int32) * length, torch.full((seqs,), length, dtype=torch.int32),
                         torch.arange(seqs * pages, dtype=torch.int32).reshape(seqs, pages), page, length)
    kv = torch.zeros(seqs * pages * page, 1, lat + rope, dtype=torch.bfloat16)
    return torch.zeros(seqs * length, heads, lat + rope, dtype=torch.bfloat16), kv, layout


def measure_prefill(heads: int, lat: int, rope: int, candidates=PREFILL_CANDIDATES, triton_tile: bool = True) -> list[list]:
    """The prefill/training launches at a 2 x 1,024-token prompt step: the Triton kernel's 64-row
    tile (`triton_tile`) and the Gluon prefill `candidates` where the shape fits that kernel."""
    from vexact_models.kernels import latent_prefill_gluon as gluon
    from vexact_models.kernels.latent_attention import LatentConfig, latent_attention_triton

    q, kv, layout = prefill_inputs(heads, lat, rope)
    rows = []
    with compile_only() as compiled:
        if triton_tile:
            latent_attention_triton(q, kv, lat, layout, lat ** -0.5, LatentConfig(64, 64, 8, 2), kv_descriptors=False)
            rows.append(_row("prefill m64 n64 w8 s2", "pointers", resources(compiled[-1])))
        if gluon.shape_fits(q, kv, lat, layout) and gluon.HAS_GLUON:
            out, lse = torch.empty(*q.shape[:2], lat, dtype=q.dtype), torch.empty(q.shape[:2])
            for cand in candidates:
                gluon.launch(q, kv, lat, layout, lat ** -0.5, out, lse, *cand)
                rows.append(_row("gluon prefill r{} w{} s{}".format(*cand), "TMA", resources(compiled[-1])))
    return rows


def measure_gluon(q, kv, lat: int, layout) -> list[list]:
    """The Gluon decode launch (`kernels.latent_decode_gluon`, warpgroup MMAs), one and four value
    chunks, where the shape fits it (Moonlight's; not DeepSeek-V3's 128 heads or the tiny shape)
    and this Triton runs the Gluon kernels (`gluon_support.HAS_GLUON`)."""
    from vexact_models.kernels import latent_decode_gluon as gluon

    flat = kv.reshape(-1, 1, kv.shape[-1])
    if not (gluon.HAS_GLUON and gluon.shape_fits(q, flat, lat, layout)):
        return []
    rows = []
    with compile_only() as compiled:
        for chunks in (1, 4):
            out = torch.empty(*q.shape[:2], lat, dtype=q.dtype)
            gluon.launch(q, flat, lat, layout, lat ** -0.5, chunks, out, torch.empty(q.shape[:2]))
            rows.append(_row(f"gluon w4 s{gluon.STAGES}" + (f" v{chunks}" if chunks > 1 else ""), "TMA",
                             resources(compiled[-1])))
    return rows


def measure_gqa(shape: str) -> list[list]:
    """The GQA decode tiles `pick_config` takes (two warps and three stages on Hopper; for launches
    of few programs four warps, three stages with TMA pages or five with pointer loads), and the
    four-warp three-stage tile they replaced, as a reference."""
    from vexact_models.kernels.attention import AttentionConfig, attention_triton

    heads, kv_heads, dim = SHAPES["gqa"][shape]
    q, k, layout = decode_inputs(heads, dim, 0, kv_heads=kv_heads)
    rows = []
    with compile_only() as compiled:
        for warps, stages, tma in ((2, 3, False), (4, 3, False), (4, 3, True), (4, 5, False)):
            cfg = AttentionConfig(16, 64, warps, stages, heads_fastest=True)
            attention_triton(q, k, k, layout, dim ** -0.5, cfg, page_descriptors=tma)
            rows.append(_row(f"m16 n64 w{warps} s{stages} heads", "TMA pages" if tma else "pointers",
                             resources(compiled[-1])))
    return rows + measure_gqa_prefill(heads, kv_heads, dim)


#: (stages, consumer registers, producer registers) of the Gluon kernel: its launch configs up to
#: 8k tokens and beyond (`attention_gluon.launch_config`), then 24 producer registers
#: (FlashAttention-3's), which spill the last block's zeroing
GQA_PREFILL_CANDIDATES = ((5, 224, 56), (4, 232, 40), (4, 240, 24))


def measure_gqa_prefill(heads: int, kv_heads: int, dim: int, candidates=GQA_PREFILL_CANDIDATES) -> list[list]:
    """A prompt step's launch (2 x 1,024 tokens over pages of 64): the Triton kernel's 128-row
    tile (pointer loads) and the Gluon kernel's candidates (`kernels.attention_gluon`: 12 warps,
    one program an SM) where the shape fits that kernel (head dim 128)."""
    from vexact_models.kernels import attention_gluon as gluon
    from vexact_models.kernels.attention import AttentionConfig, attention_triton

    q, _, layout = prefill_inputs(heads, dim, 0)
    k = torch.zeros(q.shape[0], kv_heads, dim, dtype=q.dtype)
    rows = []
    with compile_only() as compiled:
        attention_triton(q, k, k, layout, dim ** -0.5, AttentionConfig(128, 64, 4, 2))
        rows.append(_row("prefill m128 n64 w4 s2", "pointers", resources(compiled[-1])))
        if gluon.shape_fits(q, k, k, layout) and gluon.HAS_GLUON:
            out, lse = torch.empty_like(q), torch.empty(q.shape[:2])
            for cand in candidates:
                gluon.launch(q, k, k, layout, dim ** -0.5, out, lse, *cand)
                rows.append(_row("gluon prefill s{} c{} p{}".format(*cand), "TMA pages", resources(compiled[-1])))
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", choices=sorted(SHAPES), default="latent",
                   help="latent: the latent MLA attention's decode launches; gqa: the GQA attention's")
    p.add_argument("--shape", help="latent: moonlight (default), deepseek-v3 or tiny; gqa: qwen3-0.6b, "
                                   "qwen3-8b (default) or tiny")
    args = p.parse_args(argv)
    shape = args.shape or {"latent": "moonlight", "gqa": "qwen3-8b"}[args.kernel]
    if shape not in SHAPES[args.kernel]:
        p.error(f"--shape {shape!r} is not a {args.kernel} shape; choose one of {sorted(SHAPES[args.kernel])}")
    try:
        import triton  # noqa: F401
    except ImportError:
        print("kernel_resources.py needs triton (pip install triton==3.6.0); no GPU is needed", file=sys.stderr)
        return 2
    rows = (measure_latent if args.kernel == "latent" else measure_gqa)(shape)
    table(f"{args.kernel} attention launches, {shape} {SHAPES[args.kernel][shape]}, compiled for sm_90",
          ["config", "loads", "dots", "registers", "spill bytes", "shared KB", "programs/SM",
           "loop SASS"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
