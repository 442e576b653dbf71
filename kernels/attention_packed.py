"""attention_packed: differentiable causal attention over packed training sequences, and the op
that activation checkpointing keeps.

The forward is `attention`'s kernel over a trivial block table (`packed_layout`), so training
outputs are bitwise the prefill/decode ones (docs/design.md rule 2). It runs as the custom op
``torch.ops.vexact.attention_packed_forward`` so that torch's selective activation checkpointing
can name it: `saved_by_checkpointing.checkpoint_saving_context` keeps its ``(out, lse)``
through a checkpointed layer and lets everything else be recomputed. Under full recompute the
attention forward runs twice per step; at 8k-32k tokens per sequence it is a fifth to a half of
the forward time while its output is no larger than the layer's input (docs/design.md rule 8). The backward is any correct kernel
on that out/lse (rule 8, `attention_backward_choice.py`).
"""

from __future__ import annotations

import torch

from .attention import (PagedLayout, attention_backend, attention_forward_triton, attention_reference,
                        check_attention_inputs, packed_layout)
from .latent_attention import value_in_key
from .latent_attention_backward import latent_attention_backward_triton


def _attention_packed_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                              max_seqlen: int, scale: float, window: int = 0,
                              sinks: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, Dv], lse [T, Hq] fp32)`` of causal attention within each packed sequence:
    the forward of `attention_packed` as one dispatcher op (no autograd of its own). `window` 0
    is no window (the op's schema takes an int); `sinks` as `attention` takes them."""
    layout = packed_layout(cu_seqlens, max_seqlen)
    window = window or None
    if attention_backend(q, v, k) == "triton":
        return attention_forward_triton(q, k, v, layout, scale, packed=True, window=window, sinks=sinks)
    return attention_reference(q, k, v, layout, scale, return_lse=True, window=window, sinks=sinks)


def _attention_packed_forward_fake(q, k, v, cu_seqlens, max_seqlen, scale, window=0, sinks=None):
    return q.new_empty((*q.shape[:2], v.shape[-1])), q.new_empty(q.shape[:2], dtype=torch.float32)


# The op is registered once, by this module under its package name. transformers probes for a
# top-level package called ``kernels``, and with the repository root on sys.path that probe runs
# this folder a second time as ``kernels``; registering again would point the op at that copy,
# which has its own backend state (`backend.use_backend` would no longer reach it).
if __name__ == "vexact_models.kernels.attention_packed":
    attention_packed_forward = torch.library.custom_op("vexact::attention_packed_forward", mutates_args=())(
        _attention_packed_forward)
    attention_packed_forward.register_fake(_attention_packed_forward_fake)
else:
    from vexact_models.kernels.attention_packed import attention_packed_forward  # noqa: F401


class _PackedAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen, scale, window, sinks):
        out, lse = torch.ops.vexact.attention_packed_forward(q, k, v, cu_seqlens, max_seqlen, scale, window or 0, sinks)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, sinks)
        ctx.backend, ctx.max_seqlen, ctx.scale, ctx.window = attention_backend(q, v, k), max_seqlen, scale, window
        return out

    @staticmethod
    def backward(ctx, grad_out):
        from .attention_backward import attention_backward_reference, attention_backward_triton, sinks_grad
        from .attention_backward_choice import choose_attention_backward
        from .attention_backward_cudnn import attention_backward_cudnn
        from .attention_backward_flash import attention_backward_flash
        from .attention_fa4 import attention_backward_fa4

        q, k, v, out, lse, cu_seqlens, sinks = ctx.saved_tensors
        window, extra = ctx.window, (None, None, None, None)  # cu_seqlens, max_seqlen, scale, window
        if ctx.backend != "triton":
            dq, dk, dv, dsinks = attention_backward_reference(grad_out, q, k, v, cu_seqlens, ctx.scale, window, sinks)
            return dq, dk, dv, *extra, dsinks
        if value_in_key(k, v):  # latent MLA: dV is folded into dK's latent dims (no window, no sinks)
            dq, dk = latent_attention_backward_triton(grad_out, q, k, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
            return dq, dk, None, *extra, None
        if window is not None or sinks is not None:  # only ours takes them (rule 8: any correct backward)
            dq, dk, dv = attention_backward_triton(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen,
                                                   ctx.scale, window)
            return dq, dk, dv, *extra, None if sinks is None else sinks_grad(grad_out, out, lse, sinks)
        # rule 8: any correct backward may run on our forward's out/lse (attention_backward_choice.py)
        kernel = {"cudnn": attention_backward_cudnn, "fa4": attention_backward_fa4, "flash": attention_backward_flash,
                  "triton": attention_backward_triton}[choose_attention_backward(q, k, v, cu_seqlens, ctx.max_seqlen,
                                                                                  ctx.scale)]
        dq, dk, dv = kernel(grad_out.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
        return dq, dk, dv, *extra, None


def attention_packed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_seqlen: int, scale: float | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention within each of the packed sequences ``cu_seqlens`` (``[S+1]``).

    q ``[T, Hq, D]``, k ``[T, Hkv, D]``, v ``[T, Hkv, Dv]``. The forward is the paged kernel
    over a trivial block table, so it is bitwise the prefill/decode result; differentiable,
    `sinks` (``[Hq]``, GPT-OSS's per-head sink logits) included. `window`: the query at position p
    sees keys p - window + 1 .. p (transformers' ``sliding_window``; `attention_window.py`). With
    a window or sinks the backward is ours (`attention_backward.py`), whatever the backward switch.
    """
    check_attention_inputs(q, k, v, PagedLayout(cu_seqlens, cu_seqlens, cu_seqlens, 1, max_seqlen), window, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return _PackedAttentionFunction.apply(q, k, v, cu_seqlens, max_seqlen, scale, window, sinks)
