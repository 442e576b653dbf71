"""The decode sampler (`kernels.sample_tokens`) with and without its block filter, beside torch.

Our sampler is Gumbel-max over a counter RNG: every column of a row needs two correctly rounded
logarithms for its exact score, which made the kernel compute-bound (0.16 ms at 256 rows of a
151,936-token vocabulary on the H200, ~4x the time to read the logits). The block filter
(`sampling._may_beat`) computes exact scores only for blocks where some column may still beat
the running best; this script times the kernel with it (at several block widths) and without it,
checks that every variant returns the same tokens, and times a torch peer (softmax over
``logits / T`` and an exponential race, vLLM's way of sampling; not our tokens).

Rows are one decode step's logits (fp32) of three kinds: ``normal`` (independent N(0, 1) logits,
close to a randomly initialised model's, where the filter helps least), ``zipf`` (a language
model's shape: the token of rank r at -1.2 ln r plus noise, shuffled), and ``greedy`` (``zipf``
at temperature 0).

Usage (CUDA): ``cd benchmarks && python3 sampler.py [--rows 128,256] [--vocab 151936] [--temperature 0.6]``
"""

from __future__ import annotations

import argparse
import sys

import torch

from bench_utils import bench_graph, positive_int, positive_ints, table

BLOCKS = (2048, 1024, 512, 256)


def make_logits(kind: str, rows: int, vocab: int, gen: torch.Generator) -> torch.Tensor:
    """``[rows, vocab]`` fp32 logits of `kind` (the module docstring) on the GPU."""
    if kind == "normal":
        return torch.randn(rows, vocab, generator=gen).cuda()
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = -1.2 * ranks.log() + 0.3 * torch.randn(rows, vocab, generator=gen)
    order = torch.argsort(torch.rand(rows, vocab, generator=gen), dim=1)
    return logits.gather(1, order).cuda()


def torch_peer(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """vLLM-style sampling in torch: ``argmax(softmax(x / T) / Exp(1))`` (greedy: argmax)."""
    if temperature == 0:
        return logits.argmax(dim=1)
    probs = torch.softmax(logits / temperature, dim=1)
    return (probs / torch.empty_like(probs).exponential_()).argmax(dim=1)


def measure(kind: str, rows: int, vocab: int, temperature: float) -> list[list]:
    from vexact_models.kernels.sampling import sample_tokens_triton

    gen = torch.Generator().manual_seed(rows)
    logits = make_logits(kind, rows, vocab, gen)
    temp = 0.0 if kind == "greedy" else temperature
    temps = torch.full((rows,), temp, device="cuda")
    seeds = torch.arange(rows, device="cuda") * 7919 + 1
    steps = torch.full((rows,), 5, device="cuda")
    thresholds = torch.full((rows,), float("-inf"), device="cuda")
    args = (logits, temps, seeds, steps, thresholds)
    want = sample_tokens_triton(*args, filter_blocks=False)
    base = bench_graph([lambda: sample_tokens_triton(*args, filter_blocks=False)])
    out = [[kind, rows, "no filter", f"{base * 1e3:.1f}", "1.00", "-"]]
    for block in BLOCKS:
        same = torch.equal(sample_tokens_triton(*args, block_v=block), want)
        ms = bench_graph([lambda b=block: sample_tokens_triton(*args, block_v=b)])
        out.append([kind, rows, f"filter, blocks of {block}", f"{ms * 1e3:.1f}", f"{base / ms:.2f}",
                    "yes" if same else "NO"])
    ms = bench_graph([lambda: torch_peer(logits, temp)])
    out.append([kind, rows, "torch (softmax + exponential race)", f"{ms * 1e3:.1f}", f"{base / ms:.2f}", "n/a"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=positive_ints, default="128,256",
                        help="comma-separated batch sizes (default 128,256)")
    parser.add_argument("--vocab", type=positive_int, default=151936, help="columns per row (default Qwen3's 151,936)")
    parser.add_argument("--temperature", type=float, default=0.6,
                        help="temperature of the sampled kinds (default 0.6, as decode_profile.py)")
    args = parser.parse_args(argv)
    if not args.temperature > 0:
        parser.error(f"--temperature={args.temperature} must be > 0 (the greedy kind covers 0)")
    if not torch.cuda.is_available():
        print("benchmarks/sampler.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; vocab {args.vocab}, temperature {args.temperature}")
    result = [row for kind in ("normal", "zipf", "greedy") for r in args.rows
              for row in measure(kind, r, args.vocab, args.temperature)]
    table("sample_tokens per decode step (us, CUDA graphs); speedup over the kernel without the filter",
          ["logits", "rows", "sampler", "us", "speedup", "same tokens"], result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
