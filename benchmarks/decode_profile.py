"""Where a decode step's time goes: GPU kernels by name (torch profiler) beside the wall time.

Runs `LLM.generate` at a published shape (random weights, bf16) with `--batch` sequences of
`--context` prompt tokens, profiles `--steps` decode steps (CUDA graphs on, as in production),
and prints the kernels' GPU time per decode step grouped by kernel name, their total and the
step's wall time; the difference is host time and launch gaps the GPU waits through.

Usage: python benchmarks/decode_profile.py [--config qwen3-0.6b] [--batch 128] [--context 512]
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict

import torch


def _kernel_times(llm, prompts, max_tokens: int) -> dict[str, float]:
    """GPU seconds per kernel name over one `generate` of `max_tokens` new tokens per prompt."""
    from torch.profiler import ProfilerActivity, profile

    from vexact_models.runtime import SamplingParams

    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, seed=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] += event.device_time_total * 1e-6
    return kernels


def profile_decode(model, vocab: int, batch: int, context: int, steps: int):
    """(median wall seconds of a decode step, {kernel name: GPU seconds per decode step}).

    Two profiled runs that differ only in `steps` more decode steps: the difference of their
    kernel times is what those decode steps cost (the prefill cancels out)."""
    from vexact_models.runtime import LLM, SamplingParams

    rng = random.Random(0)
    llm = LLM(model, max_num_seqs=batch, max_model_len=context + steps + 16, gpu_memory_utilization=0.85)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    short = _kernel_times(llm, prompts, 4)
    llm.step_times = []
    long = _kernel_times(llm, prompts, 4 + steps)
    decode = sorted(t for n, is_decode, t in llm.step_times if is_decode and n == batch)
    per_step = {k: (long[k] - short.get(k, 0.0)) / steps for k in long}
    return decode[len(decode) // 2], {k: v for k, v in per_step.items() if v > 0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64, help="decode steps profiled")
    parser.add_argument("--top", type=int, default=15, help="kernel names to list")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.models import architecture_of, build_model, make_config

    arch = architecture_of(args.config)
    config = make_config(arch, args.config, None, None)
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    step, kernels = profile_decode(model, config.vocab_size, args.batch, args.context, args.steps)
    busy = sum(kernels.values())
    print(f"{args.config}, batch {args.batch}, context {args.context}: median decode step {step * 1e3:.2f} ms wall, "
          f"{busy * 1e3:.2f} ms of GPU kernels ({100 * busy / step:.0f}% busy); the rest is host time and launch gaps")
    print(f"{'kernel':<62}{'ms/step':>9}{'share':>8}")
    for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{name:<62}{seconds * 1e3:>9.3f}{100 * seconds / busy:>7.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
