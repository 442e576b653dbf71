"""One rank of the critic check (launched by tests/distributed/test_fsdp_critic.py through
torchrun, gloo on CPU): a PPO value head built from the policy's causal-LM checkpoint as verl
builds it (``AutoModelForTokenClassification.from_pretrained(path, num_labels=1)`` after
`patch()`), sharded with FSDP2 beside the sharded policy, and one SGD step of a value loss.

- critic/load: our token-classification class, its decoder the policy's weights, a new ``score``
  that every rank initialised alike (same seed).
- critic/values: the sharded critic's values of this rank's sequences equal the unsharded
  critic's (the score GEMM is torch's: within fp32 tolerance; the hidden states are bitwise).
- critic/step: after one SGD step of this rank's share of the masked value loss (FSDP averages
  the gradients over ranks), the gathered parameters equal the single-process step's within
  fp32 reduction tolerance; with activation checkpointing on (verl's critic default) they equal
  the step without it bitwise; the loss went down.
- policy/...: the sharded policy's logprobs beside it equal the single-process ones bitwise, and
  the critic's step left the policy's weights as they were.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fsdp_support import Results, equal_lists, make_sequences, padded, per_sequence, run_rank, splits  # noqa: E402

import vexact_models  # noqa: E402
from vexact_models.distributed import exit_rank, shard  # noqa: E402
from vexact_models.registry import get  # noqa: E402

LR = 0.02


def load_pair(path: str):
    """(policy, critic) from the one checkpoint, through the Auto classes (after `patch()`)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForTokenClassification

    config = AutoConfig.from_pretrained(path)  # verl's critic config: one label, no dropout
    config.num_labels, config.classifier_dropout = 1, 0.0
    vexact_models.patch()
    try:
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        torch.manual_seed(0)  # every rank draws the same new score
        critic = AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32, config=config)
    finally:
        vexact_models.unpatch()
    return policy, critic


def value_loss(critic, batch, returns, total_tokens: int, world: int) -> torch.Tensor:
    """This rank's share of ``sum((value - return)^2) / tokens`` (times the world size: FSDP
    averages gradients over ranks)."""
    mask = batch["attention_mask"].bool()
    values = critic(**batch).logits.squeeze(-1)
    return ((values - returns)[mask] ** 2).sum() * world / total_tokens


def sgd_step(critic, batch, returns, total_tokens, world):
    loss = value_loss(critic, batch, returns, total_tokens, world)
    loss.backward()
    with torch.no_grad():
        for p in critic.parameters():
            p -= LR * p.grad
    critic.zero_grad(set_to_none=True)
    return loss.detach()


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for n, p in model.named_parameters()}


def worst_rel(got: dict, want: dict) -> tuple[bool, str]:
    worst, where = 0.0, "-"
    for name, w in want.items():
        err = (got[name] - w).abs().max().item() / (w.abs().max().item() or 1.0)
        if err > worst:
            worst, where = err, name
    return worst <= 1e-5, f"worst relative max |diff| {worst:.3g} at {where}"


def run(res: Results, path: str, rank: int, world: int) -> None:
    arch = get("qwen3")
    policy, critic = load_pair(path)
    res.record("critic/load/class", type(critic) is arch.token_classification_class, type(critic).__name__)
    res.record("critic/load/decoder_is_the_policys",
               all(torch.equal(p, policy.model.state_dict()[n]) for n, p in critic.model.state_dict().items()), "")
    score = critic.score.weight.detach().clone()
    gathered = [torch.empty_like(score) for _ in range(world)]
    dist.all_gather(gathered, score)
    res.record("critic/load/same_score_on_every_rank", all(torch.equal(g, score) for g in gathered), "")

    seqs = make_sequences(critic.config.vocab_size, n=8)
    torch.manual_seed(1)
    returns_all = torch.randn(len(seqs), max(map(len, seqs)))
    mine = splits(len(seqs), world)["round_robin"][rank][0]
    total = sum(map(len, seqs))
    full = padded(seqs, left=False)
    batch = padded([seqs[i] for i in mine], left=False)
    returns = returns_all[mine][:, :batch["input_ids"].shape[1]]

    # the single-process reference: values, one step, the loss after it
    reference = copy.deepcopy(critic).train()
    with torch.no_grad():
        ref_values = reference(**full).logits.squeeze(-1)
        ref_lp = policy.token_logprobs(**full)
    before = sgd_step(reference, full, returns_all[:, :full["input_ids"].shape[1]], total, 1)
    ref_after = full_params(reference)
    policy_before = full_params(policy)

    stepped = {}
    for ckpt in (False, True):
        tag = "ckpt" if ckpt else "no_ckpt"
        model = shard(copy.deepcopy(critic), activation_checkpointing=ckpt).train()
        with torch.no_grad():
            values = model(**batch).logits.squeeze(-1)
        mask = batch["attention_mask"].bool()
        err = (values[mask] - ref_values[mine][:, :mask.shape[1]][mask]).abs().max().item()
        res.record(f"critic/values/{tag}", err <= 1e-5 * ref_values.abs().max().item(), f"max |diff| {err:.3g}")
        sgd_step(model, batch, returns, total, world)
        stepped[ckpt] = full_params(model)
        res.record(f"critic/step/{tag}_vs_single_process", *worst_rel(stepped[ckpt], ref_after))
        if ckpt:
            with torch.no_grad():
                after = value_loss(model, batch, returns, total, world)
            dist.all_reduce(after)
            res.record("critic/step/loss_went_down", after.item() / world < before.item(),
                       f"{before.item():.4g} -> {after.item() / world:.4g}")
    res.record("critic/step/ckpt_equals_no_ckpt",
               all(torch.equal(stepped[True][n], stepped[False][n]) for n in stepped[False]), "bitwise")

    sharded_policy = shard(copy.deepcopy(policy))
    with torch.no_grad():
        lp = sharded_policy.token_logprobs(**batch)
    want = per_sequence(ref_lp, full, seqs)
    res.record("policy/logprobs_bitwise",
               *equal_lists(per_sequence(lp, batch, [seqs[i] for i in mine]), [want[i] for i in mine]))
    res.record("policy/untouched_by_the_critic_step",
               all(torch.equal(p, policy_before[n]) for n, p in full_params(sharded_policy).items()), "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", required=True, help="a Qwen3 causal-LM checkpoint folder")
    args = parser.parse_args()
    run_rank(lambda res, rank, world: run(res, args.ckpt, rank, world), args.out)


if __name__ == "__main__":
    main()
    exit_rank(0)  # as fsdp_worker.py: interpreter teardown with gloo threads alive can abort a rank
