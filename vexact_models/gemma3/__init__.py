"""Gemma 3's text model (local sliding-window and global layers with their own RoPE, q/k norms,
sandwich norms, GeGLU, scaled embeddings)."""

from transformers import Gemma3TextConfig

from ..registry import Architecture, Shape, register
from .modeling import (Gemma3ForCausalLM, Gemma3ForCausalLMInference, Gemma3PreTrainedModel,
                       Gemma3TextForSequenceClassification, Gemma3TextForTokenClassification, Gemma3TextModel)


def tiny_config(**overrides) -> Gemma3TextConfig:
    """A tiny Gemma 3 for CPU tests: 3 layers (two local with a window of 8 keys, one global, as
    ``sliding_window_pattern``), hidden 64, heads 4/2 of dim 16, query_pre_attn_scalar 16, local
    RoPE base 1e4, global base 1e6 with linear scaling 2 (the larger Gemma 3 models' kind),
    vocab 512, tied head: windows shorter than the tests' prompts."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8,
                  max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  hidden_activation="gelu_pytorch_tanh",
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0}},
                  eos_token_id=1, bos_token_id=2, pad_token_id=0)
    fields.update(overrides)
    fields.setdefault("layer_types", ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                      for i in range(fields["num_hidden_layers"])])  # Gemma's pattern, every 3rd global
    return Gemma3TextConfig(**fields)


ARCHITECTURE = register(Architecture(
    name="gemma3",
    model_types=("gemma3_text",),
    config_class=Gemma3TextConfig,
    causal_lm_class=Gemma3ForCausalLM,
    base_model_class=Gemma3TextModel,
    sequence_classification_class=Gemma3TextForSequenceClassification,
    token_classification_class=Gemma3TextForTokenClassification,
    inference_class=Gemma3ForCausalLMInference,
    shapes=(Shape("gemma3", tiny_config, published_configs=("gemma3-text-default.json",)),),
    hf_causal_lm_class="transformers.Gemma3ForCausalLM",
    hf_head_classes=(("Model", "transformers.Gemma3TextModel"),
                     ("ForSequenceClassification", "transformers.Gemma3TextForSequenceClassification")),
    min_transformers="5.24",  # the release its stock classes were matched on (rope_parameters per layer type)
))

__all__ = ["ARCHITECTURE", "Gemma3ForCausalLM", "Gemma3ForCausalLMInference", "Gemma3PreTrainedModel",
           "Gemma3TextModel", "tiny_config"]
