"""Qwen3.5-MoE (text model) with one forward for training and rollouts.

HF's ``modeling_qwen3_5_moe`` text module tree (``Qwen3_5MoeForCausalLM``, config
``qwen3_5_moe_text``): Qwen3.5's hybrid layers (`vexact_models.gated_deltanet`) with, in every
layer, the MoE: softmax top-k routing (renormalised) over fused 3-D experts
(`kernels.fused_moe`) plus a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. Hub
checkpoints store one tensor per expert (transformers' conversion, `checkpoint_conversions`); the
text part of multimodal checkpoints loads too.
"""

from __future__ import annotations

from torch import nn
from transformers import GenerationMixin, PreTrainedModel, Qwen3_5MoeTextConfig

from ..causal_lm import CausalLMMixin, DecoderModelMixin, InitHookMixin
from ..inference_model import InferenceModel
from ..gated_deltanet import (GatedAttention, GatedRMSNorm, HybridDecoderLayer, SharedExpertMoeBlock,
                              SplitProjectionGatedDeltaNet, StockInitOrderMixin, ZeroCentredRMSNorm)
from ..heads import SequenceClassificationMixin, TokenClassificationMixin
from ..qwen3_moe.modeling import Qwen3MoeForCausalLM


class Qwen3_5MoeRMSNorm(ZeroCentredRMSNorm):
    pass


class Qwen3_5MoeRMSNormGated(GatedRMSNorm):
    pass


class Qwen3_5MoeGatedDeltaNet(SplitProjectionGatedDeltaNet):
    norm_class = Qwen3_5MoeRMSNormGated


class Qwen3_5MoeAttention(GatedAttention):
    norm_class = Qwen3_5MoeRMSNorm


class Qwen3_5MoeSparseMoeBlock(SharedExpertMoeBlock):
    pass


class Qwen3_5MoeDecoderLayer(HybridDecoderLayer):
    deltanet_class, attention_class, norm_class = Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeAttention, Qwen3_5MoeRMSNorm

    def make_mlp(self, config: Qwen3_5MoeTextConfig, layer_idx: int) -> nn.Module:
        return Qwen3_5MoeSparseMoeBlock(config)


class Qwen3_5MoePreTrainedModel(StockInitOrderMixin, InitHookMixin, PreTrainedModel):
    config_class = Qwen3_5MoeTextConfig
    config: Qwen3_5MoeTextConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["Qwen3_5MoeDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"^mtp.*", r"^model.visual.*"]


class Qwen3_5MoeTextModel(DecoderModelMixin, Qwen3_5MoePreTrainedModel):
    """The decoder stack (HF's ``Qwen3_5MoeTextModel``)."""

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__(config)
        self.init_decoder_stack(config, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm)  # RopeTables: partial rotary
        self.post_init()


class Qwen3_5MoeForCausalLM(CausalLMMixin, Qwen3_5MoePreTrainedModel, GenerationMixin):
    """Training variant: a drop-in for HF ``Qwen3_5MoeForCausalLM`` plus `token_logprobs`; with
    ``output_router_logits``, the router logits and HF's load-balancing ``aux_loss`` (as Qwen3-MoE)."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    forward = Qwen3MoeForCausalLM.forward

    def __init__(self, config: Qwen3_5MoeTextConfig) -> None:
        super().__init__(config)
        self.model = Qwen3_5MoeTextModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()


class Qwen3_5MoeForCausalLMInference(InferenceModel):
    """Inference variant: the same modules (shared storage); its gated DeltaNet layers run from the
    engine's per-sequence state cache (`runtime.linear_state_cache`), the attention layers from
    the paged KV cache."""

    training_class = Qwen3_5MoeForCausalLM


class Qwen3_5MoeForSequenceClassification(SequenceClassificationMixin, Qwen3_5MoePreTrainedModel):
    """Reward model head over our `Qwen3_5MoeTextModel` (HF's generic head)."""

    base_model_class = Qwen3_5MoeTextModel


class Qwen3_5MoeForTokenClassification(TokenClassificationMixin, Qwen3_5MoePreTrainedModel):
    """Per-token head (PPO critics' values) over our `Qwen3_5MoeTextModel`."""

    base_model_class = Qwen3_5MoeTextModel

