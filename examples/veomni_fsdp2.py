"""VeOmni builds and FSDP2-shards vexact-models causal LMs; the sharded logprobs equal the rollout's.

    torchrun --nproc-per-node 2 examples/veomni_fsdp2.py              # CPU, gloo, every architecture
    torchrun --nproc-per-node 8 examples/veomni_fsdp2.py --device cuda --dtype bfloat16

VeOmni looks model classes up in ``veomni.models.loader.MODELING_REGISTRY`` (model_type ->
``fn(architecture name) -> class``); `vexact_models.integrations.veomni.register` puts ours there. Then VeOmni's own
``build_foundation_model`` (meta-device init) and ``build_parallelize_model`` (its FSDP2: every
``_no_split_modules`` layer + root, weights loaded into the shards) build the training model,
and its ``token_logprobs`` must equal an `LLM` rollout of the same checkpoint bitwise.

What the published package (veomni 0.1.12) needs to run here (docs/fsdp.md has the details):
- ``import veomni`` works with transformers 5.10.4 but fails with newer releases (5.23 here):
  it is generated against 5.9 and imports six multimodal output classes that were removed since.
  `vexact_models.integrations.veomni.shim_transformers` aliases them before the import (a no-op where they exist); nothing of
  ours or of VeOmni's FSDP path uses them.
- ``OpsImplementationConfig`` defaults to CUDA kernels (liger, triton): every op is set to
  "eager" on CPU. Our classes run their own aligned kernels whatever it says.
- VeOmni's mixed precision casts forward inputs by default (``cast_forward_inputs=True``),
  which rounds the layers' fp32 RoPE tables to bf16: pass ``cast_forward_inputs=False``.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
import torch.distributed as dist

from vexact_models.distributed import launcher_world_size
from vexact_models.integrations.veomni import eager_ops, register, shim_transformers


def check(arch, path: str, args, rank: int) -> bool:
    from veomni.arguments.arguments_types import MixedPrecisionConfig
    from veomni.distributed.torch_parallelize import build_parallelize_model
    from veomni.models import build_foundation_model

    from vexact_models.runtime import LLM, SamplingParams

    if rank == 0:
        torch.manual_seed(0)
        config = arch.tiny_config(initializer_range=0.3, architectures=[arch.causal_lm_class.__name__])
        model = arch.causal_lm_class(config)
        if arch.init_for_conformance is not None:
            arch.init_for_conformance(model, 0)
        model.save_pretrained(path)
    dist.barrier()
    model = build_foundation_model(config_path=path, weights_path=path, torch_dtype="float32", init_device="meta",
                                   ops_implementation=eager_ops())
    mixed = args.dtype == "bfloat16"
    model = build_parallelize_model(model, weights_path=path, init_device="meta", enable_gradient_checkpointing=True,
                                    mixed_precision=MixedPrecisionConfig(enable=mixed, cast_forward_inputs=False))
    engine = arch.causal_lm_class.from_pretrained(path, dtype=getattr(torch, args.dtype)).to(args.device)
    llm = LLM(engine, device=args.device, kv_cache_bytes=4 << 20, block_size=16, max_num_seqs=8)  # one prompt
    out = llm.generate([[5 + rank, 6, 7, 8]], SamplingParams(temperature=1.0, max_tokens=args.tokens, seed=rank),
                       use_tqdm=False)[0]
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids], device=args.device)
    model.train()  # VeOmni's path: training mode, activation checkpointing, autograd
    lp = model.token_logprobs(ids)[0, len(out.prompt_token_ids):]
    lp.sum().backward()
    equal = torch.equal(lp.detach().cpu(), torch.tensor(out.outputs[0].logprobs))
    print(f"rank {rank}: {arch.name:12s} {type(model).__name__:28s} {len(out.outputs[0].token_ids)} tokens, "
          f"sharded logprobs == rollout: {equal}", flush=True)
    return equal


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="bfloat16: VeOmni's mixed precision (fp32 master weights) against a bf16 engine")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to roll out per rank")
    parser.add_argument("--no-register", dest="register", action="store_false",
                        help="leave VeOmni's registry alone (integration off: VeOmni builds its own classes)")
    args = parser.parse_args()
    if launcher_world_size() is None:  # init_process_group would fail on the missing rendezvous
        parser.error("needs torchrun (no launcher's WORLD_SIZE set): launch with "
                     "`torchrun --nproc-per-node 2 examples/veomni_fsdp2.py`")
    aliased = shim_transformers()
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    from veomni.distributed.parallel_state import init_parallel_state

    from vexact_models.registry import architectures

    if rank == 0 and aliased:
        print(f"aliased for veomni's imports (gone from this transformers): {aliased}")
    init_parallel_state(dp_size=world, dp_shard_size=world, dp_mode="fsdp2", device_type=args.device)
    registered = register() if args.register else []
    if rank == 0:
        print(f"registered with VeOmni's MODELING_REGISTRY: {registered}")
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        for arch in architectures():
            path = [f"{tmp}/{arch.name}"]
            dist.broadcast_object_list(path)
            ok &= check(arch, path[0], args, rank)
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    from vexact_models.distributed import exit_rank

    exit_rank(main())  # not sys.exit: interpreter teardown with gloo threads alive can abort a rank
