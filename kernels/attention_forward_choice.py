"""Which kernel computes the attention forward: ours (Triton) or FlashAttention-4.

The forward decides the bits of every logprob, so training and rollout must run the same one
(docs/design.md rule 2): both read this switch at every call, `LLM` captures its CUDA graphs
again when it changes, and the conformance suite checks the pair whole. Modes:

- ``triton`` (the default): our kernel (`attention.py`), on every device, dtype and layout;
- ``fa4``: FlashAttention-4 (`attention_fa4.py`; the optional ``flash-attn-4`` package) for
  causal GQA/MHA attention in training, chunked prefill and decode. On the H200 its training
  forward is 1.1-1.5x ours, its paged decode 0.66-0.82x ours at batch 128-256 with short
  contexts and ~1.2x at 32 x 8k (`benchmarks/attention_fa4.py`, 2026-11-24): a choice for
  training-heavy or long-context runs.
  The latent MLA layout (V a view of K) keeps our kernel in either mode.

``VEXACT_ATTENTION_FORWARD=triton|fa4``, or `set_attention_forward` / `use_attention_forward`
(these win over the environment). A forced ``fa4`` that cannot run (package missing, not a
Hopper GPU, fp32, head dims) raises `UnsupportedError` naming why, never a silent fallback:
a fallback on one side only would break the equality the project exists for.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from .attention_fa4 import fa4_unavailable_reason
from .backend import UnsupportedError
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_ATTENTION_FORWARD"
MODES = ("triton", "fa4")
_switch = KernelSwitch(ENV_VAR, MODES, "triton", "attention forward")


def forward_mode() -> str:
    """The attention forward choice now: `set_attention_forward`'s if set, else
    ``VEXACT_ATTENTION_FORWARD`` (``triton`` when unset). Read at every attention call."""
    return _switch.mode()


def set_attention_forward(mode: str | None) -> None:
    """Force the attention forward (``"triton"`` or ``"fa4"``); None hands the choice back to
    the environment variable."""
    _switch.set(mode)


def use_attention_forward(mode: str | None) -> AbstractContextManager[None]:
    """Context manager form of `set_attention_forward`; restores the previous choice on exit."""
    return _switch.use(mode)


def choose_attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, windowed: bool = False) -> str:
    """``"triton"`` or ``"fa4"``: the kernel the triton backend's attention forward runs for q,
    k and v (not the latent layout, which the caller keeps on ours) under `forward_mode`.
    Raises `UnsupportedError` when ``fa4`` is forced and cannot run, `windowed` (a sliding window
    or sinks, `attention_window.py`) included: FA4's windows and sinks were never checked bitwise
    against themselves across training and rollout here."""
    mode = forward_mode()
    if mode == "fa4" and windowed:
        raise UnsupportedError(f"{ENV_VAR}/use_attention_forward is 'fa4' but FA4 cannot run: a sliding window or "
                               "attention sinks (only our kernel takes them); use 'triton'")
    if mode == "fa4":
        reason = fa4_unavailable_reason(q, k, v)
        if reason is not None:
            raise UnsupportedError(f"{ENV_VAR}/use_attention_forward is 'fa4' but FA4 cannot run: {reason}")
    return mode
