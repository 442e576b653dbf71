"""GPT-OSS (attention sinks, alternating sliding-window and full attention, YaRN, a biased router
and biased experts with the clamped SwiGLU)."""

import torch
from transformers import GptOssConfig

from ..registry import Architecture, Shape, register
from .modeling import (GptOssForCausalLM, GptOssForCausalLMInference, GptOssForSequenceClassification,
                       GptOssForTokenClassification, GptOssModel, GptOssPreTrainedModel)
from ..mxfp4 import mxfp4_quantized


def tiny_config(**overrides) -> GptOssConfig:
    """A tiny GPT-OSS for CPU tests: 3 layers (sliding window of 8 keys, full, sliding), hidden
    64, heads 4/2 of dim 16 with biases and sinks, 8 experts top-2 of width 32, YaRN (factor 4
    over 64 positions), vocab 512: windows shorter than the tests' prompts."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                  max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=True,
                  router_aux_loss_coef=0.001, swiglu_limit=7.0,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                                   "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
                  eos_token_id=1, bos_token_id=0, pad_token_id=None)
    fields.update(overrides)
    fields.setdefault("layer_types", ["sliding_attention" if i % 2 == 0 else "full_attention"
                                      for i in range(fields["num_hidden_layers"])])
    return GptOssConfig(**fields)


@torch.no_grad()
def randomize_sinks_and_expert_biases(model: torch.nn.Module, seed: int = 0) -> None:
    """Random sinks (std 1: some heads' sinks take a large share of the softmax) and expert
    biases (gate/up std 3, so that some products pass the clamp at 7; down std 0.5), on our
    model or stock's (by parameter name), so that parity and conformance exercise them."""
    gen = torch.Generator().manual_seed(seed + 1)
    for name, param in sorted(model.named_parameters()):
        std = (1.0 if name.endswith("self_attn.sinks") else 3.0 if name.endswith("experts.gate_up_proj_bias")
               else 0.5 if name.endswith("experts.down_proj_bias") else None)
        if std is not None:
            param.copy_(torch.randn(param.shape, generator=gen) * std)


ARCHITECTURE = register(Architecture(
    name="gpt_oss",
    model_types=("gpt_oss",),
    config_class=GptOssConfig,
    causal_lm_class=GptOssForCausalLM,
    base_model_class=GptOssModel,
    sequence_classification_class=GptOssForSequenceClassification,
    token_classification_class=GptOssForTokenClassification,
    inference_class=GptOssForCausalLMInference,
    shapes=(Shape("gpt_oss", tiny_config, published_configs=("gpt-oss-20b.json", "gpt-oss-120b.json")),),
    hf_causal_lm_class="transformers.GptOssForCausalLM",
    init_for_conformance=randomize_sinks_and_expert_biases,
    min_transformers="5.24",  # the release its stock classes were matched on (tests/models/test_sliding_window_models.py)
))

__all__ = ["ARCHITECTURE", "GptOssForCausalLM", "GptOssForCausalLMInference", "GptOssModel", "GptOssPreTrainedModel",
           "mxfp4_quantized", "randomize_sinks_and_expert_biases", "tiny_config"]
