"""attention_fa4: FlashAttention-4 (the optional ``flash-attn-4`` package, ``flash_attn.cute``)
as the attention forward of training, chunked prefill and decode alike, and as a backward.

Why its forward can stand in for ours (docs/design.md rule 2). Selected for every call (training
and rollout read the same switch, `attention_forward_choice.py`), it keeps a query row's
arithmetic independent of how the row reaches it: on SM90 at head dims up to 192 it reduces
keys in tiles of 128 aligned to absolute key positions, with a per-row online softmax; a row's
scores and output depend on its own query only (tile-mates are other rows); a tile that is
fully masked for a row adds exact zeros; a chunk's queries are aligned to the end of the keys
(causal, bottom-right), so a prefill chunk or a decode query sees exactly the keys its training
row sees. We call it without split-KV (``num_splits=1``: splitting would reorder the
reduction). `benchmarks/attention_fa4.py` and ``kernel_invariance --only fa4`` check on the GPU
that a packed training call, each sequence alone, chunked prefill and paged decode give
bitwise equal rows; the conformance suite run with ``VEXACT_ATTENTION_FORWARD=fa4`` checks
whole models. Its bits differ from our Triton kernel's: training and rollout must both use it
(one process reads one switch; two processes must set the same one).

Only where verified: SM90 (Hopper) GPUs, bf16/fp16, head dims FA4 supports there; the latent MLA
layout (V a view of K) keeps our kernel. Our ``lse`` convention (``[T, Hq]`` fp32 log2-sum-exp2
of the scores scaled by ``scale * log2(e)``) is FA4's natural-log ``[Hq, T]`` times log2(e), so
any backward (rule 8) runs on an FA4 forward, and FA4's backward on any forward.
"""

from __future__ import annotations

import functools
import math

import torch

from ._triton import unverified_gpu_reason
from .backend import UnsupportedError

LOG2E = math.log2(math.e)
FA4_DTYPES = (torch.bfloat16, torch.float16)
#: FA4's SM90 head dims: multiples of 8 up to 256 (key) and 256 (value)
MAX_HEAD_DIM = 256
HEAD_DIM_MULTIPLE = 8
#: compute capability majors where FA4's alignment was checked (`benchmarks/attention_fa4.py`, H200, 2026-11-24)
VERIFIED_MAJORS = (9,)


@functools.lru_cache(maxsize=None)
def _fa4_interface():
    """``flash_attn.cute.interface`` or the import error's text."""
    try:
        from flash_attn.cute import interface
    except Exception as exc:  # noqa: BLE001 - a broken install is as unavailable as a missing one
        return f"{type(exc).__name__}: {exc}"
    return interface


def fa4_unavailable_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why FA4 cannot run attention of q ``[T, Hq, D]`` over k ``[..., Hkv, D]`` and v ``[...,
    Hkv, Dv]``, or None when it can. Checked in a fixed order (package, dtype, head dims,
    device, GPU), so the first failing requirement is named."""
    interface = _fa4_interface()
    if isinstance(interface, str):
        return f"flash_attn.cute (pip install flash-attn-4) cannot be imported: {interface}"
    if q.dtype not in FA4_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes q={q.dtype}, k={k.dtype}, v={v.dtype}: FA4 needs all of one of {FA4_DTYPES}"
    d, dv = q.shape[-1], v.shape[-1]
    if any(x % HEAD_DIM_MULTIPLE or x > MAX_HEAD_DIM for x in (d, dv)):
        return f"head dims {d}/{dv}: FA4 needs multiples of {HEAD_DIM_MULTIPLE} up to {MAX_HEAD_DIM}"
    if q.device.type != "cuda" or k.device != q.device or v.device != q.device:
        return f"devices q={q.device}, k={k.device}, v={v.device}: FA4 needs CUDA tensors on one GPU"
    return unverified_gpu_reason(q.device, VERIFIED_MAJORS, "FA4's alignment")


def _lse_ours(lse_fa4: torch.Tensor) -> torch.Tensor:
    """FA4's ``[Hq, T]`` natural-log LSE as ours: ``[T, Hq]`` in log2 units."""
    return (lse_fa4.t() * LOG2E).contiguous()


def attention_fa4(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout, scale: float,
                  packed: bool = False, return_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(out [T, Hq, Dv], lse [T, Hq] or None)``: causal attention of `q` over the cache that
    `layout` (`attention.PagedLayout`) describes, by FA4. `packed`: k/v are the packed training
    tensors ``[T, Hkv, D]`` and `layout` is their `attention.packed_layout`; otherwise the caches
    hold ``layout.page_size`` slots per page (FA4 reads them through the block table)."""
    varlen = _fa4_interface().flash_attn_varlen_func
    n_kv = k_cache.shape[-2]
    common = dict(cu_seqlens_q=layout.cu_seqlens_q, max_seqlen_q=layout.max_seqlen_q, softmax_scale=scale,
                  causal=True, num_splits=1, return_lse=return_lse)
    with torch.no_grad():  # training's autograd is ours (`attention_packed`), around this call
        if packed:
            out, lse = varlen(q, k_cache, v_cache, cu_seqlens_k=layout.cu_seqlens_q, max_seqlen_k=layout.max_seqlen_q,
                              **common)
        else:
            k = k_cache.reshape(-1, layout.page_size, n_kv, k_cache.shape[-1])
            v = v_cache.reshape(-1, layout.page_size, n_kv, v_cache.shape[-1])
            out, lse = varlen(q, k, v, seqused_k=layout.seq_lens, page_table=layout.block_table, **common)
    return out, (_lse_ours(lse) if return_lse else None)


def attention_backward_fa4(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of causal packed attention by FA4's backward, on any forward's `out` and
    our-convention `lse` (rule 8: the backward need only be correct)."""
    backward = getattr(_fa4_interface(), "_flash_attn_bwd", None)
    if backward is None:  # FA4 has no public backward entry point besides its autograd function
        raise UnsupportedError("attention_backward_fa4: this flash-attn-4 release has no "
                               "flash_attn.cute.interface._flash_attn_bwd (written against 4.0.0b36)")
    cu = cu_seqlens.to(torch.int32)
    lse_fa4 = (lse / LOG2E).t().contiguous()
    dq, dk, dv = backward(q, k, v, out, grad_out, lse_fa4, scale, True, cu_seqlens_q=cu, cu_seqlens_k=cu,
                          max_seqlen_q=max_seqlen, max_seqlen_k=max_seqlen)[:3]
    return dq, dk, dv
