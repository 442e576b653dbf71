"""Qwen2, Qwen3 and Qwen3-MoE with ``use_sliding_window=True``: the layers HF slides (from
``max_window_layers`` on for Qwen2 and Qwen3, whose configs list ``layer_types``; every layer for
Qwen3-MoE, whose config has none) attend within ``sliding_window`` keys through the same window
kernels as GPT-OSS and Gemma 3 (`layers.layer_window`, docs/design.md section 3). Against stock
(eager attention, its sliding-window mask) in fp32, forward and gradients; each sequence's
logprobs bitwise the same alone, packed and padded; rollouts equal the training forward bitwise,
with the engine freeing the pages behind the window where every layer slides."""

import pytest
import torch

from vexact_models.layers import cache_window, window_layers
from vexact_models.registry import get
from vexact_models.runtime import SamplingParams

from ..runtime.llm_support import gen, make_llm, prompts_for, training_logprobs
from .model_support import check_window_parity_and_batch_invariance, rel, stock_model

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)

WINDOW = 8
NAMES = ("qwen2", "qwen3", "qwen3_moe")


#: the tiny config's fields for a window of `WINDOW` from layer 1 on (Qwen3-MoE: every layer)
WINDOWED = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    """(architecture, stock with eager attention, ours with the same weights)."""
    arch = get(request.param)
    hf = stock_model(arch, initializer_range=0.1, **WINDOWED)
    hf.config._attn_implementation = "eager"  # stock's reference attention with its sliding-window mask
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    return arch, hf, ours


def test_the_layers_stock_slides_take_the_window(pair):
    arch, hf, ours = pair
    windows = [layer.self_attn.sliding_window for layer in ours.model.layers]
    if arch.name == "qwen3_moe":
        assert windows == [WINDOW] * len(windows)
    else:
        assert windows == [None if kind == "full_attention" else WINDOW for kind in hf.config.layer_types]
        assert windows[0] is None and WINDOW in windows


def test_parity_and_batch_invariance_with_windows_shorter_than_the_prompts(pair):
    """Windows of 8 under prompts of 40: parity with stock and batch invariance
    (`model_support.check_window_parity_and_batch_invariance`)."""
    check_window_parity_and_batch_invariance(*pair)


def test_the_window_changes_the_output_and_gradients_match_stock(pair):
    """The parity above would hold with the window ignored if it made no difference here: the
    same weights without the window give other logits. fp32 gradients match stock's."""
    arch, hf, ours = pair
    full = arch.causal_lm_class(arch.tiny_config(initializer_range=0.1)).eval()
    full.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 512, (2, 32))
    with torch.no_grad():
        assert rel(full(ids).logits, ours(ids).logits) > 1e-3
    losses = [model(ids, labels=ids).loss for model in (hf, ours)]
    for loss in losses:
        loss.backward()
    mine, stock = dict(ours.named_parameters()), dict(hf.named_parameters())
    for name in ("model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight",
                 "model.embed_tokens.weight"):
        assert rel(mine[name].grad, stock[name].grad) < 1e-4, name
    hf.zero_grad()
    ours.zero_grad()


@pytest.mark.parametrize("name", NAMES)
def test_rollouts_with_windows_equal_training_bitwise(name):
    """Sampled rollouts of up to 40 tokens past windows of 8, prompt chunks of 6, pages of 4:
    every logprob equal to the training forward's. Where every layer slides (Qwen3-MoE) the engine
    frees the pages behind the window (`layers.cache_window`); where some do (Qwen2, Qwen3) those
    keep pages of their own (`runtime.page_groups`)."""
    arch = get(name)
    torch.manual_seed(0)
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.1, **WINDOWED)).eval()
    llm = make_llm(model, max_num_batched_tokens=6)
    layers = arch.tiny_config().num_hidden_layers
    assert cache_window(model) == (WINDOW if name == "qwen3_moe" else None)
    assert window_layers(model) == (None if name == "qwen3_moe" else (WINDOW, tuple(range(1, layers))))
    prompts = prompts_for(6, seed=1, lo=5, hi=20)
    outs = gen(llm, prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=3))
    for prompt, out in zip(prompts, outs):
        tokens, logprobs = out.outputs[0].token_ids, torch.tensor(out.outputs[0].logprobs)
        assert len(tokens) == 40 and torch.equal(logprobs, training_logprobs(model, prompt, tokens, 1.0))


def test_a_window_an_attention_does_not_take_is_refused(monkeypatch):
    """`DecoderModelMixin.init_decoder_stack`: a config window on a layer whose attention module
    does not declare it (here, Qwen3's attention with its window removed) is a ValueError naming
    the layer, rather than full attention where stock slides."""
    from vexact_models.qwen3 import modeling

    original = modeling.Qwen3Attention.__init__

    def without_window(self, config, layer_idx):
        original(self, config, layer_idx)
        self.sliding_window = None

    monkeypatch.setattr(modeling.Qwen3Attention, "__init__", without_window)
    arch = get("qwen3")
    with pytest.raises(ValueError, match=f"layer 1 attends within a sliding window of {WINDOW} tokens"):
        arch.causal_lm_class(arch.tiny_config(**WINDOWED))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels at a published layer shape)")
@pytest.mark.parametrize("config_name, layers", [("qwen3-0.6b", 4), ("qwen3-30b-a3b", 2)])
def test_published_layer_shapes_with_windows_conform_on_gpu(config_name, layers):
    """The published Qwen3-0.6B (4 layers, the last two sliding: their own page group) and
    Qwen3-30B-A3B (2 layers, every layer sliding: pages freed behind the window) with a window of
    64 against prompts of 200 and up to 64 new tokens, random bf16 weights: rollout logprobs equal
    the training recompute bitwise in every scenario of the suite."""
    from vexact_models.conformance.models import build_model, make_config, published_shape
    from vexact_models.conformance.suite import run_conformance

    arch, _ = published_shape(config_name)
    overrides = dict(use_sliding_window=True, sliding_window=64)
    if arch.name != "qwen3_moe":  # Qwen3-MoE's config has no max_window_layers: every layer slides
        overrides["max_window_layers"] = layers // 2
    config = make_config(arch, config_name, layers=layers, max_positions=4096, overrides=overrides)
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    expected = (64 if arch.name == "qwen3_moe" else None, None if arch.name == "qwen3_moe" else
                (64, tuple(range(layers // 2, layers))))
    assert (cache_window(model), window_layers(model)) == expected
    report = run_conformance(arch, model, device=torch.device("cuda"), pool_size=64, max_tokens=64, prompt_len=200,
                             log=lambda *_: None)
    assert report.tokens > 2000 and report.mismatches == 0, [(s.name, s.mismatches) for s in report.scenarios]
    assert report.reproducibility_mismatches == 0 and report.ok, str(report.hf_parity)
