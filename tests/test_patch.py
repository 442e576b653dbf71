import sys

import pytest
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, GPT2Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as HFQwen3ForCausalLM

import vexact_models
from vexact_models.qwen3 import Qwen3ForCausalLM, Qwen3Model, tiny_config

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    HFQwen3ForCausalLM(tiny_config()).save_pretrained(tmp_path)
    return tmp_path


@pytest.fixture(autouse=True)
def _restore():
    vexact_models.unpatch()  # importing an integration (verl's installs on import) may have patched
    yield
    vexact_models.unpatch()


def test_patch_routes_auto_classes_and_unpatch_restores(checkpoint):
    assert type(AutoModelForCausalLM.from_pretrained(checkpoint)) is HFQwen3ForCausalLM
    vexact_models.patch()
    vexact_models.patch()  # idempotent
    assert vexact_models.is_patched()
    assert type(AutoModelForCausalLM.from_pretrained(checkpoint)) is Qwen3ForCausalLM
    assert type(AutoModel.from_pretrained(checkpoint)) is Qwen3Model
    assert type(AutoModelForCausalLM.from_config(tiny_config())) is Qwen3ForCausalLM
    vexact_models.unpatch()
    vexact_models.unpatch()  # idempotent
    assert not vexact_models.is_patched()
    assert type(AutoModelForCausalLM.from_pretrained(checkpoint)) is HFQwen3ForCausalLM


def test_patch_binds_the_transformers_names_of_the_classes_it_routes(checkpoint):
    """A loader that takes the class named by ``config.architectures`` from the ``transformers``
    namespace (TRL's trainers given a path) gets ours after `patch()`, through every
    ``transformers`` module object the process holds, and stock's after `unpatch()`; a name
    rebound by the user keeps what it holds; heads we do not serve stay stock's; and
    `Architecture.hf_class` still gives stock's class (`registry.stock_class`)."""
    from vexact_models.patches.compat import transformers_namespaces
    from vexact_models.registry import architectures, get, stock_class

    namespaces = transformers_namespaces()
    assert sys.modules["transformers"] in namespaces
    stock_heads = namespaces[0].Qwen3ForTokenClassification
    vexact_models.patch()
    vexact_models.patch()
    name = AutoConfig.from_pretrained(checkpoint).architectures[0]
    for namespace in namespaces:
        assert getattr(namespace, name) is Qwen3ForCausalLM and namespace.Qwen3Model is Qwen3Model
        assert type(getattr(namespace, name).from_pretrained(checkpoint)) is Qwen3ForCausalLM
        for arch in architectures():
            assert arch.hf_class().__module__.startswith("transformers.models.")  # stock's, patched or not
            assert getattr(namespace, arch.hf_class().__name__) is arch.causal_lm_class
            assert getattr(namespace, arch.hf_class("Model").__name__) is arch.base_model_class
        assert namespace.Qwen3ForQuestionAnswering.__module__.startswith("transformers.")  # a head we do not serve
    assert get("qwen3").hf_class() is HFQwen3ForCausalLM
    assert stock_class("transformers.Qwen3ForCausalLM") is HFQwen3ForCausalLM  # a top-level name, read where defined
    assert stock_class("transformers.models.qwen3.modeling_qwen3.Qwen3Model").__module__.startswith("transformers.")
    current = sys.modules["transformers"]
    current.Qwen3ForTokenClassification = stock_heads  # rebound by the user
    assert not vexact_models.is_patched()
    current.Qwen3ForTokenClassification = get("qwen3").token_classification_class
    assert vexact_models.is_patched()
    current.Qwen3ForTokenClassification = stock_heads
    vexact_models.unpatch()
    assert current.Qwen3ForTokenClassification is stock_heads
    for namespace in namespaces:
        assert getattr(namespace, name) is HFQwen3ForCausalLM
        for arch in architectures():
            assert getattr(namespace, arch.hf_class().__name__) is arch.hf_class()


def test_unsupported_model_types_stay_stock():
    from vexact_models.registry import for_model_type

    assert for_model_type("gpt2") is None
    vexact_models.patch()
    cfg = GPT2Config(vocab_size=32, n_embd=16, n_layer=1, n_head=2, n_positions=32)
    assert type(AutoModelForCausalLM.from_config(cfg)).__module__.startswith("transformers.models.gpt2")


def test_registry_lists_qwen3():
    names = [a.name for a in vexact_models.architectures()]
    assert "qwen3" in names
    from vexact_models.registry import for_model_type, get

    assert for_model_type("qwen3").causal_lm_class is Qwen3ForCausalLM and for_model_type("gpt2") is None
    with pytest.raises(ValueError, match="unknown architecture 'nope'"):
        get("nope")
