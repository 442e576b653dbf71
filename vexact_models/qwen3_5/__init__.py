"""Qwen3.5 (dense text model: gated-DeltaNet and gated full-attention layers)."""

from transformers import Qwen3_5TextConfig

from ..gated_deltanet import (GDN_FP32_PARITY, alternating_layer_types,
                              randomize_norms_and_gates)
from ..registry import Architecture, Shape, register
from .modeling import (Qwen3_5ForCausalLM, Qwen3_5ForCausalLMInference, Qwen3_5ForSequenceClassification,
                       Qwen3_5ForTokenClassification, Qwen3_5PreTrainedModel, Qwen3_5TextModel)


def tiny_config(**overrides) -> Qwen3_5TextConfig:
    """A tiny Qwen3.5 for CPU tests: 3 layers (gated DeltaNet, gated full attention, gated
    DeltaNet), hidden 64, attention heads 4/2 of dim 32 with partial rotary 0.25, DeltaNet key
    heads 2 and value heads 4 of dim 16, conv kernel 4, delta-rule chunks of 16
    (`linear_chunk_size`), vocab 512."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,

                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_conv_kernel_dim=4, linear_chunk_size=16,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                  eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    fields.setdefault("layer_types", alternating_layer_types(fields["num_hidden_layers"]))
    return Qwen3_5TextConfig(**fields)


ARCHITECTURE = register(Architecture(
    name="qwen3_5",
    model_types=("qwen3_5_text",),
    config_class=Qwen3_5TextConfig,
    causal_lm_class=Qwen3_5ForCausalLM,
    base_model_class=Qwen3_5TextModel,
    sequence_classification_class=Qwen3_5ForSequenceClassification,
    token_classification_class=Qwen3_5ForTokenClassification,
    inference_class=Qwen3_5ForCausalLMInference,
    shapes=(Shape("qwen3_5", tiny_config, published_configs=("qwen3.5-text-default.json",)),),
    hf_causal_lm_class="transformers.Qwen3_5ForCausalLM",
    init_for_conformance=randomize_norms_and_gates,
    hf_head_classes=(("Model", "transformers.Qwen3_5TextModel"),
                     ("ForSequenceClassification", "transformers.Qwen3_5TextForSequenceClassification")),
    fp32_parity=GDN_FP32_PARITY,
    checkpoint_conversions=True,  # multimodal checkpoints: model.language_model.* (transformers' own renaming)
))

__all__ = ["ARCHITECTURE", "Qwen3_5ForCausalLM", "Qwen3_5ForCausalLMInference", "Qwen3_5PreTrainedModel",
           "Qwen3_5TextModel", "tiny_config"]
