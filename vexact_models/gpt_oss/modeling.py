"""GPT-OSS with one forward for training and rollouts.

HF's ``modeling_gpt_oss`` module tree, parameter names and shapes: attention with q/k/v/o biases,
one learned sink logit per query head (``self_attn.sinks``, joining each row's softmax
denominator) and a sliding window of ``config.sliding_window`` keys on the ``"sliding_attention"``
layers of ``config.layer_types`` (docs/design.md section 3: the contexts' ``window=`` and
``sinks=``); YaRN RoPE (`layers.RopeTables`, HF's init functions); a MoE on every layer whose
router has a bias (``mlp.router.weight [E, H]``, ``mlp.router.bias [E]``) and whose experts keep
HF's layout, ``mlp.experts.gate_up_proj [E, H, 2I]`` (gate and up columns interleaved) with
``gate_up_proj_bias [E, 2I]``, ``down_proj [E, I, H]`` with ``down_proj_bias [E, H]``, run by
`kernels.fused_moe` in its GPT-OSS form (the transposed views, the biases, the clamped SwiGLU:
`kernels.moe_activation`).

Routing: stock takes the top-k router logits and a softmax over those k values. That is the
softmax over all experts renormalised over the selected ones (`kernels.softmax_topk` with
``norm_topk_prob``), which this model runs: the same experts (ties to the lowest index) and the
same weights up to fp32 rounding; the weights stay fp32 into the combine (stock rounds them to
the model dtype). Published GPT-OSS checkpoints store the experts in MXFP4; `vexact_models.mxfp4` says how they
load.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, GptOssConfig, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast

from vexact_models.adapters import apply_linear
from vexact_models.kernels import SwigluClamp, fused_moe, linear, softmax_topk
from vexact_models.experts import call_experts, expert_loras
from vexact_models.layers import PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of, layer_window

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin


class GptOssRMSNorm(RMSNorm):
    pass


class GptOssAttention(nn.Module):
    """Biased q/k/v/o projections, RoPE, sinks and the layer's sliding window."""

    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = layer_window(config, layer_idx)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.sinks = nn.Parameter(torch.empty(config.num_attention_heads))

    def init_random(self, std: float) -> None:
        """HF's init of the sinks (called by `InitHookMixin`)."""
        nn.init.normal_(self.sinks, 0.0, std)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling,
                                    window=self.sliding_window, sinks=self.sinks)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class GptOssTopKRouter(nn.Module):
    """Router logits ``hidden @ weight.T + bias`` in the model dtype, then the top-k softmax
    weights (module docstring)."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_local_experts
        self.weight = nn.Parameter(torch.zeros(config.num_local_experts, config.hidden_size))
        self.bias = nn.Parameter(torch.zeros(config.num_local_experts))

    def init_random(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        nn.init.normal_(self.bias, 0.0, std)

    def forward(self, hidden: torch.Tensor):
        logits = linear(hidden, self.weight, self.bias)
        weights, ids = softmax_topk(logits, self.top_k, True)
        return logits, weights, ids


class GptOssExperts(nn.Module):
    """The experts in HF's layout (module docstring), through `kernels.fused_moe`'s GPT-OSS form."""

    is_transposed = True  # ``[E, in, out]``, as HF's: PEFT's target_parameters adapters take HF's shapes

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        experts, hidden, inter = config.num_local_experts, config.hidden_size, config.intermediate_size
        self.num_experts = experts
        self.gate_up_proj = nn.Parameter(torch.empty(experts, hidden, 2 * inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, inter, hidden))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))
        self.clamp = SwigluClamp(alpha=float(config.swiglu_alpha), limit=float(config.swiglu_limit))

    def init_random(self, std: float) -> None:
        """HF's init: normal weights, zero biases (called by `InitHookMixin`)."""
        nn.init.normal_(self.gate_up_proj, 0.0, std)
        nn.init.normal_(self.down_proj, 0.0, std)
        nn.init.zeros_(self.gate_up_proj_bias)
        nn.init.zeros_(self.down_proj_bias)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                adapters: dict | None = None) -> torch.Tensor:
        """The routed experts' output, with the LoRA `adapters` of its tensors (`call_experts`)."""
        return fused_moe(hidden, self.gate_up_proj.transpose(1, 2), self.down_proj.transpose(1, 2), topk_weights,
                         topk_ids, gate_up_bias=self.gate_up_proj_bias, down_bias=self.down_proj_bias,
                         clamp=self.clamp, interleaved=True, **expert_loras(adapters, type(self).__name__))


class GptOssMLP(nn.Module):
    routes = True  # takes the router-logits list (see PreNormDecoderLayer)

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__()
        self.router = GptOssTopKRouter(config)
        self.experts = GptOssExperts(config)

    def forward(self, hidden: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        logits, weights, ids = self.router(hidden)
        if router_logits is not None:
            router_logits.append(logits)  # stock records the router's full logits
        return call_experts(self.experts, hidden, ids, weights)


class GptOssDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: GptOssConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GptOssPreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = GptOssConfig
    config: GptOssConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["GptOssDecoderLayer"]


class GptOssModel(DecoderModelMixin, GptOssPreTrainedModel):
    """The decoder stack (HF's ``GptOssModel``)."""

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, GptOssDecoderLayer, GptOssRMSNorm)
        self.post_init()


class GptOssForCausalLM(CausalLMMixin, GptOssPreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``GptOssForCausalLM`` plus `token_logprobs`; with
    ``output_router_logits`` HF's router logits and load-balancing ``aux_loss``."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: GptOssConfig) -> None:
        super().__init__(config)
        self.model = GptOssModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                logits_to_keep: int | torch.Tensor = 0, output_router_logits: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> MoeCausalLMOutputWithPast:
        """HF's forward (`CausalLMMixin._moe_forward`: router logits and aux loss when asked)."""
        return self._moe_forward(input_ids, attention_mask, position_ids, labels, cu_seqlens, logits_to_keep,
                                 output_router_logits, inputs_embeds=inputs_embeds, **kwargs)


class GptOssForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = GptOssForCausalLM


class GptOssForSequenceClassification(SequenceClassificationMixin, GptOssPreTrainedModel):
    """Reward model head: HF's ``GptOssForSequenceClassification`` over our `GptOssModel`."""

    base_model_class = GptOssModel


class GptOssForTokenClassification(TokenClassificationMixin, GptOssPreTrainedModel):
    """Per-token head: HF's ``GptOssForTokenClassification`` over our `GptOssModel`."""

    base_model_class = GptOssModel
