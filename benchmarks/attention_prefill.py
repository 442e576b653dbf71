"""GQA prefill and training attention (head dim 128): the Triton launch against the Gluon kernel
(`kernels.attention_gluon`: 128 rows a program on two consumer warpgroups and a producer warp,
persistent) in candidate stage counts and register splits, and torch SDPA's flash backend, at the
Qwen3-0.6B (16 query / 8 KV heads), Qwen3-8B (32 / 8) and Qwen3-30B-A3B (32 / 4) shapes.

Cases: packed training at 1,024-32,768 tokens a sequence (the training target's lengths,
docs/design.md section 9), a rollout's prompt step (prompts of 32-1,024 tokens until ~8,000 tokens,
pages of 64, as the engine's prompt steps) and a chunked prefill (4 sequences, 3,072 tokens of
context, chunks of 1,024). Each row times one launch (`bench`, median of CUDA events) and gives
TFLOP/s (4 x heads x 128 per visible query-key pair), the speed-up over the Triton launch, the
speed-up over SDPA flash (training
cases: the same batch as ``[batch, heads, seqlen, 128]`` tensors, K/V repeated to the query
heads, ``is_causal``), and whether its output and lse equal the Triton launch's bitwise (they
must: docs/design.md rule 2).

Usage:
    python benchmarks/attention_prefill.py
    python benchmarks/attention_prefill.py --cases "8b prompt" --candidates 4x232x40,5x224x56
"""

from __future__ import annotations

import argparse
import functools
import random
import sys

import torch

from bench_utils import bench, case_selected, causal_pairs, gluon_candidates, gluon_unavailable, prompt_layout, table

D, PAGE = 128, 64
SHAPES = {"0.6b": (16, 8), "8b": (32, 8), "30b-a3b": (32, 4)}


def cases() -> dict[str, tuple[str, list[int], list[int]]]:
    """name -> (shape, new query tokens a sequence, sequence lengths)."""
    rng = random.Random(0)
    prompts = []
    while sum(prompts) < 8000:
        prompts.append(rng.randint(32, 1024))
    out = {}
    for shape in ("0.6b", "8b"):
        for batch, n in ((16, 1024), (4, 4096), (1, 8192), (1, 32768)):
            out[f"{shape} training {batch} x {n:,}"] = (shape, [n] * batch, [n] * batch)
    out["8b prompt step"] = ("8b", prompts, prompts)
    out["8b chunked 4 x 1,024 after 3,072"] = ("8b", [1024] * 4, [4096] * 4)
    out["30b-a3b training 4 x 4,096"] = ("30b-a3b", [4096] * 4, [4096] * 4)
    return out


def inputs(shape: str, q_lens: list[int], seq_lens: list[int], packed: bool):
    """Random bf16 q, k, v and the layout: pages of 64 shuffled over a cache, or the packed
    training layout (keys in consecutive rows, every key a query)."""
    heads, kv_heads = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(q_lens), heads, D, generator=gen).bfloat16().cuda()
    layout, slots = prompt_layout(q_lens, seq_lens, PAGE, gen, packed)
    k, v = (torch.randn(slots, kv_heads, D, generator=gen).bfloat16().cuda() for _ in range(2))
    return q, k, v, layout


def flops(heads: int, q_lens: list[int], seq_lens: list[int]) -> float:
    """Causal attention's FLOPs: 4 x heads x 128 for each query-key pair a query sees."""
    return 4.0 * heads * D * causal_pairs(q_lens, seq_lens)


def sdpa_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: int) -> float:
    """SDPA flash on the packed training batch as dense ``[batch, heads, seqlen, D]`` tensors."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dense = [x.view(batch, -1, x.shape[1], D).transpose(1, 2) for x in (q, k, v)]
    group = q.shape[1] // k.shape[1]
    qs, ks, vs = dense[0], dense[1].repeat_interleave(group, 1), dense[2].repeat_interleave(group, 1)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        return bench(lambda: torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True))


def run_case(name: str, shape: str, q_lens: list[int], seq_lens: list[int],
             candidates: list[tuple[int, int, int]]) -> list[list]:
    """Rows of one case: the Triton launch, then each Gluon candidate (stages, consumer and
    producer registers)."""
    from vexact_models.kernels import attention_gluon
    from vexact_models.kernels.attention import attention_triton

    packed = "training" in name
    q, k, v, layout = inputs(shape, q_lens, seq_lens, packed)
    scale = D ** -0.5
    with attention_gluon.ATTENTION_PREFILL.use("triton"):
        want, want_lse = attention_triton(q, k, v, layout, scale, kv_descriptors=packed)
        ms = bench(lambda: attention_triton(q, k, v, layout, scale, kv_descriptors=packed))
    peer = sdpa_ms(q, k, v, len(q_lens)) if packed else None
    work = flops(q.shape[1], q_lens, seq_lens)

    def row(label, t, same):
        vs_peer = f"{peer / t:.2f}x" if peer else "-"
        return [name, label, f"{t * 1e3:.1f}", f"{work / t / 1e9:.0f}", f"{ms / t:.2f}x", vs_peer, same]

    rows = [row("triton", ms, "-")]
    default = attention_gluon.launch_config(layout.max_seqlen_q)
    for cand in candidates:
        out, lse = torch.empty_like(want), torch.empty_like(want_lse)
        attention_gluon.launch(q, k, v, layout, scale, out, lse, *cand)
        same = torch.equal(out, want) and torch.equal(lse, want_lse)
        t = bench(lambda: attention_gluon.launch(q, k, v, layout, scale, out, lse, *cand))
        label = "gluon {}x{}x{}".format(*cand) + (" (default)" if cand == default else "")
        rows.append(row(label, t, "yes" if same else "NO"))
    if peer:
        rows.append(row("SDPA flash", peer, "-"))
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names to keep "
                        "(e.g. '8b training'); default: every case")
    parser.add_argument("--candidates", default="4x232x40,5x224x56",
                        type=functools.partial(gluon_candidates, form="STAGESxCONSUMER_REGSxPRODUCER_REGS",
                                               example="4x232x40"),
                        help="Gluon launches to time, STAGESxCONSUMER_REGSxPRODUCER_REGS (K/V stages, registers "
                             "a thread of each consumer warpgroup and of the producer; 2 x 128 x consumer + 128 x "
                             "producer must fit 65,536); default: %(default)s")
    args = parser.parse_args(argv)
    why = gluon_unavailable("attention_prefill.py")
    if why:
        print(why, file=sys.stderr)
        return 2
    rows = []
    for name, (shape, q_lens, seq_lens) in cases().items():
        if case_selected(name, args.cases):
            rows += run_case(name, shape, q_lens, seq_lens, args.candidates)
    table(f"GQA prefill/training attention (head dim 128), {torch.cuda.get_device_name()} (us a launch)",
          ["case", "kernel", "us", "TFLOP/s", "vs triton", "vs SDPA flash", "same bits"], rows)
    return 0 if all(r[-1] != "NO" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
