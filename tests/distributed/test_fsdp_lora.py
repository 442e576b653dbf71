"""Adapter-only weight sync from an FSDP2 LoRA trainer on CPU (gloo, torchrun, 2 ranks, real
peft): rollout -> sharded recompute (bitwise) -> step on the adapters -> ``stream_full_weights(...,
adapters_only=True)`` into each rank's engine -> the engine's adapters equal the trainer's, its
base untouched, and the next rollout equals the next recompute bitwise; at Qwen3 and at Qwen3-MoE
with both fused expert tensors adapted too. The checks are tests/distributed/fsdp_lora_worker.py's."""

import pytest

from .fsdp_support import assert_passed, torchrun


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return torchrun("fsdp_lora_worker.py", 2, tmp_path_factory.mktemp("fsdp_lora"))


@pytest.mark.parametrize("tag", ["lora", "lora_moe"])
@pytest.mark.parametrize("check", ["shard_peft_model", "recompute_equals_rollout", "adapters_changed_the_rollout",
                                   "stream_names_", "engine_adapters_equal_trainer", "engine_base_untouched"])
def test_adapter_only_sync_from_fsdp2_keeps_rollouts_bitwise(results, tag, check):
    assert_passed(results, f"{tag}/{check}", world=2)
