"""attention_reference: the CPU reference of `attention.py`'s kernel, with the kernel's structure.

Per query, the keys in absolute-aligned blocks of `REFERENCE_BLOCK_N`, an fp32 (fp64 for fp64
inputs) online softmax with `exact_math`'s exp and per-output reductions: batch-invariant on the
CPU as the kernel is on the GPU (docs/design.md rule 2), equal to it in value, not bitwise.
Blocks go through torch several at a time and the sequences with as many queries together (a
decode step's: `_key_blocks`, one call per op for the group, the recurrences block by block),
which changes no bit of a sequence's rows and spares the CPU suite most of its per-sequence,
per-block calls (their cost was dispatch, not arithmetic: 40x at 64 decode rows).
Sliding windows and sinks as `attention_window.py` says.
"""

from __future__ import annotations

import math
from typing import NamedTuple

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
    its head's sink logit (running max = sink, denominator 1), as the kernel's does.

    Sequences with as many queries (a decode step's, one each) go through together, a block at a
    time for all of them: a sequence's rows are the bits it gets alone (element-wise operations
    and per-output reductions; blocks outside a sequence change nothing of it)."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    n_heads, n_kv_heads = q.shape[1], k_cache.shape[-2]
    k_flat = k_cache.reshape(-1, n_kv_heads, k_cache.shape[-1])
    v_flat = v_cache.reshape(-1, n_kv_heads, v_cache.shape[-1])
    out = torch.empty((q.shape[0], n_heads, v_cache.shape[-1]), dtype=q.dtype)
    lse = torch.empty((q.shape[0], n_heads), dtype=torch.float32)
    cu, seq_lens = layout.cu_seqlens_q.tolist(), layout.seq_lens.tolist()
    by_queries: dict[int, list[int]] = {}
    for s in range(len(seq_lens)):
        if cu[s + 1] > cu[s]:
            by_queries.setdefault(cu[s + 1] - cu[s], []).append(s)
    for n_q, seqs in by_queries.items():
        together = max(1, _GROUP_ELEMENTS // _block_elements(n_q, n_heads, k_cache.shape[-1], v_cache.shape[-1]))
        for start in range(0, len(seqs), together):
            part = seqs[start:start + together]
            rows = torch.tensor([cu[s] for s in part])[:, None] + torch.arange(n_q)  # [S, n_q] token indices
            o, e = _sequences(q[rows].to(compute), k_flat, v_flat, layout, part, [seq_lens[s] for s in part],
                              scale, window, sinks)
            out[rows] = o.to(q.dtype)
            lse[rows] = e
    return (out, lse) if return_lse else out


def _sequences(q_rows, k_flat, v_flat, layout: PagedLayout, seqs: list[int], seq_lens: list[int], scale: float,
               window: int | None, sinks):
    """Output ``[S, n_q, Hq, Dv]`` and LSE ``[S, n_q, Hq]`` of sequences `seqs`, each with the
    ``n_q`` queries of `q_rows` ``[S, n_q, Hq, D]`` (compute dtype) at its last positions."""
    n_seqs, n_q, n_heads, head_dim = q_rows.shape
    n_kv_heads, bn = k_flat.shape[1], REFERENCE_BLOCK_N
    group, head_dim_v = n_heads // n_kv_heads, v_flat.shape[-1]
    q_s = q_rows.reshape(n_seqs, 1, n_q, n_kv_heads, group, 1, head_dim)
    lens = torch.tensor(seq_lens)
    first = torch.tensor([window_block_start(n - n_q, window, bn) // bn for n in seq_lens])
    n_blocks = -(-lens // bn)
    m, l = _initial_state(sinks, n_seqs * n_q, n_kv_heads, group, q_rows.dtype)
    m, l = m.reshape(n_seqs, n_q, n_kv_heads, group), l.reshape(n_seqs, n_q, n_kv_heads, group)
    acc = torch.zeros((n_seqs, n_q, n_kv_heads, group, head_dim_v), dtype=q_rows.dtype)
    blocks = SequenceBlocks(torch.tensor(seqs), lens, lens[:, None] - n_q + torch.arange(n_q), first, n_blocks)
    step = max(1, _GROUP_ELEMENTS // (n_seqs * _block_elements(n_q, n_heads, head_dim, head_dim_v)))
    end = int(n_blocks.max())
    for b0 in range(int(first.min()), end, step):
        b1 = min(b0 + step, end)
        m, l, acc = _key_blocks(q_s, k_flat, v_flat, layout, blocks, window, scale, b0, b1, m, l, acc)
    out = (acc / l[..., None]).reshape(n_seqs, n_q, n_heads, head_dim_v)
    return out, ((m + exact_math.log(l)) * math.log2(math.e)).reshape(n_seqs, n_q, n_heads).float()


def _block_elements(n_q: int, n_heads: int, head_dim: int, head_dim_v: int) -> int:
    """The products one key block of one sequence holds (the larger of its scores' and P.V's)."""
    return n_q * n_heads * REFERENCE_BLOCK_N * max(head_dim, head_dim_v)


class SequenceBlocks(NamedTuple):
    """Sequences taken together: their ids, key counts ``[S]``, query positions ``[S, n_q]``, and
    the first block each reads and its block count ``[S]``."""

    seqs: torch.Tensor
    lens: torch.Tensor
    q_pos: torch.Tensor
    first: torch.Tensor
    n_blocks: torch.Tensor


def _initial_state(sinks, n_q: int, n_kv_heads: int, group: int, compute: torch.dtype):
    """A row's online-softmax state before its first key block: ``(-inf, 0)``, or with `sinks`
    ``(sink, 1)``: the sink's term ``exp(sink - m) = 1`` is in the denominator from the start."""
    if sinks is None:
        return (torch.full((n_q, n_kv_heads, group), float("-inf"), dtype=compute),
                torch.zeros((n_q, n_kv_heads, group), dtype=compute))
    m = sinks.detach().to("cpu", compute).reshape(1, n_kv_heads, group).expand(n_q, -1, -1).clone()
    return m, torch.ones((n_q, n_kv_heads, group), dtype=compute)


def _key_blocks(q_s, k_flat, v_flat, layout: PagedLayout, blocks: SequenceBlocks, window: int | None, scale: float,
                b0: int, b1: int, m, l, acc):
    """The online softmax over key blocks ``b0 .. b1 - 1`` of sequences `blocks` from state
    ``(m, l, acc)``: the blocks' keys and values read through the page table, their scores, running
    maxima (a cumulative max: max is exact), exponentials and P.V products in one call each
    (element-wise and per-output reductions of `REFERENCE_BLOCK_N` inputs, so each value is the
    one a block at a time gives), then the recurrences of ``l`` and ``acc`` block by block in the
    kernel's order, each sequence's only over its own blocks."""
    n_seqs, n_b, bn = q_s.shape[0], b1 - b0, REFERENCE_BLOCK_N
    k_pos = torch.arange(b0 * bn, b1 * bn)
    pages = layout.block_table[blocks.seqs].long()[:, (k_pos // layout.page_size).clamp(max=layout.block_table.shape[1] - 1)]
    real = k_pos[None] < blocks.lens[:, None]  # [S, nb * B]
    slots = torch.where(real, pages * layout.page_size + k_pos % layout.page_size, 0)
    keys = k_flat[slots].to(q_s.dtype).masked_fill(~real[..., None, None], 0)
    values = v_flat[slots].to(q_s.dtype).masked_fill(~real[..., None, None], 0)
    kb = keys.reshape(n_seqs, n_b, bn, *keys.shape[2:]).permute(0, 1, 3, 2, 4)[:, :, None, :, None]
    scores = exact_math.dot(q_s, kb) * scale  # [S, nb, n_q, Hkv, G, B]
    kp = k_pos.reshape(1, n_b, 1, 1, 1, bn)
    qp = blocks.q_pos.reshape(n_seqs, 1, -1, 1, 1, 1)
    visible = (kp <= qp) & (kp < blocks.lens.reshape(n_seqs, 1, 1, 1, 1, 1))
    if window is not None:
        visible = visible & (kp > qp - window)
    scores = scores.masked_fill(~visible, float("-inf"))
    m_all = torch.cummax(torch.cat([m[:, None], exact_math.row_max(scores)], dim=1), dim=1).values
    # a row whose window has not begun yet keeps its empty state (m = -inf): exponents of 0
    m_use = m_all[:, 1:].masked_fill(m_all[:, 1:] == float("-inf"), 0.0)
    alpha = exact_math.exp(m_all[:, :-1] - m_use)
    p = exact_math.exp(scores - m_use[..., None])
    sums = exact_math.row_sum(p)
    vb = values.reshape(n_seqs, n_b, bn, *values.shape[2:]).permute(0, 1, 3, 4, 2)[:, :, None, :, None]
    pv = exact_math.dot(p[..., None, :], vb)  # [S, nb, n_q, Hkv, G, Dv]
    block = torch.arange(b0, b1)[None]
    live = ((block >= blocks.first[:, None]) & (block < blocks.n_blocks[:, None])).reshape(n_seqs, n_b, 1, 1, 1)
    for b in range(n_b):
        l = torch.where(live[:, b], l * alpha[:, b] + sums[:, b], l)
        acc = torch.where(live[:, b, ..., None], acc * alpha[:, b, ..., None] + pv[:, b], acc)
    return m_all[:, -1], l, acc
