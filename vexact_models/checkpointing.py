"""Activation checkpointing through transformers' own machinery, keeping each layer's attention
output (and a gated DeltaNet layer's delta-rule output).

Our decoder layers are ``transformers.modeling_layers.GradientCheckpointingLayer`` instances
(`layers.PreNormDecoderLayer`), which is what transformers' ``gradient_checkpointing_enable`` /
``activation_checkpointing_enable`` (``every_n_layers`` included, where the release has it), its
``is_gradient_checkpointing`` and PEFT look for: the layer itself runs its forward under the
checkpoint function those set on it. How a layer wraps itself differs between releases (5.2
wraps ``__call__``, module hooks inside the checkpoint; later releases wrap ``forward``, hooks
outside), and follows the installed transformers, as for its own models.

What we add (`CheckpointingMixin`): the checkpoint function a model hands its layers runs
``torch.utils.checkpoint`` non-reentrant with `kernels.checkpoint_saving_context` as its
``context_fn`` (each layer's attention ``(out, lse)``, or its gated delta rule's outputs, is kept,
everything else recomputed; gradients bitwise those of full recompute) unless the caller passed a ``context_fn`` of its own
(``noop_context_fn``: full recompute); the caller's other options stay (e.g. 5.24's ``offload``
wrapper). Without gradients (a rollout through the training model's modules) the layer just runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

from vexact_models.kernels import checkpoint_saving_context


def aligned_checkpoint_function(caller: Callable) -> Callable:
    """The checkpoint function our layers run under, from the one transformers built from the
    caller's ``gradient_checkpointing_kwargs`` (a ``functools.partial`` of torch's
    ``checkpoint``, or ``checkpoint`` itself): always non-reentrant (selective checkpointing needs
    it), with the caller's ``context_fn`` or else `checkpoint_saving_context`."""
    keywords = dict(getattr(caller, "keywords", None) or {})
    context_fn = keywords.get("context_fn", checkpoint_saving_context)

    def run(function: Callable, *args, **kwargs):
        if not torch.is_grad_enabled():  # no backward to replay it for
            return function(*args, **kwargs)
        return caller(function, *args, **{**kwargs, "use_reentrant": False, "context_fn": context_fn})

    run.keywords = {**keywords, "use_reentrant": False, "context_fn": context_fn}  # what it passes, for inspection
    return run


class CheckpointingMixin:
    """Mixed into our ``PreTrainedModel`` classes (before ``PreTrainedModel``): transformers'
    ``_set_gradient_checkpointing`` with `aligned_checkpoint_function` as the layers' function."""

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Callable = checkpoint,
                                    **kwargs) -> None:
        super()._set_gradient_checkpointing(enable=enable,
                                            gradient_checkpointing_func=aligned_checkpoint_function(
                                                gradient_checkpointing_func), **kwargs)
