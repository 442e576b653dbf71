"""DeepSeek-V3 (multi-head latent attention, DeepSeekMoE with group-limited sigmoid routing).

Two shapes: ``deepseek_v3`` (q-LoRA, YaRN RoPE, grouped routing) and ``moonlight``
(Moonlight-16B-A3B: its config.json says ``model_type: deepseek_v3``; no q-LoRA, plain RoPE, one
expert group, 64 experts top-6, 2 shared experts).
"""

from transformers import DeepseekV3Config

from ..random_init import randomize_router_bias
from ..registry import Architecture, Shape, register
from .modeling import (DeepseekV3ForCausalLM, DeepseekV3ForCausalLMInference, DeepseekV3ForSequenceClassification,
                       DeepseekV3ForTokenClassification, DeepseekV3Model, DeepseekV3PreTrainedModel,
                       mla_softmax_scale)


def tiny_config(**overrides) -> DeepseekV3Config:
    """A tiny DeepSeek-V3-shaped model for CPU tests: q-LoRA, YaRN RoPE (so the softmax scale
    carries mscale**2), interleaved rope dims, qk head dim 24 (16 nope + 8 rope) vs v head dim
    12; 3 layers, the first dense; 16 routed experts in 4 groups (best 2 groups, top-4), one
    shared expert."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=4, topk_group=2,
                  norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=1024,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
                                   "mscale": 1.0, "mscale_all_dim": 1.0},
                  rope_interleave=True, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    fields.update(overrides)
    return DeepseekV3Config(**fields)


def moonlight_tiny_config(**overrides) -> DeepseekV3Config:
    """A tiny Moonlight-shaped model for CPU tests: ``q_proj`` (no q-LoRA), default RoPE, one
    expert group, 16 experts top-4, 2 shared experts, the first of 3 layers dense."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=16,
                  n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=4, n_group=1, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=2.446, first_k_dense_replace=1, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                  qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=1024,
                  rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rope_interleave=True,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    fields.update(overrides)
    return DeepseekV3Config(**fields)


ARCHITECTURE = register(Architecture(
    name="deepseek_v3",
    model_types=("deepseek_v3",),
    config_class=DeepseekV3Config,
    causal_lm_class=DeepseekV3ForCausalLM,
    base_model_class=DeepseekV3Model,
    sequence_classification_class=DeepseekV3ForSequenceClassification,
    token_classification_class=DeepseekV3ForTokenClassification,
    inference_class=DeepseekV3ForCausalLMInference,
    shapes=(Shape("deepseek_v3", tiny_config, published_configs=("deepseek-v3.json",)),
            Shape("moonlight", moonlight_tiny_config, published_configs=("moonlight-16b-a3b.json",))),
    hf_causal_lm_class="transformers.DeepseekV3ForCausalLM",
    init_for_conformance=randomize_router_bias,
    checkpoint_conversions=True,  # hub checkpoints store one tensor per expert
))

__all__ = ["ARCHITECTURE", "DeepseekV3ForCausalLM", "DeepseekV3ForCausalLMInference", "DeepseekV3Model",
           "DeepseekV3PreTrainedModel", "mla_softmax_scale", "moonlight_tiny_config", "randomize_router_bias", "tiny_config"]
