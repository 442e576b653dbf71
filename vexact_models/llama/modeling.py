"""Llama with one forward for training and rollouts.

Same module tree, parameter names and shapes as HF's ``modeling_llama`` (so ``from_pretrained``
/ ``save_pretrained`` and ``state_dict`` round-trip with stock checkpoints), computed only with
`vexact_models.kernels` ops. `LlamaModel.forward_flat` is the single forward; the training
variant (`LlamaForCausalLM`) drives it with a packed layout, the inference variant
(`LlamaForCausalLMInference`) with a paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, LlamaConfig, PreTrainedModel

from vexact_models.adapters import apply_linear
from vexact_models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of, layer_window

from ..causal_lm import CausalLMMixin, DecoderModelMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin


class LlamaRMSNorm(RMSNorm):
    pass


class LlamaAttention(nn.Module):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        self.sliding_window = layer_window(config, layer_idx)  # None for Llama; a copy's (Mistral's) window
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling, window=self.sliding_window)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class LlamaMLP(GatedMLP):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act, bias=config.mlp_bias)


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class LlamaPreTrainedModel(PreTrainedModel):
    config_class = LlamaConfig
    config: LlamaConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["LlamaDecoderLayer"]


class LlamaModel(DecoderModelMixin, LlamaPreTrainedModel):
    """The decoder stack (HF's ``LlamaModel``): embeddings, layers, final norm."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, LlamaDecoderLayer, LlamaRMSNorm)
        self.post_init()


class LlamaForCausalLM(CausalLMMixin, LlamaPreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``LlamaForCausalLM`` (forward, loss, backward,
    ``from_pretrained``/``save_pretrained``) plus `token_logprobs` (see `CausalLMMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.model = LlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class LlamaForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = LlamaForCausalLM


class LlamaForSequenceClassification(SequenceClassificationMixin, LlamaPreTrainedModel):
    """Reward model head: HF's ``LlamaForSequenceClassification`` over our `LlamaModel`."""

    base_model_class = LlamaModel


class LlamaForTokenClassification(TokenClassificationMixin, LlamaPreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``LlamaForTokenClassification`` over our `LlamaModel`."""

    base_model_class = LlamaModel
