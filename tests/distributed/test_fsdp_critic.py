"""A PPO critic beside the policy under FSDP2 on CPU (gloo, torchrun, 2 ranks): the value head
verl builds from the policy's Qwen3 checkpoint (``AutoModelForTokenClassification``,
``num_labels=1``) loads, shards and takes a training step as the single-process model does, with
activation checkpointing on and off, while the sharded policy's logprobs stay bitwise. The
checks are tests/distributed/fsdp_critic_worker.py's."""

import pytest
import torch

from vexact_models.registry import get

from .fsdp_support import assert_passed, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    ckpt = tmp_path_factory.mktemp("policy")
    arch = get("qwen3")
    torch.manual_seed(0)
    arch.causal_lm_class(arch.tiny_config(initializer_range=0.3, tie_word_embeddings=False)).save_pretrained(ckpt)
    out = tmp_path_factory.mktemp("critic")
    return torchrun("fsdp_critic_worker.py", 2, out, "--ckpt", str(ckpt))


@pytest.mark.parametrize("prefix", ["critic/load/", "critic/values/", "critic/step/", "policy/"])
def test_critic_beside_the_policy_under_fsdp2(results, prefix):
    assert_passed(results, prefix, world=2)
