"""Llama (dense, GQA, Llama-3.x rope scaling; optional attention / MLP biases)."""

from transformers import LlamaConfig

from ..projections import randomize_projection_biases
from ..registry import Architecture, Shape, register
from .modeling import (LlamaForCausalLM, LlamaForCausalLMInference, LlamaForSequenceClassification,
                       LlamaForTokenClassification, LlamaModel, LlamaPreTrainedModel, LlamaRMSNorm)

# Llama-3.x rope scaling at a tiny scale: with head dim 16 and theta 5e5, an original context of
# 64 positions puts the 8 frequencies in all three bands of the llama3 rule (kept, smoothed,
# divided by `factor`), and the tests run past position 64.
_LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def tiny_config(**overrides) -> LlamaConfig:
    """A tiny Llama-3.1-style model (2 layers, hidden 64, GQA 4/2, head dim 16, vocab 512, llama3
    rope scaling, untied LM head) for CPU tests."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, rope_parameters=dict(_LLAMA3_ROPE),
                  attention_bias=False, mlp_bias=False, eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_tied_config(**overrides) -> LlamaConfig:
    """A tiny Llama-3.2-1B-style model: LM head tied to the embeddings, rope factor 32."""
    fields = dict(tie_word_embeddings=True, rope_parameters={**_LLAMA3_ROPE, "factor": 32.0})
    fields.update(overrides)
    return tiny_config(**fields)


ARCHITECTURE = register(Architecture(
    name="llama",
    model_types=("llama",),
    config_class=LlamaConfig,
    causal_lm_class=LlamaForCausalLM,
    base_model_class=LlamaModel,
    sequence_classification_class=LlamaForSequenceClassification,
    token_classification_class=LlamaForTokenClassification,
    inference_class=LlamaForCausalLMInference,
    shapes=(Shape("llama", tiny_config, published_configs=("llama-3.1-8b.json",)),
            Shape("llama_tied", tiny_tied_config)),
    hf_causal_lm_class="transformers.LlamaForCausalLM",
    init_for_conformance=randomize_projection_biases,  # random init zeroes the biases
))

__all__ = ["ARCHITECTURE", "LlamaForCausalLM", "LlamaForCausalLMInference", "LlamaModel", "LlamaPreTrainedModel",
           "LlamaRMSNorm", "tiny_config", "tiny_tied_config"]
