"""`Architecture.min_transformers`: an architecture needing a newer transformers than the one
installed stays out of the registry (so patch() leaves its model types to stock and no shared
test sees it), and `get` names the release it needs."""

import pytest
import transformers

from vexact_models import registry
from vexact_models.registry import Architecture, Shape, register

pytestmark = pytest.mark.compat


def _arch(name: str, floor: str | None) -> Architecture:
    qwen3 = registry.get("qwen3")
    return Architecture(name=name, model_types=(f"{name}_type",), config_class=qwen3.config_class,
                        causal_lm_class=qwen3.causal_lm_class, base_model_class=qwen3.base_model_class,
                        inference_class=qwen3.inference_class, shapes=(Shape(name, qwen3.tiny_config),),
                        hf_causal_lm_class=qwen3.hf_causal_lm_class, min_transformers=floor)


@pytest.fixture
def clean_registry():
    yield
    for name in ("floor_future", "floor_past"):
        registry._REGISTRY.pop(name, None)
        registry._TOO_OLD.pop(name, None)


def test_an_architecture_newer_than_the_installed_transformers_is_left_out(clean_registry):
    register(_arch("floor_future", "999.0"))
    register(_arch("floor_past", "5.0"))
    names = [arch.name for arch in registry.architectures()]
    assert "floor_past" in names and "floor_future" not in names
    assert registry.for_model_type("floor_future_type") is None
    assert registry.unavailable()["floor_future"] == "999.0" and "floor_past" not in registry.unavailable()
    with pytest.raises(ValueError, match=rf"'floor_future' needs transformers >= 999.0 .*{transformers.__version__} "
                                         "is installed"):
        registry.get("floor_future")


#: the built-in architectures with a floor: GPT-OSS and Gemma 3 matched against stock on transformers
#: 5.24 only (the releases before it are not checked yet); OLMo 3 from 5.13, the first release whose
#: stock model takes RoPE per layer type (before it one table served every layer)
FLOORED = {"gpt_oss": "5.24", "gemma3": "5.24", "olmo3": "5.13", "minimax_m2": "5.18"}


def test_every_builtin_architecture_is_registered_on_every_supported_release():
    """No built-in architecture but those in `FLOORED` has a floor above the oldest supported
    release (5.2): the gated-DeltaNet hybrids neither (their release differences are in
    `patches.compat`), so the compat runs (.ci/run) cover them on 5.2, 5.10 and 5.17."""
    names = {arch.name for arch in registry.architectures()}
    assert {"qwen3", "qwen3_moe", "deepseek_v3", "llama", "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_next"} <= names
    floors = {arch.name: arch.min_transformers for arch in registry.architectures()
              if arch.causal_lm_class.__module__.startswith("vexact_models.") and arch.min_transformers is not None}
    assert floors == {name: floor for name, floor in FLOORED.items() if name in names}
    assert set(registry._TOO_OLD) <= set(FLOORED)
