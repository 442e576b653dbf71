"""GLM-4.5 (model_type ``glm4_moe``): the checks specific to this architecture (scaffolded from
DeepSeek-V3 by ``vexact new-architecture``, its MLA attention replaced): stock checkpoints load and
give stock's logits with and without the q/k norms and the q/k/v biases, with the router's random
correction bias; the parameters keep stock's dtypes when loaded in bf16 (the router's fp32).

The architecture-agnostic checks (conformance, PEFT, FSDP, HF drop-in) run over every
registered architecture in tests/conformance and tests/models.
"""

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

import vexact_models
from vexact_models import registry
from vexact_models.conformance.suite import hf_parity
from vexact_models.random_init import randomize_norms_and_biases, randomize_router_bias

from vexact_models.glm4_moe import ARCHITECTURE


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_registered_and_discovered():
    assert registry.for_model_type("glm4_moe") is ARCHITECTURE and ARCHITECTURE.name == "glm4_moe"
    assert "vexact_models.glm4_moe" in registry.builtin_architecture_packages()  # a folder with modeling.py


@pytest.mark.parametrize("tie, qk_norm, bias", [(False, True, True), (True, True, True), (False, False, False)],
                         ids=["untied", "tied", "no-qk-norm-no-bias"])
def test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path, tie, qk_norm, bias):
    """A checkpoint written by stock transformers' Glm4MoeForCausalLM, every norm weight, bias and
    router correction bias random, loads strictly and gives its logits."""
    config = ARCHITECTURE.tiny_config(tie_word_embeddings=tie, use_qk_norm=qk_norm, attention_bias=bias)
    torch.manual_seed(0)
    stock = ARCHITECTURE.hf_class()(config)
    assert randomize_norms_and_biases(stock, seed=0) > 0
    randomize_router_bias(stock, seed=1, std=0.1)
    stock.save_pretrained(tmp_path)
    ours = ARCHITECTURE.causal_lm_class.from_pretrained(tmp_path, dtype=torch.float32).eval()
    hf = ARCHITECTURE.hf_class().from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert list(ours.state_dict()) == list(hf.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 24))
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


def test_bf16_loading_keeps_stocks_dtypes(tmp_path):
    """Loaded in bf16, every parameter and buffer has stock's dtype: the correction bias fp32, and
    the router's weight fp32 exactly where the installed transformers keeps it so."""
    stock = ARCHITECTURE.hf_class()(ARCHITECTURE.tiny_config())
    stock.save_pretrained(tmp_path)
    hf = ARCHITECTURE.hf_class().from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = ARCHITECTURE.causal_lm_class.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = {name: t.dtype for name, t in (*hf.named_parameters(), *hf.named_buffers()) if "rotary" not in name}
    got = {name: t.dtype for name, t in (*ours.named_parameters(), *ours.named_buffers())}
    assert got == want
    assert got["model.layers.1.mlp.gate.e_score_correction_bias"] == torch.float32
