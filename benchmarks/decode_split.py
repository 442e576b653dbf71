"""Decode steps as two half batches on two CUDA streams (`runtime.split_decode`) beside the
one-forward step, in the same run: the median full-batch decode step (async scheduling, CUDA
graphs) for each ``VEXACT_DECODE_SPLIT`` mode, its ratio to ``off`` and its HBM roofline share.

Each mode gets its own engine (the graphs are captured at construction, which is when the mode
is read) over the same model and prompts; the modes run in turn, `--rounds` times, and each
mode's best round is reported (the rounds show the spread).

Usage:
    python benchmarks/decode_split.py [--config qwen3-0.6b] [--batch 128,256] [--context 512]
    python benchmarks/decode_split.py --config qwen3-8b --batch 128 --modes off,free
"""

from __future__ import annotations

import argparse
import gc
import random
import sys

import torch

from bench_utils import copy_bandwidth, decode_bytes, positive_int, positive_ints, table
from decode_profile import _median_step


def step_seconds(model, vocab: int, batch: int, context: int, steps: int, mode: str) -> float:
    """Median async full-batch decode step of a fresh engine whose graphs are captured under
    ``VEXACT_DECODE_SPLIT`` = `mode`."""
    from vexact_models.runtime import LLM, SamplingParams
    from vexact_models.runtime.split_decode import DECODE_SPLIT

    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=steps, ignore_eos=True, seed=0)
    with DECODE_SPLIT.use(mode):
        llm = LLM(model, max_num_seqs=batch, max_model_len=context + steps + 16, gpu_memory_utilization=0.85)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    seconds = _median_step(llm, prompts, params, batch, True)
    llm.runner.free_cache()  # the next mode's engine takes the memory
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--batch", type=positive_ints, default=[128, 256], help="comma-separated batch sizes")
    parser.add_argument("--context", type=positive_int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=positive_int, default=64, help="new tokens per sequence")
    parser.add_argument("--modes", default="off,free,alternate", help="VEXACT_DECODE_SPLIT modes, off first")
    parser.add_argument("--rounds", type=positive_int, default=2, help="times each mode runs, in turn")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    args = parser.parse_args(argv)
    from vexact_models.runtime.split_decode import DECODE_SPLIT

    modes = args.modes.split(",")
    for mode in modes:
        DECODE_SPLIT.check(mode, "--modes")
    if modes[0] != "off":
        parser.error(f"--modes={args.modes!r} must start with off (the peer the others are compared with)")
    if not torch.cuda.is_available():
        print("benchmarks/decode_split.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.models import architecture_of, build_model, make_config

    arch = architecture_of(args.config)
    config = make_config(arch, args.config, args.layers, None, {})
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    hbm = copy_bandwidth()
    for batch in args.batch:
        rounds = {mode: [] for mode in modes}
        for _ in range(args.rounds):
            for mode in modes:
                rounds[mode].append(step_seconds(model, config.vocab_size, batch, args.context, args.steps, mode))
        roof = decode_bytes(model, batch, args.context + args.steps // 2) / (hbm * 1e9)
        best = {mode: min(times) for mode, times in rounds.items()}
        rows = [[mode, f"{best[mode] * 1e3:.3f}", " / ".join(f"{t * 1e3:.3f}" for t in rounds[mode]),
                 f"{best['off'] / best[mode]:.3f}x", f"{100 * roof / best[mode]:.1f}%"] for mode in modes]
        table(f"{args.config}, {batch} sequences at context {args.context}: decode step (roofline {roof * 1e3:.2f} ms "
              f"at {hbm:.0f} GB/s)", ["mode", "best ms", "rounds ms", "speed vs off", "roofline share"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
