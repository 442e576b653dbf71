"""transformers' checkpoint conversions (hub MoE checkpoints store one tensor per expert) for our
classes: `patch()` registers them for every architecture with ``checkpoint_conversions`` and
`unpatch()` leaves transformers' conversion registry exactly as it was; our classes load and save
the hub layout without `patch()`, registering the conversion only for the duration of the call.
Importing the package changes nothing. On transformers < 5.13 there is nothing to register (the
conversions apply to every class by model_type); the same assertions hold there."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import conversion_mapping as table

import vexact_models
from vexact_models.patches.checkpoints import expert_tensor_shapes
from vexact_models.registry import architectures

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)

CONVERTED = [arch for arch in architectures() if arch.checkpoint_conversions]
CONVERTED_TYPES = {t for arch in CONVERTED for t in arch.model_types}
#: those whose hub checkpoints store one tensor per expert (Qwen3.5's dense model converts only
#: the multimodal checkpoints' key prefix: tests/models/test_gated_deltanet_models.py)
PER_EXPERT = [arch for arch in CONVERTED if expert_tensor_shapes(arch.tiny_config()) is not None]
#: 5.13+: conversions apply to classes outside transformers only for the model types listed here
USER_REGISTERED = getattr(table, "USER_REGISTERED_MAPPINGS", None)


@pytest.fixture(autouse=True)
def _unpatch():
    yield
    vexact_models.unpatch()


def registry_state() -> tuple[set | None, dict]:
    """(the user-registered names, the conversion table) as transformers holds them now."""
    table.get_checkpoint_conversion_mapping("qwen3_moe")  # builds the table on first use
    return (None if USER_REGISTERED is None else set(USER_REGISTERED)), dict(table._checkpoint_conversion_mapping_cache)


def assert_registry_is(state: tuple[set | None, dict]) -> None:
    """The registry holds the same names and the very same table entries (by identity) as `state`."""
    users, entries = registry_state()
    assert users == state[0]
    assert entries.keys() == state[1].keys()
    changed = sorted(k for k, v in entries.items() if v is not state[1][k])
    assert not changed, f"conversion table entries replaced: {changed}"


def test_import_registers_nothing_and_unpatch_restores_the_registry():
    assert CONVERTED_TYPES >= {"qwen3_moe", "deepseek_v3"}
    before = registry_state()
    if USER_REGISTERED is not None:
        assert not CONVERTED_TYPES & before[0], "registered outside patch() (on import?)"
    vexact_models.patch()
    vexact_models.patch()  # idempotent
    if USER_REGISTERED is not None:
        assert CONVERTED_TYPES <= registry_state()[0]
    vexact_models.unpatch()
    assert_registry_is(before)
    vexact_models.unpatch()  # idempotent
    assert_registry_is(before)


def test_a_users_own_conversion_registration_survives_patch_and_unpatch():
    registry_state()  # builds the table
    previous = table._checkpoint_conversion_mapping_cache["qwen3_moe"]
    users_mapping = table.get_checkpoint_conversion_mapping("qwen3_moe")  # a copy: another object
    table.register_checkpoint_conversion_mapping("qwen3_moe", users_mapping, overwrite=True)
    try:
        before = registry_state()
        vexact_models.patch()
        vexact_models.unpatch()
        assert_registry_is(before)
        assert table._checkpoint_conversion_mapping_cache["qwen3_moe"] is users_mapping
    finally:
        table._checkpoint_conversion_mapping_cache["qwen3_moe"] = previous
        if USER_REGISTERED is not None:
            USER_REGISTERED.discard("qwen3_moe")


@pytest.mark.parametrize("arch", PER_EXPERT, ids=lambda a: a.name)
def test_our_classes_load_and_save_the_hub_layout_without_patch(arch, tmp_path):
    before = registry_state()
    torch.manual_seed(0)
    stock = arch.hf_class()(arch.tiny_config())
    stock.save_pretrained(tmp_path / "stock")
    hub_keys = set(load_file(tmp_path / "stock" / "model.safetensors"))
    assert any(".experts.0.gate_proj." in k for k in hub_keys), "stock no longer writes one tensor per expert"
    assert not vexact_models.is_patched()
    ours = arch.causal_lm_class.from_pretrained(tmp_path / "stock", dtype=torch.float32)
    assert_registry_is(before)
    want = stock.state_dict()
    assert all(torch.equal(tensor, want[name]) for name, tensor in ours.state_dict().items())
    # built, not loaded: save_pretrained has no conversions recorded by a load, it asks the registry
    arch.causal_lm_class(arch.tiny_config()).save_pretrained(tmp_path / "ours")
    assert set(load_file(tmp_path / "ours" / "model.safetensors")) == hub_keys
    assert_registry_is(before)
