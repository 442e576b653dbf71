"""Qwen3-MoE (softmax top-k routing over fused 3-D experts, Qwen3 attention)."""

from transformers import Qwen3MoeConfig

from ..registry import Architecture, Shape, register
from .modeling import (Qwen3MoeForCausalLM, Qwen3MoeForCausalLMInference, Qwen3MoeForSequenceClassification,
                       Qwen3MoeForTokenClassification, Qwen3MoeModel, Qwen3MoePreTrainedModel, Qwen3MoeSparseMoeBlock)


def tiny_config(**overrides) -> Qwen3MoeConfig:
    """A tiny Qwen3-MoE (3 layers, the middle one dense; 8 experts, top-2) for CPU tests."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
                  num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=0.001,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e6}, eos_token_id=1, bos_token_id=0)
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


ARCHITECTURE = register(Architecture(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    config_class=Qwen3MoeConfig,
    causal_lm_class=Qwen3MoeForCausalLM,
    base_model_class=Qwen3MoeModel,
    sequence_classification_class=Qwen3MoeForSequenceClassification,
    token_classification_class=Qwen3MoeForTokenClassification,
    inference_class=Qwen3MoeForCausalLMInference,
    shapes=(Shape("qwen3_moe", tiny_config, published_configs=("qwen3-30b-a3b.json", "qwen3-235b-a22b.json")),),
    hf_causal_lm_class="transformers.Qwen3MoeForCausalLM",
    checkpoint_conversions=True,  # hub checkpoints store one tensor per expert
))

__all__ = ["ARCHITECTURE", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLMInference", "Qwen3MoeModel",
           "Qwen3MoePreTrainedModel", "Qwen3MoeSparseMoeBlock", "tiny_config"]
