"""Qwen2 with one forward for training and rollouts.

Same module tree, parameter names and shapes as HF's ``modeling_qwen2`` (so ``from_pretrained``
/ ``save_pretrained`` and ``state_dict`` round-trip with stock checkpoints), computed only with
`vexact_models.kernels` ops. `Qwen2Model.forward_flat` is the single forward; the training
variant (`Qwen2ForCausalLM`) drives it with a packed layout, the inference variant
(`Qwen2ForCausalLMInference`) with a paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen2Config

from vexact_models.adapters import apply_linear
from vexact_models.layers import GatedMLP, PreNormDecoderLayer, RMSNorm, grouped_linear, head_dim_of, layer_window

from ..causal_lm import CausalLMMixin, DecoderModelMixin
from ..inference_model import InferenceModel
from ..heads import SequenceClassificationMixin, TokenClassificationMixin


class Qwen2RMSNorm(RMSNorm):
    pass


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        # Qwen2 always biases q/k/v and never o_proj (its config has no attention_bias field);
        # the biased q/k/v still fuse into one rollout GEMM (`layers.fuse_linears`)
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        # None unless use_sliding_window: then the window on the layers from max_window_layers on
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
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope, self.scaling, window=self.sliding_window)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class Qwen2MLP(GatedMLP):
    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class Qwen2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: Qwen2Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Qwen2Attention(config, layer_idx)
        self.mlp = Qwen2MLP(config)
        self.input_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class Qwen2PreTrainedModel(PreTrainedModel):
    config_class = Qwen2Config
    config: Qwen2Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen2DecoderLayer"]


class Qwen2Model(DecoderModelMixin, Qwen2PreTrainedModel):
    """The decoder stack (HF's ``Qwen2Model``): embeddings, layers, final norm."""

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen2DecoderLayer, Qwen2RMSNorm)
        self.post_init()


class Qwen2ForCausalLM(CausalLMMixin, Qwen2PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen2ForCausalLM`` (forward, loss, backward,
    ``from_pretrained``/``save_pretrained``) plus `token_logprobs` (see `CausalLMMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Qwen2Config) -> None:
        super().__init__(config)
        self.model = Qwen2Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen2ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Qwen2ForCausalLM


class Qwen2ForSequenceClassification(SequenceClassificationMixin, Qwen2PreTrainedModel):
    """Reward model head: HF's ``Qwen2ForSequenceClassification`` over our `Qwen2Model`."""

    base_model_class = Qwen2Model


class Qwen2ForTokenClassification(TokenClassificationMixin, Qwen2PreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``Qwen2ForTokenClassification`` over our `Qwen2Model`."""

    base_model_class = Qwen2Model
