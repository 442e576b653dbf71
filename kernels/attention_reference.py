"""attention_reference: the CPU reference of `attention.py`'s kernel, with the kernel's structure.

Per query, the keys in absolute-aligned blocks of `REFERENCE_BLOCK_N`, an fp32 (fp64 for fp64
inputs) online softmax with `exact_math`'s exp and per-output reductions: batch-invariant on the
CPU as the kernel is on the GPU (docs/design.md rule 2), equal to it in value, not bitwise.
A sequence's blocks go through torch several at a time (`_key_blocks`: one call per op for the
group, the recurrences block by block), which changes no bit and spares the CPU suite most of
its per-block calls (their cost was dispatch, not arithmetic).
Sliding windows and sinks as `attention_window.py` says.
"""

from __future__ import annotations

import math

import torch

from . import exact_math
from .attention_window import window_block_start
from .paged_layout import PagedLayout

REFERENCE_BLOCK_N = 16  # the reference's own fixed key block
_GROUP_ELEMENTS = 1 << 22  # products one group of key blocks materialises at most (memory)


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
        step = max(1, _GROUP_ELEMENTS // (n_q * n_heads * REFERENCE_BLOCK_N * max(head_dim, head_dim_v)))
        for b0 in range(first_block, n_blocks, step):
            b1 = min(b0 + step, n_blocks)
            m, l, acc = _key_blocks(q_s, keys, values, k_pos, q_pos, seq_len, window, scale, b0, b1, m, l, acc)
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


def _key_blocks(q_s, keys, values, k_pos, q_pos, seq_len: int, window: int | None, scale: float, b0: int, b1: int,
                m, l, acc):
    """The online softmax over key blocks ``b0 .. b1 - 1`` of one sequence from state ``(m, l, acc)``:
    the blocks' scores, running maxima (a cumulative max: max is exact), exponentials and P.V
    products in one call each (element-wise and per-output reductions of `REFERENCE_BLOCK_N`
    inputs, so each value is the one a block at a time gives), then the recurrences of ``l`` and
    ``acc`` block by block in the kernel's order."""
    n_b, bn = b1 - b0, REFERENCE_BLOCK_N
    blk = slice(b0 * bn, b1 * bn)
    kb = keys[blk].reshape(n_b, bn, *keys.shape[1:]).permute(0, 2, 1, 3)[:, None, :, None]  # [nb, 1, Hkv, 1, B, D]
    scores = exact_math.dot(q_s[None], kb) * scale  # [nb, n_q, Hkv, G, B]
    kp = k_pos[blk].reshape(n_b, 1, 1, 1, bn)
    visible = (kp <= q_pos[None]) & (kp < seq_len)
    if window is not None:
        visible = visible & (kp > q_pos[None] - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    m_all = torch.cummax(torch.cat([m[None], exact_math.row_max(scores)]), dim=0).values
    # a row whose window has not begun yet keeps its empty state (m = -inf): exponents of 0
    m_use = m_all[1:].masked_fill(m_all[1:] == float("-inf"), 0.0)
    alpha = exact_math.exp(m_all[:-1] - m_use)
    p = exact_math.exp(scores - m_use[..., None])
    sums = exact_math.row_sum(p)
    vb = values[blk].reshape(n_b, bn, *values.shape[1:]).permute(0, 2, 3, 1)[:, None, :, None]  # [nb, 1, Hkv, 1, Dv, B]
    pv = exact_math.dot(p[..., None, :], vb)  # [nb, n_q, Hkv, G, Dv]
    for b in range(n_b):
        l = l * alpha[b] + sums[b]
        acc = acc * alpha[b][..., None] + pv[b]
    return m_all[-1], l, acc
