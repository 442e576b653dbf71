"""attention_reference: the CPU reference of `attention.py`'s kernel, with the kernel's structure.

Per query, the keys in absolute-aligned blocks of `REFERENCE_BLOCK_N`, an fp32 (fp64 for fp64
inputs) online softmax with `exact_math`'s exp and per-output reductions: batch-invariant on the
CPU as the kernel is on the GPU (docs/design.md rule 2), equal to it in value, not bitwise.
Sliding windows and sinks as `attention_window.py` says.
"""

from __future__ import annotations

import math

import torch

from . import exact_math
from .attention_window import window_block_start
from .paged_layout import PagedLayout

REFERENCE_BLOCK_N = 16  # the reference's own fixed key block


def attention_reference(q, k_cache, v_cache, layout: PagedLayout, scale: float, return_lse: bool = False,
                        window: int | None = None, sinks: torch.Tensor | None = None):
    """CPU reference with the kernel's structure: per query, keys in absolute-aligned blocks of
    `REFERENCE_BLOCK_N`, fp32 online softmax with `exact_math` exp and per-output reductions.
    With `return_lse` also the ``[T, Hq]`` fp32 log2-sum-exp2 of the scores scaled by
    ``scale * log2(e)``, the kernel's LSE (equal in value, not bitwise; with `sinks` the sink's
    term is in it). `window`: the query at position p sees keys p - window + 1 .. p; blocks wholly
    before a sequence's first window are skipped. `sinks` ``[Hq]``: each row's softmax starts from
    its head's sink logit (running max = sink, denominator 1), as the kernel's does."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, head_dim_v = k_cache.shape[-2], v_cache.shape[-1]
    group = n_heads // n_kv_heads
    k_flat = k_cache.reshape(-1, n_kv_heads, head_dim)
    v_flat = v_cache.reshape(-1, n_kv_heads, head_dim_v)
    out = torch.empty((n_tokens, n_heads, head_dim_v), dtype=q.dtype)
    lse = torch.empty((n_tokens, n_heads), dtype=torch.float32)
    cu = layout.cu_seqlens_q.tolist()
    for s, seq_len in enumerate(layout.seq_lens.tolist()):
        q_s = q[cu[s]:cu[s + 1]].to(compute).reshape(-1, n_kv_heads, group, 1, head_dim)
        n_q = q_s.shape[0]
        if n_q == 0:
            continue
        q_pos = torch.arange(seq_len - n_q, seq_len)[:, None, None, None]
        first_block = window_block_start(seq_len - n_q, window, REFERENCE_BLOCK_N) // REFERENCE_BLOCK_N
        n_blocks = -(-seq_len // REFERENCE_BLOCK_N)
        k_pos = torch.arange(n_blocks * REFERENCE_BLOCK_N)
        pages = layout.block_table[s].long()[(k_pos // layout.page_size).clamp(max=layout.block_table.shape[1] - 1)]
        slots = torch.where(k_pos < seq_len, pages * layout.page_size + k_pos % layout.page_size, 0)
        keys = k_flat[slots].to(compute).masked_fill((k_pos >= seq_len)[:, None, None], 0)
        values = v_flat[slots].to(compute).masked_fill((k_pos >= seq_len)[:, None, None], 0)
        m, l = _initial_state(sinks, n_q, n_kv_heads, group, compute)
        acc = torch.zeros((n_q, n_kv_heads, group, head_dim_v), dtype=compute)
        for b in range(first_block, n_blocks):
            blk = slice(b * REFERENCE_BLOCK_N, (b + 1) * REFERENCE_BLOCK_N)
            kb = keys[blk].permute(1, 0, 2)[None, :, None]  # [1, Hkv, 1, B, D]
            scores = exact_math.dot(q_s, kb) * scale  # [n_q, Hkv, G, B]
            visible = (k_pos[blk][None, None, None, :] <= q_pos) & (k_pos[blk] < seq_len)
            if window is not None:
                visible = visible & (k_pos[blk][None, None, None, :] > q_pos - window)
            scores = scores.masked_fill(~visible, float("-inf"))
            m_new = torch.maximum(m, exact_math.row_max(scores))
            # a row whose window has not begun yet keeps its empty state (m = -inf): exponents of 0
            m_use = m_new.masked_fill(m_new == float("-inf"), 0.0)
            alpha = exact_math.exp(m - m_use)
            p = exact_math.exp(scores - m_use[..., None])
            l = l * alpha + exact_math.row_sum(p)
            vb = values[blk].permute(1, 2, 0)[None, :, None]  # [1, Hkv, 1, Dv, B]
            acc = acc * alpha[..., None] + exact_math.dot(p[..., None, :], vb)
            m = m_new
        out[cu[s]:cu[s + 1]] = (acc / l[..., None]).reshape(n_q, n_heads, head_dim_v).to(q.dtype)
        lse[cu[s]:cu[s + 1]] = ((m + torch.log(l)) * math.log2(math.e)).reshape(n_q, n_heads).float()
    return (out, lse) if return_lse else out


def _initial_state(sinks, n_q: int, n_kv_heads: int, group: int, compute: torch.dtype):
    """A row's online-softmax state before its first key block: ``(-inf, 0)``, or with `sinks`
    ``(sink, 1)``: the sink's term ``exp(sink - m) = 1`` is in the denominator from the start."""
    if sinks is None:
        return (torch.full((n_q, n_kv_heads, group), float("-inf"), dtype=compute),
                torch.zeros((n_q, n_kv_heads, group), dtype=compute))
    m = sinks.detach().to("cpu", compute).reshape(1, n_kv_heads, group).expand(n_q, -1, -1).clone()
    return m, torch.ones((n_q, n_kv_heads, group), dtype=compute)
