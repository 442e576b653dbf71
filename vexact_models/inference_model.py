"""The inference variant of every architecture: the training model's own modules driven by the
paged runtime (`vexact_models.runtime`), so that rollouts and `token_logprobs` run one forward
(docs/design.md section 3)."""

from __future__ import annotations

import torch
from torch import nn

from vexact_models.adapters import UnsupportedAdapter, forbid_adapters
from vexact_models.layers import PagedContext
from vexact_models.loading import from_pretrained_complete


class InferenceModel(nn.Module):
    """Inference variant: drives a training-variant model's modules with the paged runtime.

    It holds the training model itself (not a copy), so both share parameter storage: an
    optimizer step on the training model is what the next rollout uses.
    """

    def __init__(self, causal_lm: nn.Module) -> None:
        super().__init__()
        if isinstance(causal_lm, nn.Module) and type(causal_lm).__name__.startswith("PeftModel"):
            # the runtime drives our model under PEFT's wrapper: its LoRA layers are in there
            causal_lm = causal_lm.get_base_model()
        self.causal_lm = causal_lm

    @property
    def config(self):
        return self.causal_lm.config

    def kv_cache_spec(self) -> tuple[int, int, int, int]:
        return self.causal_lm.kv_cache_spec()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, context: PagedContext,
                logits_indices: torch.Tensor, hidden_indices: torch.Tensor | None = None):
        """Run new tokens through the paged cache; return fp32 logits ``[n, vocab]`` for the
        flat rows ``logits_indices`` (the last token of each sequence that samples), and with
        `hidden_indices` also the final hidden states of those rows, whose logits the caller
        computes with ``causal_lm.final_logits`` as it goes (prompt positions scored a few at a
        time: `runtime.top_logprobs`; the head is row-wise, rule 3, so the bits are the same)."""
        hidden = self.causal_lm.model.forward_flat(input_ids, positions, context)
        logits = self.causal_lm.final_logits(hidden[logits_indices])
        return logits if hidden_indices is None else (logits, hidden[hidden_indices])

    @torch.no_grad()
    def forward_stage(self, layers: range, first: bool, last: bool, input_ids: torch.Tensor, positions: torch.Tensor,
                      context: PagedContext, logits_indices: torch.Tensor, hidden: torch.Tensor | None = None,
                      residual: torch.Tensor | None = None):
        """One pipeline stage's share of `forward` (`vexact_models.runtime.pipeline`): the
        decoder `layers`, after the embeddings (`first`) or the previous stage's ``(hidden,
        residual)``; then the final norm and the logits of `forward` (`last`), else ``(hidden,
        residual)`` for the next stage. The same calls as ``forward_flat``, so all stages
        together compute `forward`'s logits bitwise."""
        base = self.causal_lm.model
        if first:
            forbid_adapters(base.embed_tokens, "embed_tokens", "train it fully with modules_to_save=['embed_tokens']")
            hidden, residual = base.embed_tokens(input_ids), None
        rope = base.rope.get(hidden.device)
        try:
            for i in layers:
                hidden, residual = base.layers[i](hidden, residual, positions, rope, context)
        except UnsupportedAdapter as error:
            raise error.at(base) from None
        if not last:
            return hidden, residual
        hidden = base.norm(hidden, residual)[0]
        return self.causal_lm.final_logits(hidden[logits_indices])

    @classmethod
    def from_pretrained(cls, path, **kwargs) -> "InferenceModel":
        """The training class's weights from a checkpoint folder, strictly: a tensor the checkpoint
        lacks (a head included) is a `loading.CheckpointError` (`loading.from_pretrained_complete`)."""
        return cls(from_pretrained_complete(cls.training_class, path, **kwargs))
