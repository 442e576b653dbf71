"""What is specific to Llama (the parametrised modules check the rest at both shapes): Llama-3.x
rope scaling past the original context, tied and untied heads through save/load, the
``attention_bias`` / ``mlp_bias`` flags, a head_dim that is not hidden / heads, the published
Llama-3.1-8B config."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaForCausalLM as StockLlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from vexact_models.conformance.models import make_config
from vexact_models.llama import ARCHITECTURE, LlamaForCausalLM, tiny_config, tiny_tied_config
from vexact_models.projections import randomize_projection_biases
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


def stock_and_ours(config, tmp_path, biases: bool = False):
    """A stock transformers Llama with random weights (and random biases), saved and loaded by both."""
    torch.manual_seed(0)
    stock = StockLlamaForCausalLM(config)
    if biases:
        randomize_projection_biases(stock)
    stock.save_pretrained(tmp_path)
    return (StockLlamaForCausalLM.from_pretrained(tmp_path).eval(), LlamaForCausalLM.from_pretrained(tmp_path).eval())


def test_llama3_rope_scaling_matches_stock_past_the_original_context(tmp_path):
    """Positions 0..199 span the tiny shape's original context (64) three times over: the llama3
    rule rescales the low frequencies, which stock applies and a plain RoPE would not."""
    config = tiny_config()
    assert config.rope_parameters["rope_type"] == "llama3"
    stock, ours = stock_and_ours(config, tmp_path)
    ids = torch.randint(0, 512, (2, 200))
    with torch.no_grad():
        assert rel(ours(ids).logits, stock(ids).logits) <= 1e-5
    # our fp32 tables are stock's rotary embedding, bitwise, and differ from unscaled RoPE's
    cos, sin = ours.model.rope.get(torch.device("cpu"))
    positions = torch.arange(200)[None]
    stock_cos, stock_sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[1]
    assert torch.equal(cos[:200], stock_cos[0, :, :half]) and torch.equal(sin[:200], stock_sin[0, :, :half])
    plain = LlamaConfig(**{**config.to_dict(), "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}})
    plain_cos, _ = LlamaRotaryEmbedding(plain)(torch.zeros(1), positions)
    assert not torch.allclose(cos[:200], plain_cos[0, :, :half], atol=1e-3)


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_batch_dependent_rope_types_are_refused(rope_type):
    """Stock recomputes dynamic / longrope frequencies from the batch's longest position."""
    rope = {"rope_type": rope_type, "rope_theta": 500000.0, "factor": 2.0, "original_max_position_embeddings": 64,
            "short_factor": [1.0] * 8, "long_factor": [2.0] * 8}
    with pytest.raises(ValueError, match=f"rope_type='{rope_type}' is not supported"):
        LlamaForCausalLM(tiny_config(rope_parameters=rope))


@pytest.mark.parametrize("make, tied", [(tiny_config, False), (tiny_tied_config, True)])
def test_tied_and_untied_heads_save_and_load_as_stock(make, tied, tmp_path):
    stock, ours = stock_and_ours(make(), tmp_path / "stock")
    assert (ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()) is tied
    ours.save_pretrained(tmp_path / "ours")
    stored = load_file(tmp_path / "ours" / "model.safetensors")
    assert ("lm_head.weight" in stored) is not tied  # stock writes a tied head once, as the embeddings
    assert set(stored) == set(load_file(tmp_path / "stock" / "model.safetensors"))
    again = StockLlamaForCausalLM.from_pretrained(tmp_path / "ours").eval()
    ids = torch.randint(0, 512, (1, 21))
    with torch.no_grad():
        assert torch.equal(again(ids).logits, stock(ids).logits)


def _engine(model):
    block = 4
    return LLM(model, device="cpu", block_size=block, max_num_seqs=8, max_num_batched_tokens=32,
               kv_cache_bytes=64 * kv_bytes_per_block(model.kv_cache_spec(), block, torch.float32))


def test_attention_and_mlp_biases_match_stock_and_roll_out_bitwise(tmp_path):
    """``attention_bias`` biases q/k/v and o_proj, ``mlp_bias`` gate/up/down (as stock); the
    biased q/k/v and gate/up groups still fuse, and rollouts equal `token_logprobs` bitwise."""
    stock, ours = stock_and_ours(tiny_config(attention_bias=True, mlp_bias=True, initializer_range=0.2), tmp_path,
                                 biases=True)
    attn, mlp = ours.model.layers[0].self_attn, ours.model.layers[0].mlp
    assert all(lin.bias is not None for lin in (attn.q_proj, attn.o_proj, mlp.gate_proj, mlp.down_proj))
    ids = torch.randint(0, 512, (2, 33))
    with torch.no_grad():
        assert rel(ours(ids).logits, stock(ids).logits) <= 1e-5
    llm = _engine(ours)
    assert attn.q_proj.bias.untyped_storage().data_ptr() == attn.v_proj.bias.untyped_storage().data_ptr()
    assert mlp.gate_proj.bias.untyped_storage().data_ptr() == mlp.up_proj.bias.untyped_storage().data_ptr()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=3, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        lp = ours.token_logprobs(torch.tensor([prompt + tokens]))[0, len(prompt):]  # autograd on: the separate GEMMs
        assert torch.equal(lp.detach(), torch.tensor(out.outputs[0].logprobs))


def test_head_dim_from_config_not_hidden_over_heads(tmp_path):
    config = tiny_config(head_dim=32)  # hidden 64 / 4 heads would be 16
    stock, ours = stock_and_ours(config, tmp_path)
    assert ours.model.layers[0].self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert ours.kv_cache_spec() == (2, 2, 32, 32)
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        assert rel(ours(ids).logits, stock(ids).logits) <= 1e-5


def test_published_llama_3_1_8b_config():
    assert ARCHITECTURE.shape("llama").published_configs == ("llama-3.1-8b.json",)
    config = make_config(ARCHITECTURE, "llama-3.1-8b", 2, None)
    assert config.num_hidden_layers == 2 and config.head_dim == 128 and not config.tie_word_embeddings
    assert config.rope_parameters["rope_type"] == "llama3" and config.rope_parameters["factor"] == 8.0
    assert not config.attention_bias and not config.mlp_bias
