"""Qwen3 with one forward for training and rollouts.

Same module tree, parameter names and shapes as HF's ``modeling_qwen3`` (so ``from_pretrained``
/ ``save_pretrained`` and ``state_dict`` round-trip with stock checkpoints), computed only with
`vexact_models.kernels` ops. `Qwen3Model.forward_flat` is the single forward; the training
variant (`Qwen3ForCausalLM`) drives it with a packed layout, the inference variant
(`Qwen3ForCausalLMInference`) with a paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen3Config

from vexact_models.adapters import apply_linear
from vexact_models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of, layer_window

from ..causal_lm import CausalLMMixin, DecoderModelMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin


class Qwen3RMSNorm(RMSNorm):
    pass


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
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
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        # None unless use_sliding_window: then the window on the layers HF slides (from
        # max_window_layers on for Qwen3; every layer for Qwen3-MoE, whose config has no layer_types)
        self.sliding_window = layer_window(config, layer_idx)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling, self.q_norm, self.k_norm,
                                    window=self.sliding_window)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class Qwen3MLP(GatedMLP):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class Qwen3DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen3PreTrainedModel(PreTrainedModel):
    config_class = Qwen3Config
    config: Qwen3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3DecoderLayer"]


class Qwen3Model(DecoderModelMixin, Qwen3PreTrainedModel):
    """The decoder stack (HF's ``Qwen3Model``): embeddings, layers, final norm."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen3DecoderLayer, Qwen3RMSNorm)
        self.post_init()


class Qwen3ForCausalLM(CausalLMMixin, Qwen3PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen3ForCausalLM`` (forward, loss, backward,
    ``from_pretrained``/``save_pretrained``) plus `token_logprobs` (see `CausalLMMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        self.model = Qwen3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Qwen3ForCausalLM


class Qwen3ForSequenceClassification(SequenceClassificationMixin, Qwen3PreTrainedModel):
    """Reward model head: HF's ``Qwen3ForSequenceClassification`` over our `Qwen3Model`."""

    base_model_class = Qwen3Model


class Qwen3ForTokenClassification(TokenClassificationMixin, Qwen3PreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``Qwen3ForTokenClassification`` over our `Qwen3Model`."""

    base_model_class = Qwen3Model
