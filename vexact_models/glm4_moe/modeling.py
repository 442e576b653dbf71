"""GLM-4.5 / GLM-4.6 (``glm4_moe``, HF's ``Glm4MoeForCausalLM``) with one forward for training and
rollouts.

HF's ``modeling_glm4_moe`` module tree and parameter names, so stock checkpoints load and save as
they are (the hub's, which store one tensor per expert, through transformers' conversion). HF
builds it from DeepSeek-V3's model with another attention, and so does this file:

- GQA attention with biases on q/k/v (``attention_bias``; never on o), per-head q/k RMSNorms when
  ``use_qk_norm`` (GLM-4.5 and 4.6 set it), RoPE on the first ``partial_rotary_factor`` (0.5) of
  each head's dims (`layers.RopeTables` reads the factor; the kernels copy the other dims).
- DeepSeekMoE, DeepSeek-V3's modules (`vexact_models.deepseek_v3.modeling`): sigmoid scores,
  ``e_score_correction_bias`` for selection only, group-limited top-k, ``routed_scaling_factor``,
  shared experts, the first ``first_k_dense_replace`` layers dense. The router's weight is fp32
  where the installed transformers keeps GLM's fp32 (`KEEP_IN_FP32`).
- The multi-token-prediction layer the hub checkpoints append (``num_nextn_predict_layers``) is
  left out on load, as stock leaves it.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Glm4MoeConfig, GenerationMixin, PreTrainedModel
from transformers.models.glm4_moe import modeling_glm4_moe as stock

from vexact_models.adapters import apply_linear
from vexact_models.causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from vexact_models.deepseek_v3.modeling import (DeepseekV3ForCausalLM, DeepseekV3MLP, DeepseekV3MoE,
                                                 DeepseekV3TopkRouter, stock_keep_in_fp32)
from vexact_models.heads import SequenceClassificationMixin, TokenClassificationMixin
from vexact_models.inference_model import InferenceModel
from vexact_models.layers import PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of

#: what stays fp32 whatever dtype the model is built or loaded in, as the installed transformers
#: keeps it for GLM (the correction bias; the router's weight too in its newer releases)
KEEP_IN_FP32 = stock_keep_in_fp32(stock.Glm4MoePreTrainedModel)


class Glm4MoeRMSNorm(RMSNorm):
    pass


class Glm4MoeAttention(nn.Module):
    """HF's ``Glm4MoeAttention``: q/k/v (biased with ``attention_bias``), per-head q/k norms when
    ``use_qk_norm``, partial RoPE, attention, an unbiased o_proj."""

    def __init__(self, config: Glm4MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.use_qk_norm = config.use_qk_norm
        if self.use_qk_norm:
            self.q_norm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = Glm4MoeRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.use_qk_norm else (None, None)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling, *norms)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class Glm4MoeMLP(DeepseekV3MLP):
    pass


class Glm4MoeTopkRouter(DeepseekV3TopkRouter):
    fp32_weight = "gate.weight" in KEEP_IN_FP32


class Glm4MoeMoE(DeepseekV3MoE):
    """Routed experts plus the always-on shared experts (DeepSeek-V3's block, GLM's router)."""

    router_class = Glm4MoeTopkRouter


class Glm4MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Glm4MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Glm4MoeAttention(config, layer_idx)
        self.mlp = Glm4MoeMoE(config) if layer_idx >= config.first_k_dense_replace else Glm4MoeMLP(config)
        self.input_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Glm4MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Glm4MoePreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = Glm4MoeConfig
    config: Glm4MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Glm4MoeDecoderLayer"]
    _keep_in_fp32_modules_strict = KEEP_IN_FP32
    # the multi-token-prediction layer of the hub checkpoints (GLM-4.5: layer 92; GLM-4.5-Air: 46)
    _keys_to_ignore_on_load_unexpected = list(getattr(stock.Glm4MoePreTrainedModel,
                                                      "_keys_to_ignore_on_load_unexpected", None) or [])


class Glm4MoeModel(DecoderModelMixin, Glm4MoePreTrainedModel):
    """The decoder stack (HF's ``Glm4MoeModel``)."""

    def __init__(self, config: Glm4MoeConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Glm4MoeDecoderLayer, Glm4MoeRMSNorm)
        self.post_init()


class Glm4MoeForCausalLM(CausalLMMixin, Glm4MoePreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Glm4MoeForCausalLM`` plus `token_logprobs`. With
    ``output_router_logits`` the output carries each MoE layer's fp32 router logits over the
    non-padding tokens (GLM balances experts through ``e_score_correction_bias``, as DeepSeek-V3
    does: no ``aux_loss``)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Glm4MoeConfig) -> None:
        super().__init__(config)
        self.model = Glm4MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    forward = DeepseekV3ForCausalLM.forward  # DeepSeek-V3's: the router logits when asked, no aux_loss


class Glm4MoeForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Glm4MoeForCausalLM


class Glm4MoeForSequenceClassification(SequenceClassificationMixin, Glm4MoePreTrainedModel):
    """Reward model head over our `Glm4MoeModel` (stock transformers has none for GLM-4.5)."""

    base_model_class = Glm4MoeModel


class Glm4MoeForTokenClassification(TokenClassificationMixin, Glm4MoePreTrainedModel):
    """Per-token head (PPO critics' values) over our `Glm4MoeModel` (stock has none)."""

    base_model_class = Glm4MoeModel
