"""Where a decode step's time goes: GPU kernels by name (torch profiler) beside the wall time.

Runs `LLM.generate` at a published shape (random weights, bf16) with `--batch` sequences of
`--context` prompt tokens, profiles `--steps` decode steps (CUDA graphs on, as in production),
and prints the kernels' GPU time per decode step grouped by kernel name, their total and the
step's wall time; the difference is host time and launch gaps the GPU waits through.

The last line compares the step with the HBM roofline: the bytes a decode step must read (all
weights but the input embedding, plus the batch's KV cache) over the measured copy bandwidth.

Usage:
    python benchmarks/decode_profile.py [--config qwen3-0.6b] [--batch 128] [--context 512]
    python benchmarks/decode_profile.py --config deepseek-v3 --set n_routed_experts=8 --batch 16 \
        --mla-kv-cache latent
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict

import torch

from bench_utils import copy_bandwidth, decode_bytes


LAUNCHES = "(kernel launches)"  # the pseudo-kernel under which _kernel_times counts launches


def _kernel_times(llm, prompts, max_tokens: int) -> dict[str, float]:
    """GPU seconds per kernel name over one `generate` of `max_tokens` new tokens per prompt, and
    the number of kernels run under `LAUNCHES`."""
    from torch.profiler import ProfilerActivity, profile

    from vexact_models.runtime import SamplingParams

    params = SamplingParams(temperature=0.6, max_tokens=max_tokens, ignore_eos=True, seed=0)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name[:60]] += event.device_time_total * 1e-6
            kernels[LAUNCHES] += 1
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
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (JSON value; repeatable), e.g. --set n_routed_experts=8")
    parser.add_argument("--mla-kv-cache", choices=("expanded", "latent"), help="MLA models: the KV cache mode")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.models import architecture_of, build_model, make_config, parse_overrides

    arch = architecture_of(args.config)
    config = make_config(arch, args.config, args.layers, None, parse_overrides(args.set))
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    if args.mla_kv_cache:
        if not hasattr(model, "set_mla_kv_cache"):
            parser.error(f"--mla-kv-cache: {args.config} is not an MLA model")
        model.set_mla_kv_cache(args.mla_kv_cache)
    step, kernels = profile_decode(model, config.vocab_size, args.batch, args.context, args.steps)
    launches = kernels.pop(LAUNCHES, 0.0)
    busy = sum(kernels.values())
    print(f"{args.config}, batch {args.batch}, context {args.context}: median decode step {step * 1e3:.2f} ms wall, "
          f"{busy * 1e3:.2f} ms of GPU kernels ({100 * busy / step:.0f}% busy) in {launches:.0f} kernels; the rest is host "
          "time and launch gaps")
    print(f"{'kernel':<62}{'ms/step':>9}{'share':>8}")
    for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{name:<62}{seconds * 1e3:>9.3f}{100 * seconds / busy:>7.1f}%")
    hbm = copy_bandwidth()
    roof = decode_bytes(model, args.batch, args.context + args.steps // 2) / (hbm * 1e9)
    print(f"HBM roofline {roof * 1e3:.2f} ms ({hbm:.0f} GB/s copy): the step is at {100 * roof / step:.0f}% of it, "
          f"the kernels alone at {100 * roof / busy:.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
