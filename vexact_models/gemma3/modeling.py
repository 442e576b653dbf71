"""Gemma 3's text model (``gemma3_text``, ``Gemma3ForCausalLM``) with one forward for training
and rollouts.

HF's ``modeling_gemma3`` module tree and parameter names: local layers attending over a sliding
window of ``config.sliding_window`` keys and global layers (``config.layer_types``), each kind
with its own RoPE (``config.rope_parameters[layer_type]``: base and scaling; `LayerTypeRope`),
q/k norms, four norms a layer (pre- and post-norms around attention and MLP), all of them
Gemma's ``x * (1 + w)`` RMSNorm (`kernels.rms_norm` with ``zero_centred``), the GeGLU MLP
(`kernels.gelu_tanh_and_mul`), embeddings scaled by ``sqrt(hidden_size)`` rounded to the model
dtype as stock does, and the attention scale ``query_pre_attn_scalar ** -0.5``.

``final_logit_softcapping`` (None in transformers' default and the published Gemma 3 configs;
a value caps the LM head's logits at ``cap * tanh(logits / cap)`` as stock's ``Gemma3ForCausalLM``
does) is applied by `causal_lm.CausalLMMixin.final_logits`, on every path that computes logits:
the training forward, `token_logprobs` and the rollout's sampler (`kernels.logit_softcap`).
``attn_logit_softcapping`` is read by stock's Gemma 3 attention but not applied (its attention
call passes no ``softcap``, in every attention implementation), so neither is it here: a config
setting it gives stock's logits (tests/models/test_sliding_window_models.py checks that stock
ignores it). Not taken: ``use_bidirectional_attention``. The text model of the published
multimodal checkpoints (Gemma 3 4B, 12B, 27B: ``Gemma3ForConditionalGeneration``) loads too
(`vexact_models.multimodal`).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import Gemma3TextConfig, GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from vexact_models.adapters import apply_linear
from vexact_models.layer_type_rope import LayerTypeRope
from vexact_models.layers import GatedMLP, ZeroCentredRMSNorm, add_and_norm, grouped_linear, head_dim_of, layer_window

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin, final_logit_softcap
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin


class Gemma3RMSNorm(ZeroCentredRMSNorm):
    pass  # Gemma's x * (1 + w), one rounding, initialised to zeros


class Gemma3TextScaledWordEmbedding(nn.Embedding):
    """HF's scaled embedding: rows times ``sqrt(hidden_size)`` rounded to the weight's dtype
    (stock multiplies by that scale as a 0-dim tensor of the model dtype: the same bits)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, embed_scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scalar_embed_scale = float(embed_scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scalar_embed_scale).to(self.weight.dtype).item()
        return super().forward(input_ids) * scale


class Gemma3Attention(nn.Module):
    def __init__(self, config: Gemma3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = layer_window(config, layer_idx)
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = config.query_pre_attn_scalar ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Gemma3RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: dict, context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope[self.layer_type], self.scaling,
                                    self.q_norm, self.k_norm, window=self.sliding_window)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class Gemma3MLP(GatedMLP):
    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_activation)


class Gemma3DecoderLayer(GradientCheckpointingLayer):
    """Gemma's sandwich layer: ``h + post_attn(attn(input_norm(h)))``, then ``h +
    post_ff(mlp(pre_ff(h)))``; each residual add fused into the norm after it (as
    `layers.PreNormDecoderLayer`), the post-norms plain."""

    def __init__(self, config: Gemma3TextConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = Gemma3RMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = Gemma3RMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = Gemma3RMSNorm(config.hidden_size, eps=eps)

    def forward(self, hidden, residual, positions, rope, context) -> tuple[torch.Tensor, torch.Tensor]:
        normed, residual = add_and_norm(self.input_layernorm, hidden, residual)
        attended = self.post_attention_layernorm(self.self_attn(normed, positions, rope, context))
        normed, residual = self.pre_feedforward_layernorm(attended, residual)
        return self.post_feedforward_layernorm(self.mlp(normed)), residual


def check_config(config: Gemma3TextConfig) -> None:
    """ValueErrors for what this model does not take (module docstring)."""
    final_logit_softcap(config)  # a finite number > 0, or None
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma3: use_bidirectional_attention=True is not supported (causal attention only)")


class Gemma3PreTrainedModel(InitHookMixin, PreTrainedModel):
    config_class = Gemma3TextConfig
    config: Gemma3TextConfig
    base_model_prefix = "model"
    # the multimodal checkpoints' other parts (`vexact_models.multimodal`)
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^multi_modal_projector\.", r"^model\.vision_tower\.",
                                          r"^model\.multi_modal_projector\."]
    supports_gradient_checkpointing = True
    _no_split_modules = ["Gemma3DecoderLayer"]


class Gemma3TextModel(DecoderModelMixin, Gemma3PreTrainedModel):
    """The decoder stack (HF's ``Gemma3TextModel``)."""

    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__(config)
        check_config(config)
        self.init_decoder_stack(config, Gemma3DecoderLayer, Gemma3RMSNorm)
        self.embed_tokens = Gemma3TextScaledWordEmbedding(config.vocab_size, config.hidden_size, config.pad_token_id,
                                                          config.hidden_size ** 0.5)
        self.rope = LayerTypeRope(config, head_dim_of(config))
        self.post_init()


class Gemma3ForCausalLM(CausalLMMixin, Gemma3PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Gemma3ForCausalLM`` (text) plus `token_logprobs`."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Gemma3TextConfig) -> None:
        super().__init__(config)
        self.model = Gemma3TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Gemma3ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Gemma3ForCausalLM


class Gemma3TextForSequenceClassification(SequenceClassificationMixin, Gemma3PreTrainedModel):
    """Reward model head: HF's ``Gemma3TextForSequenceClassification`` over our `Gemma3TextModel`."""

    base_model_class = Gemma3TextModel


class Gemma3TextForTokenClassification(TokenClassificationMixin, Gemma3PreTrainedModel):
    """Per-token head (PPO critics' values) over our `Gemma3TextModel` (stock transformers has
    none for the text config)."""

    base_model_class = Gemma3TextModel
