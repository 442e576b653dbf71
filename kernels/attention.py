"""attention: causal GQA attention of new query tokens over a paged K/V cache.

One kernel serves training, chunked prefill and decode. Its input is a flat batch of query
tokens ``q[T, Hq, D]`` grouped by sequence (``cu_seqlens_q``), each sequence's total length
``seq_lens`` (cached context + its new tokens; the new tokens are the last ones) and a block
table mapping each sequence's positions to cache slots: position ``p`` of sequence ``s`` lives
in slot ``block_table[s, p // page_size] * page_size + p % page_size`` of the caches
``[slots, Hkv, D]``. Training is the same call with an empty context: its packed K/V *are* the
cache, read through a trivial block table with ``page_size = 1`` (`attention_packed.attention_packed`).

Invariance contract (docs/design.md rule 2): for every query row, the keys are reduced in blocks of
`BLOCK_N` aligned to absolute positions 0, BLOCK_N, 2*BLOCK_N, ... with an fp32 online softmax,
with `BLOCK_N` fixed (`page_size` is a runtime argument that Triton does not specialize on), so
a query's output is the same whether it is computed packed, in prefill chunks of any size, or as
a decode step. The rows per program, warps and stages follow the launch (`pick_config`: decode,
prefill and training tiles differ): each row's softmax denominator is summed in one fixed order
(`row_sum.row_sum_halves`), and the GPU sweep found every tile of 16 to 128 rows (mma.sync or
wgmma), warp and stage count bitwise equal. A tile may run past a row's last key; those blocks
are fully masked and leave the row's state bitwise unchanged (p = 0, alpha = exp2(0) = 1). No
split-KV. Packed training K/V may arrive by TMA instead of pointer loads (`kv_descriptors`):
the same values in the same tiles, so the same bits, and 1.4-1.6x faster on the H200; so may the
whole key blocks of a decode launch of few programs over pages of 64 (`page_descriptors`, one
copy per block from its page: 1.16-1.20x at 32 sequences of 1k-8k tokens). The cache layout and
its addressing helpers live in `paged_layout.py`. On Hopper, training and prompt launches of head dim 128
run `attention_gluon`'s warp-specialised kernel instead, with the same bits. The reference does the
same on CPU with `exact_math` (`attention_reference.py`). The backward (`attention_backward.py`) is
correct, not invariant.
"""

from __future__ import annotations

import math

import torch

from ._triton import (deep_pipeline, has_tma, launch_staged, next_power_of_2, num_sms, require_triton, tl,
                      tma_rows_aligned, triton)
from . import attention_gluon
from .attention_fa4 import attention_fa4
from .attention_forward_choice import choose_attention_forward
from .attention_reference import REFERENCE_BLOCK_N, attention_reference  # noqa: F401 (public here too)
from .attention_window import check_window_and_sinks
from .attention_tiles import (BLOCK_N, DECODE_BLOCK_M, HEAD_DIMS, TMA_HEAD_DIMS, VALUE_HEAD_DIMS, AttentionConfig,
                              few_decode_programs, pick_config, split_mask)
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .latent_attention import latent_attention_triton, value_in_key
from .paged_layout import PagedLayout, offsets_fit_int32, packed_layout, page_shift, page_slots  # noqa: F401 (public here too)
from .row_sum import lane_sums, row_sum_halves, row_sum_levels


@triton.jit
def _attend_block(q, k, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2, SUM_LEVELS: tl.constexpr,
                  LANE_SUMS: tl.constexpr, MASKED: tl.constexpr, window=0, WINDOWED: tl.constexpr = False):
    """One key block of the online softmax, the arithmetic every load path shares: scores, the
    causal mask (`MASKED`), running max, denominators summed in a fixed order, rescaled output.
    The scale is applied inside the exponent's FMA and to the row max of the raw scores (rounding
    is monotonic, so ``max(s) * c == max(s * c)`` for c > 0): a block gives the same bits with or
    without the mask when nothing in it is masked, so the blocks below every row's diagonal skip it.
    `WINDOWED`: the mask also hides keys at or below ``q_pos - window`` (`attention_window.py`),
    and a row still without a visible key (running max ``-inf``) takes exponents of 0, so that a
    block wholly before its window leaves its empty state empty instead of NaN."""
    s = tl.dot(q, tl.trans(k))
    if MASKED:
        visible = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
        if WINDOWED:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
    m_use = m_new
    if WINDOWED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(tl.fma(s, scale_log2, -m_use[:, None]))
    l_i = tl.fma(l_i, alpha, row_sum_halves(p, SUM_LEVELS, LANE_SUMS))  # a fixed order for every tile shape
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _paged_block(k_ptr, v_ptr, table_row, start, n_keys, page_size, page_shift, kv_head, stride_ks, stride_kh,
                 stride_vs, stride_vh, d, d_ok, dv, BLOCK_N: tl.constexpr, POW2_PAGES: tl.constexpr,
                 OFFSETS_32: tl.constexpr):
    """Key block `start` of a sequence through its block table: (k, v, positions, in range).

    The slots come from `paged_layout.page_slots` (`POW2_PAGES`: shift and mask; `OFFSETS_32`:
    32-bit addresses): 801 -> 511 SASS instructions a key block and warp in the sm_90 decode loop
    (`benchmarks/kernel_resources.py --kernel gqa --shape qwen3-0.6b`, 2026-11-28; checked by
    tests/test_kernel_resources.py). The same slots, so the same bits."""
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < n_keys
    slot = page_slots(table_row, k_pos, k_ok, page_size, page_shift, POW2_PAGES, OFFSETS_32)
    k = tl.load(k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + dv[None, :], mask=k_ok[:, None], other=0.0)
    return k, v, k_pos, k_ok


@triton.jit(do_not_specialize=["page_size", "page_shift", "stride_bt", "window"])
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, k_desc, v_desc,
    cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr, seq_order_ptr, sinks_ptr,
    page_size, page_shift, scale_log2, window,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_ot, stride_oh, stride_lt, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SUM_LEVELS: tl.constexpr,
    LANE_SUMS: tl.constexpr, KV_DESC: tl.constexpr, PAGE_DESC: tl.constexpr, SPLIT_MASK: tl.constexpr,
    POW2_PAGES: tl.constexpr = False, OFFSETS_32: tl.constexpr = False, HEADS_FASTEST: tl.constexpr = False,
    ORDERED: tl.constexpr = False, PDL: tl.constexpr = False, WINDOWED: tl.constexpr = False,
    SINKS: tl.constexpr = False,
):
    wait_for_inputs(PDL)
    # the last tiles of a causal sequence have the most keys: launch them first, so that the
    # light ones fill the end of the grid instead of a few heavy ones running alone
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    if HEADS_FASTEST:  # a sequence's KV heads side by side: they read neighbouring bytes of each cache row
        kv_head = tl.program_id(1)
        seq = tl.program_id(2)
    else:
        seq = tl.program_id(1)
        kv_head = tl.program_id(2)
    if ORDERED:  # PagedLayout.seq_order: which sequence this program's slot of the grid runs
        seq = tl.load(seq_order_ptr + seq)
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    # Row r of the tile is query token (tile*BLOCK_M + r) // GROUP, head (tile*BLOCK_M + r) % GROUP
    # of this KV head's group: the group's heads share each K/V block load.
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < q_len
    q_pos = context + q_idx
    token = (q_start + q_idx).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # HEAD_DIM padded to a power of two; the pad lanes load zeros
    d_ok = d < HEAD_DIM
    dv = tl.arange(0, HEAD_DIM_V)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    if SINKS:  # attention_window.py: the sink is each row's initial state (max = sink, denominator 1)
        m_i = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        l_i = tl.full((BLOCK_M,), 1.0, tl.float32)
    else:
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM_V), tl.float32)
    last_q = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    n_keys = context + last_q + 1
    # WINDOWED: the blocks wholly before the tile's first row's window are skipped; any row's
    # blocks before its own window are fully masked (attention_window.py), so the bits are the same
    lo = 0
    if WINDOWED:
        lo = tl.maximum(context + tile * BLOCK_M // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
    # key blocks [0, unmasked) lie wholly at or below the tile's first query position: no row of
    # the tile masks anything in them (SPLIT_MASK, never WINDOWED: a loop of their own; the same bits either way)
    unmasked = 0
    if SPLIT_MASK:
        unmasked = (context + tile * BLOCK_M // GROUP + 1) // BLOCK_N * BLOCK_N
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    if KV_DESC:
        # Packed training K/V (sequence s's keys are rows cu_seqlens_q[s]...): every key block
        # wholly inside the sequence comes through TMA, straight into shared memory, also the
        # tile's last block where it runs past n_keys into later tokens' keys: those are finite
        # and masked (p = 0 exactly, as for the pointer loads' zeros), so the arithmetic, and the
        # bits, are the same. Only the sequence's own partial last block takes pointer loads.
        first = tl.minimum(tl.cdiv(n_keys, BLOCK_N), seq_len // BLOCK_N) * BLOCK_N
        if SPLIT_MASK:
            for start in range(0, unmasked, BLOCK_N):
                k_pos = start + tl.arange(0, BLOCK_N)
                k = k_desc.load([q_start + start, kv_head * HEAD_DIM])
                v = v_desc.load([q_start + start, kv_head * HEAD_DIM_V])
                m_i, l_i, acc = _attend_block(q, k, v, k_pos, k_pos < n_keys, q_pos, m_i, l_i, acc, scale_log2,
                                              SUM_LEVELS, LANE_SUMS, False)
        for start in range(tl.maximum(unmasked, lo), first, BLOCK_N):
            k_pos = start + tl.arange(0, BLOCK_N)
            k = k_desc.load([q_start + start, kv_head * HEAD_DIM])
            v = v_desc.load([q_start + start, kv_head * HEAD_DIM_V])
            m_i, l_i, acc = _attend_block(q, k, v, k_pos, k_pos < n_keys, q_pos, m_i, l_i, acc, scale_log2, SUM_LEVELS,
                                          LANE_SUMS, True, window, WINDOWED)
    elif PAGE_DESC:
        # Decode over pages of whole key blocks: each block wholly below n_keys is one TMA copy
        # from its page, and the next block's slot is read a block ahead, so that the copies get
        # two buffers (a copy whose address waits on a load of the same iteration gets one). The
        # partial last block takes the pointer loads below, which never read an unwritten slot.
        first = n_keys // BLOCK_N * BLOCK_N
        slot = tl.load(table_row + lo // page_size, mask=lo < first, other=0) * page_size + lo % page_size
        for start in range(lo, first, BLOCK_N):
            k = k_desc.load([slot, kv_head * HEAD_DIM])
            v = v_desc.load([slot, kv_head * HEAD_DIM_V])
            ahead = start + BLOCK_N
            slot = tl.load(table_row + ahead // page_size, mask=ahead < first, other=0) * page_size + ahead % page_size
            k_pos = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _attend_block(q, k, v, k_pos, k_pos < n_keys, q_pos, m_i, l_i, acc, scale_log2, SUM_LEVELS,
                                          LANE_SUMS, True, window, WINDOWED)
    else:
        if SPLIT_MASK:
            for start in range(0, unmasked, BLOCK_N):
                k, v, k_pos, k_ok = _paged_block(k_ptr, v_ptr, table_row, start, n_keys, page_size, page_shift,
                                                 kv_head, stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, dv,
                                                 BLOCK_N, POW2_PAGES, OFFSETS_32)
                m_i, l_i, acc = _attend_block(q, k, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2, SUM_LEVELS,
                                              LANE_SUMS, False)
        first = unmasked
    # the diagonal blocks (KV_DESC, PAGE_DESC: the partial last one)
    for start in range(tl.maximum(first, lo), n_keys, BLOCK_N):
        k, v, k_pos, k_ok = _paged_block(k_ptr, v_ptr, table_row, start, n_keys, page_size, page_shift, kv_head,
                                         stride_ks, stride_kh, stride_vs, stride_vh, d, d_ok, dv, BLOCK_N, POW2_PAGES,
                                         OFFSETS_32)
        m_i, l_i, acc = _attend_block(q, k, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2, SUM_LEVELS, LANE_SUMS, True,
                                      window, WINDOWED)
    out = acc / l_i[:, None]
    tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    # log2-sum-exp2 of the scaled scores, for the backward
    tl.store(lse_ptr + token * stride_lt + head, m_i + tl.log2(l_i), mask=row_ok)


def kv_descriptors_fit(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether packed training K ``[T, Hkv, D]`` and V ``[T, Hkv, Dv]`` can be read through TMA
    tensor descriptors (`attention_triton`'s ``kv_descriptors``): a Hopper or newer GPU, head
    dims of `TMA_HEAD_DIMS` (powers of two: no padded lanes), heads side by side in each row and 16-byte
    aligned bases and row strides."""
    return has_tma(k.device) and tma_rows_aligned(k, v) and all(
        t.dim() == 3 and t.shape[-1] in TMA_HEAD_DIMS and t.stride(-1) == 1 and t.stride(-2) == t.shape[-1]
        for t in (k, v))


def page_descriptors_fit(k_cache: torch.Tensor, v_cache: torch.Tensor, page_size: int, rows_per_seq: int) -> bool:
    """Whether a launch over the paged caches ``[slots, Hkv, D]`` may read its whole key blocks
    through TMA tensor descriptors (`attention_triton`'s ``page_descriptors``): a decode launch
    (<= `DECODE_BLOCK_M` (query token, head) rows per sequence), a 16-bit cache, pages of a
    multiple of the key block `BLOCK_N` (a block then lies in one page) and what
    `kv_descriptors_fit` asks of packed K/V (Hopper, power-of-two head dims, heads side by side
    in 16-byte aligned rows)."""
    return (rows_per_seq <= DECODE_BLOCK_M and page_size % BLOCK_N == 0 and k_cache.dtype in (torch.bfloat16, torch.float16)
            and kv_descriptors_fit(k_cache, v_cache))


def _kv_descriptor(x: torch.Tensor, block_n: int):
    """A TMA descriptor over ``x [T, H, D]`` seen as ``[T, H*D]``: one block is `block_n` rows of
    one head."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(x, [x.shape[0], x.shape[1] * x.shape[2]], [x.stride(0), 1], [block_n, x.shape[2]])


def attention_triton(q, k_cache, v_cache, layout: PagedLayout, scale: float, config: AttentionConfig | None = None,
                     kv_descriptors: bool = False, page_descriptors: bool | None = None, window: int | None = None,
                     sinks: torch.Tensor | None = None):
    """(out, lse) of the GQA kernel with `config` (default `pick_config`'s). Public for the GPU
    sweeps that compare launch parameters (benchmarks/attention_configs.py); models call `attention`.

    `kv_descriptors`: `k_cache`/`v_cache` are packed training tensors and `layout` is their
    `packed_layout`; whole key blocks are then read through TMA descriptors (the same values,
    so the same bits; check `kv_descriptors_fit` first on a GPU). `page_descriptors`: a decode
    launch over paged caches reads its whole key blocks through TMA descriptors, page by page
    (default: where `page_descriptors_fit` and the launch has few programs, `few_decode_programs`;
    the same bits). Without a `config` or page
    descriptors, a prompt or packed training launch that `attention_gluon.fits` runs the Gluon
    kernel instead (``VEXACT_ATTENTION_PREFILL``; the same bits). `window` and `sinks`
    (`attention_window.py`) run the Triton kernel (the Gluon kernel does not take them), every key
    block under the mask (no split-mask loop: the same bits either way)."""
    require_triton("attention")
    if kv_descriptors and layout.page_size != 1:
        raise ValueError(f"attention_triton: kv_descriptors=True needs packed K/V (a packed_layout, page_size 1), "
                         f"got page_size={layout.page_size}")
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, head_dim_v = k_cache.shape[-2], v_cache.shape[-1]
    k = k_cache.reshape(-1, n_kv_heads, head_dim)
    v = v_cache.reshape(-1, n_kv_heads, head_dim_v)
    # a prompt or training launch runs the Gluon kernel (1.5x on prompt steps, 1.04-1.29x in training)
    windowed, with_sinks = window is not None, sinks is not None
    sinks = sinks.contiguous() if with_sinks else None  # the kernel reads sinks[head]
    if (config is None and not page_descriptors and not windowed and not with_sinks
            and attention_gluon.ATTENTION_PREFILL.mode() == "gluon"
            and attention_gluon.fits(q, k, v, layout, contiguous=kv_descriptors)):
        return attention_gluon.attention_prefill_gluon(q, k, v, layout, scale, contiguous=kv_descriptors)
    out = torch.empty((n_tokens, n_heads, head_dim_v), device=q.device, dtype=q.dtype)
    lse = torch.empty((n_tokens, n_heads), device=q.device, dtype=torch.float32)
    n_seqs = layout.seq_lens.shape[0]
    if n_tokens == 0 or n_seqs == 0:
        return out, lse
    group = n_heads // n_kv_heads
    rows = layout.max_seqlen_q * group
    programs, sms, deep = n_seqs * n_kv_heads * triton.cdiv(rows, DECODE_BLOCK_M), num_sms(q.device), deep_pipeline(q.device)
    few = few_decode_programs(programs, sms, deep)
    if page_descriptors is None:  # where they pay: launches of few programs (`pick_config`)
        page_descriptors = not kv_descriptors and few and page_descriptors_fit(k, v, layout.page_size, rows)
    cfg = config or pick_config(head_dim, rows, q.dtype, programs, sms, deep, page_descriptors)
    split = split_mask(cfg) and not windowed
    if page_descriptors and (kv_descriptors or layout.page_size % cfg.block_n or split):
        raise ValueError(f"attention_triton: page_descriptors=True needs paged decode tiles (not kv_descriptors, no "
                         f"split mask) over pages of a multiple of block_n={cfg.block_n}, got "
                         f"page_size={layout.page_size}, block_m={cfg.block_m}, kv_descriptors={kv_descriptors}")
    descs = ((_kv_descriptor(k, cfg.block_n), _kv_descriptor(v, cfg.block_n)) if kv_descriptors or page_descriptors
             else (None, None))
    shift, offsets_32 = page_shift(layout.page_size), offsets_fit_int32(k, v)
    grid = (triton.cdiv(layout.max_seqlen_q * group, cfg.block_m),
            *((n_kv_heads, n_seqs) if cfg.heads_fastest else (n_seqs, n_kv_heads)))
    args = (q, k, v, out, lse, *descs, layout.cu_seqlens_q, layout.seq_lens, layout.block_table, layout.seq_order,
            sinks, layout.page_size, shift or 0, scale * math.log2(math.e), window or 0,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            out.stride(0), out.stride(1), lse.stride(0), layout.block_table.stride(0))
    kwargs = dict(GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=next_power_of_2(head_dim),
                  BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, SUM_LEVELS=row_sum_levels(cfg.block_n),
                  LANE_SUMS=lane_sums(cfg.block_m, cfg.num_warps), KV_DESC=kv_descriptors, PAGE_DESC=page_descriptors,
                  SPLIT_MASK=split, POW2_PAGES=shift is not None, OFFSETS_32=offsets_32,
                  HEADS_FASTEST=cfg.heads_fastest, WINDOWED=windowed, SINKS=with_sinks,
                  ORDERED=layout.seq_order is not None, num_warps=cfg.num_warps,
                  # few programs: no PDL. Launched dependently, a 256-program decode at 8k tokens
                  # took 1.27x as long (TMA, 242 -> 307 us), the step 1.09x (H200, 2026-11-26)
                  **dependent_launch_kwargs(q.device, allowed=not few))
    key = ("attention", q.device, q.dtype, group, head_dim, head_dim_v, cfg, kv_descriptors, page_descriptors,
           shift is not None, offsets_32, windowed, with_sinks)
    launch_staged(_attention_fwd_kernel, grid, args, kwargs, cfg.num_stages, key, fp_fusion=True, fallback=config is None)
    return out, lse


def check_attention_inputs(q, k_cache, v_cache, layout, window: int | None = None, sinks: torch.Tensor | None = None):
    """ValueError naming the mismatch when q, the K/V (cache), `layout`, `window` and `sinks` do
    not fit together (latent MLA, V a view of K, takes neither window nor sinks)."""
    check_window_and_sinks("attention", q, window, sinks)
    if (window is not None or sinks is not None) and value_in_key(k_cache, v_cache):
        raise ValueError("attention: window and sinks are not supported for latent MLA (V a view of K); "
                         f"got window={window!r}, sinks {'set' if sinks is not None else 'None'}")
    if q.dim() != 3:
        raise ValueError(f"attention: q must be [tokens, heads, head_dim], got {tuple(q.shape)}")
    if q.shape[1] % k_cache.shape[-2]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k_cache.shape[-2]} KV heads")
    if k_cache.shape[-1] != q.shape[-1]:
        raise ValueError(f"attention: key head_dim {k_cache.shape[-1]} != query head_dim {q.shape[-1]}")
    if layout.page_size < 1:
        raise ValueError(f"attention: page_size must be >= 1, got {layout.page_size}")
    order = layout.seq_order
    if order is not None and (order.shape != layout.seq_lens.shape or order.dtype != torch.int32
                              or order.device != layout.seq_lens.device):
        raise ValueError(f"attention: layout.seq_order must be int32 {tuple(layout.seq_lens.shape)} on "
                         f"{layout.seq_lens.device} like seq_lens, got {order.dtype} {tuple(order.shape)} on {order.device}")


def attention_backend(q: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None) -> str:
    """The backend ("triton" or "reference") that runs attention on q, k and v (`backend.select`)."""
    if k is not None and value_in_key(k, v):  # latent MLA: kernels/latent_attention.py pads any dims
        return select("attention", q)
    backend = select("attention", q, head_dim=q.shape[-1], head_dims=HEAD_DIMS)
    if backend == "triton":  # the value head dim has its own (power of two) list
        select("attention", q, head_dim=v.shape[-1], head_dims=VALUE_HEAD_DIMS)
    return backend


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, layout: PagedLayout,
              scale: float | None = None, return_lse: bool = False, window: int | None = None,
              sinks: torch.Tensor | None = None):
    """Causal attention of `q` (``[T, Hq, D]``) over the cache (``[..., Hkv, D]`` flattened to
    slots) described by `layout`. Returns ``[T, Hq, Dv]`` in q's dtype (and with `return_lse`
    the ``[T, Hq]`` fp32 log2-sum-exp2 of the scores scaled by ``scale * log2(e)``).

    `window` (None or an int >= 1): the query at position p sees keys p - window + 1 .. p
    (transformers' ``sliding_window``); `sinks` (``[Hq]``, None or a float tensor): a logit per
    query head that joins each row's softmax denominator (GPT-OSS). `attention_window.py` says how
    both keep the bits. Not differentiable: training goes through `attention_packed`.
    """
    check_attention_inputs(q, k_cache, v_cache, layout, window, sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if attention_backend(q, v_cache, k_cache) == "triton":
        out, lse = attention_forward_triton(q, k_cache, v_cache, layout, scale, need_lse=return_lse, window=window,
                                            sinks=sinks)
        return (out, lse) if return_lse else out
    return attention_reference(q, k_cache, v_cache, layout, scale, return_lse, window, sinks)


def attention_forward_triton(q, k_cache, v_cache, layout: PagedLayout, scale: float, packed: bool = False,
                             need_lse: bool = True, window: int | None = None, sinks: torch.Tensor | None = None):
    """(out, lse) from the GQA kernel, or from the latent MLA kernel when V is a view of K, or
    from FlashAttention-4 when the forward switch says ``fa4`` (`attention_forward_choice`;
    its lse is None unless `need_lse`). `packed`: the K/V are packed training tensors (TMA
    loads where they fit). `window` / `sinks`: the GQA kernel's (`attention_triton`)."""
    if value_in_key(k_cache, v_cache):
        return latent_attention_triton(q, k_cache, v_cache.shape[-1], layout, scale, packed=packed)
    if choose_attention_forward(q, k_cache, v_cache, windowed=window is not None or sinks is not None) == "fa4":
        return attention_fa4(q, k_cache, v_cache, layout, scale, packed=packed, return_lse=need_lse)
    return attention_triton(q, k_cache, v_cache, layout, scale,
                            kv_descriptors=packed and kv_descriptors_fit(k_cache, v_cache), window=window, sinks=sinks)
