"""GLM-4.5 / GLM-4.6 (HF ``Glm4MoeForCausalLM``, model_type ``glm4_moe``): GQA attention with
q/k/v biases, per-head q/k norms and partial RoPE over DeepSeek-V3's MoE (sigmoid routing with the
score-correction bias, shared experts, the first layers dense)."""

from transformers import Glm4MoeConfig

from vexact_models.random_init import randomize_router_bias
from vexact_models.registry import Architecture, Shape, register
from .modeling import (Glm4MoeForCausalLM, Glm4MoeForCausalLMInference, Glm4MoeForSequenceClassification,
                       Glm4MoeForTokenClassification, Glm4MoeModel, Glm4MoePreTrainedModel)


def tiny_config(**overrides) -> Glm4MoeConfig:
    """A tiny GLM-4.5 for CPU tests: 3 layers, the first dense; 16 routed experts top-4 in 2 groups
    (the best one taken), one shared expert, ``routed_scaling_factor`` 2.5; hidden 64, GQA 4/2 with
    a head dim of 32 (not hidden / heads, as GLM-4.5's 128 is not), q/k/v biases, per-head q/k
    norms, RoPE on the first half of each head's dims (``partial_rotary_factor`` 0.5)."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                  n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4, n_group=2, topk_group=1,
                  norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, attention_bias=True, use_qk_norm=True,
                  max_position_embeddings=1024, partial_rotary_factor=0.5,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
                  rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    fields.update(overrides)
    return Glm4MoeConfig(**fields)


ARCHITECTURE = register(Architecture(
    name="glm4_moe",
    model_types=("glm4_moe",),
    config_class=Glm4MoeConfig,
    causal_lm_class=Glm4MoeForCausalLM,
    base_model_class=Glm4MoeModel,
    sequence_classification_class=Glm4MoeForSequenceClassification,
    token_classification_class=Glm4MoeForTokenClassification,
    inference_class=Glm4MoeForCausalLMInference,
    shapes=(Shape("glm4_moe", tiny_config, published_configs=("glm4-moe-default.json",)),),
    hf_causal_lm_class="transformers.Glm4MoeForCausalLM",
    init_for_conformance=randomize_router_bias,
    checkpoint_conversions=True,  # hub checkpoints store one tensor per expert
))

__all__ = ["ARCHITECTURE", "Glm4MoeForCausalLM", "Glm4MoeForCausalLMInference", "Glm4MoeModel",
           "Glm4MoePreTrainedModel", "tiny_config"]
