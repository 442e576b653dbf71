"""Moonlight-16B-A3B: DeepSeek-V3's architecture (its config.json says ``model_type:
deepseek_v3``, so it loads as published into `vexact_models.deepseek_v3`) at another shape:
no q-LoRA (``q_proj``), plain RoPE, one expert group, 64 experts top-6, 2 shared experts.
Registered separately so that conformance checks this shape too."""

from transformers import DeepseekV3Config

from ..deepseek_v3 import randomize_router_bias
from ..deepseek_v3.modeling import (DeepseekV3ForCausalLM, DeepseekV3ForCausalLMInference,
                                    DeepseekV3ForSequenceClassification, DeepseekV3ForTokenClassification,
                                    DeepseekV3Model)
from ..registry import Architecture, register


def tiny_config(**overrides) -> DeepseekV3Config:
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
    name="moonlight",
    model_types=("deepseek_v3",),
    config_class=DeepseekV3Config,
    causal_lm_class=DeepseekV3ForCausalLM,
    base_model_class=DeepseekV3Model,
    sequence_classification_class=DeepseekV3ForSequenceClassification,
    token_classification_class=DeepseekV3ForTokenClassification,
    inference_class=DeepseekV3ForCausalLMInference,
    tiny_config=tiny_config,
    hf_causal_lm_class="transformers.DeepseekV3ForCausalLM",
    published_configs=("moonlight-16b-a3b.json",),
    init_for_conformance=randomize_router_bias,
))

__all__ = ["ARCHITECTURE", "tiny_config"]
