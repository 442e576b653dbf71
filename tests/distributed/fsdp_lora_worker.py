"""One rank of the adapter-only sync under FSDP2 (launched by tests/distributed/test_fsdp_lora.py
through torchrun, gloo on CPU), with real peft: the RL loop where only the LoRA adapters train.

Each rank holds an `LLM` over its own copy of the LoRA model (``owns_weights=True``) and the same
LoRA model sharded with FSDP2 (`shard` on the model under PEFT). Two iterations of: rollout of
this rank's prompts -> the sharded recompute equals the rollout's logprobs bitwise -> engine
asleep (level 1) -> one optimizer step on the adapters -> engine wakes its weights -> only the
adapters are streamed in (``stream_full_weights(..., adapters_only=True)``, small buckets; from
the ``PeftModel`` in one iteration, from the model under it in the other: both of PEFT's names)
-> KV cache back -> the engine's adapters equal the gathered ones and its base is untouched;
then the next rollout is checked against the next recompute.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_iteration import _prompts, _recompute, _rollout, policy_step  # noqa: E402
from fsdp_support import Results, equal_lists, make_model, run_rank  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

from vexact_models.adapter_weights import adapter_tensors  # noqa: E402
from vexact_models.adapters import expert_target_parameters  # noqa: E402
from vexact_models.distributed import exit_rank, shard, stream_full_weights  # noqa: E402
from vexact_models.registry import get  # noqa: E402
from vexact_models.runtime import LLM  # noqa: E402
from vexact_models.runtime.model_runner import kv_bytes_per_block  # noqa: E402


def lora_model(base):
    """`base` under LoRA on every linear layer and on both fused expert tensors of a MoE model."""
    torch.manual_seed(7)  # the same random adapters on every rank and in the engine
    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False,
                        target_parameters=expert_target_parameters(base))
    return get_peft_model(copy.deepcopy(base), config)


def run(res: Results, rank: int, name: str, tag: str) -> None:
    """The loop of the module docstring on architecture `name`, its checks recorded as ``tag/...``."""
    base = make_model(get(name), tie_word_embeddings=False)
    engine_model = lora_model(base)
    block = 4
    llm = LLM(engine_model, device="cpu", block_size=block, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_bytes=64 * kv_bytes_per_block(base.kv_cache_spec(), block, torch.float32), owns_weights=True)
    engine_base = {n: p.detach().clone() for n, p in engine_model.named_parameters() if "lora_" not in n}
    trainer = lora_model(base)
    res.record(f"{tag}/shard_peft_model", shard(trainer) is trainer and isinstance(trainer.get_base_model(), FSDPModule),
               "shard(PeftModel) shards the model under it and returns the PeftModel")
    optim = torch.optim.AdamW([p for p in trainer.parameters() if p.requires_grad], lr=2e-2)
    prompts = _prompts(base.config.vocab_size, rank)
    previous = None
    for it in range(2):
        rollout = _rollout(llm, prompts, seed=1000 * it + rank)
        trainer.train()
        lp = _recompute(trainer, rollout)
        res.record(f"{tag}/recompute_equals_rollout", *equal_lists([t.detach() for t in lp], [r[2] for r in rollout]))
        if previous is not None:
            res.record(f"{tag}/adapters_changed_the_rollout",
                       any(not torch.equal(a[2], b[2]) for a, b in zip(rollout, previous)), "logprobs moved")
        previous = rollout
        llm.sleep(level=1)
        policy_step(lp, optim)
        llm.wake_up(tags=["weights"])
        source = trainer if it == 0 else trainer.get_base_model()
        names = [n for n, _ in stream_full_weights(source, bucket_bytes=512, adapters_only=True)]
        copied = llm.update_weights(stream_full_weights(source, bucket_bytes=512, adapters_only=True))
        llm.wake_up(tags=["kv_cache"])
        wanted = adapter_tensors(source)
        same = sorted(names) == sorted(t.name for t in wanted)  # every adapter once (in the stream's order)
        res.record(f"{tag}/stream_names_{it}", same and all("lora_" in n for n in names),
                   f"{len(names)} names, e.g. {names[:1]}")
        engine = {t.name: t.param for t in adapter_tensors(engine_model.get_base_model())}
        full = {t.name.removeprefix("base_model.model."): t.param.full_tensor() for t in wanted}
        res.record(f"{tag}/engine_adapters_equal_trainer",
                   copied == len(full) == len(engine) and all(torch.equal(engine[n], v) for n, v in full.items()),
                   f"{copied} tensors streamed, {len(engine)} adapters in the engine")
        now = dict(engine_model.named_parameters())
        res.record(f"{tag}/engine_base_untouched", all(torch.equal(now[n], v) for n, v in engine_base.items()),
                   f"{len(engine_base)} base tensors")
    rollout = _rollout(llm, prompts, seed=5000 + rank)
    lp = _recompute(trainer, rollout)
    res.record(f"{tag}/recompute_equals_rollout", *equal_lists([t.detach() for t in lp], [r[2] for r in rollout]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    def both(res: Results, rank: int, world: int) -> None:
        run(res, rank, "qwen3", "lora")
        run(res, rank, "qwen3_moe", "lora_moe")  # the experts adapted too (PEFT's target_parameters)

    run_rank(both, args.out)


if __name__ == "__main__":
    main()
    exit_rank(0)  # not a plain return: interpreter teardown with gloo threads alive can abort a rank
