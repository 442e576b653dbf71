"""Which kernel computes the packed attention backward: cuDNN, FlashAttention-4,
FlashAttention-2 or ours (Triton).

The forward decides the bits (docs/design.md rule 2; `attention_forward_choice.py`); rule 8 lets
the backward be any correct kernel, so training takes the fastest that applies (the training
step's target, docs/design.md section 9; H200 figures in docs/performance.md):

- ``cudnn``: cuDNN's fused SDPA backward through the cuDNN frontend (`attention_backward_cudnn`),
  1.4-1.7x the FA2 backward at D = 128; needs the optional ``nvidia-cudnn-frontend`` package;
- ``fa4``: FlashAttention-4's backward (`attention_fa4`), 1.3-1.8x the FA2 backward at D = 128
  on the H200; needs the optional ``flash-attn-4`` package and a Hopper GPU, bf16/fp16;
- ``flash``: torch's own FlashAttention-2 backward (`attention_backward_flash`), no extra package,
  one head dim for q, k and v;
- ``triton``: our FlashAttention-2-scheme kernel (`attention_backward`): any dtype and head dim
  (fp32, MLA's qk 192 / v 128 where cuDNN refuses), repeats bitwise run to run.

``VEXACT_ATTENTION_BACKWARD=auto|cudnn|fa4|flash|triton`` (default ``auto``: the first of cudnn,
fa4, flash, triton that applies) or `set_attention_backward` / `use_attention_backward` (these
win over the environment, read at every backward call) choose; a forced kernel that
cannot run raises `UnsupportedError` naming why. The latent MLA layout (V a view of K) always
keeps its own Triton backward, and the reference backend (CPU) has one backward. A sliding
window or attention sinks (`attention_window.py`) always take ours (`attention_packed`): the
others are not given them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from .attention_backward_cudnn import cudnn_backward_unavailable_reason
from .attention_backward_flash import flash_backward_unavailable_reason
from .attention_fa4 import fa4_unavailable_reason
from .backend import UnsupportedError
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_ATTENTION_BACKWARD"
MODES = ("auto", "cudnn", "fa4", "flash", "triton")
#: the kernels ``auto`` tries, fastest first (the H200 figures in docs/performance.md)
AUTO_ORDER = ("cudnn", "fa4", "flash")
_switch = KernelSwitch(ENV_VAR, MODES, "auto", "attention backward")


def backward_mode() -> str:
    """The attention backward choice now: `set_attention_backward`'s if set, else the
    environment variable ``VEXACT_ATTENTION_BACKWARD`` (``auto`` when unset). Read at every
    backward call, so changing it between steps takes effect."""
    return _switch.mode()


def set_attention_backward(mode: str | None) -> None:
    """Force the packed attention backward: ``"cudnn"``, ``"fa4"``, ``"flash"``, ``"triton"`` or
    ``"auto"``; ``None`` returns the choice to the environment variable."""
    _switch.set(mode)


def use_attention_backward(mode: str | None) -> AbstractContextManager[None]:
    """Context manager form of `set_attention_backward`; restores the previous choice on exit."""
    return _switch.use(mode)


def choose_attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor | None = None,
                              max_seqlen: int = 1, scale: float = 1.0) -> str:
    """``"cudnn"``, ``"fa4"``, ``"flash"`` or ``"triton"``: the kernel the triton backend's packed attention
    backward runs for these inputs under `backward_mode` (`cu_seqlens`, `max_seqlen` and
    `scale` let cuDNN check the graph itself). Raises `UnsupportedError` when a forced kernel
    cannot run, ValueError for a bad mode."""
    mode = backward_mode()
    if mode == "triton":
        return "triton"
    candidates = {"cudnn": lambda: cudnn_backward_unavailable_reason(q, k, v, cu_seqlens, max_seqlen, scale),
                  "fa4": lambda: fa4_unavailable_reason(q, k, v),
                  "flash": lambda: flash_backward_unavailable_reason(q, k, v)}
    for name in (AUTO_ORDER if mode == "auto" else (mode,)):
        reason = candidates[name]()
        if reason is None:
            return name
        if mode != "auto":
            raise UnsupportedError(f"{ENV_VAR}/use_attention_backward is {mode!r} but the {mode} backward "
                                   f"cannot run: {reason}")
    return "triton"
