"""Qwen3-MoE with one forward for training and rollouts.

HF's ``modeling_qwen3_moe`` module tree and parameter names (experts as fused 3-D tensors
``mlp.experts.gate_up_proj [E, 2I, H]`` / ``mlp.experts.down_proj [E, H, I]``, router
``mlp.gate.weight [E, H]``); attention is Qwen3's. The routed experts run through
`kernels.fused_moe` (batch-invariant), the router through `kernels.softmax_topk`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen3MoeConfig
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from vexact_models.kernels import linear, softmax_topk
from vexact_models.experts import FusedExperts, call_experts
from vexact_models.layers import PreNormDecoderLayer, RMSNorm
from vexact_models.patches.compat import qwen3_moe_router_output

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from ..qwen3.modeling import Qwen3Attention, Qwen3MLP


class Qwen3MoeRMSNorm(RMSNorm):
    pass


class Qwen3MoeExperts(FusedExperts):
    """The routed experts as HF stores them: fused 3-D weight tensors."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__(config.num_experts, config.hidden_size, config.moe_intermediate_size)


class Qwen3MoeTopKRouter(nn.Module):
    """Router: logits in the model dtype (as HF), fp32 softmax, top-k, optional renormalisation."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))

    def init_random(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, hidden: torch.Tensor):
        logits = linear(hidden, self.weight)
        weights, ids = softmax_topk(logits, self.top_k, self.norm_topk_prob)
        return logits, weights, ids


class Qwen3MoeSparseMoeBlock(nn.Module):
    routes = True  # takes the router-logits list (see PreNormDecoderLayer)

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.experts = Qwen3MoeExperts(config)
        self.gate = Qwen3MoeTopKRouter(config)

    def forward(self, hidden: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        logits, weights, ids = self.gate(hidden)
        if router_logits is not None:
            router_logits.append(qwen3_moe_router_output(logits))  # stock's router_logits on this transformers
        return call_experts(self.experts, hidden, ids, weights)


class Qwen3MoeDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Qwen3MoeConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        sparse = layer_idx not in config.mlp_only_layers and config.num_experts > 0 \
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        self.mlp = Qwen3MoeSparseMoeBlock(config) if sparse else Qwen3MLP(config)
        self.input_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3MoeRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3MoePreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = Qwen3MoeConfig
    config: Qwen3MoeConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3MoeDecoderLayer"]


class Qwen3MoeModel(DecoderModelMixin, Qwen3MoePreTrainedModel):
    """The decoder stack (HF's ``Qwen3MoeModel``)."""

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm)
        self.post_init()


class Qwen3MoeForCausalLM(CausalLMMixin, Qwen3MoePreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen3MoeForCausalLM`` plus `token_logprobs`.

    With ``output_router_logits`` the output carries each MoE layer's router logits over the
    non-padding tokens and HF's load-balancing ``aux_loss`` (added to ``loss`` times
    ``router_aux_loss_coef`` when ``labels`` are given).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__(config)
        self.model = Qwen3MoeModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                logits_to_keep: int | torch.Tensor = 0, output_router_logits: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> MoeCausalLMOutputWithPast:
        """HF's forward (`CausalLMMixin._moe_forward`: router logits and aux loss when asked)."""
        return self._moe_forward(input_ids, attention_mask, position_ids, labels, cu_seqlens, logits_to_keep,
                                 output_router_logits, inputs_embeds=inputs_embeds, **kwargs)


class Qwen3MoeForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Qwen3MoeForCausalLM


class Qwen3MoeForSequenceClassification(SequenceClassificationMixin, Qwen3MoePreTrainedModel):
    """Reward model head: HF's ``Qwen3MoeForSequenceClassification`` over our `Qwen3MoeModel`."""

    base_model_class = Qwen3MoeModel


class Qwen3MoeForTokenClassification(TokenClassificationMixin, Qwen3MoePreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``Qwen3MoeForTokenClassification`` over our `Qwen3MoeModel`."""

    base_model_class = Qwen3MoeModel
