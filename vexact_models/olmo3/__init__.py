"""OLMo 3 (HF ``Olmo3ForCausalLM``, model_type ``olmo3``): post-norm layers, q/k norms over the
whole projections, sliding-window layers beside full ones, RoPE per layer type."""

from transformers import Olmo3Config

from vexact_models.registry import Architecture, Shape, register
from .modeling import (Olmo3ForCausalLM, Olmo3ForCausalLMInference, Olmo3ForSequenceClassification,
                       Olmo3ForTokenClassification, Olmo3Model, Olmo3PreTrainedModel, Olmo3RMSNorm)


def tiny_config(**overrides) -> Olmo3Config:
    """A tiny OLMo 3 for CPU tests: 3 layers (two sliding with a window of 8 keys, then one full:
    OLMo 3's sliding-then-full pattern, shortened), hidden 64, GQA 4/2 of head dim 16, vocab 512;
    plain RoPE on the sliding layers and YaRN (factor 4 over an original 64 positions, as the
    long-context checkpoints scale their full-attention layers) on the full one, so that the tests
    run past both."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, sliding_window=8,
                  tie_word_embeddings=False, attention_bias=False,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500000.0},
                                   "full_attention": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0,
                                                      "original_max_position_embeddings": 64}},
                  eos_token_id=1, bos_token_id=None, pad_token_id=0)
    fields.update(overrides)
    fields.setdefault("layer_types", ["full_attention" if (i + 1) % 3 == 0 else "sliding_attention"
                                      for i in range(fields["num_hidden_layers"])])
    return Olmo3Config(**fields)


ARCHITECTURE = register(Architecture(
    name="olmo3",
    model_types=("olmo3",),
    config_class=Olmo3Config,
    causal_lm_class=Olmo3ForCausalLM,
    base_model_class=Olmo3Model,
    sequence_classification_class=Olmo3ForSequenceClassification,
    token_classification_class=Olmo3ForTokenClassification,
    inference_class=Olmo3ForCausalLMInference,
    shapes=(Shape("olmo3", tiny_config, published_configs=("olmo3-default.json",)),),
    hf_causal_lm_class="transformers.Olmo3ForCausalLM",
    min_transformers="5.13",  # the release whose stock classes take rope_parameters per layer type
))

__all__ = ["ARCHITECTURE", "Olmo3ForCausalLM", "Olmo3ForCausalLMInference", "Olmo3Model", "Olmo3PreTrainedModel",
           "Olmo3RMSNorm", "tiny_config"]
