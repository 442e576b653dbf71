"""What is specific to Qwen2 / Qwen2.5 (the parametrised modules check the rest at both shapes):
biases on q/k/v and none on o_proj, their gradients, and the biased q/k/v fused into one rollout
GEMM: rollouts equal the training forward bitwise, across sleep / wake_up too. Sliding windows:
test_qwen_sliding_window.py."""

import pytest
import torch
from transformers import Qwen2Config
from transformers.models.qwen2.modeling_qwen2 import Qwen2ForCausalLM as StockQwen2ForCausalLM

from vexact_models.conformance.models import make_config
from vexact_models.projections import randomize_projection_biases
from vexact_models.qwen2 import ARCHITECTURE, Qwen2ForCausalLM, tiny_config, tiny_tied_config
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(stock, ours) loaded from one stock checkpoint with random weights and random biases."""
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(0)
    stock = StockQwen2ForCausalLM(tiny_config(initializer_range=0.2))
    randomize_projection_biases(stock)
    stock.save_pretrained(path)
    return StockQwen2ForCausalLM.from_pretrained(path).eval(), Qwen2ForCausalLM.from_pretrained(path).eval()


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_biases_on_qkv_only_and_they_count(pair):
    stock, ours = pair
    attn = ours.model.layers[0].self_attn
    assert all(lin.bias is not None for lin in (attn.q_proj, attn.k_proj, attn.v_proj)) and attn.o_proj.bias is None
    assert ours.model.layers[0].mlp.gate_proj.bias is None
    assert set(ours.state_dict()) == set(stock.state_dict())
    assert float(attn.k_proj.bias.detach().abs().max()) > 0.1  # the checkpoint's random biases arrived
    ids = torch.randint(0, 512, (2, 29))
    with torch.no_grad():
        assert rel(ours(ids).logits, stock(ids).logits) <= 1e-5


def test_bias_gradients_equal_stock(pair):
    stock, ours = pair
    ids = torch.randint(0, 512, (2, 16))
    grads = []
    for model in (stock, ours):
        biases = [p for n, p in model.named_parameters() if n.endswith("_proj.bias")]
        grads.append(torch.autograd.grad(model(ids, labels=ids).loss, biases))
    assert len(grads[1]) == 3 * ours.config.num_hidden_layers
    for got, want in zip(grads[1], grads[0]):
        assert want.abs().max() > 0 and rel(got, want) < 1e-4


def _engine(model, **kwargs):
    block = 4
    return LLM(model, device="cpu", block_size=block, max_num_seqs=8, max_num_batched_tokens=16,
               kv_cache_bytes=64 * kv_bytes_per_block(model.kv_cache_spec(), block, torch.float32), **kwargs)


PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27]]
PARAMS = SamplingParams(temperature=0.8, max_tokens=8, seed=5, ignore_eos=True)


def _rollout(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("make", [tiny_config, tiny_tied_config], ids=["untied", "tied"])
def test_fused_bias_rollout_equals_training_bitwise(make, monkeypatch):
    """The engine fuses the biased q/k/v (one GEMM, one bias buffer); the training forward with
    autograd on runs the separate GEMMs; the logprobs are the same bits."""
    import vexact_models.projections as projections

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(make(initializer_range=0.3)).eval()
    randomize_projection_biases(model)
    llm = _engine(model)
    attn = model.model.layers[1].self_attn
    assert _storage(attn.q_proj.bias) == _storage(attn.k_proj.bias) == _storage(attn.v_proj.bias)
    fused_calls = []
    real = projections.linear
    monkeypatch.setattr(projections, "linear", lambda x, w, b=None, *a, **k: (
        fused_calls.append(b is not None and b.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features)
        or real(x, w, b, *a, **k)))
    outs = _rollout(llm)
    assert any(fused_calls)  # the rollout ran the fused, biased GEMM
    monkeypatch.setattr(projections, "linear", real)
    for prompt, (tokens, logprobs) in zip(PROMPTS, outs):
        lp = model.token_logprobs(torch.tensor([prompt + tokens]), temperature=PARAMS.temperature)[0, len(prompt):]
        assert lp.requires_grad and torch.equal(lp.detach(), torch.tensor(logprobs))


def test_sleep_and_wake_keep_the_fused_bias_buffer():
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(tiny_config(initializer_range=0.3)).eval()
    randomize_projection_biases(model)
    llm = _engine(model, owns_weights=True)
    before = _rollout(llm)
    biases = {n: p.detach().clone() for n, p in model.named_parameters() if n.endswith(".bias")}
    llm.sleep(level=1)
    assert all(p.numel() == 0 for p in model.parameters())
    llm.wake_up()
    attn = model.model.layers[0].self_attn
    assert _storage(attn.q_proj.bias) == _storage(attn.k_proj.bias) == _storage(attn.v_proj.bias)
    assert all(torch.equal(p, biases[n]) for n, p in model.named_parameters() if n.endswith(".bias"))
    assert _rollout(llm) == before


def test_published_qwen2_5_7b_config():
    assert ARCHITECTURE.shape("qwen2").published_configs == ("qwen2.5-7b.json",)
    config = make_config(ARCHITECTURE, "qwen2.5-7b", 2, None)
    assert isinstance(config, Qwen2Config) and config.num_hidden_layers == 2 and not config.tie_word_embeddings
    assert not config.use_sliding_window and config.sliding_window is None
    assert config.hidden_size // config.num_attention_heads == 128
