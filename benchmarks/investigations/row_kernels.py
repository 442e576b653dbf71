"""The row kernels of a dense decode layer under each launch shape, beside the torch ops HF runs,
in CUDA graphs (CUDA only).

Between its GEMMs a Qwen3 decode layer runs `add_rms_norm` twice, `rotary_cache_write` (q/k norms,
rotation, cache write) and `silu_and_mul`: 113 launches a Qwen3-0.6B step, all on the step's
critical path (1.5-4.4 us each before the tiles this script picked: H200, 2026-11-28). This times
each kernel at the published shapes' decode batches (and the norm at a training batch, which shares
its tile) under every rows-per-program / warps tile
(`rms_norm.norm_launch_tile`) or columns-per-program / warps launch (`silu_and_mul_triton`), and
says whether each output equals the current launch's bit for bit. `silu_and_mul` is element-wise:
every row must say "yes". A norm's row sum follows its tile's layout, so a tile with other bits
("NO") could only replace the current one after the invariance sweep and the conformance runs
(docs/design.md rule 3). The peer is HF's ops: `Qwen3RMSNorm`'s formula, `rotate_half` and an
`index_copy_` into the cache (vLLM's layout), `silu(gate) * up`.

Usage: python benchmarks/investigations/row_kernels.py [--models qwen3-0.6b,qwen3-8b] [--tokens 128,256] [--norm-widths 512,2048]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# bench_utils lives one folder up, in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import graph_us_or_none, positive_ints, table  # noqa: E402

#: model -> (hidden, query heads, key/value heads, head dim, intermediate)
SHAPES = {"qwen3-0.6b": (1024, 16, 8, 128, 3072), "qwen3-8b": (4096, 32, 8, 128, 12288)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
WARPS = (1, 2, 4, 8)
SILU_BLOCKS = (256, 512, 1024, 2048, 4096)
TRAINING_ROWS = 8192
EPS = 1e-6


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """HF `Qwen3RMSNorm.forward` in torch ops (the peer)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * xf.to(x.dtype)


def hf_rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF `apply_rotary_pos_emb` for one tensor (`rotate_half`), cos/sin ``[tokens, 1, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _same(got, want) -> str:
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    return "yes" if all(torch.equal(a, b) for a, b in zip(got, want)) else "NO"


def _rows(kernel: str, run, candidates, default, peer, label, timer=None, launch=None) -> list[list]:
    """Rows (kernel, launch, us, vs the peer, same bits) for each candidate: the bits of
    `run(candidate)`, the time of `launch(candidate)` (default `run`) by `timer` (default: in a
    CUDA graph; microseconds, None where a launch does not fit)."""
    launch, timer = launch or run, timer or graph_us_or_none
    peer_us = timer(peer)
    if peer_us is None:  # the torch ops always launch: a failure here is a real one
        raise RuntimeError(f"{kernel}: the torch peer did not run")
    rows = [[f"{kernel} (torch peer)", "HF ops", f"{peer_us:.1f}", "1.00x", ""]]
    want = run(default)
    for cand in candidates:
        try:
            same = _same(run(cand), want)
        except Exception as exc:  # out of resources for a launch shape
            print(f"  skipped {kernel} {cand}: {type(exc).__name__}: {str(exc)[:100]}", file=sys.stderr)
            continue
        us = timer(lambda: launch(cand))
        now = " (now)" if cand == default else ""
        speed = "-" if us is None else f"{peer_us / us:.2f}x"
        rows.append([kernel, label(cand) + now, "-" if us is None else f"{us:.1f}", speed, same])
    return rows


def norm_tiles(n: int) -> list[tuple[int, int]]:
    """Every (rows, warps) tile the norm kernel takes for rows of `n` within 16,384 elements."""
    from vexact_models.kernels._triton import next_power_of_2

    return [(r, w) for r in ROWS for w in WARPS if r * next_power_of_2(n) <= 16384]


def norm_rows(hidden: int, tokens: int, device="cuda", timer=None, tiles=None) -> list[list]:
    """`add_rms_norm` over ``[tokens, hidden]`` (a residual add, the hidden norm) per tile (default
    `norm_tiles`)."""
    from vexact_models.kernels.rms_norm import norm_tile, rms_norm_triton

    gen = torch.Generator(device=device).manual_seed(tokens + hidden)
    x, res = (torch.randn(tokens, hidden, device=device, generator=gen).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(hidden, device=device, generator=gen)).bfloat16()
    _, rows, warps = norm_tile(hidden)
    return _rows("add_rms_norm", lambda t: rms_norm_triton(x, weight, EPS, res, tile=t), tiles or norm_tiles(hidden),
                 (rows, warps), lambda: hf_rms_norm(x + res, weight), lambda t: f"{t[0]} rows, {t[1]} warps", timer)


def rotary_rows(q_heads: int, kv_heads: int, head_dim: int, tokens: int, device="cuda", timer=None,
                tiles=None) -> list[list]:
    """`rotary_cache_write` (Qwen3's q/k norms, the rotation, the cache write) per tile (default
    `norm_tiles`)."""
    from vexact_models.kernels import rope_table, rotary_cache_write
    from vexact_models.kernels.rms_norm import norm_tile

    gen = torch.Generator(device=device).manual_seed(tokens + q_heads)
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, device=device, generator=gen).bfloat16()
    q, k, v = (t.view(tokens, -1, head_dim) for t in qkv.split([q_heads * head_dim, kv_heads * head_dim,
                                                                 kv_heads * head_dim], dim=1))
    positions = torch.randint(0, 4096, (tokens,), device=device, generator=gen)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = (t.to(device) for t in rope_table(inv_freq, 4096))  # fp32 tables, made on the CPU
    q_w, k_w = ((1 + 0.1 * torch.randn(head_dim, device=device, generator=gen)).bfloat16() for _ in range(2))
    k_cache, v_cache = (torch.zeros(2 * tokens, kv_heads, head_dim, device=device).bfloat16() for _ in range(2))
    slots = torch.randperm(2 * tokens, device=device, generator=gen)[:tokens]
    full_cos, full_sin = (torch.cat([t, t], dim=-1)[positions].unsqueeze(1).bfloat16() for t in (cos, sin))

    def run(tile):
        return rotary_cache_write(q, k, v, positions, cos, sin, k_cache, v_cache, slots, q_w, k_w, EPS, tile=tile)

    def peer():
        q_out = hf_rotate(hf_rms_norm(q, q_w), full_cos, full_sin)
        k_cache.index_copy_(0, slots, hf_rotate(hf_rms_norm(k, k_w), full_cos, full_sin))
        v_cache.index_copy_(0, slots, v)
        return q_out

    _, rows, warps = norm_tile(head_dim)
    return _rows("rotary_cache_write", lambda t: (run(t), k_cache.clone(), v_cache.clone()),
                 tiles or norm_tiles(head_dim), (rows, warps), peer, lambda t: f"{t[0]} rows, {t[1]} warps", timer,
                 launch=run)


def silu_rows(intermediate: int, tokens: int, device="cuda", timer=None, launches=None) -> list[list]:
    """`silu_and_mul` over the two halves of a fused gate/up output, per (columns, warps) launch
    (default: every `SILU_BLOCKS` x `WARPS` pair)."""
    from vexact_models.kernels.silu_and_mul import SILU_BLOCK, SILU_WARPS, silu_and_mul_triton

    gate_up = torch.randn(tokens, 2 * intermediate, device=device).bfloat16()
    gate, up = gate_up.split(intermediate, dim=1)
    candidates = launches or [(b, w) for b in SILU_BLOCKS for w in WARPS]
    return _rows("silu_and_mul", lambda c: silu_and_mul_triton(gate, up, *c), candidates, (SILU_BLOCK, SILU_WARPS),
                 lambda: torch.nn.functional.silu(gate) * up, lambda c: f"{c[0]} columns, {c[1]} warps", timer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3-0.6b,qwen3-8b",
                        help=f"comma-separated shapes among {', '.join(SHAPES)} (default: both)")
    parser.add_argument("--tokens", type=positive_ints, default=[128, 256], metavar="T,T,...",
                        help="decode batches (tokens per step) to time (default 128,256)")
    parser.add_argument("--norm-widths", type=positive_ints, default=[512, 2048, 7168], metavar="N,N,...",
                        help="more row widths for the norm alone, at each --tokens (default 512,2048,7168: "
                             "Moonlight's latent rank and hidden size, DeepSeek-V3's hidden size)")
    parser.add_argument("--no-training", action="store_true",
                        help=f"skip the norm at {TRAINING_ROWS} rows (a training batch, which shares the tile)")
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in SHAPES]
    if unknown or not models:
        parser.error(f"--models {args.models!r}: choose among {', '.join(SHAPES)}")
    if not torch.cuda.is_available():
        print("row_kernels.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for model in models:
        hidden, q_heads, kv_heads, head_dim, intermediate = SHAPES[model]
        for tokens in args.tokens:
            rows = norm_rows(hidden, tokens) + rotary_rows(q_heads, kv_heads, head_dim, tokens)
            rows += silu_rows(intermediate, tokens)
            table(f"{model}: {tokens} tokens (microseconds in a CUDA graph)",
                  ["kernel", "launch", "us", "vs torch", "same bits"], rows)
        if not args.no_training:
            table(f"{model}: the hidden norm at {TRAINING_ROWS} rows (training; microseconds in a CUDA graph)",
                  ["kernel", "launch", "us", "vs torch", "same bits"], norm_rows(hidden, TRAINING_ROWS))
    for width in args.norm_widths:
        for tokens in args.tokens:
            table(f"the norm over {tokens} rows of {width} (microseconds in a CUDA graph)",
                  ["kernel", "launch", "us", "vs torch", "same bits"], norm_rows(width, tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
