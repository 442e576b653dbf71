"""Qwen3.5 (dense text model) with one forward for training and rollouts.

HF's ``modeling_qwen3_5`` text module tree and parameter names (``Qwen3_5ForCausalLM``, config
``qwen3_5_text``): decoder layers whose token mixer is, per ``config.layer_types``, a gated
DeltaNet (``linear_attn``: ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, the
causal ``conv1d``, ``A_log``, ``dt_bias``, the gated ``norm``, ``out_proj``) or gated full
attention (``self_attn``: ``q_proj`` emitting query and output gate, zero-centred q/k norms,
partial rotary); zero-centred RMSNorms; a SwiGLU MLP. The layers are
`vexact_models.gated_deltanet`'s (docs/design.md section 6b). The text part of the published
multimodal checkpoints (``Qwen3_5ForConditionalGeneration``) loads too (`vexact_models.multimodal`).
"""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen3_5TextConfig

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..gated_deltanet import (GatedAttention, GatedRMSNorm, HybridDecoderLayer, SplitProjectionGatedDeltaNet,
                              StockInitOrderMixin, ZeroCentredRMSNorm)
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from ..layers import GatedMLP


class Qwen3_5RMSNorm(ZeroCentredRMSNorm):
    pass


class Qwen3_5RMSNormGated(GatedRMSNorm):
    pass


class Qwen3_5GatedDeltaNet(SplitProjectionGatedDeltaNet):
    norm_class = Qwen3_5RMSNormGated


class Qwen3_5Attention(GatedAttention):
    norm_class = Qwen3_5RMSNorm


class Qwen3_5MLP(GatedMLP):
    def __init__(self, config: Qwen3_5TextConfig, intermediate_size: int) -> None:
        super().__init__(config.hidden_size, intermediate_size, config.hidden_act)


class Qwen3_5DecoderLayer(HybridDecoderLayer):
    deltanet_class, attention_class, norm_class = Qwen3_5GatedDeltaNet, Qwen3_5Attention, Qwen3_5RMSNorm

    def make_mlp(self, config: Qwen3_5TextConfig, layer_idx: int) -> nn.Module:
        return Qwen3_5MLP(config, config.intermediate_size)


class Qwen3_5PreTrainedModel(StockInitOrderMixin, InitHookMixin, PreTrainedModel):
    config_class = Qwen3_5TextConfig
    config: Qwen3_5TextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3_5DecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp.*", r"^model.visual.*"]


class Qwen3_5TextModel(DecoderModelMixin, Qwen3_5PreTrainedModel):
    """The decoder stack (HF's ``Qwen3_5TextModel``): embeddings, hybrid layers, final norm."""

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen3_5DecoderLayer, Qwen3_5RMSNorm)  # RopeTables: partial rotary
        self.post_init()


class Qwen3_5ForCausalLM(CausalLMMixin, Qwen3_5PreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen3_5ForCausalLM`` (forward, loss, backward,
    ``from_pretrained``/``save_pretrained``) plus `token_logprobs` (see `CausalLMMixin`)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Qwen3_5TextConfig) -> None:
        super().__init__(config)
        self.model = Qwen3_5TextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3_5ForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage); its gated DeltaNet layers run from the
    engine's per-sequence state cache (`runtime.linear_state_cache`), the attention layers from
    the paged KV cache."""

    training_class = Qwen3_5ForCausalLM


class Qwen3_5ForSequenceClassification(SequenceClassificationMixin, Qwen3_5PreTrainedModel):
    """Reward model head: HF's ``Qwen3_5TextForSequenceClassification`` over our `Qwen3_5TextModel`."""

    base_model_class = Qwen3_5TextModel


class Qwen3_5ForTokenClassification(TokenClassificationMixin, Qwen3_5PreTrainedModel):
    """Per-token head (PPO critics' values) over our `Qwen3_5TextModel`."""

    base_model_class = Qwen3_5TextModel
