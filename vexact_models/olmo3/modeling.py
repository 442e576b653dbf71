"""OLMo 3 (``olmo3``, HF's ``Olmo3ForCausalLM``) with one forward for training and rollouts.

HF's ``modeling_olmo3`` module tree and parameter names (so ``from_pretrained`` /
``save_pretrained`` and ``state_dict`` round-trip with stock checkpoints), computed only with
`vexact_models.kernels` ops. What sets it apart from Llama:

- post-norm layers: ``h = h + post_attention_layernorm(attn(h))``, then ``h = h +
  post_feedforward_layernorm(mlp(h))`` (no norm before either sublayer);
- q/k norms over the whole ``q_proj`` / ``k_proj`` output (every head's dims at once), before
  the split into heads and RoPE;
- sliding-window layers (``config.layer_types``: three of every four attend over the last
  ``config.sliding_window`` keys), each layer type with its own RoPE
  (``config.rope_parameters[layer_type]``: YaRN on the full-attention layers of the long-context
  checkpoints, plain RoPE on the sliding ones; `LayerTypeRope`).

Its RMSNorm rounds once in stock (the weight multiplies the fp32 normalized row); ours is
Llama's (`kernels.rms_norm`: the row rounded, then times the weight): the same in fp32, within
the bf16 parity rule in bf16, and the same op in training and rollout. `Olmo3Model.forward_flat`
is the single forward; the training variant (`Olmo3ForCausalLM`) drives it with a packed layout,
the inference variant (`Olmo3ForCausalLMInference`) with a paged KV cache.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import GenerationMixin, Olmo3Config, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from vexact_models.adapters import apply_linear
from vexact_models.causal_lm import CausalLMMixin, DecoderModelMixin
from vexact_models.heads import SequenceClassificationMixin, TokenClassificationMixin
from vexact_models.inference_model import InferenceModel
from vexact_models.layer_type_rope import LayerTypeRope
from vexact_models.layers import GatedMLP, RMSNorm, grouped_linear, head_dim_of, layer_window


class Olmo3RMSNorm(RMSNorm):
    pass


class Olmo3Attention(nn.Module):
    """HF's ``Olmo3Attention``: q_norm / k_norm over the whole projections, then the layer type's
    RoPE and attention, within the sliding window on ``sliding_attention`` layers."""

    def __init__(self, config: Olmo3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = layer_window(config, layer_idx)
        self.head_dim = head_dim_of(config)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Olmo3RMSNorm(self.num_heads * self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Olmo3RMSNorm(self.num_kv_heads * self.head_dim, eps=config.rms_norm_eps)

    def projection_groups(self) -> list[list[nn.Linear]]:
        return [[self.q_proj, self.k_proj, self.v_proj]]

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: dict, context) -> torch.Tensor:
        tokens = hidden.shape[0]
        q, k, v = grouped_linear(hidden, [self.q_proj, self.k_proj, self.v_proj])
        q = self.q_norm(q).view(tokens, self.num_heads, self.head_dim)  # the norms see every head's dims
        k = self.k_norm(k).view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        out = context.attend_rotary(self.layer_idx, q, k, v, positions, rope[self.layer_type], self.scaling,
                                    window=self.sliding_window)
        return apply_linear(out.reshape(tokens, -1), self.o_proj)


class Olmo3MLP(GatedMLP):
    def __init__(self, config: Olmo3Config) -> None:
        super().__init__(config.hidden_size, config.intermediate_size, config.hidden_act)


class Olmo3DecoderLayer(GradientCheckpointingLayer):
    """HF's post-norm ``Olmo3DecoderLayer`` under the layer contract of `DecoderModelMixin`:
    ``hidden + residual`` is the stream (`residual` None at the first layer); the MLP's normed
    output is returned unsummed, for the next layer (or the final norm) to add."""

    def __init__(self, config: Olmo3Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Olmo3Attention(config, layer_idx)
        self.mlp = Olmo3MLP(config)
        self.post_attention_layernorm = Olmo3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor, rope: dict,
                context) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else hidden + residual  # the layer's input, as stock's
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, rope, context))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo3PreTrainedModel(PreTrainedModel):
    config_class = Olmo3Config
    config: Olmo3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Olmo3DecoderLayer"]


class Olmo3Model(DecoderModelMixin, Olmo3PreTrainedModel):
    """The decoder stack (HF's ``Olmo3Model``): embeddings, layers, final norm."""

    def __init__(self, config: Olmo3Config) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Olmo3DecoderLayer, Olmo3RMSNorm)
        self.rope = LayerTypeRope(config, head_dim_of(config))
        self.post_init()


class Olmo3ForCausalLM(CausalLMMixin, Olmo3PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Olmo3ForCausalLM`` (forward, loss, backward,
    ``from_pretrained``/``save_pretrained``) plus `token_logprobs` (see `CausalLMMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Olmo3Config) -> None:
        super().__init__(config)
        self.model = Olmo3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Olmo3ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage) driven by the paged runtime."""

    training_class = Olmo3ForCausalLM


class Olmo3ForSequenceClassification(SequenceClassificationMixin, Olmo3PreTrainedModel):
    """Reward model head: HF's ``Olmo3ForSequenceClassification`` (transformers releases that have
    it) over our `Olmo3Model`."""

    base_model_class = Olmo3Model


class Olmo3ForTokenClassification(TokenClassificationMixin, Olmo3PreTrainedModel):
    """Per-token head (PPO critics' values) over our `Olmo3Model` (stock transformers has none for
    OLMo 3)."""

    base_model_class = Olmo3Model
