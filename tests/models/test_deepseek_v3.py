"""DeepSeek-V3-specific checks, at both shapes (``deepseek_v3``: q-LoRA, YaRN; ``moonlight``):
the expert-selection bias, router logits, the published configs, MLA's softmax scale and KV
cache size, grouped KV heads, hub checkpoints through patch(). What every architecture must do
(HF parity, padding, checkpoints...) is tests/models/test_architectures.py."""

import pytest
import torch
from transformers import AutoConfig, DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

from vexact_models import deepseek_v3
from vexact_models.conformance.models import CONFIG_DIR
from vexact_models.deepseek_v3 import DeepseekV3ForCausalLM, mla_softmax_scale, randomize_router_bias
from vexact_models.runtime.model_runner import kv_bytes_per_block

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)

SHAPES = {shape.name: shape for shape in deepseek_v3.ARCHITECTURE.shapes}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def model(request):
    """Our model at the shape, with a non-zero expert-selection bias."""
    torch.manual_seed(0)
    ours = DeepseekV3ForCausalLM(SHAPES[request.param].tiny_config(initializer_range=0.1)).eval()
    with torch.no_grad():
        randomize_router_bias(ours, seed=1, std=0.1)
    return ours


def test_shapes_are_q_lora_with_yarn_and_moonlight():
    assert sorted(SHAPES) == ["deepseek_v3", "moonlight"]
    assert SHAPES["deepseek_v3"].tiny_config().q_lora_rank and SHAPES["moonlight"].tiny_config().q_lora_rank is None


def test_bias_changes_the_selection(model):
    """The expert-selection bias is live: zeroing it changes the output."""
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        before = model(ids).logits
        gate = model.model.layers[1].mlp.gate
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        after = model(ids).logits
        gate.e_score_correction_bias.copy_(saved)
    assert not torch.equal(before, after)


def test_router_logits_per_moe_layer(model):
    out = model(torch.randint(0, 512, (2, 5)), output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].dtype == torch.float32  # layer 0 is dense
    assert out.router_logits[0].shape == (10, model.config.n_routed_experts)


def _published(name, tmp_path):
    """The bundled config.json, loaded as a user would: AutoConfig on a checkpoint folder."""
    (tmp_path / "config.json").write_text((CONFIG_DIR / f"{name}.json").read_text())
    return AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name,total", [("deepseek-v3", 671e9), ("moonlight-16b-a3b", 16e9)])
def test_published_configs_build_at_full_size(name, total, tmp_path):
    config = _published(name, tmp_path)
    assert isinstance(config, DeepseekV3Config)
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    assert abs(params - total) / total < 0.03, f"{name}: {params / 1e9:.1f}B parameters"
    attn = model.model.layers[0].self_attn
    assert (attn.q_lora_rank is None) == (name != "deepseek-v3")
    assert type(model.model.layers[0].mlp).__name__ == "DeepseekV3MLP"
    assert type(model.model.layers[-1].mlp).__name__ == "DeepseekV3MoE"


def test_softmax_scale_matches_stock(tmp_path):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention as HFAttention

    for name in ("deepseek-v3", "moonlight-16b-a3b"):
        config = _published(name, tmp_path)
        with torch.device("meta"):
            want = HFAttention(config, 0).scaling
        assert mla_softmax_scale(config) == pytest.approx(want, rel=1e-12)
    assert mla_softmax_scale(_published("deepseek-v3", tmp_path)) > 192 ** -0.5 * 1.8  # YaRN mscale**2 ~ 1.87


def test_kv_cache_holds_expanded_keys_and_values(tmp_path):
    """Per token: heads * (nope + rope + v) * 2 bytes per layer in bf16 (the expanded cache, a
    choice since the latent one became the default)."""
    for name, per_token in (("deepseek-v3", 61 * 128 * 320 * 2), ("moonlight-16b-a3b", 27 * 16 * 320 * 2)):
        config = _published(name, tmp_path)
        fields = {**config.to_dict(), "num_hidden_layers": 1, "mla_kv_cache": "expanded"}
        with torch.device("meta"):
            spec = DeepseekV3ForCausalLM(config.__class__(**fields)).kv_cache_spec()
        spec = (config.num_hidden_layers, *spec[1:])
        assert spec[2:] == (192, 128)
        assert kv_bytes_per_block(spec, 1, torch.bfloat16) == per_token


def test_rejects_grouped_kv_heads():
    with pytest.raises(ValueError, match="num_key_value_heads=2 must equal num_attention_heads=4"):
        DeepseekV3ForCausalLM(deepseek_v3.tiny_config(num_key_value_heads=2))


def test_patched_auto_class_loads_ours(tmp_path):
    """A hub-layout checkpoint (one tensor per expert) through patch() and back to stock after."""
    import vexact_models
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    HFDeepseekV3ForCausalLM(deepseek_v3.moonlight_tiny_config()).save_pretrained(tmp_path)
    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    finally:
        vexact_models.unpatch()
    assert type(model) is DeepseekV3ForCausalLM
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)) is HFDeepseekV3ForCausalLM


def test_the_router_is_kept_in_fp32_as_the_installed_transformers_keeps_it(tmp_path):
    """``_keep_in_fp32_modules_strict`` is the installed stock class's (the correction bias; in
    transformers 5.24, not yet in 5.17, the router's weight too), and both are made fp32 at construction as
    stock's are: built with `from_config` in bf16 or loaded in bf16, ours holds the router in the
    dtypes stock loads it in, and the forward runs on it with fp32 logits."""
    from transformers import AutoModelForCausalLM
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as stock

    config = SHAPES["deepseek_v3"].tiny_config()
    hf = HFDeepseekV3ForCausalLM(config)
    hf.save_pretrained(tmp_path)
    stock_router = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).model.layers[1].mlp.gate
    strict = stock.DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict
    assert deepseek_v3.DeepseekV3PreTrainedModel._keep_in_fp32_modules_strict == strict
    want = (stock_router.weight.dtype, stock_router.e_score_correction_bias.dtype)
    assert want[1] == torch.float32 and want[0] == (torch.float32 if "gate.weight" in strict else torch.bfloat16)
    built = DeepseekV3ForCausalLM._from_config(config, dtype=torch.bfloat16)
    loaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    for ours in (built, loaded):
        router = ours.model.layers[1].mlp.gate
        assert (router.weight.dtype, router.e_score_correction_bias.dtype) == want
        assert ours.model.layers[1].mlp.experts.gate_up_proj.dtype == torch.bfloat16
        out = ours(torch.randint(0, 512, (2, 5)), output_router_logits=True)
        assert out.logits.dtype == torch.float32 and out.router_logits[0].dtype == torch.float32
