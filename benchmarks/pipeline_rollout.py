"""An FSDP2 trainer and a pipeline-parallel rollout engine on the same GPUs (random weights).

One process per GPU (torchrun); the trainer is sharded with FSDP2 over all of them, the engine
runs ``LLM(model, pipeline_parallel_size=P)`` with P = the number of processes (P = 1: one GPU,
no pipeline). ``--pipeline-size 1`` with several processes gives every rank its own whole engine
instead (data-parallel rollout, as verl colocates them): each rank rolls out its share of the
tokens from its own prompts and the sharded trainer recomputes every rank's samples. The engine's
stage model holds only its stage's layers (`empty_stage_model`) and gets its weights from the
trainer (`stream_full_weights` -> ``update_weights``). Per iteration:

1. rollout of ``--tokens`` generated tokens (at least) on every stage -> rollout tok/s;
2. sharded recompute (``token_logprobs``) of every sampled token -> mismatches (want 0);
3. engine asleep (level 2), one training step (SGD: no optimizer state; the table says how many
   parameters it changed), engine awake, the new weights streamed into every stage ->
   weight-sync seconds (and GB/s of this stage's bytes); the next iteration's recompute checks
   the rollout of the new weights.

The trainer is built on the meta device, sharded, then given random values shard by shard, so
shapes larger than one GPU (Qwen3-235B-A22B over 8) build. ``--trainer none`` replaces it with
a full unsharded copy on every process (the reference for the recompute), so that several
stages can share one GPU over gloo (``--backend gloo``), e.g. to run the stages' CUDA graphs on
a machine with one GPU.

Usage (current figures in docs/performance.md):
    torchrun --nproc-per-node 2 benchmarks/pipeline_rollout.py --config qwen3-8b            # 2 GPUs
    torchrun --nproc-per-node 2 benchmarks/pipeline_rollout.py --config qwen3-8b --pipeline-size 1  # 2 engines
    torchrun --nproc-per-node 8 benchmarks/pipeline_rollout.py --config qwen3-235b-a22b.json --tokens 20000
    python benchmarks/pipeline_rollout.py --config qwen3-8b                                 # P = 1, one GPU
    torchrun --nproc-per-node 2 benchmarks/pipeline_rollout.py --config qwen3-0.6b --trainer none \\
        --backend gloo --same-gpu                                                          # 2 stages, 1 GPU
    torchrun --nproc-per-node 2 benchmarks/pipeline_rollout.py --tiny                       # CPU smoke run
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time

import torch
import torch.distributed as dist

from bench_models import recompute_mismatches


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-8b", help="a bundled published config or a config.json path")
    p.add_argument("--layers", type=int, default=0, help="num_hidden_layers override (0: the config's)")
    p.add_argument("--tokens", type=int, default=100_000, help="generated tokens to check per iteration (at least)")
    p.add_argument("--iterations", type=int, default=2, help="rollout -> recompute -> step -> sync rounds")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per request")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--recompute-tokens", type=int, default=16384, help="tokens per recompute micro-batch")
    p.add_argument("--kv-cache-gib", type=float, default=16.0, help="KV cache per process (GiB)")
    p.add_argument("--bucket-mib", type=float, default=512.0, help="stream_full_weights bucket (MiB)")
    p.add_argument("--lr", type=float, default=1e-2, help="SGD learning rate of the training step")
    p.add_argument("--pipeline-size", type=int, default=0,
                   help="stages of the engine: the number of processes (default, 0) or 1 (a whole engine per rank)")
    p.add_argument("--trainer", choices=("fsdp2", "none"), default="fsdp2")
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help="default: nccl on CUDA, gloo on CPU")
    p.add_argument("--same-gpu", action="store_true", help="every process on GPU 0 (needs --backend gloo)")
    p.add_argument("--enforce-eager", action="store_true", help="no decode CUDA graphs")
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the tiny Qwen3 config, a few hundred tokens")
    args = p.parse_args(argv)
    if args.tiny:
        args.config, args.tokens, args.prompt_len, args.max_tokens = "tiny", 200, 8, 16
        args.recompute_tokens, args.kv_cache_gib, args.bucket_mib, args.max_num_seqs = 64, 1 / 64, 0.01, 16
    for name in ("tokens", "iterations", "prompt_len", "max_tokens", "max_num_seqs", "recompute_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.pipeline_size < 0:
        p.error(f"--pipeline-size must be 0 (the number of processes) or >= 1, got {args.pipeline_size}")
    if args.kv_cache_gib <= 0 or args.bucket_mib <= 0:
        p.error("--kv-cache-gib and --bucket-mib must be > 0")
    args.device_type = "cpu" if args.tiny else "cuda"
    args.backend = args.backend or ("gloo" if args.tiny else "nccl")
    if args.same_gpu and args.backend != "gloo":
        p.error("--same-gpu needs --backend gloo (NCCL takes one GPU per process)")
    if args.trainer == "fsdp2" and args.same_gpu:
        p.error("--same-gpu needs --trainer none (FSDP2's collectives over gloo do not take CUDA tensors)")
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    if args.device_type == "cuda" and not torch.cuda.is_available():
        print("pipeline_rollout.py needs a CUDA GPU (or --tiny for the CPU smoke run)", file=sys.stderr)
        sys.exit(2)
    return args


def init(args) -> torch.device:
    if "RANK" in os.environ:
        dist.init_process_group(args.backend)
    else:  # plain python: one process, P = 1
        dist.init_process_group(args.backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    args.pipeline_size = args.pipeline_size or world
    if args.pipeline_size not in (1, world):
        dist.destroy_process_group()
        print(f"pipeline_rollout.py: --pipeline-size {args.pipeline_size} must be 1 or the number of processes "
              f"({world})", file=sys.stderr)
        sys.exit(2)
    args.data_parallel = world if args.pipeline_size == 1 else 1  # whole engines, one per rank
    if args.device_type == "cpu":
        return torch.device("cpu")
    index = 0 if args.same_gpu else int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def model_config(args):
    from vexact_models.conformance.models import architecture_of, make_config
    from vexact_models.registry import get

    arch = get("qwen3") if args.config == "tiny" else architecture_of(args.config)
    overrides = {"initializer_range": 0.3} if args.config == "tiny" else None
    return arch, make_config(arch, None if args.config == "tiny" else args.config, args.layers or None, None, overrides)


def random_values(model, seed: int, std: float) -> None:
    """Random values on every local shard (norm weights 1); full (unsharded) tensors and buffers
    from one seed on every rank."""
    with torch.no_grad():
        for i, (name, p) in enumerate(model.named_parameters()):
            sharded = hasattr(p, "to_local")
            rank = dist.get_rank() if sharded else 0
            local = p.to_local() if sharded else p
            if "norm" in name:
                local.fill_(1.0)
            else:
                gen = torch.Generator(device=local.device).manual_seed(seed * 1_000_003 + i * 1009 + rank)
                local.normal_(0.0, std, generator=gen)
        for i, (_, b) in enumerate(model.named_buffers()):
            b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(seed + i)) * 0.1)


def build_trainer(arch, config, args, device):
    """FSDP2-sharded over every rank (built on meta, then filled shard by shard); or, with
    ``--trainer none``, a full copy on this process."""
    from vexact_models.conformance.models import construct
    from vexact_models.distributed import shard

    if args.trainer == "none":
        model = construct(arch.causal_lm_class, config, device, args.dtype)
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        model = shard(construct(arch.causal_lm_class, config, torch.device("meta"), args.dtype), mesh)
        model.to_empty(device=device)
    random_values(model, seed=0, std=0.3 if args.tiny else config.initializer_range)
    return model.eval()


def build_engine(arch, config, trainer, args, device):
    from vexact_models.runtime import LLM
    from vexact_models.runtime.pipeline import join_pipeline
    from vexact_models.runtime.pipeline_load import empty_stage_model

    size = args.pipeline_size
    stage = join_pipeline(size, config)
    model = empty_stage_model(arch, config, args.dtype, stage, device)
    held = dict(model.named_buffers())
    with torch.no_grad():  # buffers are not streamed (not parameters): the same seed's values
        for name, b in trainer.named_buffers():
            if not held[name].is_meta:
                held[name].copy_(b)
    return LLM(model, pipeline_parallel_size=size, owns_weights=True, enforce_eager=args.enforce_eager,
               kv_cache_bytes=int(args.kv_cache_gib * 2**30), max_num_seqs=args.max_num_seqs,
               max_model_len=args.prompt_len + args.max_tokens + 1)


def sync_weights(llm, trainer, args) -> tuple[float, int]:
    """Stream the trainer's weights into every stage: (seconds, bytes this stage kept)."""
    from vexact_models.distributed import stream_full_weights

    sync(trainer)
    t0 = time.perf_counter()
    llm.update_weights(stream_full_weights(trainer, max(1, int(args.bucket_mib * 2**20)), dtype=args.dtype))
    sync(trainer)
    kept = sum(p.numel() * p.element_size() for p in llm.model.causal_lm.parameters() if not p.is_meta)
    return time.perf_counter() - t0, kept


def sync(model) -> None:
    if next(model.parameters()).device.type == "cuda":
        torch.cuda.synchronize()


def rollout(llm, args, seed: int):
    from vexact_models.runtime import SamplingParams

    # pipeline: the same prompts on every rank (every stage runs the same generate); whole engines:
    # each rank its own prompts and sampling seeds, and its share of the tokens
    shard = dist.get_rank() if args.data_parallel > 1 else 0
    seed += 100_000 * shard
    rng = random.Random(seed)
    vocab = llm.config.vocab_size
    n = math.ceil(args.tokens / args.data_parallel / args.max_tokens)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True, seed=seed + i)
              for i in range(n)]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], seconds


def recompute(trainer, samples, args) -> tuple[int, int, float]:
    """(tokens checked, mismatches, max |diff|) over every rank's rollout. Pipeline: every rank
    holds every sample and recomputes them all (the sharded forward is a collective: the same
    micro-batches everywhere). Whole engines: each rank recomputes its own samples (the same
    lengths on every rank, so the same number of micro-batches) and the counts are summed."""
    checked, bad, worst = recompute_mismatches(trainer, samples, args.recompute_tokens,
                                               next(trainer.parameters()).device)
    if args.data_parallel == 1:
        return checked, bad, worst
    (checked, bad), (worst,) = over_ranks([checked, bad], [worst])
    return int(checked), int(bad), worst


def collective_device() -> torch.device:
    """Where the default group's collectives take tensors: host memory for gloo, this GPU for NCCL."""
    if "gloo" in str(dist.get_backend()):
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def over_ranks(sums: list[float], maxima: list[float]) -> tuple[list[float], list[float]]:
    """`sums` added and `maxima` maxed over every rank, on the default group (float64 tensors on
    `collective_device`)."""
    device = collective_device()
    totals = torch.tensor(sums, dtype=torch.float64, device=device)
    tops = torch.tensor(maxima, dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    dist.all_reduce(tops, op=dist.ReduceOp.MAX)
    return totals.tolist(), tops.tolist()


def checksums(trainer) -> list[float]:
    """A float64 sum of each parameter's local shard: which ones a step changed."""
    with torch.no_grad():
        return [float((p.to_local() if hasattr(p, "to_local") else p).double().sum()) for p in trainer.parameters()]


def train_step(trainer, samples, args) -> int:
    """One SGD step on the rollout's sequences (every rank the same data, as a smoke step);
    returns how many parameters (of this rank's shards) it changed."""
    before = checksums(trainer)
    device = next(trainer.parameters()).device
    seqs = [p + c for p, c, _ in samples[:8]]
    ids = torch.tensor([[t for s in seqs for t in s]], device=device)
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]], device=device)
    trainer.train()
    lp = trainer.token_logprobs(ids, position_ids=pos)
    (-lp.sum() / lp.numel()).backward()
    with torch.no_grad():
        for p in trainer.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-args.lr)
    trainer.zero_grad(set_to_none=True)
    trainer.eval()
    return sum(a != b for a, b in zip(before, checksums(trainer)))


def align_replicas(trainer) -> int:
    """``--trainer none`` over several processes: every rank steps its own full replica on the same
    data, but a backward that accumulates with atomics (torch's FlashAttention-2 backward, which
    `attention_backward_choice` may take) need not give the replicas the same bits, and each stage
    takes its layers from its own rank's replica. Rank 0's parameters are broadcast to every
    replica (staged on `collective_device`); returns how many differed, over all ranks."""
    device = collective_device()
    differed = 0
    with torch.no_grad():
        for p in trainer.parameters():
            mine = p.detach().to(device, copy=True)
            ref = mine.clone()
            dist.broadcast(ref, src=0)
            differed += not torch.equal(ref, mine)
            p.copy_(ref)
    (total,), _ = over_ranks([differed], [0.0])
    return int(total)


def iterate(llm, trainer, args, it: int) -> list:
    samples, seconds = rollout(llm, args, seed=1000 * (it + 1))
    generated = sum(len(c) for _, c, _ in samples)
    if args.data_parallel > 1:  # every rank's tokens over the slowest rank's time
        (generated,), (seconds,) = over_ranks([generated], [seconds])
    checked, bad, worst = recompute(trainer, samples, args)
    llm.sleep(level=2)  # the trainer runs with the engine's weights and KV cache released
    changed = train_step(trainer, samples, args)
    replicas = align_replicas(trainer) if args.trainer == "none" and dist.get_world_size() > 1 else "-"
    llm.wake_up(tags=["weights"])
    sync_s, kept = sync_weights(llm, trainer, args)
    llm.wake_up(tags=["kv_cache"])
    total = sum(1 for _ in trainer.parameters())
    return [it, f"{checked:,}", bad, f"{worst:.3g}", f"{generated / seconds:,.0f}", f"{changed}/{total}", replicas,
            f"{sync_s:.3f}", f"{kept / sync_s / 1e9:.2f}"]


def main(argv=None) -> int:
    args = parse_args(argv)
    device = init(args)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_utils import table

    arch, config = model_config(args)
    trainer = build_trainer(arch, config, args, device)
    llm = build_engine(arch, config, trainer, args, device)
    first_sync, _ = sync_weights(llm, trainer, args)
    rollout(llm, argparse.Namespace(**{**vars(args), "tokens": 8, "max_tokens": 4}), seed=1)  # warm-up
    rows = [iterate(llm, trainer, args, it) for it in range(args.iterations)]
    stage = llm.pipeline_stage
    graphs = llm.runner.graphs
    captured = f"{len(graphs.graphs)} decode CUDA graphs captured" if graphs is not None else "eager (no CUDA graphs)"
    ok = all(r[2] == 0 for r in rows)
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
        layers = f"{stage.layers.start}..{stage.layers.stop - 1}" if stage else "all"
        print(f"\n{args.config} ({config.num_hidden_layers} layers), {args.dtype}, {dist.get_world_size()} process(es) "
              f"({args.backend}, {name}); trainer: {args.trainer}; pipeline stages: {stage.size if stage else 1} "
              f"(stage 0 runs layers {layers}; {captured}); whole engines: {args.data_parallel}; first weight sync "
              f"{first_sync:.3f} s")
        table("rollout -> sharded recompute -> step -> weights streamed into the stages",
              ["iteration", "tokens", "mismatches", "max |diff|", "rollout tok/s", "params stepped",
               "replicas realigned", "weight sync s", "stage 0 GB/s"], rows)
        print("\nOK" if ok else "\nFAILED: mismatches")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from vexact_models.distributed import exit_rank

    exit_rank(main())  # not sys.exit: interpreter teardown with gloo threads alive can abort a rank
