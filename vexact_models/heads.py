"""Sequence- and token-classification heads over our base models: reward models and PPO critics
(value heads), as ``AutoModelForSequenceClassification`` / ``AutoModelForTokenClassification``
return them after `vexact_models.patch()`.

The heads are HF's own (``GenericForSequenceClassification``: a bias-free ``score`` linear pooled
at each row's last non-padding token; ``GenericForTokenClassification``: dropout then ``score``
with a bias), with their forward, parameter names and loss, over our base model, which runs
the aligned forward. Each architecture declares its classes as HF does, e.g.
``class Qwen3ForSequenceClassification(SequenceClassificationMixin, Qwen3PreTrainedModel)``
with ``base_model_class = Qwen3Model``. The score GEMM is torch's: critics and reward models
need no rollout equality.
"""

from __future__ import annotations

from torch import nn
from transformers.modeling_layers import GenericForSequenceClassification, GenericForTokenClassification

from .causal_lm import StrictLoadingMixin


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


class SequenceClassificationMixin(StrictLoadingMixin, GenericForSequenceClassification):
    """HF's sequence-classification head over ``base_model_class`` (set by the subclass)."""

    base_model_class: type
    base_model_prefix = "model"

    def __init__(self, config) -> None:
        # HF's __init__ builds the body with AutoModel (stock or ours, depending on patch());
        # ours is always our base model
        super(GenericForSequenceClassification, self).__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        self.score = nn.Linear(_text_config(config).hidden_size, self.num_labels, bias=False)
        self.post_init()


class TokenClassificationMixin(StrictLoadingMixin, GenericForTokenClassification):
    """HF's token-classification head (PPO critics' per-token values) over ``base_model_class``."""

    base_model_class: type
    base_model_prefix = "model"

    def __init__(self, config) -> None:
        super(GenericForTokenClassification, self).__init__(config)
        self.num_labels = config.num_labels
        self.model = self.base_model_class(config)
        dropout = getattr(config, "classifier_dropout", None)
        if dropout is None:
            dropout = getattr(config, "hidden_dropout", None)
        self.dropout = nn.Dropout(0.1 if dropout is None else dropout)
        self.score = nn.Linear(_text_config(config).hidden_size, config.num_labels,
                               bias=getattr(config, "token_classification_bias", True))
        self.post_init()
