"""Qwen3 (dense, GQA, q/k-norm)."""

from transformers import Qwen3Config

from ..registry import Architecture, Shape, register
from .modeling import (Qwen3ForCausalLM, Qwen3ForCausalLMInference, Qwen3ForSequenceClassification,
                       Qwen3ForTokenClassification, Qwen3Model, Qwen3PreTrainedModel, Qwen3RMSNorm)


def tiny_config(**overrides) -> Qwen3Config:
    """A tiny Qwen3 (2 layers, hidden 64, GQA 4/2, head dim 16, vocab 512) for CPU tests."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    return Qwen3Config(**fields)


ARCHITECTURE = register(Architecture(
    name="qwen3",
    model_types=("qwen3",),
    config_class=Qwen3Config,
    causal_lm_class=Qwen3ForCausalLM,
    base_model_class=Qwen3Model,
    sequence_classification_class=Qwen3ForSequenceClassification,
    token_classification_class=Qwen3ForTokenClassification,
    inference_class=Qwen3ForCausalLMInference,
    shapes=(Shape("qwen3", tiny_config, published_configs=("qwen3-0.6b.json", "qwen3-8b.json")),),
    hf_causal_lm_class="transformers.Qwen3ForCausalLM",
))

__all__ = ["ARCHITECTURE", "Qwen3ForCausalLM", "Qwen3ForCausalLMInference", "Qwen3Model", "Qwen3PreTrainedModel",
           "Qwen3RMSNorm", "tiny_config"]
