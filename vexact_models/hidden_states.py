"""HF's ``output_hidden_states`` for the one forward, on the autograd path to the output.

Stock transformers returns the residual stream after the embeddings and after every layer (the
last one replaced by the final normed output), each a tensor the rest of the forward reads: a
gradient of the logits, or of a loss, reaches it (``retain_grad``, ``torch.autograd.grad(loss,
hidden_states[i])``, attribution methods). Ours runs on flat ``[tokens, hidden]`` rows and hands
back copies in the input's padded shape (`FlatBatch.to_padded`), which the forward does not read.
`HiddenStates.keep` puts each copy on the path: the tensors the forward carries on (the layer's
``hidden`` and ``residual``, or the final output) pass through `_OnPath`, unchanged in value, and
their gradient flows through the padded copy and from it, by the copy's own graph, back to them.
The forward computes the same numbers as without hidden states, and the gradients reach the
weights by the same arithmetic (the padded copy's scatter and gather move values exactly).
"""

from __future__ import annotations

import torch

from vexact_models.flat_batch import FlatBatch
from vexact_models.patches.compat import select_hidden_states


def hidden_states_request(value, config):
    """HF's ``output_hidden_states``: the argument when given (a flag, or layer indices where the
    installed transformers takes them), else the config's field."""
    return value if value is not None else getattr(config, "output_hidden_states", False)


class _OnPath(torch.autograd.Function):
    """``carried`` unchanged, with their gradient sent through ``padded`` instead.

    The carried tensors reach the rest of the forward only through the state ``padded`` copies:
    a layer's ``(hidden, residual)`` through their sum (the next layer's first op, `add_and_norm`,
    and the final norm read ``hidden + residual`` alone), the embeddings or the final output as
    themselves. So their gradients are one tensor, the state's; `backward` passes the first on as
    ``padded``'s, and ``padded``'s graph (a scatter of the state's rows) takes it back to them.
    `tests/models/test_hf_drop_in.py` checks that the weights' gradients are bitwise the same with
    and without hidden states, for every architecture."""

    @staticmethod
    def forward(ctx, flat: FlatBatch, padded: torch.Tensor, *carried: torch.Tensor):
        ctx.flat = flat
        return carried

    @staticmethod
    def backward(ctx, *grads):
        grad = grads[0]
        return (None, None if grad is None else ctx.flat.to_padded(grad), *([None] * len(grads)))


class HiddenStates:
    """Collects HF's ``hidden_states`` during the one forward (`keep`), each in the input's padded
    shape and on the path to the output, and returns them as HF does (`output`)."""

    def __init__(self, flat: FlatBatch) -> None:
        self.flat = flat
        self.padded: list[torch.Tensor] = []

    def keep(self, state: torch.Tensor, *carried: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Keep `state` (flat rows: the embeddings, a layer's ``hidden + residual``, or the final
        output) and return `carried`, the tensors the forward goes on with, which reach the rest
        of it only through `state` (`_OnPath`); unchanged where no gradient is being recorded."""
        padded = self.flat.to_padded(state)
        self.padded.append(padded)
        if torch.is_grad_enabled() and state.requires_grad:
            return _OnPath.apply(self.flat, padded, *carried)
        return carried

    def output(self, request) -> tuple[torch.Tensor | None, ...]:
        """HF's ``hidden_states`` for `request` (`hidden_states_request`, truthy): all the kept
        states, or None where layer indices leave one out (`compat.select_hidden_states`)."""
        return tuple(select_hidden_states(self.padded, request))
