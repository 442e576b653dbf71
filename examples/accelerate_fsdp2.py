"""Train a vexact-models causal LM with accelerate's FSDP2 and a colocated rollout engine per rank;
every step checks that the sharded recompute equals the rollout's logprobs bitwise.

    torchrun --nproc-per-node 2 examples/accelerate_fsdp2.py                        # CPU, gloo
    accelerate launch --num_processes 8 examples/accelerate_fsdp2.py --device cuda \\
        --dtype bfloat16 --arch qwen3_moe --steps 20 --max-tokens 256               # GPUs

(On CPU launch with torchrun: ``accelerate launch --cpu`` starts one process unless under mpirun,
and accelerate 1.x enables its FSDP plugin only on accelerator devices: on CPU the script
switches accelerate's state to FSDP itself, see `make_accelerator`.)

Each step, on every rank: roll out this rank's prompts with its own `LLM` (a full copy of the
weights the engine owns) -> recompute their logprobs with the FSDP2-sharded model
(``token_logprobs``) and count mismatches -> engine asleep (level 2) -> a policy-gradient step
through ``accelerator.backward`` and the prepared optimizer -> engine awake, the new weights
streamed in from the shards (`stream_full_weights`, cast to the engine's dtype). Exits 1 when
any logprob differed on any rank.

With ``--dtype bfloat16`` the master weights stay fp32 and FSDP computes in bf16
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, cast_forward_inputs=False)``: an
input cast would round the layers' fp32 RoPE tables); the engine holds the same bf16 weights.
Give accelerate this policy through the plugin: ``Accelerator(mixed_precision="bf16")`` alone
builds ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)``, whose input cast (torch's
default) rounds the RoPE tables; accelerate 1.15 also set ``output_dtype=bf16``, rounding the
fp32 logprobs to bf16.
"""

from __future__ import annotations

import argparse
import copy
import random
import time

import torch
import torch.distributed as dist


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="qwen3", help="a registered architecture (vexact_models.architectures())")
    parser.add_argument("--steps", type=int, default=3, help="training steps")
    parser.add_argument("--prompts", type=int, default=2, help="prompts per rank per step")
    parser.add_argument("--max-tokens", type=int, default=6, help="tokens per rollout")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="compute dtype (bfloat16: fp32 master weights, FSDP mixed precision)")
    parser.add_argument("--config", default=None, help="a config.json for real shapes (random weights); "
                                                       "default: the architecture's tiny config")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--kv-cache-mib", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("steps", "prompts", "max_tokens", "kv_cache_mib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    # checked before any model is built: a plain `python examples/accelerate_fsdp2.py` ends with
    # usage, not with accelerate's traceback (accelerate sets up FSDP only on 2+ processes)
    from vexact_models.distributed import LAUNCHER_WORLD_SIZE_VARS, launcher_world_size

    world = launcher_world_size()
    if world is None or world < 2:
        parser.error(f"needs 2 or more processes (FSDP2 shards over ranks), got world size {world or 'unset'} "
                     f"({'/'.join(LAUNCHER_WORLD_SIZE_VARS)}): launch with `torchrun --nproc-per-node 2 "
                     f"examples/accelerate_fsdp2.py` (CPU) or `accelerate launch --num_processes N ...` (GPUs)")
    return args


def build_model(args):
    from vexact_models.registry import get

    arch = get(args.arch)
    overrides = {} if args.layers is None else {"num_hidden_layers": args.layers}
    if args.config:
        config = arch.config_class.from_json_file(args.config)
        for key, value in overrides.items():
            setattr(config, key, value)
    else:
        config = arch.tiny_config(initializer_range=0.3, **overrides)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    with torch.device(args.device):
        model = arch.causal_lm_class(config)
    if arch.init_for_conformance is not None:
        arch.init_for_conformance(model, args.seed)
    return arch, model


def make_accelerator(args, layer_class: str):
    from accelerate import Accelerator, FullyShardedDataParallelPlugin
    from accelerate.utils import DistributedType
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = None
    if args.dtype == "bfloat16":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                            transformer_cls_names_to_wrap=[layer_class], reshard_after_forward=True,
                                            activation_checkpointing=args.activation_checkpointing,
                                            mixed_precision_policy=policy, state_dict_type="SHARDED_STATE_DICT")
    accelerator = Accelerator(fsdp_plugin=plugin, cpu=args.device == "cpu")
    if accelerator.distributed_type == DistributedType.MULTI_CPU:
        # accelerate turns the plugin into FSDP only for accelerator devices (MULTI_GPU & co.) and
        # would wrap the model in DDP on CPU; switch the state so that prepare() runs its FSDP2
        # path (fsdp2_prepare_model: fully_shard per layer class, then the root) over gloo.
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"accelerate set up {accelerator.distributed_type}, not FSDP2: launch with torchrun or "
                           "accelerate launch on 2+ processes")
    return accelerator


def rollout_and_recompute(llm, model, prompts, args, step: int, rank: int):
    """(rollout logprobs, differentiable recompute) per completion, and the mismatch count."""
    from vexact_models.runtime import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=10_000 * step + rank, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    seqs = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    ids = torch.tensor([[t for s in seqs for t in s]], device=device)
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]], device=device)
    lp = model.token_logprobs(ids, position_ids=pos)[0]
    pairs, start, mismatches = [], 0, 0
    for o, s in zip(outs, seqs):
        n_prompt = len(o.prompt_token_ids)
        mine = lp[start + n_prompt:start + len(s)]
        want = torch.tensor(o.outputs[0].logprobs, device=device)
        mismatches += int((mine.detach() != want).sum())
        pairs.append((want, mine))
        start += len(s)
    return pairs, mismatches


def main(argv=None) -> int:
    args = parse_args(argv)
    from vexact_models.distributed import stream_full_weights
    from vexact_models.runtime import LLM

    arch, model = build_model(args)
    accelerator = make_accelerator(args, type(model.model.layers[0]).__name__)
    rank, world = accelerator.process_index, accelerator.num_processes
    engine_dtype = getattr(torch, args.dtype)
    engine_model = copy.deepcopy(model).to(engine_dtype).eval()
    llm = LLM(engine_model, device=args.device if args.device == "cpu" else None,
              kv_cache_bytes=args.kv_cache_mib << 20, block_size=16, owns_weights=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = accelerator.prepare(model, optimizer)
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, FSDPModule) or not isinstance(model.model.layers[0], FSDPModule):
        raise RuntimeError(f"accelerate.prepare returned {type(model).__name__}, not an FSDP2-sharded model")
    rng = random.Random(args.seed * 1_000 + rank)  # each rank its own prompts: a data split
    vocab = model.config.vocab_size
    total_bad = total_tokens = 0
    for step in range(args.steps):
        started = time.perf_counter()
        prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(4, 12))] for _ in range(args.prompts)]
        model.train()
        pairs, bad = rollout_and_recompute(llm, model, prompts, args, step, rank)
        tokens = sum(w.numel() for w, _ in pairs)
        llm.sleep(level=2)  # the engine's weights and KV cache leave the device while training
        advantages = torch.randn(len(pairs), generator=torch.Generator().manual_seed(step)).tolist()
        loss = -sum(a * m.sum() for a, (_, m) in zip(advantages, pairs)) / tokens
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        llm.wake_up(tags=["weights"])
        synced = llm.update_weights(stream_full_weights(model, dtype=engine_dtype))
        llm.wake_up(tags=["kv_cache"])
        counts = torch.tensor([bad, tokens], dtype=torch.int64, device=accelerator.device)
        dist.all_reduce(counts)
        total_bad += int(counts[0])
        total_tokens += int(counts[1])
        if accelerator.is_main_process:
            print(f"step {step}: {int(counts[1])} tokens on {world} ranks, {int(counts[0])} mismatches "
                  f"(rollout vs sharded recompute), loss {loss.item():+.4f}, {synced} tensors streamed, "
                  f"{time.perf_counter() - started:.2f} s", flush=True)
    if accelerator.is_main_process:
        print(f"{arch.name} ({type(model).__name__}, {world} ranks): {total_tokens} tokens, {total_bad} mismatches "
              f"over {args.steps} steps")
    # every rank done with its collectives before any rank tears the process group down (an
    # unsynchronised teardown aborted one rank after a successful run once, on a loaded CI host)
    dist.barrier()
    accelerator.end_training()
    return 1 if total_bad else 0


if __name__ == "__main__":
    from vexact_models.distributed import exit_rank

    exit_rank(main())  # not sys.exit: interpreter teardown with gloo threads alive can abort a rank
