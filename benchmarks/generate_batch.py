"""transformers' ``generate_batch`` as an RL loop calls it (TRL's ``use_transformers_continuous_batching``):
on our model, where the rollout engine runs it (`vexact_models.batch_generation`), beside stock's
``generate_batch`` on the stock class (transformers' own paged runtime), in the same run.

Workload: ``--calls`` calls in a row, each of ``--prompts`` random prompts of ``--prompt-len``
tokens, ``--max-new-tokens`` sampled tokens each (EOS off, temperature 1), with TRL's
``ContinuousBatchingConfig(max_memory_percent=0.5)``. Model: random weights at a bundled published
config (default Qwen3-0.6B), bf16, CUDA. Our model runs each call twice over: as TRL calls it (an
engine built for the call, its CUDA graphs captured, dropped after it) and with
``persistent_manager=True`` (one engine kept over the calls); stock's runs as TRL calls it.

Table: per call, each side's seconds (ours: of which building the engine, its decode graphs
included; its decode graphs at `batch_generation.CALL_GRAPH_SIZES`, or ``--default-graph-sizes``)
and output tok/s, and ours against stock's. Then every sample of ours recomputed by
``token_logprobs`` (its ``return_logprobs``): the mismatches must be 0.

Usage (one H100 or H200):
    cd benchmarks && python3 generate_batch.py --config qwen3-0.6b --prompts 64 --max-new-tokens 256
    cd benchmarks && python3 generate_batch.py --tiny        # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench_models import build_published, recompute_mismatches
from bench_utils import positive_int, synchronize, table, tiny_or_cuda
from stock_peers import stock_alone
from throughput_engines import cpu_cache_fields, timed_generate_batch

CONFIGS = ("qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b", "qwen3.5-35b-a3b")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-0.6b", choices=CONFIGS, help="bundled published config (qwen3-0.6b)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    p.add_argument("--prompts", type=positive_int, default=64, help="prompts a call (default 64)")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="tokens a prompt (default 256)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, help="sampled tokens a prompt (default 256)")
    p.add_argument("--calls", type=positive_int, default=3, help="generate_batch calls in a row (default 3)")
    p.add_argument("--skip-stock", action="store_true", help="leave out stock's generate_batch")
    p.add_argument("--default-graph-sizes", action="store_true",
                   help="engines of one call capture LLM's default decode batch sizes, not "
                        "batch_generation.CALL_GRAPH_SIZES (what the coarser sizes save)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the architecture's tiny config (tests)")
    args = p.parse_args(argv)
    if args.tiny:
        args.prompts, args.prompt_len, args.max_new_tokens, args.calls = 3, 8, 5, 2
    tiny_or_cuda(args, "benchmarks/generate_batch.py")
    return args


def timed_builds() -> list[float]:
    """From now on, the seconds each engine `batch_generation` builds takes (its decode graphs
    captured at construction), appended as they are built."""
    from vexact_models.batch_generation import BatchEngineSettings

    seconds, build_engine = [], BatchEngineSettings.build

    def timed(self, model):
        start = time.perf_counter()
        llm = build_engine(self, model)
        synchronize(llm.device)
        seconds.append(time.perf_counter() - start)
        return llm
    BatchEngineSettings.build = timed
    return seconds


def run_calls(model, prompts: list[list[list[int]]], args, persistent: bool = False) -> tuple[list[float], list, int]:
    """(seconds of each call, (prompt, tokens, logprobs) of every sample, output tokens a call)."""
    from transformers.generation import ContinuousBatchingConfig

    seconds, samples = [], []
    for call, batch in enumerate(prompts):
        cb = ContinuousBatchingConfig(max_memory_percent=0.5, seed=args.seed + call, return_logprobs=True,
                                      **cpu_cache_fields(args.device))
        took, out = timed_generate_batch(model, batch, args.max_new_tokens, 1.0, continuous_batching_config=cb,
                                         persistent_manager=persistent)
        seconds.append(took)
        samples += [(r.prompt_ids, r.generated_tokens, r.logprobs) for r in out.values()]
    if persistent:
        model.destroy_cached_continuous_batching_manager()
    return seconds, samples, sum(len(s[1]) for s in samples) // len(prompts)


def main(argv=None) -> int:
    args = parse_args(argv)
    arch, _, model = build_published(args)
    rng = random.Random(args.seed)
    vocab = model.config.vocab_size
    prompts = [[[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
               for _ in range(args.calls)]
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU (--tiny)"
    print(f"{device}, torch {torch.__version__}; {args.config}{' tiny' if args.tiny else ''} "
          f"({model.config.num_hidden_layers} layers), {args.calls} calls of {args.prompts} prompts x "
          f"{args.prompt_len} tokens, {args.max_new_tokens} new tokens each")
    if args.default_graph_sizes:
        from vexact_models import batch_generation

        batch_generation.CALL_GRAPH_SIZES = None
    builds = timed_builds()
    ours, samples, tokens = run_calls(model.eval(), prompts, args)
    kept, kept_samples, _ = run_calls(model, prompts, args, persistent=True)
    stock = [float("nan")] * args.calls
    if not args.skip_stock:
        with stock_alone(arch, model, args.device) as hf:  # ours waits in host memory
            stock = run_calls(hf.eval(), prompts, args)[0]
    rows = [[call + 1, f"{ours[call]:.2f}", f"{builds[call]:.2f}", f"{kept[call]:.2f}", f"{stock[call]:.2f}",
             f"{tokens / ours[call]:,.0f}", f"{tokens / kept[call]:,.0f}", f"{tokens / stock[call]:,.0f}",
             f"{stock[call] / ours[call]:.1f}x"] for call in range(args.calls)]
    table(f"generate_batch calls ({tokens:,} output tokens a call)",
          ["call", "ours s", "of it the engine's build s", "ours kept s", "stock s", "ours tok/s", "kept tok/s",
           "stock tok/s", "ours / stock"], rows)
    same = [s[1] for s in samples] == [s[1] for s in kept_samples]
    print(f"\nthe kept engine's tokens: {'the same as a new engine a call' if same else 'DIFFERENT'}")
    n, mismatches, worst = recompute_mismatches(model, samples, 16384, args.device)
    print(f"recomputed by token_logprobs: {n:,} tokens, {mismatches} mismatches (max |diff| {worst:.3g})")
    ok = same and mismatches == 0
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
