"""MiniMax-M2 (``minimax_m2``, HF's ``MiniMaxM2ForCausalLM``) with one forward for training and
rollouts.

HF's ``modeling_minimax_m2`` module tree and parameter names, so stock checkpoints load and save as
they are (the hub's, which store one tensor per expert under ``block_sparse_moe``, through
transformers' conversion). Stock builds it from Mixtral with two changes, and so does this file:

- attention: GQA without biases, q/k RMSNorms over the whole projections (every head's dims at
  once, as OLMo's), RoPE on the first ``partial_rotary_factor`` of each head's dims (the released
  checkpoints' ``rotary_dim``, which transformers reads as that factor from 5.18: the floor this
  architecture registers at; `layers.RopeTables` reads the factor, the kernels copy the other dims);
- every layer's MLP a sparse MoE block (``mlp``): the router's logits in the model dtype (as
  stock's, from its own weight), sigmoid scores, ``mlp.e_score_correction_bias`` added for the
  choice only (a buffer of the block, not of the router), top-k of the biased scores, the picked
  scores renormalised; fused 3-D expert tensors; no shared experts, no dense layers.

With ``output_router_logits`` the forward returns each layer's router logits and Mixtral's
load-balancing ``aux_loss``, as stock's does.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, MiniMaxM2Config, PreTrainedModel

from vexact_models.adapters import apply_linear
from vexact_models.experts import FusedExperts, call_experts
from vexact_models.kernels import linear, sigmoid_grouped_topk
from vexact_models.layers import PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from ..inference_model import InferenceModel
from ..qwen3_moe.modeling import Qwen3MoeForCausalLM


class MiniMaxM2RMSNorm(RMSNorm):
    pass


class MiniMaxM2Attention(nn.Module):
    """HF's ``MiniMaxM2Attention``: unbiased q/k/v/o, q_norm / k_norm over the whole projections,
    then partial RoPE and attention."""

    def __init__(self, config: MiniMaxM2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.q_norm = MiniMaxM2RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = MiniMaxM2RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = self.q_norm(q).view(tokens, self.num_heads, self.head_dim)  # the norms see every head's dims
        k = self.k_norm(k).view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class MiniMaxM2Experts(FusedExperts):
    """The routed experts as HF stores them: fused 3-D weight tensors of ``intermediate_size``."""

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__(config.num_local_experts, config.hidden_size, config.intermediate_size)


class MiniMaxM2TopKRouter(nn.Module):
    """Router: logits in the weight's dtype (as HF: a bf16 model's are bf16), sigmoid scores, the
    block's correction bias added for the choice, top-k, the picked scores renormalised."""

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.zeros(config.num_local_experts, config.hidden_size))

    def init_random(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)

    def forward(self, hidden: torch.Tensor, e_score_correction_bias: torch.Tensor):
        logits = linear(hidden.to(self.weight.dtype), self.weight)
        # one group (all experts), scale 1: the plain biased top-k (which widens the logits to fp32 as it reads them)
        weights, ids = sigmoid_grouped_topk(logits, e_score_correction_bias, self.top_k, 1, 1, True, 1.0)
        return logits, weights, ids


class MiniMaxM2SparseMoeBlock(nn.Module):
    """HF's ``MiniMaxM2SparseMoeBlock``: the router, the experts and the correction bias."""

    routes = True  # takes the router-logits list (see PreNormDecoderLayer)

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        if config.router_jitter_noise:
            raise ValueError(f"MiniMaxM2Config: router_jitter_noise={config.router_jitter_noise} is not supported "
                             "by vexact-models (training noise on the router's input would make the training "
                             "forward differ from the rollout's); set it to 0")
        self.gate = MiniMaxM2TopKRouter(config)
        self.experts = MiniMaxM2Experts(config)
        self.register_buffer("e_score_correction_bias", torch.zeros(config.num_local_experts))

    def init_random(self, std: float) -> None:
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, hidden: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        logits, weights, ids = self.gate(hidden, self.e_score_correction_bias)
        if router_logits is not None:
            router_logits.append(logits)
        return call_experts(self.experts, hidden, ids, weights)


class MiniMaxM2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: MiniMaxM2Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = MiniMaxM2Attention(config, layer_idx)
        self.mlp = MiniMaxM2SparseMoeBlock(config)
        self.input_layernorm = MiniMaxM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = MiniMaxM2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class MiniMaxM2PreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = MiniMaxM2Config
    config: MiniMaxM2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["MiniMaxM2DecoderLayer"]


class MiniMaxM2Model(DecoderModelMixin, MiniMaxM2PreTrainedModel):
    """The decoder stack (HF's ``MiniMaxM2Model``)."""

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, MiniMaxM2DecoderLayer, MiniMaxM2RMSNorm)
        self.post_init()


class MiniMaxM2ForCausalLM(CausalLMMixin, MiniMaxM2PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``MiniMaxM2ForCausalLM`` plus `token_logprobs`.

    With ``output_router_logits`` the output carries each layer's router logits over the
    non-padding tokens and HF's load-balancing ``aux_loss`` (added to ``loss`` times
    ``router_aux_loss_coef`` when ``labels`` are given).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__(config)
        self.model = MiniMaxM2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    forward = Qwen3MoeForCausalLM.forward  # Qwen3-MoE's: router logits and aux loss when asked, as stock's


class MiniMaxM2ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = MiniMaxM2ForCausalLM


class MiniMaxM2ForSequenceClassification(SequenceClassificationMixin, MiniMaxM2PreTrainedModel):
    """Reward model head over our `MiniMaxM2Model` (stock transformers has none for MiniMax-M2)."""

    base_model_class = MiniMaxM2Model


class MiniMaxM2ForTokenClassification(TokenClassificationMixin, MiniMaxM2PreTrainedModel):
    """Per-token head (PPO critics' values) over our `MiniMaxM2Model` (stock has none)."""

    base_model_class = MiniMaxM2Model
