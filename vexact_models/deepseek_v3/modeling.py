"""DeepSeek-V3 (MLA attention, DeepSeekMoE) with one forward for training and rollouts.

HF's ``modeling_deepseek_v3`` module tree and parameter names, so stock checkpoints load and
save as they are (Moonlight-16B-A3B ships the same ``model_type``). Everything runs through
`vexact_models.kernels`:

- Multi-head latent attention: ``q_proj`` (or the q-LoRA ``q_a_proj`` -> ``q_a_layernorm`` ->
  ``q_b_proj``), ``kv_a_proj_with_mqa`` -> latent (``kv_a_layernorm``, ``kv_b_proj``) + one
  shared RoPE key. The query/key head dim (nope + rope, 192) differs from the value head dim
  (128); the attention kernel takes both. ``config.mla_kv_cache`` picks what the KV cache holds
  (docs/mla-kv-cache.md), always what training attends over (docs/design.md rule 6):
  ``"expanded"`` (the default) the per-head K and V; ``"latent"`` the normalised latent plus the
  rope key, with ``kv_b_proj`` absorbed on both paths (`latent_attention`).
- RoPE on the rope dims only, from one fp32 table (YaRN for DeepSeek-V3); DeepSeek's
  interleaved rope layout (``rope_interleave``) is de-interleaved first, which is HF's math.
  With YaRN, the softmax scale carries ``mscale**2`` as in HF.
- DeepSeekMoE: sigmoid scores, ``e_score_correction_bias`` for selection only, group-limited
  top-k (`kernels.grouped_topk`), ``routed_scaling_factor``, shared experts added to the routed
  output, the first ``first_k_dense_replace`` layers dense. The router's fp32 logits come from
  `kernels.linear` over the weight as stored, accumulating in fp32 (no fp32 weight copy).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import DeepseekV3Config, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as stock

from vexact_models.adapters import apply_linear
from vexact_models.kernels import apply_rotary, deinterleave, linear, sigmoid_grouped_topk
from vexact_models.experts import FusedExperts, call_experts
from vexact_models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, grouped_linear
from vexact_models.side_stream import beside

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from .latent_attention import KVCacheSpec, check_mla_kv_cache, expanded_cache_check, latent_attention, mla_kv_cache_mode


class DeepseekV3RMSNorm(RMSNorm):
    pass


def rope_parameters(config) -> dict:
    """The config's RoPE parameters (``rope_parameters``, or the older ``rope_scaling``)."""
    return dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})


def mla_softmax_scale(config) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim) ** 2`` when the
    RoPE is scaled (DeepSeek-V3's long-context attention temperature, as HF computes it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if rope_type != "default" and mscale_all_dim:
        factor = float(params["factor"])
        mscale = 1.0 if factor <= 1 else 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class DeepseekV3Attention(nn.Module):
    """Multi-head latent attention over expanded per-head K (nope + rope) and V, or (``config.
    mla_kv_cache == "latent"``) in absorbed form over the latent (`latent_attention`)."""

    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        mla_kv_cache_mode(config)  # a bad value fails at construction, naming it
        self.config = config  # the mode is read at each forward: set_mla_kv_cache switches it
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        if config.num_key_value_heads != config.num_attention_heads:
            raise ValueError(f"DeepseekV3Attention: num_key_value_heads={config.num_key_value_heads} must equal "
                             f"num_attention_heads={config.num_attention_heads} (MLA expands K/V per head)")
        self.q_lora_rank = config.q_lora_rank
        self.kv_lora_rank = config.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.interleaved = bool(getattr(config, "rope_interleave", True))
        self.scaling = mla_softmax_scale(config)
        bias, hidden = config.attention_bias, config.hidden_size
        if self.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, self.num_heads * self.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = DeepseekV3RMSNorm(self.q_lora_rank)
            self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = DeepseekV3RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, hidden, bias=bias)

    def projection_groups(self) -> list[list[nn.Linear]]:
        """The query's first projection and ``kv_a_proj_with_mqa`` both read the hidden state."""
        return [[self.q_proj if self.q_lora_rank is None else self.q_a_proj, self.kv_a_proj_with_mqa]]

    def _query(self, q: torch.Tensor) -> torch.Tensor:
        """``[T, heads, qk_head_dim]`` from the first projection's output (q itself, or the q-LoRA latent)."""
        if self.q_lora_rank is not None:
            q = apply_linear(self.q_a_layernorm(q), self.q_b_proj)
        return q.view(q.shape[0], self.num_heads, self.qk_head_dim)

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor, rope) -> torch.Tensor:
        cos, sin = rope
        return apply_rotary(deinterleave(x) if self.interleaved else x, positions, cos, sin)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        q, compressed = grouped_linear(hidden, self.projection_groups()[0])
        q = self._query(q)
        if mla_kv_cache_mode(self.config) == "latent":
            out = latent_attention(self, q, compressed, positions, rope, context)
        else:
            out = self._expanded(q, compressed, positions, rope, context)
        return apply_linear(out.reshape(hidden.shape[0], -1), self.o_proj)

    def normed_and_rotated(self, q: torch.Tensor, compressed: torch.Tensor, positions: torch.Tensor,
                           rope: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_rot [T, H, rope], c [T, kv_lora_rank], k_rot [T, 1, rope])`` from the queries
        ``[T, H, qk_head_dim]`` and ``kv_a_proj_with_mqa``'s output ``[T, kv_lora_rank + rope]``:
        the rotated rope query, the normed latent and the rotated rope key."""
        latent, k_pe = compressed.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(latent.contiguous())
        q_rot = self._rotate(q[..., self.nope_dim:], positions, rope)
        k_rot = self._rotate(k_pe.reshape(compressed.shape[0], 1, self.rope_dim), positions, rope)
        return q_rot, c, k_rot

    def _expanded(self, q, compressed, positions, rope, context) -> torch.Tensor:
        """Attention over the per-head K (nope + rope) and V that ``kv_b_proj`` expands from the
        normed latent."""
        expanded_cache_check(context, self)
        q_rot, c, k_rot = self.normed_and_rotated(q, compressed, positions, rope)
        q_nope = q[..., :self.nope_dim]
        tokens = c.shape[0]
        kv = apply_linear(c, self.kv_b_proj)
        k_nope, v = kv.view(tokens, self.num_heads, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        # every head's key shares the one rotated rope key (MQA-style); the cache stores it per head
        q = torch.cat([q_nope, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(tokens, self.num_heads, self.rope_dim)], dim=-1)
        return context.attend(self.layer_idx, q, k, v.contiguous(), self.scaling)


class DeepseekV3MLP(GatedMLP):
    def __init__(self, config: DeepseekV3Config, intermediate_size: int | None = None) -> None:
        super().__init__(config.hidden_size, intermediate_size or config.intermediate_size, config.hidden_act)


class DeepseekV3Experts(FusedExperts):
    """The routed experts as HF stores them: fused 3-D weight tensors."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)


#: what stays fp32 whatever dtype the model is built or loaded in, as the installed transformers
#: keeps it (the correction bias; the router's weight too in releases after 5.17, e.g. 5.24)
def stock_keep_in_fp32(stock_class: type) -> list[str]:
    """What `stock_class` (a transformers ``PreTrainedModel``) keeps in fp32 whatever the dtype,
    the correction bias at least (releases without the attribute keep it so too)."""
    return list(getattr(stock_class, "_keep_in_fp32_modules_strict", None) or ["e_score_correction_bias"])


KEEP_IN_FP32 = stock_keep_in_fp32(stock.DeepseekV3PreTrainedModel)


class DeepseekV3TopkRouter(nn.Module):
    """Router: fp32 logits (as HF), sigmoid scores, bias-corrected group-limited top-k."""

    #: the weight made fp32 here where stock keeps it fp32, so that `from_config` keeps it too
    fp32_weight = "gate.weight" in KEEP_IN_FP32

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size,
                                               dtype=torch.float32 if self.fp32_weight else None))
        self.register_buffer("e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32))

    def init_random(self, std: float) -> None:
        nn.init.normal_(self.weight, 0.0, std)
        nn.init.zeros_(self.e_score_correction_bias)

    def forward(self, hidden: torch.Tensor):
        # fp32 logits straight from the stored weight: `linear` accumulates in fp32 and the
        # products of bf16 values are exact, so no fp32 copy of the weight is made (or cached,
        # which FSDP2's all-gathers and `.data` writes could leave stale) and none is cast per forward
        weight = self.weight
        if weight.dtype != hidden.dtype:  # e.g. a router kept in fp32: compute in the wider dtype, as HF does
            wide = torch.promote_types(weight.dtype, hidden.dtype)
            hidden, weight = hidden.to(wide), weight.to(wide)
        logits = linear(hidden, weight, out_dtype=torch.float32)
        weights, ids = sigmoid_grouped_topk(logits, self.e_score_correction_bias, self.top_k, self.n_group,
                                            self.topk_group, self.norm_topk_prob, self.routed_scaling_factor)
        return logits, weights, ids


class DeepseekV3MoE(nn.Module):
    """Routed experts plus the always-on shared experts (one MLP of ``n_shared_experts`` width)."""

    routes = True  # takes the router-logits list (see PreNormDecoderLayer)
    router_class = DeepseekV3TopkRouter  # (GLM-4.5's keeps its weight in fp32 by its own stock's rule)

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__()
        self.experts = DeepseekV3Experts(config)
        self.gate = self.router_class(config)
        self.shared_experts = DeepseekV3MLP(config, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, hidden: torch.Tensor, router_logits: list | None = None) -> torch.Tensor:
        # in CUDA-graph captures without autograd the shared experts run on a side stream beside
        # the router and the routed experts (`side_stream.beside`: the same bits, ~7% of a decode
        # layer's time)
        shared, shared_ready = beside(self.shared_experts, hidden)
        logits, weights, ids = self.gate(hidden)
        if router_logits is not None:
            router_logits.append(logits)
        # the shared experts' output is added inside the routed experts' combine kernel (rollouts):
        # bitwise the plain sum, one launch fewer per layer
        return call_experts(self.experts, hidden, ids, weights, add=shared, add_ready=shared_ready)


class DeepseekV3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: DeepseekV3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DeepseekV3Attention(config, layer_idx)
        self.mlp = DeepseekV3MoE(config) if layer_idx >= config.first_k_dense_replace else DeepseekV3MLP(config)
        self.input_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DeepseekV3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class DeepseekV3PreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = DeepseekV3Config
    config: DeepseekV3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _keep_in_fp32_modules_strict = KEEP_IN_FP32
    # DeepSeek-V3's multi-token-prediction layer (layer 61) is not part of the causal LM
    _keys_to_ignore_on_load_unexpected = [r"model\.layers\.61.*"]

    @classmethod
    def from_pretrained(cls, *args, mla_kv_cache: str | None = None, **kwargs):
        """HF ``from_pretrained``; ``mla_kv_cache="latent" | "expanded"`` overrides the
        checkpoint config's MLA KV cache mode (docs/mla-kv-cache.md)."""
        if mla_kv_cache is not None:
            check_mla_kv_cache(mla_kv_cache)  # before anything is loaded
        model = super().from_pretrained(*args, **kwargs)
        if mla_kv_cache is not None:
            (model[0] if isinstance(model, tuple) else model).set_mla_kv_cache(mla_kv_cache)
        return model

    def set_mla_kv_cache(self, mode: str) -> None:
        """Switch the MLA KV cache mode (``"expanded"`` or ``"latent"``): a compute choice over
        the same parameters, saved with the config. A rollout engine built before the switch
        keeps a cache of the old layout and refuses to run (create a new ``LLM``)."""
        self.config.mla_kv_cache = check_mla_kv_cache(mode)


class DeepseekV3Model(DecoderModelMixin, DeepseekV3PreTrainedModel):
    """The decoder stack (HF's ``DeepseekV3Model``); RoPE tables span the rope dims only."""

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, rope_dim=config.qk_rope_head_dim)
        self.post_init()


class DeepseekV3ForCausalLM(CausalLMMixin, DeepseekV3PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``DeepseekV3ForCausalLM`` plus `token_logprobs`.

    With ``output_router_logits`` the output carries each MoE layer's fp32 router logits over
    the non-padding tokens (DeepSeek-V3 balances experts through ``e_score_correction_bias``,
    not an auxiliary loss, so there is no ``aux_loss``).
    """

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: DeepseekV3Config) -> None:
        super().__init__(config)
        self.model = DeepseekV3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, labels=None, cu_seqlens=None,
                logits_to_keep: int | torch.Tensor = 0, output_router_logits: bool | None = None,
                inputs_embeds: torch.Tensor | None = None, **kwargs) -> MoeCausalLMOutputWithPast:
        router = self._router_logits_list(output_router_logits)
        out = self._causal_lm_output(MoeCausalLMOutputWithPast, input_ids, attention_mask, position_ids, labels,
                                     cu_seqlens, logits_to_keep, router_logits=router, inputs_embeds=inputs_embeds,
                                     **kwargs)
        out.router_logits = None if router is None else tuple(router)
        return self._as_requested(out, kwargs.get("return_dict"))

    def kv_cache_spec(self) -> KVCacheSpec:
        """(layers, KV heads, key dim, value dim) of the mode's cache (``config.mla_kv_cache``).

        ``"expanded"``: (layers, heads, qk_nope + qk_rope, v), the per-head K and V: ``heads *
        (nope + rope + v) * dtype bytes`` per token and layer, 80 KiB for DeepSeek-V3 in bf16
        (4.8 MiB over 61 layers) and 10 KiB for Moonlight (270 KiB over 27 layers).
        ``"latent"``: (layers, 1, kv_lora_rank + qk_rope, kv_lora_rank) with ``value_in_key``
        (the value is a view of the key's first dims): 576 * 2 = 1,152 bytes per token and layer
        (70,272 over DeepSeek-V3's 61 layers, 31,104 over Moonlight's 27).
        """
        cfg = self.config
        if mla_kv_cache_mode(cfg) == "latent":
            return KVCacheSpec(cfg.num_hidden_layers, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank,
                               value_in_key=True)
        return KVCacheSpec(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim,
                           cfg.v_head_dim)


class DeepseekV3ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = DeepseekV3ForCausalLM


class DeepseekV3ForSequenceClassification(SequenceClassificationMixin, DeepseekV3PreTrainedModel):
    """Reward model head: HF's ``DeepseekV3ForSequenceClassification`` over our `DeepseekV3Model`."""

    base_model_class = DeepseekV3Model


class DeepseekV3ForTokenClassification(TokenClassificationMixin, DeepseekV3PreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``DeepseekV3ForTokenClassification`` over our `DeepseekV3Model`."""

    base_model_class = DeepseekV3Model
