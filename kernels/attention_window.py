"""attention_window: the sliding-window and attention-sink options every attention path shares.

A **sliding window** ``W`` (a model's per-layer ``sliding_window``: Mistral, Gemma 3's local layers,
GPT-OSS's windowed layers) lets the query at absolute position ``p`` see the keys at positions
``p - W + 1 .. p``: ``W`` keys, itself included. This is transformers' convention
(``masking_utils.sliding_window_overlay``: ``kv_idx > q_idx - sliding_window``), so a config's
``sliding_window`` is passed as is. ``None`` is full causal attention.

**Sinks** (GPT-OSS's ``self_attn.sinks``, one learned logit per query head): the logit joins each
row's softmax denominator with no value, in the units of the scaled scores (HF concatenates it to
``q . k * scale`` before the softmax and drops its column after), so a row's weights sum to less
than 1.

How the kernels keep the bits (docs/design.md rule 2, "windows and sinks"): a row's keys are still
reduced in the blocks aligned to absolute positions 0, B, 2B, ...; the window is one more term of
the mask (``k_pos > q_pos - W``), a block wholly before a row's window is either skipped (a
launch starts at `window_first_key` of its tile's first row, rounded down to a block) or fully
masked, and a fully masked block leaves a row's state bitwise unchanged, the empty state included
(the kernels take ``m = 0`` for the exponents while a row's running max is still ``-inf``). The
sink is each row's *initial* state: running max ``sink * log2(e)``, denominator 1, output 0; the
same initial state on every path, so the same bits.
"""

from __future__ import annotations

import torch

#: the widest key block any attention kernel reduces (the Triton GQA kernel's `BLOCK_N`; the
#: reference's 16 and the latent kernel's blocks divide it): a launch reads no key below
#: `window_first_key` rounded down to this, which is what the paged cache may free behind a window
#: (`runtime/block_manager.py`, docs/design.md section 6)
WIDEST_KEY_BLOCK = 64


def check_window_and_sinks(op: str, q: torch.Tensor, window: int | None, sinks: torch.Tensor | None) -> None:
    """ValueError naming the argument, its value and the limit when `window` is not None or an
    int >= 1, or `sinks` is not a floating 1-D tensor of one logit per query head on q's device."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window={window!r} must be None (full causal attention) or an int >= 1 "
                         "(the query at position p sees keys p - window + 1 .. p)")
    if sinks is None:
        return
    if not isinstance(sinks, torch.Tensor) or not sinks.is_floating_point() or sinks.dim() != 1:
        got = f"{sinks.dtype} {tuple(sinks.shape)}" if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"{op}: sinks must be a floating 1-D tensor of one logit per query head, got {got}")
    if sinks.shape[0] != q.shape[1]:
        raise ValueError(f"{op}: sinks has {sinks.shape[0]} logits, q has {q.shape[1]} query heads (one sink per head)")
    if sinks.device != q.device:
        raise ValueError(f"{op}: sinks on {sinks.device}, q on {q.device}: they must share a device")


def window_first_key(position: int, window: int | None) -> int:
    """The first key position the query at `position` sees under `window` (0 without one)."""
    return 0 if window is None else max(0, position - window + 1)


def window_block_start(position: int, window: int | None, block: int = WIDEST_KEY_BLOCK) -> int:
    """The first key a launch whose first query sits at `position` may read: `window_first_key`
    rounded down to `block`. Keys below it are never read again by any later query of the
    sequence (later queries see later keys), so the paged cache may free them."""
    return window_first_key(position, window) // block * block
