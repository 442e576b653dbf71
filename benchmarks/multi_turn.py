"""Multi-turn rollouts: an engine that owns its weights keeps the pages a call published
(`LLM._keep_prefix_cache`), so a conversation's next turn prefills only its new tokens; beside it,
in the same run, the same engine over weights it does not own (as over a trainer's), which
prefills every turn's whole conversation again. For the gated-DeltaNet hybrids (Qwen3.5,
Qwen3-Next), whose prompts share no pages by content, the engines keep ``--prefix-states`` prompt
states (`runtime.scheduler_prefix_states`; default: one a conversation, and one for a system prompt), so that a next turn
takes its last turn's pages and state up to that prompt's last whole page. A ``--system-len``
system prompt is shared within each call by both engines (the hybrids: at the page end where it
ends, `scheduler_prefix_states`' branch points).

Workload: ``--conversations`` conversations; the first prompt of each ``--system-len`` token ids
common to all (a system prompt; default none) and ``--prompt-len`` random ones; each turn
``--max-tokens`` sampled tokens (``ignore_eos``, a seed per conversation and turn), then
``--user-len`` new random tokens appended for the next turn; ``--turns`` turns, each one
``generate`` call. Model: random weights at a bundled published config (default Qwen3-8B),
bf16, CUDA. The two engines run one after the other (one freed before the next is built), each
after an untimed warm-up of the same shape: every turn of the workload on other tokens, so that
no timed turn pays a kernel's compile or a graph's capture (a second table says what each timed
turn paid on first use: Triton compiles, `benchmarks/compile_clock.py`, and mixed-step CUDA graph
captures; on a GPU every entry should be 0).

Table: per turn, the prompt tokens and the tokens each engine took from shared pages, each
engine's seconds and output tok/s, and the ratio. Then whether the two engines' tokens and
logprobs are bitwise equal over all turns (they must be: shared pages hold the very K/V the
sequence would have written), and every sample recomputed by ``token_logprobs`` (in micro-batches
of about ``--recompute-tokens`` tokens).

Usage (one H100 or H200):
    cd benchmarks && python3 multi_turn.py --config qwen3-8b --turns 4
    cd benchmarks && python3 multi_turn.py --config qwen3.5-35b-a3b --layers 8 --turns 4
    cd benchmarks && python3 multi_turn.py --config qwen3.5-35b-a3b --layers 8 --turns 4 --system-len 2048
    cd benchmarks && python3 multi_turn.py --tiny            # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from bench_models import build_published, recompute_mismatches
from compile_clock import CompileClock
from bench_utils import gpu_share, positive_int, synchronize, table, tiny_or_cuda

CONFIGS = ("qwen3-0.6b", "qwen3-8b", "llama-3.1-8b", "qwen2.5-7b", "qwen3-30b-a3b", "moonlight-16b-a3b",
           "qwen3.5-35b-a3b", "qwen3.5-text-default", "qwen3-next-80b-a3b")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-8b", choices=CONFIGS, help="bundled published config (qwen3-8b)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    p.add_argument("--conversations", type=positive_int, default=64, help="conversations (default 64)")
    p.add_argument("--turns", type=positive_int, default=4, help="turns, one generate call each (default 4)")
    p.add_argument("--prompt-len", type=positive_int, default=1024, help="first prompt's tokens (default 1024)")
    p.add_argument("--system-len", type=int, default=0,
                   help="tokens of a system prompt that begins every conversation (default 0: none)")
    p.add_argument("--max-tokens", type=positive_int, default=256, help="sampled tokens a turn (default 256)")
    p.add_argument("--user-len", type=positive_int, default=128, help="tokens appended after each turn (default 128)")
    p.add_argument("--gpu-memory-utilization", type=gpu_share, default=0.85, help="each engine's share of the GPU (0.85)")
    p.add_argument("--recompute-tokens", type=positive_int, default=16384,
                   help="tokens a recompute micro-batch holds (default 16384)")
    p.add_argument("--prefix-states", type=positive_int,
                   help="prompt states the engines keep, for the gated-DeltaNet hybrids (default: --conversations, "
                        "one more with --system-len)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the architecture's tiny config (tests)")
    args = p.parse_args(argv)
    if args.system_len < 0:
        p.error(f"argument --system-len: must be >= 0, got {args.system_len}")
    if args.tiny:
        args.conversations, args.turns, args.prompt_len, args.max_tokens, args.user_len = 3, 3, 24, 6, 5
    tiny_or_cuda(args, "benchmarks/multi_turn.py")
    return args


def build(args):
    """(architecture, model): the published config (``--layers``; ``--tiny``: the tiny config),
    its positions raised to the conversations' length."""
    length = args.system_len + args.prompt_len + args.turns * (args.max_tokens + args.user_len)
    arch, _, model = build_published(args, length + 64)
    return arch, model


def run_turns(llm, args, vocab: int) -> tuple[list[tuple], list[dict]]:
    """Every turn of the workload on `llm`: ((conversation, tokens, logprobs) of every sample of
    every turn, each turn's measures)."""
    from vexact_models.runtime import SamplingParams

    rng = random.Random(args.seed)
    system = [rng.randrange(3, vocab) for _ in range(args.system_len)]
    conversations = [system + [rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.conversations)]
    samples, measures = [], []
    for turn in range(args.turns):
        params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                                 seed=1000 * turn + i) for i in range(args.conversations)]
        hits, captured = llm.block_manager.num_shared_hits, _captures(llm)
        synchronize(args.device)
        start = time.perf_counter()
        with CompileClock() as compiles:
            outs = llm.generate(conversations, params, use_tqdm=False)
        synchronize(args.device)
        seconds = time.perf_counter() - start
        captured = [now - before for now, before in zip(_captures(llm), captured)]
        shared = (llm.block_manager.num_shared_hits - hits) * llm.block_manager.block_size
        samples += [(c, o.outputs[0].token_ids, o.outputs[0].logprobs) for c, o in zip(conversations, outs)]
        measures.append(dict(prompt=sum(map(len, conversations)), shared=shared, seconds=seconds,
                             tokens=sum(len(o.outputs[0].token_ids) for o in outs), compiles=compiles.summary(),
                             captures=f"{captured[0]} ({captured[1]:.2f} s)"))
        conversations = [c + o.outputs[0].token_ids + [rng.randrange(3, vocab) for _ in range(args.user_len)]
                         for c, o in zip(conversations, outs)]
    return samples, measures


def _captures(llm) -> tuple[int, float]:
    """The mixed-step CUDA graphs `llm` captured so far and their host seconds (none off CUDA)."""
    graphs = llm.runner.graphs
    return (graphs.num_mixed, graphs.mixed_capture_seconds) if graphs is not None else (0, 0.0)


def warm_up(llm, args, vocab: int) -> None:
    """The whole workload once, untimed, on other tokens (nothing of it is shared later): every
    turn's step shapes meet their kernels' compiles (a token count's new divisibility is a new
    Triton specialisation) and their CUDA graphs' captures here, not inside a timed turn (the
    first-use table shows what a timed turn still paid)."""
    run_turns(llm, argparse.Namespace(**{**vars(args), "seed": args.seed + 1}), vocab)


def main(argv=None) -> int:
    from vexact_models.runtime import LLM
    from vexact_models.runtime.linear_state_cache import linear_state_spec

    args = parse_args(argv)
    arch, model = build(args)
    vocab = model.config.vocab_size
    shape = "its tiny config" if args.tiny else args.config + (f", {args.layers} layers" if args.layers else "")
    print(f"{arch.name} ({shape}) on {args.device}, "
          f"{args.conversations} conversations x {args.turns} turns: {args.system_len} system and "
          f"{args.prompt_len} prompt tokens, "
          f"{args.max_tokens} sampled and {args.user_len} appended a turn")
    engine = dict(device=args.device) if args.tiny else dict(gpu_memory_utilization=args.gpu_memory_utilization)
    if linear_state_spec(model) is not None:  # (the hybrids: prompts shared through kept states)
        engine["prefix_states"] = args.prefix_states or args.conversations + bool(args.system_len)  # (+ the system prompt's)
        print(f"kept prompt states: {engine['prefix_states']}")
    results = {}
    for name, owns in (("pages kept across calls", True), ("each call afresh", False)):
        llm = LLM(model, owns_weights=owns, max_num_seqs=args.conversations, **engine)
        warm_up(llm, args, vocab)
        results[name] = run_turns(llm, args, vocab)
        del llm
        if args.device.type == "cuda":
            torch.cuda.empty_cache()
    (kept, kept_m), (fresh, fresh_m) = results.values()
    rows = []
    for turn, (k, f) in enumerate(zip(kept_m, fresh_m), start=1):
        rows.append([turn, f"{k['prompt']:,}", f"{k['shared']:,}", f"{f['shared']:,}", f"{k['seconds']:.2f}",
                     f"{f['seconds']:.2f}", f"{k['tokens'] / k['seconds']:,.0f}", f"{f['tokens'] / f['seconds']:,.0f}",
                     f"{f['seconds'] / k['seconds']:.2f}x"])
    table("turns (kept: an engine that owns its weights; afresh: over weights it does not own)",
          ["turn", "prompt tokens", "shared: kept", "shared: afresh", "s: kept", "s: afresh", "tok/s: kept",
           "tok/s: afresh", "speed-up"], rows)
    table("first-use costs inside each turn (Triton compiles, a cache load included; mixed-step CUDA graphs captured)",
          ["turn", "compiles: kept", "compiles: afresh", "captures: kept", "captures: afresh"],
          [[turn, k["compiles"], f["compiles"], k["captures"], f["captures"]]
           for turn, (k, f) in enumerate(zip(kept_m, fresh_m), start=1)])
    equal = kept == fresh
    print(f"\nthe two engines' tokens and logprobs over all turns: {'bitwise equal' if equal else 'DIFFERENT'}")
    n, mismatches, worst = recompute_mismatches(model, kept, args.recompute_tokens, args.device)
    print(f"recomputed by token_logprobs: {n:,} tokens, {mismatches} mismatches (max |diff| {worst:.3g})")
    ok = equal and mismatches == 0
    print("OK" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
