"""One RL iteration with a sharded trainer and a colocated engine per rank (see fsdp_worker.py).

Each rank holds an `LLM` over its own full copy of the weights (``owns_weights=True``) and the
FSDP2-sharded training model. Two iterations of: rollout of this rank's prompts -> the sharded
recompute equals the rollout's logprobs bitwise -> engine asleep (level 2: KV cache and weights
released) -> one optimizer step -> engine wakes its weights -> the new weights are streamed in
(`stream_full_weights`, small buckets) -> KV cache back -> the engine's weights equal the
gathered parameters bitwise, and the next rollout is checked against the next recompute.
"""

from __future__ import annotations

import copy
import random

import torch

from fsdp_support import equal_lists

from vexact_models.distributed import shard, stream_full_weights
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block


def _prompts(vocab: int, rank: int, n: int = 3) -> list[list[int]]:
    rng = random.Random(100 + rank)  # each rank its own prompts: a data split
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 7))] for _ in range(n)]


def _rollout(llm, prompts, seed):
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=seed, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.prompt_token_ids, o.outputs[0].token_ids, torch.tensor(o.outputs[0].logprobs)) for o in outs]


def _recompute(model, rollout):
    """Sharded token_logprobs of prompt + completion, packed; the completions' part."""
    seqs = [p + c for p, c, _ in rollout]
    ids = torch.tensor([[t for s in seqs for t in s]])
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]])
    lp = model.token_logprobs(ids, position_ids=pos)[0]
    out, start = [], 0
    for p, c, _ in rollout:
        out.append(lp[start + len(p):start + len(p) + len(c)])
        start += len(p) + len(c)
    return out


def policy_step(lp: list[torch.Tensor], optim) -> None:
    """One optimizer step on a policy-gradient loss over the recomputed logprobs `lp` (one tensor
    per sample; advantages +1 and -1 alternating), normalised by the token count."""
    advantages = [1.0 if i % 2 == 0 else -1.0 for i in range(len(lp))]
    loss = -sum(a * t.sum() for a, t in zip(advantages, lp)) / sum(t.numel() for t in lp)
    loss.backward()
    optim.step()
    optim.zero_grad(set_to_none=True)


def run_iteration(res, arch, base, rank: int, world: int) -> None:
    engine_model = copy.deepcopy(base).eval()
    block = 4
    llm = LLM(engine_model, device="cpu", block_size=block, max_num_seqs=4, max_num_batched_tokens=32,
              kv_cache_bytes=64 * kv_bytes_per_block(engine_model.kv_cache_spec(), block, torch.float32),
              owns_weights=True)
    model = shard(copy.deepcopy(base))
    optim = torch.optim.AdamW(model.parameters(), lr=2e-2)
    prompts = _prompts(base.config.vocab_size, rank)
    tag = f"iteration/{arch.name}"
    previous = None
    for it in range(2):
        rollout = _rollout(llm, prompts, seed=1000 * it + rank)
        model.train()
        lp = _recompute(model, rollout)
        res.record(f"{tag}/recompute_equals_rollout", *equal_lists([t.detach() for t in lp], [r[2] for r in rollout]))
        if previous is not None:
            res.record(f"{tag}/weights_changed_the_rollout",
                       any(not torch.equal(a[2], b[2]) for a, b in zip(rollout, previous)), "logprobs moved")
        previous = rollout
        llm.sleep(level=2)
        policy_step(lp, optim)
        llm.wake_up(tags=["weights"])
        copied = llm.update_weights(stream_full_weights(model, bucket_bytes=8192))
        llm.wake_up(tags=["kv_cache"])
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        engine = dict(engine_model.named_parameters())
        res.record(f"{tag}/engine_weights_equal_trainer",
                   copied == len(full) and all(torch.equal(engine[n], full[n]) for n in full),
                   f"{copied} tensors streamed")
    rollout = _rollout(llm, prompts, seed=5000 + rank)
    lp = _recompute(model, rollout)
    res.record(f"{tag}/recompute_equals_rollout", *equal_lists([t.detach() for t in lp], [r[2] for r in rollout]))
