"""Qwen3-Next with one forward for training and rollouts.

HF's ``modeling_qwen3_next`` module tree (``Qwen3NextForCausalLM``, config ``qwen3_next``): the
hybrid layers of `vexact_models.gated_deltanet` with Qwen3-Next's fused DeltaNet projections
(``in_proj_qkvz``, ``in_proj_ba``, grouped by key head), and per layer either the MoE with a
gated shared expert (``num_experts > 0``, every ``decoder_sparse_step``-th layer outside
``mlp_only_layers``) or a SwiGLU MLP. Hub checkpoints store one tensor per expert
(transformers' conversion, `checkpoint_conversions`).
"""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen3NextConfig

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..gated_deltanet import (FusedProjectionGatedDeltaNet, GatedAttention, GatedRMSNorm, HybridDecoderLayer,
                              SharedExpertMoeBlock, StockInitOrderMixin, ZeroCentredRMSNorm)
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from ..layers import GatedMLP
from ..qwen3_moe.modeling import Qwen3MoeForCausalLM


class Qwen3NextRMSNorm(ZeroCentredRMSNorm):
    pass


class Qwen3NextRMSNormGated(GatedRMSNorm):
    pass


class Qwen3NextGatedDeltaNet(FusedProjectionGatedDeltaNet):
    norm_class = Qwen3NextRMSNormGated


class Qwen3NextAttention(GatedAttention):
    norm_class = Qwen3NextRMSNorm


class Qwen3NextMLP(GatedMLP):
    def __init__(self, config: Qwen3NextConfig, intermediate_size: int | None = None) -> None:
        super().__init__(config.hidden_size, intermediate_size or config.intermediate_size, config.hidden_act)


class Qwen3NextSparseMoeBlock(SharedExpertMoeBlock):
    pass


class Qwen3NextDecoderLayer(HybridDecoderLayer):
    deltanet_class, attention_class, norm_class = Qwen3NextGatedDeltaNet, Qwen3NextAttention, Qwen3NextRMSNorm

    def make_mlp(self, config: Qwen3NextConfig, layer_idx: int) -> nn.Module:
        sparse = layer_idx not in config.mlp_only_layers and config.num_experts > 0 \
            and (layer_idx + 1) % config.decoder_sparse_step == 0
        return Qwen3NextSparseMoeBlock(config) if sparse else Qwen3NextMLP(config)


class Qwen3NextPreTrainedModel(StockInitOrderMixin, InitHookMixin, PreTrainedModel):
    config_class = Qwen3NextConfig
    config: Qwen3NextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3NextDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp.*"]


class Qwen3NextModel(DecoderModelMixin, Qwen3NextPreTrainedModel):
    """The decoder stack (HF's ``Qwen3NextModel``)."""

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen3NextDecoderLayer, Qwen3NextRMSNorm)  # RopeTables: partial rotary
        self.post_init()


class Qwen3NextForCausalLM(CausalLMMixin, Qwen3NextPreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen3NextForCausalLM`` plus `token_logprobs`; with
    ``output_router_logits``, the router logits and HF's load-balancing ``aux_loss`` (as Qwen3-MoE)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    forward = Qwen3MoeForCausalLM.forward

    def __init__(self, config: Qwen3NextConfig) -> None:
        super().__init__(config)
        self.model = Qwen3NextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3NextForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage); its gated DeltaNet layers run from the
    engine's per-sequence state cache (`runtime.linear_state_cache`), the attention layers from
    the paged KV cache."""

    training_class = Qwen3NextForCausalLM


class Qwen3NextForSequenceClassification(SequenceClassificationMixin, Qwen3NextPreTrainedModel):
    """Reward model head: HF's ``Qwen3NextForSequenceClassification`` over our `Qwen3NextModel`."""

    base_model_class = Qwen3NextModel


class Qwen3NextForTokenClassification(TokenClassificationMixin, Qwen3NextPreTrainedModel):
    """Per-token head (PPO critics' values): HF's ``Qwen3NextForTokenClassification`` over our `Qwen3NextModel`."""

    base_model_class = Qwen3NextModel
