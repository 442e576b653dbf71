"""Qwen3-specific checks. What every architecture must do (HF parity, packing/padding, checkpoints,
errors) is tests/models/test_architectures.py, at Qwen3's tied-head tiny shape among the others."""

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3ForCausalLM as HFQwen3ForCausalLM

from vexact_models.qwen3 import Qwen3ForCausalLM, Qwen3ForCausalLMInference, tiny_config

from .model_support import rel

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


def test_untied_head_matches_stock():
    """Qwen3-8B and larger have an untied LM head (the tiny shape is tied, as Qwen3-0.6B)."""
    torch.manual_seed(0)
    hf = HFQwen3ForCausalLM(tiny_config(tie_word_embeddings=False)).eval()
    ours = Qwen3ForCausalLM(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    assert ours.lm_head.weight.data_ptr() != ours.model.embed_tokens.weight.data_ptr()
    ids = torch.randint(0, 512, (2, 19))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= 1e-5


def test_kv_cache_spec_is_layers_kv_heads_head_dim_twice():
    model = Qwen3ForCausalLM(tiny_config())
    assert Qwen3ForCausalLMInference(model).kv_cache_spec() == (2, 2, 16, 16)
