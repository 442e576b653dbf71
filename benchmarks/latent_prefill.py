"""Latent MLA prefill and training attention: the Triton launch against the Gluon kernel
(`kernels.latent_prefill_gluon`) at Moonlight's shape (16 heads, 512 latent + 64 rope dims) and
DeepSeek-V3's (128 heads).

Cases: a rollout's prompt step (prompts of 32-1,024 tokens until ~7,300 tokens, pages of 64, as
the engine's prompt steps), a chunked prefill (4 sequences, 3,072 tokens of context, chunks of
1,024), packed training (8 x 4,096; 2 x 16,384), and at DeepSeek-V3's head count a prompt step of
4 x 1,024 and training 2 x 4,096. Each row times one launch (`bench`, median of CUDA events) and
gives TFLOP/s (2 x heads x (576 + 512) per visible query-key pair), the speed-up over the Triton
launch, and whether its output and lse equal the Triton launch's bitwise (they must:
docs/design.md rule 2).

Usage:
    python benchmarks/latent_prefill.py
    python benchmarks/latent_prefill.py --cases training --candidates 32x4x2,64x8x1
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from bench_utils import bench, case_selected, causal_pairs, gluon_candidates, gluon_unavailable, prompt_layout, table

LAT, ROPE, PAGE = 512, 64, 64


def cases() -> dict[str, tuple[int, list[int], list[int]]]:
    """name -> (query heads, new query tokens a sequence, sequence lengths)."""
    rng = random.Random(0)
    prompts = []
    while sum(prompts) < 7300:
        prompts.append(rng.randint(32, 1024))
    return {"prompt step": (16, prompts, prompts), "chunked 4 x 1,024 after 3,072": (16, [1024] * 4, [4096] * 4),
            "training 8 x 4,096": (16, [4096] * 8, [4096] * 8), "training 2 x 16,384": (16, [16384] * 2, [16384] * 2),
            "deepseek-v3 prompt step 4 x 1,024": (128, [1024] * 4, [1024] * 4),
            "deepseek-v3 training 2 x 4,096": (128, [4096] * 2, [4096] * 2)}


def inputs(heads: int, q_lens: list[int], seq_lens: list[int], packed: bool):
    """Random bf16 queries and keys, and the layout: pages of 64 shuffled over a cache, or the
    packed training layout (keys in consecutive rows, every key a query)."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), heads, LAT + ROPE, generator=gen).bfloat16().cuda()
    layout, slots = prompt_layout(q_lens, seq_lens, PAGE, gen, packed)
    return q, torch.randn(slots, 1, LAT + ROPE, generator=gen).bfloat16().cuda(), layout


def flops(heads: int, q_lens: list[int], seq_lens: list[int]) -> float:
    """Causal latent attention's FLOPs: 2 x heads x (576 + 512) for each query-key pair a query sees."""
    return 2.0 * heads * (LAT + ROPE + LAT) * causal_pairs(q_lens, seq_lens)


def run_case(name: str, heads: int, q_lens: list[int], seq_lens: list[int],
             candidates: list[tuple[int, int, int]]) -> list[list]:
    """Rows of one case: the Triton launch, then each Gluon candidate."""
    from vexact_models.kernels import latent_prefill_gluon as gluon
    from vexact_models.kernels.latent_attention import latent_attention_triton

    packed = "training" in name
    q, kv, layout = inputs(heads, q_lens, seq_lens, packed)
    scale = (LAT + ROPE) ** -0.5
    with gluon.LATENT_PREFILL.use("triton"):
        want, want_lse = latent_attention_triton(q, kv, LAT, layout, scale, packed=packed)
        ms = bench(lambda: latent_attention_triton(q, kv, LAT, layout, scale, packed=packed))
    work = flops(heads, q_lens, seq_lens)
    rows = [[name, "triton", f"{ms * 1e3:.1f}", f"{work / ms / 1e9:.0f}", "1.00x", "-"]]
    for cand in candidates:
        out, lse = torch.empty_like(want), torch.empty_like(want_lse)
        gluon.launch(q, kv, LAT, layout, scale, out, lse, *cand)
        same = torch.equal(out, want) and torch.equal(lse, want_lse)
        t = bench(lambda: gluon.launch(q, kv, LAT, layout, scale, out, lse, *cand))
        label = "gluon {}x{}x{}".format(*cand) + (" (default)" if cand == (gluon.ROWS, gluon.WARPS, gluon.STAGES) else "")
        rows.append([name, label, f"{t * 1e3:.1f}", f"{work / t / 1e9:.0f}", f"{ms / t:.2f}x", "yes" if same else "NO"])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names to keep "
                        "(e.g. 'training'); default: every case")
    parser.add_argument("--candidates", default="64x8x1,32x4x2", type=gluon_candidates,
                        help="Gluon launches to time, ROWSxWARPSxSTAGES (query rows a program, warps, key stages); "
                             "default: %(default)s")
    args = parser.parse_args(argv)
    why = gluon_unavailable("latent_prefill.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    rows = []
    for name, (heads, q_lens, seq_lens) in cases().items():
        if case_selected(name, args.cases):
            rows += run_case(name, heads, q_lens, seq_lens, args.candidates)
    table(f"latent MLA prefill/training attention (512 + 64 dims), {torch.cuda.get_device_name()} (us a launch)",
          ["case", "kernel", "us", "TFLOP/s", "vs triton", "same bits"], rows)
    return 0 if all(r[-1] != "NO" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
