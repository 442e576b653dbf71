"""attention_decode_rotary: a decode step's `rotary_cache_write` and `attention` in one launch.

A decode step of Qwen3 runs, per layer, `rotary_cache_write` (q/k norms, rotary embedding, KV
cache write) and then the attention, two launches whose boundary costs more than the first
one's bytes. Here each attention program, one per (sequence, KV head), first does
`rotary_cache_write`'s work for its own rows: its token's query heads of that KV head, normed and
rotated into the queries' buffer, and the key and value heads into the caches; then, after a
barrier, the attention reads them as it would have.

Invariance contract: bitwise the two launches (docs/design.md rules 2, 3 and 5). The rows go
through the very helpers `rotary_cache_write`'s kernel uses (`rotary_cache_write._rotate_rows_into`:
the norm kernel's `load_rows` and `normalize_rows`, the rotation's explicit fused multiply-adds),
on a 16-row tile of 4 warps where that kernel has 64 rows of 8 warps; along a row both tiles have
32 lanes of one element each and 4 warps (an offline sm_90 compile of the norm on both tiles,
docs/gpu-results.md, twenty-fifth session), so `tl.sum` adds each row in the same order. The
attention part is `attention_triton`'s kernel, unchanged after the prologue. Decode launches
only (one query token per sequence), pointer loads only (a key the program has just stored must
not come back through TMA's asynchronous proxy).

Status: built on the CPU (the interpreter checks the bits against the two launches); not yet run
on a GPU, so nothing calls it unless ``VEXACT_DECODE_ROTARY=on`` (`use_decode_rotary`; the layers
ask `decode_rotary_taken`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .attention import PagedLayout, attention_triton
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_DECODE_ROTARY"
MODES = ("off", "on")
_switch = KernelSwitch(ENV_VAR, MODES, "off", "fused decode rotary + attention")


def use_decode_rotary(mode: str | None) -> AbstractContextManager[None]:
    """``"on"`` / ``"off"`` for a ``with`` block (None: ``VEXACT_DECODE_ROTARY`` decides)."""
    return _switch.use(mode)


@dataclass
class DecodeRotary:
    """What a fused decode launch rotates and writes first: the fused projection rows ``qkv
    [T, (Hq + 2 Hkv) * D]`` (query heads, key heads, value heads side by side), the tokens'
    `positions`, the fp32 `cos`/`sin` tables, the optional per-head norm weights and their `eps`,
    and each token's cache slot (`slot_mapping`, -1: not written)."""

    qkv: torch.Tensor
    positions: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor
    q_weight: torch.Tensor | None
    k_weight: torch.Tensor | None
    eps: float

    def kernel_args(self) -> tuple:
        """The attention kernel's rotary arguments, in its order."""
        norm = self.q_weight is not None
        return (self.qkv, self.qkv.stride(0), self.positions, self.cos, self.sin, self.cos.stride(0),
                self.q_weight if norm else self.cos, self.k_weight if norm else self.cos, self.slot_mapping, self.eps)


def decode_rotary_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       layout: PagedLayout) -> bool:
    """Whether a step's q/k/v ``[T, H, D]`` views and caches can take the fused launch: a decode
    step (one query token per sequence), views of one contiguous fused projection row (query,
    key, value heads side by side), a power-of-two head dim of at most 128 shared by all three,
    caches of contiguous ``[.., Hkv, D]`` rows, a GQA group of at most 16 heads, no gradient."""
    d = q.shape[-1]
    if layout.max_seqlen_q != 1 or not (k.shape[-1] == v.shape[-1] == d) or d & (d - 1) or d > 128:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        return False
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv or hq // hkv > 16 or q.dtype != k_cache.dtype:
        return False
    row = q.stride(0)
    base = q.data_ptr()
    esize = q.element_size()
    return (q.stride(1) == k.stride(1) == v.stride(1) == d and q.stride(2) == 1 and k.stride(0) == v.stride(0) == row
            and k.data_ptr() == base + hq * d * esize and v.data_ptr() == base + (hq + hkv) * d * esize
            and all(c.stride(-1) == 1 and c.stride(-2) == d for c in (k_cache, v_cache)))


def decode_rotary_taken(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, layout: PagedLayout, q_weight: torch.Tensor | None = None,
                        k_weight: torch.Tensor | None = None) -> bool:
    """Whether a step whose ops would run `rotary_cache_write` then `attention` runs the fused
    launch instead: switched on (``VEXACT_DECODE_ROTARY``, default off), `decode_rotary_fits`,
    norm weights that are plain tensors (not sharded), and both ops would run our Triton kernels
    (the triton backend for rotary, the norm and attention, and the forward switch's ``triton``,
    not FA4)."""
    from .attention import attention_backend
    from .attention_forward_choice import choose_attention_forward
    from .backend import select

    return (_switch.mode() == "on" and decode_rotary_fits(q, k, v, k_cache, v_cache, layout)
            and all(type(w) in (torch.Tensor, torch.nn.Parameter) for w in (q_weight, k_weight) if w is not None)
            and select("rotary", q) == select("rms_norm", q) == "triton" and attention_backend(q, v_cache, k_cache) == "triton"
            and choose_attention_forward(q, k_cache, v_cache) == "triton")


def attention_decode_rotary(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_mapping: torch.Tensor, layout: PagedLayout, scale: float,
                            q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                            eps: float = 1e-6) -> torch.Tensor:
    """``attention(rotary_cache_write(q, k, v, ...), k_cache, v_cache, layout, scale)`` of a decode
    step in one launch; the caches are written in place as `rotary_cache_write` writes them.

    `q`, `k`, `v` must pass `decode_rotary_fits` (ValueError otherwise); the other arguments are
    `rotary_cache_write`'s and `attention`'s. Returns the attention output ``[T, Hq, D]``.
    """
    if not decode_rotary_fits(q, k, v, k_cache, v_cache, layout):
        raise ValueError(f"attention_decode_rotary: q {tuple(q.shape)}/{q.stride()}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} and max_seqlen_q={layout.max_seqlen_q} do not fit the fused decode "
                         "launch (decode_rotary_fits)")
    tokens = q.shape[0]
    qkv = torch.as_strided(q, (tokens, q.stride(0)), (q.stride(0), 1))
    rotated = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    rotary = DecodeRotary(qkv, positions, cos, sin, slot_mapping, q_weight, k_weight, eps)
    return attention_triton(rotated, k_cache, v_cache, layout, scale, rotary=rotary)[0]
