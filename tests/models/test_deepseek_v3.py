"""DeepSeek-V3 / Moonlight training variant: HF parity (logits, loss, grads, padding), checkpoint
layouts, the published configs, MLA's softmax scale and KV cache size."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, DeepseekV3Config
from transformers import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

from vexact_models import deepseek_v3
from vexact_models.conformance.cli import CONFIG_DIR
from vexact_models.deepseek_v3 import (DeepseekV3ForCausalLM, DeepseekV3ForCausalLMInference, mla_softmax_scale,
                                       randomize_router_bias)
from vexact_models.runtime.model_runner import kv_bytes_per_block

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)

SHAPES = {"deepseek_v3": deepseek_v3.tiny_config, "moonlight": deepseek_v3.moonlight_tiny_config}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def checkpoint(request, tmp_path_factory):
    """A stock checkpoint (transformers saves experts one tensor each, the hub layout) with a
    non-zero expert-selection bias."""
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    hf = HFDeepseekV3ForCausalLM(SHAPES[request.param](initializer_range=0.1))
    with torch.no_grad():
        randomize_router_bias(hf, seed=1, std=0.1)
    hf.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint):
    hf = HFDeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return hf, ours


def test_hub_checkpoint_stores_one_tensor_per_expert(checkpoint):
    keys = load_file(checkpoint / "model.safetensors")
    assert "model.layers.1.mlp.experts.3.gate_proj.weight" in keys
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in keys and "model.layers.0.mlp.up_proj.weight" in keys


def test_logits_match_stock(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (3, 40))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= 1e-5
        # left padding: our positions count from each row's first token, as HF's with position_ids
        mask = torch.ones_like(ids)
        mask[0, :7] = 0
        positions = (mask.cumsum(1) - 1).clamp_min(0)
        a = hf(ids, attention_mask=mask, position_ids=positions).logits
        b = ours(ids, attention_mask=mask).logits
    assert rel(b[mask.bool()], a[mask.bool()]) <= 1e-5


def test_bias_changes_the_selection(pair):
    """The expert-selection bias is live: zeroing it changes the output."""
    _, ours = pair
    ids = torch.randint(0, 512, (2, 30))
    with torch.no_grad():
        before = ours(ids).logits
        gate = ours.model.layers[1].mlp.gate
        saved = gate.e_score_correction_bias.clone()
        gate.e_score_correction_bias.zero_()
        after = ours(ids).logits
        gate.e_score_correction_bias.copy_(saved)
    assert not torch.equal(before, after)


def test_loss_and_gradients_match_stock(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 12))
    loss_hf, loss_ours = hf(ids, labels=ids).loss, ours(ids, labels=ids, output_router_logits=True).loss
    assert abs(float(loss_hf.detach()) - float(loss_ours.detach())) < 1e-5
    names = [n for n, _ in hf.named_parameters()]
    g_hf = dict(zip(names, torch.autograd.grad(loss_hf, list(hf.parameters()))))
    g_ours = dict(zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(loss_ours, list(ours.parameters()))))
    assert g_hf.keys() == g_ours.keys()
    for name in names:
        assert rel(g_ours[name], g_hf[name]) < 1e-4, name


def test_router_logits_per_moe_layer(pair):
    _, ours = pair
    out = ours(torch.randint(0, 512, (2, 5)), output_router_logits=True)
    assert len(out.router_logits) == 2 and out.router_logits[0].dtype == torch.float32  # layer 0 is dense
    assert out.router_logits[0].shape == (10, ours.config.n_routed_experts)


def test_save_pretrained_is_loadable_by_stock(pair, tmp_path):
    _, ours = pair
    ours.save_pretrained(tmp_path)
    stock = HFDeepseekV3ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(stock.state_dict()[name], tensor), name


def test_token_logprobs_bitwise_across_packing(pair):
    _, ours = pair
    seqs = [torch.randint(0, 512, (n,)) for n in (9, 1, 21)]
    with torch.no_grad():
        alone = [ours.token_logprobs(s[None])[0] for s in seqs]
        packed = ours.token_logprobs(torch.cat(seqs), cu_seqlens=torch.tensor([0, 9, 10, 31]))
    for got, want in zip(torch.split(packed, [9, 1, 21]), alone):
        assert torch.equal(got, want)


def test_inference_variant_shares_storage(pair):
    _, ours = pair
    inference = DeepseekV3ForCausalLMInference(ours)
    assert {p.data_ptr() for p in inference.parameters()} == {p.data_ptr() for p in ours.parameters()}


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
    """Per token: heads * (nope + rope + v) * 2 bytes per layer in bf16 (the expanded cache)."""
    for name, per_token in (("deepseek-v3", 61 * 128 * 320 * 2), ("moonlight-16b-a3b", 27 * 16 * 320 * 2)):
        config = _published(name, tmp_path)
        with torch.device("meta"):
            spec = DeepseekV3ForCausalLM(config.__class__(**{**config.to_dict(), "num_hidden_layers": 1})).kv_cache_spec()
        spec = (config.num_hidden_layers, *spec[1:])
        assert spec[2:] == (192, 128)
        assert kv_bytes_per_block(spec, 1, torch.bfloat16) == per_token


def test_rejects_grouped_kv_heads():
    with pytest.raises(ValueError, match="num_key_value_heads=2 must equal num_attention_heads=4"):
        DeepseekV3ForCausalLM(deepseek_v3.tiny_config(num_key_value_heads=2))


def test_patched_auto_class_loads_ours(checkpoint):
    import vexact_models
    from transformers import AutoModelForCausalLM

    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    finally:
        vexact_models.unpatch()
    assert type(model) is DeepseekV3ForCausalLM
    assert type(AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)) is HFDeepseekV3ForCausalLM
