"""The order decode attention's programs take the sequences: the engine's longest first
(`runtime.step_inputs.attention_order`, ``PagedLayout.seq_order``) beside the scheduled
(arrival) order, over batches of mixed context lengths like `throughput.py`'s workload.

A GPU starts a launch's programs in grid order as SMs free up. With one or two programs per SM
(latent MLA decode runs one per sequence) a long sequence that starts last runs alone at the end;
longest first is the classic list-scheduling remedy. Each case draws its prompt lengths uniformly
from [100, 1024] (`throughput.py`'s prompts), adds `--steps` decoded tokens to each, and times one
attention launch per order in a CUDA graph (pages of 64, shuffled). "same bits" compares every
sequence's output with the arrival order's: an order moves work between programs, never a bit.

Usage:
    python benchmarks/investigations/attention_order.py                      # every case, 128 and 256 sequences
    python benchmarks/investigations/attention_order.py --only latent --batches 256 --steps 64,400
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
from pathlib import Path

import numpy as np
import torch

# bench_utils lives one folder up, in benchmarks/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_utils import bench_graph, copy_bandwidth, decode_layout, positive_ints, table  # noqa: E402

# (name, query heads, KV heads, qk dim, v dim, latent: the value is the key's first dims)
CASES = [("moonlight latent", 16, 1, 576, 512, True), ("qwen3-0.6b", 16, 8, 128, 128, False),
         ("qwen3-8b", 32, 8, 128, 128, False), ("moonlight expanded", 16, 16, 192, 128, False)]
PAGE = 64


def time_orders(case, batch: int, steps: int, rng: random.Random, hbm: float) -> list:
    """One table row: the case's launch in arrival order and longest first."""
    from vexact_models.kernels.attention import attention_triton
    from vexact_models.kernels.latent_attention import latent_attention_triton
    from vexact_models.runtime.step_inputs import attention_order

    name, heads, kv_heads, d, dv, latent = case
    lens = [rng.randint(100, 1024) + steps for _ in range(batch)]
    layout = decode_layout(batch, lens, PAGE)
    pages = int(layout.block_table.max()) + 1
    k = torch.randn(pages, PAGE, kv_heads, d, device="cuda").bfloat16()
    v = k[..., :dv] if latent else torch.randn(pages, PAGE, kv_heads, dv, device="cuda").bfloat16()
    q = torch.randn(batch, heads, d, device="cuda").bfloat16()
    order = torch.from_numpy(attention_order(np.ones(batch, np.int64), np.array(lens))).cuda()
    longest = dataclasses.replace(layout, seq_order=order)

    def run(lay):
        if latent:
            return latent_attention_triton(q, k, dv, lay, d ** -0.5)[0]
        return attention_triton(q, k, v, lay, d ** -0.5)[0]

    same = torch.equal(run(layout), run(longest))
    arrival_ms, longest_ms = (bench_graph([lambda lay=lay: run(lay)]) for lay in (layout, longest))
    kv_bytes = sum(lens) * kv_heads * (d + (0 if latent else dv)) * 2
    share = [f"{kv_bytes / ms / 1e6 / hbm * 100:.0f}%" for ms in (arrival_ms, longest_ms)]
    return [name, batch, f"{min(lens)}-{max(lens)}", f"{arrival_ms * 1e3:.1f}", share[0], f"{longest_ms * 1e3:.1f}",
            share[1], f"{arrival_ms / longest_ms:.2f}x", "yes" if same else "NO"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--only", choices=["latent", "gqa"], help="latent MLA cases only, or GQA ones only")
    parser.add_argument("--batches", type=positive_ints, default=[128, 256], help="sequences per launch (128,256)")
    parser.add_argument("--steps", type=positive_ints, default=[64, 400],
                        help="tokens decoded past each prompt: the launch's place in a rollout (64,400)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt lengths")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("attention_order.py needs a CUDA GPU", file=sys.stderr)
        return 2
    hbm = copy_bandwidth()
    rng = random.Random(args.seed)
    cases = [c for c in CASES if args.only is None or c[5] == (args.only == "latent")]
    rows = [time_orders(case, batch, steps, rng, hbm) for case in cases for batch in args.batches
            for steps in args.steps]
    print(f"{torch.cuda.get_device_name()}: KV copy bandwidth {hbm:.0f} GB/s (read + write); shares are KV bytes read / it")
    table("decode attention, microseconds per launch (CUDA graph)",
          ["case", "sequences", "context", "arrival us", "share", "longest first us", "share", "speed-up", "same bits"],
          rows)
    return 0 if all(r[-1] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
