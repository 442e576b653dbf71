"""OLMo 3 (model_type ``olmo3``): the checks specific to this architecture (scaffolded from Llama by
``vexact new-architecture``): stock checkpoints load and give stock's logits past the window and
past YaRN's original context, the layer types' RoPE tables differ where they should, and the
q/k norms see the whole projection. Windows shorter than the prompts: test_sliding_window_models.py;
the window page group's engine: tests/runtime/test_page_groups_engine.py.

The architecture-agnostic checks (conformance, PEFT, FSDP, HF drop-in) run over every
registered architecture in tests/conformance and tests/models.
"""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import vexact_models
from vexact_models import registry
from vexact_models.conformance.suite import hf_parity
from vexact_models.random_init import randomize_norms_and_biases

from vexact_models.olmo3 import ARCHITECTURE


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_registered_and_discovered():
    assert registry.for_model_type("olmo3") is ARCHITECTURE and ARCHITECTURE.name == "olmo3"
    assert "vexact_models.olmo3" in registry.builtin_architecture_packages()  # a folder with modeling.py


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path, tie):
    """A checkpoint written by stock transformers' Olmo3ForCausalLM, every norm weight random, loads
    strictly and gives its logits over 100 tokens: past the sliding layers' window of 8 and the
    full layer's YaRN original context of 64."""
    config = ARCHITECTURE.tiny_config(tie_word_embeddings=tie)
    torch.manual_seed(0)
    stock = ARCHITECTURE.hf_class()(config)
    assert randomize_norms_and_biases(stock, seed=0) > 0
    stock.save_pretrained(tmp_path)
    ours = ARCHITECTURE.causal_lm_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf = ARCHITECTURE.hf_class().from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert list(ours.state_dict()) == list(hf.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 100))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= 1e-5


def test_config_as_published_builds_hf_model():
    """Only the config class's own fields (what a hub config.json holds): the modeling code must
    not read a field the class lacks, and must match HF with the class's defaults."""
    config_class = ARCHITECTURE.config_class
    defaults = config_class().to_dict()
    fields = {k: v for k, v in ARCHITECTURE.tiny_config().to_dict().items() if k in defaults}
    torch.manual_seed(0)
    model = ARCHITECTURE.causal_lm_class(config_class(**fields)).eval()
    randomize_norms_and_biases(model, seed=1)
    assert hf_parity(ARCHITECTURE, model, torch.device("cpu")).vs_hf <= 1e-5


def test_patch_routes_the_auto_classes():
    config = ARCHITECTURE.tiny_config()
    vexact_models.patch()
    try:
        assert type(AutoModelForCausalLM.from_config(config)) is ARCHITECTURE.causal_lm_class
        assert type(AutoModel.from_config(config)) is ARCHITECTURE.base_model_class
    finally:
        vexact_models.unpatch()
    assert type(AutoModelForCausalLM.from_config(config)) is ARCHITECTURE.hf_class()


def test_each_layer_type_has_its_own_rope_and_the_norms_see_whole_projections():
    """The full layer's YaRN table differs from the sliding layers' plain one (past position 0);
    the q/k norms are over every head's dims at once (stock's), not per head (Qwen3's)."""
    model = ARCHITECTURE.causal_lm_class(ARCHITECTURE.tiny_config()).eval()
    tables = model.model.rope.get(torch.device("cpu"))
    assert sorted(tables) == ["full_attention", "sliding_attention"]
    assert not torch.equal(tables["full_attention"][0][1:100], tables["sliding_attention"][0][1:100])
    attention = model.model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (4 * 16,) and attention.k_norm.weight.shape == (2 * 16,)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [8, 8, None]
