"""The ops whose outputs activation checkpointing keeps, and the ``context_fn`` that keeps them.

A checkpointed decoder layer (`vexact_models.checkpointing`) runs torch's selective activation
checkpointing with `checkpoint_saving_context`: the outputs of the ops in `SAVED_BY_CHECKPOINTING`
are saved during the forward and handed back when the backward recomputes the layer; every other
op is recomputed. Both ops are deterministic, so the gradients are bitwise those of full
recompute (docs/design.md rule 8; tests/kernels/test_attention_packed.py,
tests/kernels/test_gated_delta_rule.py).

- ``vexact::attention_packed_forward`` (`attention_packed`): ``(out, lse)``, a fifth to a half of
  the forward at 8k-32k tokens a sequence, no larger than the layer's input.
- ``vexact::gated_delta_forward`` (`gated_delta_rule`): ``(out, final states)``. The gated
  DeltaNet's forward is its walk token by token, ~11 ms a layer at 16,384 tokens (H200), and its
  backward reads only the walk's inputs; the output costs ``T * Hv * dv`` elements in the model
  dtype a layer (134 MB at Qwen3.5's 32 x 128 heads and 16,384 tokens in bf16).
"""

from __future__ import annotations

import torch

from . import attention_packed, gated_delta_rule  # noqa: F401 (they register the ops)

#: the dispatcher ops whose outputs `checkpoint_saving_context` keeps
SAVED_BY_CHECKPOINTING = (torch.ops.vexact.attention_packed_forward.default, torch.ops.vexact.gated_delta_forward.default)


def checkpoint_saving_context():
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the
    outputs of `SAVED_BY_CHECKPOINTING`'s ops are saved during the forward and handed back when
    the backward recomputes the region, every other op is recomputed (torch's selective activation
    checkpointing). Gradients are bitwise those of full recompute: those forwards are deterministic."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(list(SAVED_BY_CHECKPOINTING))
