"""MiniMax-M2 (model_type ``minimax_m2``): the checks specific to this architecture (q/k norms
over the whole projections, partial RoPE from the checkpoints' ``rotary_dim``, the block's
correction bias, stock's dtypes, the router's logits and aux loss).

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

from vexact_models.minimax_m2 import ARCHITECTURE


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def test_registered_and_discovered():
    assert registry.for_model_type("minimax_m2") is ARCHITECTURE and ARCHITECTURE.name == "minimax_m2"
    assert "vexact_models.minimax_m2" in registry.builtin_architecture_packages()  # a folder with modeling.py


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path, tie):
    """A checkpoint written by stock transformers' MiniMaxM2ForCausalLM, every norm weight and
    correction bias random, loads strictly and gives its logits."""
    config = ARCHITECTURE.tiny_config(tie_word_embeddings=tie)
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


def test_partial_rope_follows_rotary_dim_and_the_norms_span_every_head():
    """The checkpoints' ``rotary_dim`` (16 of the head's 32 dims here) is the RoPE our tables and
    stock apply: at 16 and at 32 each model matches stock over 40 positions, and the two differ;
    the q/k norms are single RMSNorms over every head's dims."""
    ids = torch.randint(0, 512, (1, 40), generator=torch.Generator().manual_seed(3))
    logits, widths = [], []
    for rotary_dim in (16, 32):
        config = ARCHITECTURE.tiny_config(rotary_dim=rotary_dim)
        assert config.rope_parameters["partial_rotary_factor"] == rotary_dim / 32
        torch.manual_seed(0)
        ours = ARCHITECTURE.causal_lm_class(config).eval()
        randomize_norms_and_biases(ours, seed=0)
        randomize_router_bias(ours, seed=1, std=0.1)
        widths.append(ours.model.rope.get(torch.device("cpu"))[0].shape[-1])
        assert hf_parity(ARCHITECTURE, ours, torch.device("cpu")).vs_hf <= 1e-5
        with torch.no_grad():
            logits.append(ours(ids).logits)
    assert rel(logits[0], logits[1]) > 1e-3 and 2 * widths[0] == widths[1]
    attention = ours.model.layers[0].self_attn
    assert attention.q_norm.weight.shape == (4 * 32,) and attention.k_norm.weight.shape == (2 * 32,)


def test_bf16_loading_keeps_stocks_dtypes(tmp_path):
    """Loaded in bf16, every parameter and buffer has stock's dtype (the block's correction bias
    too, a buffer stock casts with the model)."""
    stock = ARCHITECTURE.hf_class()(ARCHITECTURE.tiny_config())
    stock.save_pretrained(tmp_path)
    hf = ARCHITECTURE.hf_class().from_pretrained(tmp_path, dtype=torch.bfloat16)
    ours = ARCHITECTURE.causal_lm_class.from_pretrained(tmp_path, dtype=torch.bfloat16)
    want = {name: t.dtype for name, t in (*hf.named_parameters(), *hf.named_buffers()) if "rotary" not in name}
    got = {name: t.dtype for name, t in (*ours.named_parameters(), *ours.named_buffers())}
    assert got == want and "model.layers.1.mlp.e_score_correction_bias" in got


def test_router_logits_and_aux_loss_are_stocks():
    """``output_router_logits``: each layer's router logits and Mixtral's load-balancing aux loss,
    added to the loss, as stock's forward gives them (fp32, random correction biases)."""
    config = ARCHITECTURE.tiny_config()
    torch.manual_seed(0)
    ours = ARCHITECTURE.causal_lm_class(config).eval()
    randomize_router_bias(ours, seed=1, std=0.1)
    stock = ARCHITECTURE.hf_class()(config).eval()
    stock.load_state_dict(ours.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(ids, labels=ids, output_router_logits=True)
        b = stock(ids, labels=ids, output_router_logits=True)
    assert len(a.router_logits) == len(b.router_logits) == config.num_hidden_layers
    for x, y in zip(a.router_logits, b.router_logits):
        assert rel(x.reshape(y.shape), y) <= 1e-5
    assert abs(float(a.aux_loss) - float(b.aux_loss)) <= 1e-5 and abs(float(a.loss) - float(b.loss)) <= 1e-5


def test_router_jitter_noise_is_refused_before_anything_is_built():
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        ARCHITECTURE.causal_lm_class(ARCHITECTURE.tiny_config(router_jitter_noise=0.1))
