"""Qwen2 / Qwen2.5 (dense, GQA, biases on q/k/v; full attention only)."""

from transformers import Qwen2Config

from ..projections import randomize_projection_biases
from ..registry import Architecture, Shape, register
from .modeling import (Qwen2ForCausalLM, Qwen2ForCausalLMInference, Qwen2ForSequenceClassification,
                       Qwen2ForTokenClassification, Qwen2Model, Qwen2PreTrainedModel, Qwen2RMSNorm)


def tiny_config(**overrides) -> Qwen2Config:
    """A tiny Qwen2.5-7B-style model (2 layers, hidden 64, GQA 4/2, head dim 16 from hidden/heads,
    vocab 512, untied LM head) for CPU tests."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                  use_sliding_window=False, eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    return Qwen2Config(**fields)


def tiny_tied_config(**overrides) -> Qwen2Config:
    """A tiny model shaped like the small Qwen2.5 sizes (0.5B to 3B): LM head tied to the embeddings."""
    return tiny_config(**{"tie_word_embeddings": True, **overrides})


ARCHITECTURE = register(Architecture(
    name="qwen2",
    model_types=("qwen2",),
    config_class=Qwen2Config,
    causal_lm_class=Qwen2ForCausalLM,
    base_model_class=Qwen2Model,
    sequence_classification_class=Qwen2ForSequenceClassification,
    token_classification_class=Qwen2ForTokenClassification,
    inference_class=Qwen2ForCausalLMInference,
    shapes=(Shape("qwen2", tiny_config, published_configs=("qwen2.5-7b.json",)),
            Shape("qwen2_tied", tiny_tied_config)),
    hf_causal_lm_class="transformers.Qwen2ForCausalLM",
    init_for_conformance=randomize_projection_biases,  # random init zeroes the biases
))

__all__ = ["ARCHITECTURE", "Qwen2ForCausalLM", "Qwen2ForCausalLMInference", "Qwen2Model", "Qwen2PreTrainedModel",
           "Qwen2RMSNorm", "tiny_config", "tiny_tied_config"]
