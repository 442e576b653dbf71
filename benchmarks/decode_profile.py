"""Where a decode step's time goes: GPU kernels by name (torch profiler) beside the wall time.

Runs `LLM.generate` at a published shape (random weights, bf16) with `--batch` sequences of
`--context` prompt tokens and `--steps` new tokens each (CUDA graphs on, as in production), and
prints for the steps that decode the whole batch (no prefill chunk in them) the kernels' GPU
time and launches per step grouped by kernel name, their total and the step's wall time (median, from
separate unprofiled runs: with async scheduling, the engine's default, and one step at a time);
the difference is host time and launch gaps the GPU waits through. The profiled run goes one
step at a time, so that each step's kernels run inside its profiler range. Its steps' median GPU
span (first kernel start to last kernel end) is the device's own time per step: the async wall
time above it is time the device waited for the host.
Kernels launched dependently (PDL) start before their predecessor ends and wait inside, so
their measured times overlap: the kernels' total can exceed the span ("busy" over 100%), and a
kernel's time is not what removing it would save, either way (`--without` measures that: at
Qwen3-8B batch 128 the rotary stand-in saved about twice its kernels' time).

It also prints the SM clock and power draw `nvidia-smi` sampled during the timed runs
(`gpu_clocks.py`): whether the step ran at full clocks. The last line compares the step with the
HBM roofline: the bytes a decode step must read (all weights but the input embedding, plus the
batch's KV cache) over the measured copy bandwidth.
Then the GEMM peers (`weight_gemms.py`, dense models, the dense hybrids included): the step's
GEMMs alone, run by cuBLAS (``torch.mm``) and by ours under sampled clocks, and the roofline with
the GEMMs at those times: at batch 128-256 the GEMMs' tensor-core work can hold the card at its
power limit, below the clocks a lone copy runs at, and small models' GEMMs are too small to fill
the card.

`--without OP,...` profiles the step with those small ops replaced by kernel-free stand-ins that
return real values (`stand_ins.py`): an upper bound of what fusing them away could gain.
`--lora R` profiles the engine over the model under random PEFT LoRA adapters of rank R on
every linear layer (and both fused expert tensors of a MoE: `conformance.models.add_random_lora`,
as `benchmarks/lora.py` builds them): where an adapted step's time goes, launch by launch (the
roofline counts the adapters' ``r (K + N)`` values a projection at the base weights' element size,
though PEFT keeps them in fp32). `--prompt-steps` profiles the steps with prompt tokens instead (the prefill chunks of the
`--batch` prompts, beside the decode rows that share their steps), with their new tokens per step
and tokens/s; they are bound by arithmetic, so no roofline or GEMM peer is printed.

Usage:
    python benchmarks/decode_profile.py [--config qwen3-0.6b] [--batch 128] [--context 512]
    python benchmarks/decode_profile.py --config qwen3-8b --without silu_and_mul,rotary_cache_write
    python benchmarks/decode_profile.py --config qwen3-0.6b --batch 32 --lora 16
    python benchmarks/decode_profile.py --config moonlight-16b-a3b --batch 32 --context 1024 --steps 4 --prompt-steps
    python benchmarks/decode_profile.py --config deepseek-v3 --set n_routed_experts=8 --batch 16 \
        --mla-kv-cache latent
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import defaultdict
from dataclasses import dataclass

import torch

import stand_ins
from bench_utils import check_overrides, copy_bandwidth, decode_bytes, positive_int
from gpu_clocks import GpuClocks, nvidia_smi_id
from weight_gemms import cublas_gemm, step_gemm_weights, time_weight_gemms, weight_bytes
from vexact_models.kernels import linear


LAUNCHES = "(kernel launches)"  # the pseudo-kernel under which profile_decode counts launches
DECODE_STEP = "vexact decode step"  # the profiler range around each profiled step


def is_profiled_step(scheduled, batch: int, prompt_steps: bool = False) -> bool:
    """Whether a step of `scheduled` items is one the profile attributes kernels to: a decode
    step of all `batch` sequences, one new token each; with `prompt_steps`, instead a step with
    prompt tokens (a prefill chunk, beside whatever decode rows share the step)."""
    decode_only = all(item.num_new_tokens == 1 for item in scheduled)
    return _picked(len(scheduled), decode_only, batch, prompt_steps)


def _picked(sequences: int, decode_only: bool, batch: int, prompt_steps: bool) -> bool:
    """`is_profiled_step` on a step's summary, as ``LLM.step_times`` records it (an empty step
    is decode-only and has no sequences, so neither kind picks it)."""
    return (not decode_only) if prompt_steps else (decode_only and sequences == batch and sequences > 0)


def _mark_steps(llm, batch: int, prompt_steps: bool = False) -> list[int]:
    """Run every step of `llm` that `is_profiled_step` picks under a profiler range named
    `DECODE_STEP`, so that kernels can be attributed to those steps alone (for decode: the
    prefill, steps that mix decode with prefill chunks and the batch's ragged end are left out).
    Turns async scheduling off: a step's tokens are waited for inside its range. Returns the list
    that the marked steps' new-token counts are appended to as they run."""
    from torch.profiler import record_function

    launch = llm._launch
    tokens: list[int] = []

    def marked(scheduled):
        if is_profiled_step(scheduled, batch, prompt_steps):
            tokens.append(sum(item.num_new_tokens for item in scheduled))
            with record_function(DECODE_STEP):
                launched = launch(scheduled)
                launched.results()  # the host sync: the step's kernels run inside the range
                return launched
        return launch(scheduled)

    llm.async_scheduling = False
    llm._launch = marked
    return tokens


def _median_step(llm, prompts, params, batch: int, async_scheduling: bool, prompt_steps: bool = False) -> float:
    """Median wall seconds between the completions of the steps `is_profiled_step` picks
    (unprofiled)."""
    llm.async_scheduling = async_scheduling
    llm.step_times = []
    llm.generate(prompts, params, use_tqdm=False)
    picked = sorted(t for n, decode_only, t in llm.step_times if _picked(n, decode_only, batch, prompt_steps))
    if not picked:
        raise SystemExit("decode_profile: no step with prompt tokens ran" if prompt_steps else
                         f"decode_profile: no decode step ran all {batch} sequences; raise --steps")
    return picked[len(picked) // 2]


def _kernel_events_by_range(events, ranges: list[tuple[float, float]]) -> dict[int, list]:
    """The GPU kernel events that start inside one of `ranges` (sorted host-clock intervals; the
    step's host sync at its end keeps its kernels inside), by the index of their range."""
    import bisect

    starts = [r[0] for r in ranges]
    by_range: dict[int, list] = defaultdict(list)
    for event in events:
        if event.device_type != torch.autograd.DeviceType.CUDA or event.name == DECODE_STEP:
            continue  # (the range itself has a GPU-side annotation too)
        at = bisect.bisect_right(starts, event.time_range.start) - 1
        if at >= 0 and event.time_range.start <= ranges[at][1]:
            by_range[at].append(event)
    return by_range


def _kernels_in_ranges(events, ranges: list[tuple[float, float]]) -> tuple[dict[str, float], dict[str, int], float]:
    """GPU seconds and launch counts per kernel name over the kernels that start inside one of
    `ranges` (`_kernel_events_by_range`); the seconds also hold the total count under `LAUNCHES`.
    Last, the median span of a range's GPU work, first start to last end (seconds): the step's
    device time without the host's gaps between steps, since the host queues a step's few eager
    launches (the sampler) long before its graph ends."""
    kernels: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    widths = []
    for range_events in _kernel_events_by_range(events, ranges).values():
        for event in range_events:
            kernels[event.name[:60]] += event.device_time_total * 1e-6
            counts[event.name[:60]] += 1
            kernels[LAUNCHES] += 1
        widths.append(max(e.time_range.end for e in range_events) - min(e.time_range.start for e in range_events))
    widths.sort()
    return kernels, counts, (widths[len(widths) // 2] * 1e-6 if widths else 0.0)


def _idle_before(events, ranges: list[tuple[float, float]]) -> dict[str, float]:
    """GPU idle time inside `ranges` (the kernels of `_kernel_events_by_range`), summed by the
    name of the kernel that ends each idle stretch: a gap between the end of everything that
    started earlier in the range and the next kernel's start is time the GPU waited, for the
    host's launch of that kernel or for a sync before it. Seconds over all ranges."""
    idle: dict[str, float] = defaultdict(float)
    for range_events in _kernel_events_by_range(events, ranges).values():
        kernels = sorted((e.time_range.start, e.time_range.end, e.name[:60]) for e in range_events)
        busy_until = kernels[0][1]
        for start, end, name in kernels[1:]:
            if start > busy_until:
                idle[name] += (start - busy_until) * 1e-6
            busy_until = max(busy_until, end)
    return dict(idle)


@dataclass
class DecodeProfile:
    """`profile_decode`'s results."""

    walls: tuple[float, float]  # median wall seconds of a full-batch decode step: async, one at a time
    kernels: dict[str, float]  # kernel name -> GPU seconds per such step (`LAUNCHES`: launches per step)
    counts: dict[str, float]  # kernel name -> launches per such step
    profiled: int  # steps profiled
    span: float  # median GPU span of a profiled step, seconds (`_kernels_in_ranges`)
    clocks: str  # the SM clock and power during the timed runs (`gpu_clocks.GpuClocks`)
    tokens: float = 0.0  # mean new tokens a profiled step computes
    idle: dict[str, float] | None = None  # kernel name -> GPU idle seconds per step before it (`_idle_before`)


def profile_decode(model, vocab: int, batch: int, context: int, steps: int,
                   block_size: int | None = None, prompt_steps: bool = False) -> DecodeProfile:
    """Time and profile full-batch decode steps of `model` (`DecodeProfile`); with
    `prompt_steps`, the steps with prompt tokens instead.

    Unprofiled `generate` calls time the steps (the profiler slows the host); a last one,
    profiled, attributes kernels to the steps `is_profiled_step` picks (`_mark_steps`). `block_size`:
    the engine's page size (None: `LLM`'s default)."""
    from torch.profiler import ProfilerActivity, profile

    from vexact_models.runtime import LLM, SamplingParams

    rng = random.Random(0)
    llm = LLM(model, max_num_seqs=batch, max_model_len=context + steps + 16, gpu_memory_utilization=0.85,
              block_size=block_size)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=steps, ignore_eos=True, seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    with GpuClocks(nvidia_smi_id(torch.cuda.get_device_properties(torch.cuda.current_device()))) as clocks:
        walls = tuple(_median_step(llm, prompts, params, batch, on, prompt_steps) for on in (True, False))
    tokens = _mark_steps(llm, batch, prompt_steps)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    events = prof.events()
    ranges = sorted((e.time_range.start, e.time_range.end) for e in events
                    if e.name == DECODE_STEP and e.device_type == torch.autograd.DeviceType.CPU)
    kernels, counts, span = _kernels_in_ranges(events, ranges)
    n = len(ranges)
    return DecodeProfile(walls, {k: v / n for k, v in kernels.items() if v > 0}, {k: c / n for k, c in counts.items()},
                         n, span, clocks.summary_line(), sum(tokens) / max(len(tokens), 1),
                         {k: v / n for k, v in _idle_before(events, ranges).items()})


def _report(args, model, result: DecodeProfile) -> None:
    """Print `profile_decode`'s results: the step, the kernels by name, the roofline shares."""
    (step, one_at_a_time), kernels, counts, profiled, span = (result.walls, dict(result.kernels), result.counts,
                                                              result.profiled, result.span)
    launches = kernels.pop(LAUNCHES, 0.0)
    busy = sum(kernels.values())
    pages = f", pages of {args.block_size}" if args.block_size else ""
    kind, steps = (("step with prompt tokens", f"steps with prompt tokens, {result.tokens:.0f} new tokens each: "
                    f"{result.tokens / step:.0f} tokens/s") if args.prompt_steps
                   else ("decode step", "full-batch decode steps"))
    print(f"{args.config}, batch {args.batch}, context {args.context}{pages}: median {kind} {step * 1e3:.2f} ms wall "
          f"with async scheduling ({one_at_a_time * 1e3:.2f} ms one step at a time: {one_at_a_time / step:.2f}x), "
          f"{busy * 1e3:.2f} ms of GPU kernels ({100 * busy / step:.0f}% busy) in {launches:.0f} kernels (mean of "
          f"{profiled} {steps}); the rest is host time and launch gaps")
    print(f"GPU span of a profiled step (first kernel start to last kernel end, median): {span * 1e3:.2f} ms; "
          f"the async step's wall time is {step / span:.2f}x that")
    print(result.clocks)
    print(f"{'kernel':<62}{'ms/step':>9}{'share':>8}{'launches':>10}")
    for name, seconds in sorted(kernels.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{name:<62}{seconds * 1e3:>9.3f}{100 * seconds / busy:>7.1f}%{counts.get(name, 0):>10.1f}")
    idle = result.idle or {}
    worst = sorted(idle.items(), key=lambda kv: -kv[1])[:4]
    print(f"GPU idle inside a profiled step: {sum(idle.values()) * 1e3:.2f} ms; the longest before: "
          + (", ".join(f"{name.strip()} ({seconds * 1e3:.2f} ms)" for name, seconds in worst) or "none"))
    if args.prompt_steps:  # bound by their arithmetic: the decode step's byte roofline does not apply
        return
    hbm = copy_bandwidth()
    step_bytes = decode_bytes(model, args.batch, args.context + args.steps // 2)
    roof = step_bytes / (hbm * 1e9)
    print(f"HBM roofline {roof * 1e3:.2f} ms ({hbm:.0f} GB/s copy): the step is at {100 * roof / step:.0f}% of it, "
          f"the kernels alone at {100 * roof / busy:.0f}%, the GPU span at {100 * roof / span:.0f}%")
    if args.lora:  # the peer times plain weight GEMMs; the adapters' launches are in the table above
        print("GEMM peers: none (--lora)")
        return
    _report_gemm_peer(model, args.batch, step, step_bytes, hbm)


def _report_gemm_peer(model, batch: int, step: float, step_bytes: int, hbm: float, seconds: float = 3.0) -> None:
    """Print the GEMM peers (`weight_gemms`, each timed for `seconds`): the step's GEMMs alone at
    `batch` rows, by cuBLAS and by our `kernels.linear`, with their clocks; then the roofline with
    the GEMMs at each one's time and every other byte (the KV cache, norm weights) at copy
    bandwidth `hbm` GB/s: what the card reaches at this batch when the GEMMs' power draw lowers
    its clocks, or their size leaves SMs idle."""
    try:
        weights = step_gemm_weights(model)
    except ValueError as exc:
        print(f"GEMM peers: none ({exc})")
        return
    rest = (step_bytes - weight_bytes(weights)) / (hbm * 1e9)
    bounds = []
    for name, gemm in (("cuBLAS (torch.mm)", cublas_gemm), ("ours (kernels.linear)", linear)):
        peer = time_weight_gemms(weights, batch, seconds, gemm)
        bounds.append(peer.seconds + rest)
        print(f"The step's {len(weights)} GEMMs alone, {name}, {batch} rows, {peer.weight_bytes / 1e9:.2f} GB of "
              f"weights: {peer.seconds * 1e3:.2f} ms, {peer.bandwidth_gbs:.0f} GB/s ({100 * peer.bandwidth_gbs / hbm:.0f}% "
              f"of copy); {peer.clocks}")
    print(f"Roofline with the GEMMs at those times (the rest at copy bandwidth): cuBLAS's {bounds[0] * 1e3:.2f} ms, "
          f"ours {bounds[1] * 1e3:.2f} ms: the step is at {100 * bounds[0] / step:.0f}% / {100 * bounds[1] / step:.0f}%")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64,
                        help="new tokens per sequence; the full-batch decode steps among them are profiled")
    parser.add_argument("--top", type=int, default=15, help="kernel names to list")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (JSON value; repeatable), e.g. --set n_routed_experts=8")
    parser.add_argument("--mla-kv-cache", choices=("expanded", "latent"), help="MLA models: the KV cache mode")
    parser.add_argument("--block-size", type=positive_int,
                        help="positions per KV page (default: LLM's own, `default_block_size`)")
    parser.add_argument("--without", default="", metavar="OP,...",
                        help="replace these ops by kernel-free stand-ins with real values (wrong numbers, an upper "
                             f"bound of a fusion's gain): a comma-separated subset of {', '.join(stand_ins.OPS)}")
    parser.add_argument("--lora", type=positive_int, metavar="RANK",
                        help="random PEFT LoRA adapters of this rank on every linear layer (and the fused experts)")
    parser.add_argument("--prompt-steps", action="store_true",
                        help="profile the steps with prompt tokens (prefill chunks of the --batch prompts of "
                             "--context tokens) instead of the full-batch decode steps; no roofline or GEMM peers")
    args = parser.parse_args(argv)
    try:
        without = stand_ins.parse_ops(args.without)
    except ValueError as exc:
        parser.error(str(exc))
    check_overrides(parser, args.set, [args.config])
    if not torch.cuda.is_available():
        print("benchmarks/decode_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.models import (add_random_lora, architecture_of, build_model, make_config,
                                                  parse_overrides)

    arch = architecture_of(args.config)
    config = make_config(arch, args.config, args.layers, None, parse_overrides(args.set))
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    if args.mla_kv_cache:
        if not hasattr(model, "set_mla_kv_cache"):
            parser.error(f"--mla-kv-cache: {args.config} is not an MLA model")
        model.set_mla_kv_cache(args.mla_kv_cache)
    engine_model = add_random_lora(model, args.lora) if args.lora else model  # the PeftModel over `model`
    with stand_ins.without(without) as calls:
        result = profile_decode(engine_model, config.vocab_size, args.batch, args.context, args.steps, args.block_size,
                                args.prompt_steps)
    if without:
        called = ", ".join(f"{name} ({calls[name]} host calls{'' if calls[name] else ': this model never runs it'})"
                           for name in without)
        print(f"WITHOUT {called}: kernel-free stand-ins, wrong numbers; an upper bound of fusing them away")
    _report(args, model, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
