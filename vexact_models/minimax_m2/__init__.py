"""MiniMax-M2 (HF ``MiniMaxM2ForCausalLM``, model_type ``minimax_m2``): GQA attention with q/k
norms over the whole projections and partial RoPE, every layer a sparse MoE with sigmoid routing
and a score-correction bias (MiniMax-M2, M2.1, M2.5)."""

from transformers import MiniMaxM2Config

from vexact_models.random_init import randomize_router_bias
from vexact_models.registry import Architecture, Shape, register
from .modeling import (MiniMaxM2ForCausalLM, MiniMaxM2ForCausalLMInference, MiniMaxM2ForSequenceClassification,
                       MiniMaxM2ForTokenClassification, MiniMaxM2Model, MiniMaxM2PreTrainedModel,
                       MiniMaxM2SparseMoeBlock)


def tiny_config(**overrides) -> MiniMaxM2Config:
    """A tiny MiniMax-M2 for CPU tests: 2 layers, each 8 experts top-2 of intermediate 32; hidden
    64, GQA 4/2 with a head dim of 32 (not hidden / heads, as M2's 128 is not), RoPE on the first
    16 of each head's dims given as the released checkpoints give it (``rotary_dim``)."""
    fields = dict(vocab_size=512, hidden_size=64, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, max_position_embeddings=1024,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, router_aux_loss_coef=0.001, eos_token_id=1,
                  bos_token_id=0)
    fields.update(overrides)
    return MiniMaxM2Config(**fields)


ARCHITECTURE = register(Architecture(
    name="minimax_m2",
    model_types=("minimax_m2",),
    config_class=MiniMaxM2Config,
    causal_lm_class=MiniMaxM2ForCausalLM,
    base_model_class=MiniMaxM2Model,
    sequence_classification_class=MiniMaxM2ForSequenceClassification,
    token_classification_class=MiniMaxM2ForTokenClassification,
    inference_class=MiniMaxM2ForCausalLMInference,
    shapes=(Shape("minimax_m2", tiny_config, published_configs=("minimax-m2-default.json",)),),
    hf_causal_lm_class="transformers.MiniMaxM2ForCausalLM",
    init_for_conformance=randomize_router_bias,
    checkpoint_conversions=True,  # hub checkpoints store one tensor per expert
    min_transformers="5.18",  # the first release whose stock config reads the checkpoints' rotary_dim
))

__all__ = ["ARCHITECTURE", "MiniMaxM2ForCausalLM", "MiniMaxM2ForCausalLMInference", "MiniMaxM2Model",
           "MiniMaxM2PreTrainedModel", "MiniMaxM2SparseMoeBlock", "tiny_config"]
