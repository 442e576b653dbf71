"""Qwen3-Next (gated-DeltaNet and gated full-attention layers, MoE with a shared expert)."""

from transformers import Qwen3NextConfig

from ..gated_deltanet import (GDN_FP32_PARITY, alternating_layer_types,
                              randomize_norms_and_gates)
from ..registry import Architecture, Shape, register
from .modeling import (Qwen3NextForCausalLM, Qwen3NextForCausalLMInference, Qwen3NextForSequenceClassification,
                       Qwen3NextForTokenClassification, Qwen3NextModel, Qwen3NextPreTrainedModel,
                       Qwen3NextSparseMoeBlock)


def tiny_config(**overrides) -> Qwen3NextConfig:
    """A tiny Qwen3-Next for CPU tests: 3 layers (gated DeltaNet, gated full attention, gated
    DeltaNet; the middle one a dense MLP, the others 8 experts top-2 and a shared expert); hidden
    64, attention heads 4/2 of dim 32 (partial rotary 0.25), DeltaNet key heads 2 and value heads 4
    of dim 16, delta-rule chunks of 16
    (`linear_chunk_size`), vocab 512."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
 mlp_only_layers=[1],
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_chunk_size=16,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, moe_intermediate_size=32,
                  shared_expert_intermediate_size=32, decoder_sparse_step=1, router_aux_loss_coef=0.001,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                  eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    fields.setdefault("layer_types", alternating_layer_types(fields["num_hidden_layers"]))
    return Qwen3NextConfig(**fields)


ARCHITECTURE = register(Architecture(
    name="qwen3_next",
    model_types=("qwen3_next",),
    config_class=Qwen3NextConfig,
    causal_lm_class=Qwen3NextForCausalLM,
    base_model_class=Qwen3NextModel,
    sequence_classification_class=Qwen3NextForSequenceClassification,
    token_classification_class=Qwen3NextForTokenClassification,
    inference_class=Qwen3NextForCausalLMInference,
    shapes=(Shape("qwen3_next", tiny_config, published_configs=("qwen3-next-80b-a3b.json",)),),
    hf_causal_lm_class="transformers.Qwen3NextForCausalLM",
    init_for_conformance=randomize_norms_and_gates,
    fp32_parity=GDN_FP32_PARITY,
    checkpoint_conversions=True,  # hub checkpoints store one tensor per expert
))

__all__ = ["ARCHITECTURE", "Qwen3NextForCausalLM", "Qwen3NextForCausalLMInference", "Qwen3NextModel",
           "Qwen3NextPreTrainedModel", "Qwen3NextSparseMoeBlock", "tiny_config"]
