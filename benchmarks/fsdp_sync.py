"""FSDP2 (world size 1) beside a colocated rollout engine, at published shapes (random weights).

Per config (default Qwen3-8B, and Qwen3-30B-A3B at 24 of its 48 layers so that trainer and engine
fit one H200 side by side; every layer has the real shape):

1. mismatches: roll out >= ``--tokens`` tokens with the engine, recompute every sampled token's
   logprob with the FSDP2-sharded trainer (``token_logprobs``), count the differences (want 0).
2. weight sync: time of streaming the trainer's full weights into the engine
   (`stream_full_weights` -> ``LLM.update_weights``, per bucket size) beside a plain ``copy_`` of
   the same bytes from the trainer's (local, world size 1) tensors into the engine's.
3. memory (``--memory-configs``, default Qwen3-8B): peak CUDA memory of one training step of the
   trainer alone, beside one colocated iteration: rollout -> engine ``sleep(level=2)`` -> the
   same training step -> engine wakes, weights streamed in -> rollout.
4. sleep cycles (``--sleep-cycles`` on ``--sleep-config``, default Qwen3-0.6B with decode graphs
   up to batch 16, so that the 100 re-captures stay short): allocated memory after every sleep
   and every wake_up (levels 1 and 2 alternating; level 2 refilled from the sharded trainer)
   must be flat.

Usage (one H200; each command well under 10 minutes; current figures in docs/performance.md):
    python benchmarks/fsdp_sync.py --configs qwen3-8b                           # + memory + sleep
    python benchmarks/fsdp_sync.py --configs qwen3-30b-a3b --sleep-cycles 0     # 24 of 48 layers
    python benchmarks/fsdp_sync.py --configs qwen3-30b-a3b --layers qwen3-30b-a3b=48 --sleep-cycles 0
    python benchmarks/fsdp_sync.py --tiny                                       # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import math
import random
import time

import torch
import torch.distributed as dist

from bench_models import packed, recompute_mismatches
from bench_utils import timed, tiny_or_cuda


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="qwen3-8b,qwen3-30b-a3b", help="published configs (conformance/configs)")
    p.add_argument("--layers", default="qwen3-30b-a3b=24", help="NAME=N,... or N: num_hidden_layers overrides")
    p.add_argument("--tokens", type=int, default=100_000, help="generated tokens to check per config (at least)")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--recompute-tokens", type=int, default=16384, help="tokens per recompute micro-batch")
    p.add_argument("--bucket-mib", default="64,512", help="stream bucket sizes to time (MiB, comma-separated)")
    p.add_argument("--memory-configs", default="qwen3-8b", help="configs to measure peak memory on ('' for none)")
    p.add_argument("--train-prompts", type=int, default=8, help="sequences in the training step of the memory check")
    p.add_argument("--sleep-cycles", type=int, default=100)
    p.add_argument("--sleep-config", default="qwen3-0.6b", help="config of the sleep/wake cycles")
    p.add_argument("--kv-cache-gib", type=float, default=16.0)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the tiny Qwen3 config, a few hundred tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.configs, args.layers, args.memory_configs, args.sleep_config = "tiny", "", "tiny", "tiny"
        args.tokens, args.prompt_len, args.max_tokens, args.recompute_tokens = 300, 8, 16, 64
        args.bucket_mib, args.train_prompts, args.sleep_cycles, args.kv_cache_gib = "0.01,1", 2, 4, 1 / 64
    for name in ("tokens", "prompt_len", "max_tokens", "recompute_tokens", "train_prompts"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.sleep_cycles < 0:
        p.error("--sleep-cycles must be >= 0")
    tiny_or_cuda(args, "fsdp_sync.py")
    return args


def layer_overrides(spec: str) -> dict[str, int]:
    out = {}
    for item in filter(None, spec.split(",")):
        name, _, n = item.rpartition("=")
        out[name or "*"] = int(n)
    return out


def allocated(device) -> int | None:
    return torch.cuda.memory_allocated() if device.type == "cuda" else None


def gib(n) -> str:
    return "n/a (CPU)" if n is None else f"{n / 2**30:.2f}"


def build(name: str, args, seed: int = 0):
    from vexact_models.conformance.models import architecture_of, build_model, make_config
    from vexact_models.registry import get

    arch = get("qwen3") if name == "tiny" else architecture_of(name)
    layers = layer_overrides(args.layers)
    config = make_config(arch, None if name == "tiny" else name, layers.get(name, layers.get("*")), None,
                         {"initializer_range": 0.3} if name == "tiny" else None)
    return build_model(arch, config, args.device, args.dtype, seed)


def make_llm(model, args, max_num_seqs: int = 256):
    from vexact_models.runtime import LLM

    return LLM(model, device=args.device, kv_cache_bytes=int(args.kv_cache_gib * 2**30), owns_weights=True,
               max_model_len=args.prompt_len + args.max_tokens + 1, max_num_seqs=max_num_seqs)


def rollout(llm, n: int, args, seed: int, max_tokens: int | None = None):
    from vexact_models.runtime import SamplingParams

    rng = random.Random(seed)
    vocab = llm.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=max_tokens or args.max_tokens, ignore_eos=True, seed=seed + i)
              for i in range(n)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def recompute(trainer, samples, args):
    """(tokens checked, mismatches, max |diff|) of the sharded recompute against the rollout."""
    return recompute_mismatches(trainer, samples, args.recompute_tokens, args.device)


def weight_sync(trainer, llm, engine_model, args) -> tuple[list[list], bool]:
    """Rows (method, bucket, bytes, seconds, GB/s), and whether the streamed weights equal the
    trainer's."""
    from vexact_models.distributed import stream_full_weights

    engine = dict(engine_model.named_parameters())
    pairs = [(engine[n], p.to_local() if hasattr(p, "to_local") else p) for n, p in trainer.named_parameters()]
    nbytes = sum(dst.numel() * dst.element_size() for dst, _ in pairs)

    @torch.no_grad()
    def plain():
        for dst, src in pairs:
            dst.copy_(src)

    rows = []
    for mib in [float(m) for m in args.bucket_mib.split(",")]:
        bucket = max(1, int(mib * 2**20))
        seconds = timed(lambda: llm.update_weights(stream_full_weights(trainer, bucket, dtype=args.dtype)), args.device)
        rows.append(["stream_full_weights -> update_weights", f"{mib:g} MiB", nbytes, seconds])
    same = all(torch.equal(dst, src) for dst, src in pairs)  # the engine started from other values
    rows.append(["plain copy_", "-", nbytes, timed(plain, args.device)])
    size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.3f} MB"
    return [[m, b, size, f"{s:.4f}", f"{n / s / 1e9:.2f}"] for m, b, n, s in rows], same


def train_step(trainer, optim, seqs, args) -> None:
    ids, pos = packed(seqs, args.device)
    trainer.train()
    lp = trainer.token_logprobs(ids, position_ids=pos)
    (-lp.sum() / lp.numel()).backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def memory_check(name, args) -> list:
    """[trainer alone peak, colocated peak, engine awake footprint] (GiB) and the recompute check
    of the rollout after the colocated step."""
    from vexact_models.distributed import shard, stream_full_weights

    cuda = args.device.type == "cuda"
    n, length = args.train_prompts, args.prompt_len + args.max_tokens
    trainer = shard(build(name, args), activation_checkpointing=True)
    optim = torch.optim.AdamW(trainer.parameters(), lr=1e-5)
    rng = random.Random(7)
    vocab = trainer.config.vocab_size
    random_seqs = [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]
    train_step(trainer, optim, random_seqs, args)  # optimizer state exists from here on, as in a run
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    train_step(trainer, optim, random_seqs, args)
    alone = torch.cuda.max_memory_allocated() if cuda else None
    before_engine = allocated(args.device)
    engine_model = build(name, args, seed=1)
    llm = make_llm(engine_model, args)
    llm.update_weights(stream_full_weights(trainer, dtype=args.dtype))
    footprint = None if not cuda else allocated(args.device) - before_engine
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    samples = rollout(llm, n, args, seed=11)
    llm.sleep(level=2)
    train_step(trainer, optim, [p + c for p, c, _ in samples], args)
    llm.wake_up(tags=["weights"])
    llm.update_weights(stream_full_weights(trainer, dtype=args.dtype))
    llm.wake_up(tags=["kv_cache"])
    after = rollout(llm, n, args, seed=12)
    colocated = torch.cuda.max_memory_allocated() if cuda else None
    checked, bad, _ = recompute(trainer, after, args)
    del llm, engine_model, trainer, optim
    if cuda:
        torch.cuda.empty_cache()
    return [name, gib(alone), gib(colocated), gib(footprint), f"{checked:,}", bad]


def sleep_cycles(args) -> tuple[list, bool]:
    """Allocated memory after each sleep and each wake_up; flat means one value per state."""
    from vexact_models.distributed import shard, stream_full_weights

    name = args.sleep_config
    trainer = shard(build(name, args))
    llm = make_llm(build(name, args), args, max_num_seqs=16)
    llm.update_weights(stream_full_weights(trainer, dtype=args.dtype))
    rollout(llm, 4, args, seed=0, max_tokens=8)
    asleep, awake = {1: set(), 2: set()}, set()
    for cycle in range(args.sleep_cycles):
        level = 1 + cycle % 2
        llm.sleep(level=level)
        asleep[level].add(allocated(args.device))
        llm.wake_up(tags=["weights"])
        if level == 2:
            llm.update_weights(stream_full_weights(trainer, dtype=args.dtype))
        llm.wake_up(tags=["kv_cache"])
        awake.add(allocated(args.device))
    checked, bad, _ = recompute(trainer, rollout(llm, 4, args, seed=2000, max_tokens=32), args)
    flat = all(len(v) <= 1 for v in (*asleep.values(), awake))
    rows = [[name, f"asleep, level {lvl}", ", ".join(gib(v) for v in sorted(vals, key=lambda v: v or 0))]
            for lvl, vals in asleep.items()]
    rows.append([name, "awake", ", ".join(gib(v) for v in sorted(awake, key=lambda v: v or 0))])
    del llm, trainer
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, (flat or args.device.type != "cuda") and bad == 0 and checked > 0


def run_config(name, args, tables) -> bool:
    from vexact_models.distributed import shard

    trainer = shard(build(name, args))
    engine_model = build(name, args, seed=1)  # different values: the first sync must fix them
    llm = make_llm(engine_model, args)
    sync_rows, same = weight_sync(trainer, llm, engine_model, args)
    tables["sync"] += [[name, *r] for r in sync_rows]
    n = math.ceil(args.tokens / args.max_tokens)
    rollout(llm, 2, args, seed=0, max_tokens=4)  # warm-up: kernels compiled, graphs captured
    t0 = time.perf_counter()
    samples = rollout(llm, n, args, seed=1000)
    seconds = time.perf_counter() - t0
    checked, bad, worst = recompute(trainer, samples, args)
    tables["mismatch"].append([name, trainer.config.num_hidden_layers, f"{checked:,}", bad, f"{worst:.3g}",
                               f"{checked / seconds:,.0f}"])
    ok = same and bad == 0
    del llm, engine_model, trainer
    if args.device.type == "cuda":
        torch.cuda.empty_cache()
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    from bench_utils import table

    if args.device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    tables = {"mismatch": [], "sync": [], "memory": [], "sleep": []}
    ok = True
    for name in args.configs.split(","):
        ok &= run_config(name, args, tables)
        if name in args.memory_configs.split(","):
            row = memory_check(name, args)
            tables["memory"].append(row)
            ok &= row[-1] == 0
    if args.sleep_cycles:
        rows, fine = sleep_cycles(args)
        tables["sleep"] += rows
        ok &= fine
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(f"\nFSDP2 world size 1 ({dist.get_backend()}), {device}, {args.dtype}")
    table("rollout -> sharded recompute", ["config", "layers", "tokens", "mismatches", "max |diff|", "rollout tok/s"],
          tables["mismatch"])
    table("weights into the engine", ["config", "method", "bucket", "bytes", "seconds", "GB/s"], tables["sync"])
    if tables["memory"]:
        table("peak memory (GiB): one training step alone vs a colocated iteration (engine asleep while training)",
              ["config", "trainer alone", "colocated", "engine awake (weights+KV)", "tokens rechecked", "mismatches"],
              tables["memory"])
    if tables["sleep"]:
        table(f"allocated memory (GiB) over {args.sleep_cycles} sleep/wake cycles (flat: one value each)",
              ["config", "state", "values seen"], tables["sleep"])
    dist.destroy_process_group()
    print("\nOK" if ok else "\nFAILED: mismatches, a weight sync that differs, or memory that is not flat")
    return 0 if ok else 1


if __name__ == "__main__":
    from vexact_models.distributed import exit_rank

    exit_rank(main())  # not sys.exit: interpreter teardown with gloo threads alive can abort a rank
