"""GQA decode attention in Gluon (Hopper): persistent and warp-specialised, key-major dots.

WORK IN PROGRESS (thirty-sixth session): compiled for sm_90 on the CPU only, never run on a GPU.
Neither its bits nor its speed are known; `attention_triton` routes decode launches to it only
under ``VEXACT_ATTENTION_DECODE=gluon``.

Why: the Triton decode launch (16-row tiles, up to four programs an SM) reads the cache at 85-87%
of the copy bandwidth at 128 sequences of ~544 tokens and 92% at 256 (twenty-third and
twenty-fifth sessions): each (sequence, KV head) program loads its query, block table and first
blocks before its first dot, and only the other programs on the SM hide that latency. At long
contexts the same launch reads at the copy bandwidth, so the loss is per program. Here one program an SM
takes (sequence, KV head) tiles from a global counter and a producer warp copies every tile's K/V
blocks into a ring of stages, the next tile's first blocks while the consumers finish the last
(`attention_gluon`'s producer, tile queue and barriers, reused as they are).

The consumers: two warpgroups, each the tile's full scores and softmax and one half of the value
dims, key-major as `latent_decode_gluon` (the query's group of heads is 2-8 rows, an MMA's N):

- ``S^T [64 keys, R] = K . Q^T``, A = the key block, B = the group's query rows (``R`` = the group
  padded to 8) from shared memory;
- `attention._attend_block`'s softmax column by column (a head per column), its operations in its
  order: the mask, the scaled raw max, exponents by one FMA, denominators by halves
  (`latent_decode_gluon.key_sum_halves`, `row_sum.row_sum_halves`' order);
- ``O^T [64 value dims, R] += V^T . P^T`` over the warpgroup's half of the value dims.

Same bits as the Triton decode launch, by the argument of `latent_decode_gluon` (rule 2): each
output element is the same sequence of fp32 operations; a transposed product swaps which operand
is A, not the products or their order. The sequence's partial last block is zeroed past its last
key by the producer (`attention_gluon._copy_block`), the zeros the Triton pointer loads read.
"""

from __future__ import annotations

import math

import torch

from ._triton import has_tma, num_sms, tma_rows_aligned
from .attention_tiles import BLOCK_N
from .gluon_support import HAS_GLUON, tma_descriptor
from .kernel_switch import KernelSwitch
from .row_sum import row_sum_levels

__all__ = ["ATTENTION_DECODE", "CONFIGS", "HEAD_DIM", "MAX_GROUP", "attention_decode_gluon", "fits", "launch", "shape_fits"]

#: ``VEXACT_ATTENTION_DECODE``: ``triton`` (the default until this kernel's bits and speed are
#: measured) or ``gluon`` (this kernel for every decode launch it `fits`)
ATTENTION_DECODE = KernelSwitch("VEXACT_ATTENTION_DECODE", ("triton", "gluon"), "triton", "GQA decode kernel")
HEAD_DIM = 128
MAX_GROUP = 8  # query heads per KV head the kernel takes: its N of 8 (Qwen3 2-8, Llama 4, Qwen2.5-7B 7)
#: (K/V stages of 32 KB, programs an SM, registers a thread of each consumer warpgroup, of the
#: producer, scores a block ahead), each with its blocks one after another or pipelined
#: (`_attend_tile_ahead`). One program an SM with a deep ring: 192 / 48 registers (the default
#: partition's 144), no spills on sm_90 (compiled on the CPU; at 120 the pipelined first consumer
#: spilled). Two programs an SM with three stages each: their 24 warps fit the register file at
#: 80 a thread, where the first consumer spills 12-24 bytes whatever the split. None was timed yet.
CONFIGS = ((4, 1, 192, 48, False), (4, 1, 192, 48, True), (3, 2, 96, 48, False), (3, 2, 96, 48, True))

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                   warpgroup_mma_wait)

    from .attention_gluon import producer, release_ring_barriers, ring_barriers
    from .gluon_support import grid_tile, receive_tile
    from .latent_decode_gluon import key_sum_halves


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout) -> bool:
    """Whether this kernel takes a launch: a Hopper GPU with a verified Gluon and `shape_fits`."""
    return HAS_GLUON and q.is_cuda and has_tma(q.device) and shape_fits(q, k, v, layout)


def shape_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout) -> bool:
    """A decode launch (one query token a sequence) of 16-bit ``q [T, Hq, 128]`` over paged K/V
    ``[slots, Hkv, 128]`` with heads side by side in 16-byte aligned rows, at most `MAX_GROUP`
    query heads per KV head, over pages of a multiple of the 64-key block."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False
    return (layout.max_seqlen_q == 1 and q.shape[1] // k.shape[1] <= MAX_GROUP and layout.page_size % BLOCK_N == 0
            and q.shape[-1] == k.shape[-1] == v.shape[-1] == HEAD_DIM and k.shape[1] == v.shape[1]
            and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and all(t.stride(-1) == 1 and t.stride(-2) == HEAD_DIM for t in (q, k, v)) and tma_rows_aligned(k, v))


if HAS_GLUON:
    @gluon.jit
    def _store_query(q_ptr, q_smem, token, kv_head, stride_qt, stride_qh, GROUP: gl.constexpr, R: gl.constexpr,
                     D: gl.constexpr):
        """The token's `GROUP` query heads of `kv_head` into ``q_smem [R, D]`` (zeros below), for the
        score MMA's B operand."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        rows = gl.arange(0, R, layout=gl.SliceLayout(1, ld))
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q = gl.load(q_ptr + token * stride_qt + (kv_head * GROUP + rows)[:, None] * stride_qh + d[None, :],
                    mask=(rows < GROUP)[:, None], other=0.0)
        q_smem.store(q)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _softmax_columns(s, block, n_keys, m_i, l_i, scale_log2, cols: gl.constexpr, BLOCK_N: gl.constexpr,
                         SUM_LEVELS: gl.constexpr):
        """`attention._attend_block`'s softmax on the raw scores ``S^T [keys, heads]`` of key block
        `block`, a head per column: a decode query sees every key below `n_keys` (the causal mask
        and the launch's keys agree there), the scale applied to the raw max, exponents by one FMA,
        denominators by halves. ``(p, m, l, alpha)``."""
        s = gl.convert_layout(s, cols)
        k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cols))
        s = gl.where((k_pos < n_keys)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0) * scale_log2)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(gl.fma(s, scale_log2, -m_new[None, :]))
        l_i = l_i * alpha + gl.convert_layout(key_sum_halves(p, SUM_LEVELS), gl.SliceLayout(0, cols))
        return p, m_new, l_i, alpha

    @gluon.jit
    def _store_half(acc, m_i, l_i, o_ptr, lse_ptr, token, kv_head, stride_ot, stride_oh, stride_lt, HALF_IX: gl.constexpr,
                    mma: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr, HALF: gl.constexpr):
        """``out = O / l`` of this warpgroup's value dims for the group's heads, and (the first half's
        warpgroup) ``lse = m + log2(l)``."""
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, mma))[None, :]
        dims = HALF_IX * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, mma))
        heads = gl.arange(0, R, layout=gl.SliceLayout(0, mma))
        gl.store(o_ptr + token * stride_ot + (kv_head * GROUP + heads)[None, :] * stride_oh + dims[:, None],
                 out.to(o_ptr.dtype.element_ty), mask=(heads < GROUP)[None, :])
        if HALF_IX == 0:
            heads_l = gl.arange(0, R, layout=l_i.type.layout)
            gl.store(lse_ptr + token * stride_lt + kv_head * GROUP + heads_l, m_i + gl.log2(l_i), mask=heads_l < GROUP)

    @gluon.jit
    def _issue_scores(k_stage, q_smem, mma: gl.constexpr, BLOCK_N: gl.constexpr, R: gl.constexpr):
        """``S^T = K . Q^T`` of one key block, issued asynchronously."""
        return warpgroup_mma(k_stage, q_smem.permute((1, 0)), gl.zeros([BLOCK_N, R], gl.float32, layout=mma),
                             is_async=True)

    @gluon.jit
    def _issue_value_dot(v_stage, p_smem, acc, HALF_IX: gl.constexpr, HALF: gl.constexpr):
        """``O^T += V^T . P^T`` over value dims ``HALF * HALF_IX ..`` of one block, issued asynchronously."""
        return warpgroup_mma(v_stage.slice(HALF_IX * HALF, HALF, dim=1).permute((1, 0)), p_smem.permute((1, 0)), acc,
                             is_async=True)

    @gluon.jit
    def _stage_probabilities(p, p_smem):
        """``P^T`` into shared memory for the value dot's B operand, visible to the MMA of every warp."""
        p_smem.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def _attend_tile(k_smem, v_smem, q_smem, p_smem, ready, empty, it, n_blocks, n_keys, scale_log2,
                     HALF_IX: gl.constexpr, mma: gl.constexpr, cols: gl.constexpr, R: gl.constexpr, D: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr):
        """A tile's blocks from ring position `it` on, one after another: scores, softmax, value dot,
        each stage released after its value dot. ``(O^T half, m, l)``."""
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, cols))
        l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(0, cols))
        acc = gl.zeros([D // 2, R], gl.float32, layout=mma)
        for i in range(n_blocks):
            stage = (it + i) % STAGES
            phase = ((it + i) // STAGES) & 1
            mbarrier.wait(ready.index(stage), phase)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_scores(k_smem.index(stage), q_smem, mma, BLOCK_N,
                                                                          R), ))
            p, m_i, l_i, alpha = _softmax_columns(s, i, n_keys, m_i, l_i, scale_log2, cols, BLOCK_N, SUM_LEVELS)
            _stage_probabilities(p, p_smem)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma))[None, :]
            mbarrier.wait(ready.index(STAGES + stage), phase)
            acc = _issue_value_dot(v_smem.index(stage), p_smem, acc, HALF_IX, D // 2)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(stage), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _attend_tile_ahead(k_smem, v_smem, q_smem, p_smem, ready, empty, it, n_blocks, n_keys, scale_log2,
                           HALF_IX: gl.constexpr, mma: gl.constexpr, cols: gl.constexpr, R: gl.constexpr,
                           D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr):
        """`_attend_tile` with block ``i``'s scores issued before block ``i - 1``'s value dot and its
        softmax run while that dot is on the tensor cores (the prefill consumer's pipelining): the
        same operations on every element in the same order, ``O`` rescaled for block ``i`` after
        block ``i - 1``'s dot as `_attend_block` does before block ``i``'s."""
        m_i = gl.full([R], float("-inf"), gl.float32, layout=gl.SliceLayout(0, cols))
        l_i = gl.zeros([R], gl.float32, layout=gl.SliceLayout(0, cols))
        acc = gl.zeros([D // 2, R], gl.float32, layout=mma)
        mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_scores(k_smem.index(it % STAGES), q_smem, mma, BLOCK_N,
                                                                      R), ))
        p, m_i, l_i, alpha = _softmax_columns(s, 0, n_keys, m_i, l_i, scale_log2, cols, BLOCK_N, SUM_LEVELS)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma))[None, :]
        _stage_probabilities(p, p_smem)
        for i in range(1, n_blocks):
            cur = (it + i) % STAGES
            prev = (it + i - 1) % STAGES
            mbarrier.wait(ready.index(cur), ((it + i) // STAGES) & 1)
            s = _issue_scores(k_smem.index(cur), q_smem, mma, BLOCK_N, R)
            mbarrier.wait(ready.index(STAGES + prev), ((it + i - 1) // STAGES) & 1)
            acc = _issue_value_dot(v_smem.index(prev), p_smem, acc, HALF_IX, D // 2)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # block i's scores; i-1's value dot runs on
            p, m_i, l_i, alpha = _softmax_columns(s, i, n_keys, m_i, l_i, scale_log2, cols, BLOCK_N, SUM_LEVELS)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
            mbarrier.arrive(empty.index(prev), count=1)
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma))[None, :]
            _stage_probabilities(p, p_smem)  # block i-1's value dot has read the last P
        last = (it + n_blocks - 1) % STAGES
        mbarrier.wait(ready.index(STAGES + last), ((it + n_blocks - 1) // STAGES) & 1)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_value_dot(v_smem.index(last), p_smem, acc, HALF_IX,
                                                                            D // 2), ))
        mbarrier.arrive(empty.index(last), count=1)
        return acc, m_i, l_i

    @gluon.jit
    def _decode_consumer(q_ptr, o_ptr, lse_ptr, k_smem, v_smem, q_smem, p_smem, ready, empty, tile_ids, tile_full,
                         tile_free, n_tiles, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, HALF_IX: gl.constexpr,
                         ORDERED: gl.constexpr, GROUP: gl.constexpr, R: gl.constexpr, D: gl.constexpr,
                         BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr,
                         AHEAD: gl.constexpr):
        """Consumer warpgroup `HALF_IX`: every tile's scores and softmax, and value dims
        ``64 * HALF_IX ..`` of its output, releasing each stage after its value dot."""
        HALF: gl.constexpr = D // 2
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, R, 16])
        # the softmax's layout: a head's keys in 16 lanes of one warp, two heads a warp
        cols: gl.constexpr = gl.BlockedLayout([BLOCK_N // 16, 1], [16, 2], [1, 4], [0, 1])
        it = 0
        turn = 0
        t = receive_tile(turn, tile_ids, tile_full, tile_free, 4)
        while t < n_tiles:
            seq, kv_head, q_start, q_len, tile, context, n_blocks = grid_tile(
                t, 1, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, ORDERED, GROUP, 128, BLOCK_N)
            if tile >= 0:
                token = q_start.to(gl.int64)
                n_keys = context + 1
                _store_query(q_ptr, q_smem, token, kv_head, stride_qt, stride_qh, GROUP, R, D)
                if AHEAD:
                    acc, m_i, l_i = _attend_tile_ahead(k_smem, v_smem, q_smem, p_smem, ready, empty, it, n_blocks,
                                                       n_keys, scale_log2, HALF_IX, mma, cols, R, D, BLOCK_N, STAGES,
                                                       SUM_LEVELS)
                else:
                    acc, m_i, l_i = _attend_tile(k_smem, v_smem, q_smem, p_smem, ready, empty, it, n_blocks, n_keys,
                                                 scale_log2, HALF_IX, mma, cols, R, D, BLOCK_N, STAGES, SUM_LEVELS)
                _store_half(acc, m_i, l_i, o_ptr, lse_ptr, token, kv_head, stride_ot, stride_oh, stride_lt, HALF_IX,
                            mma, GROUP, R, HALF)
                it += n_blocks
            turn += 1
            t = receive_tile(turn, tile_ids, tile_full, tile_free, 4)

    @gluon.jit(do_not_specialize=["page_size", "stride_bt", "n_tiles", "n_seqs"])
    def _gqa_decode_ws_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr,
                              seq_order_ptr, counter_ptr, page_size, scale_log2, stride_qt, stride_qh, stride_ot,
                              stride_oh, stride_lt, stride_bt, n_tiles, n_seqs, GROUP: gl.constexpr, R: gl.constexpr,
                              D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr,
                              ORDERED: gl.constexpr, AHEAD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr):
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        q_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, D], k_desc.dtype)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([R, BLOCK_N], k_desc.dtype)
        q0 = gl.allocate_shared_memory(k_desc.dtype, [R, D], q_layout)  # each consumer its own query and P
        q1 = gl.allocate_shared_memory(k_desc.dtype, [R, D], q_layout)
        p0 = gl.allocate_shared_memory(k_desc.dtype, [R, BLOCK_N], p_layout)
        p1 = gl.allocate_shared_memory(k_desc.dtype, [R, BLOCK_N], p_layout)
        ready, empty, landed, tile_ids, tile_full, tile_free = ring_barriers(STAGES)

        gl.warp_specialize([
            (_decode_consumer, (q_ptr, o_ptr, lse_ptr, k_smem, v_smem, q0, p0, ready, empty, tile_ids, tile_full,
                                tile_free, n_tiles, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2,
                                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, 0, ORDERED, GROUP, R, D, BLOCK_N,
                                STAGES, SUM_LEVELS, AHEAD)),
            (_decode_consumer, (q_ptr, o_ptr, lse_ptr, k_smem, v_smem, q1, p1, ready, empty, tile_ids, tile_full,
                                tile_free, n_tiles, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2,
                                stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, 1, ORDERED, GROUP, R, D, BLOCK_N,
                                STAGES, SUM_LEVELS, AHEAD)),
            (producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, landed.index(0), tile_ids, tile_full, tile_free,
                        counter_ptr, n_tiles, 1, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr,
                        block_table_ptr, stride_bt, page_size, ORDERED, GROUP, STAGES, D, BLOCK_N)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

        release_ring_barriers(ready, empty, landed, tile_full, tile_free, STAGES)


def attention_decode_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, scale: float,
                           config: tuple[int, int, int, int, bool] = CONFIGS[0]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, 128], lse [T, Hq])`` of a decode launch that `fits` (`k`, `v` the paged caches
    as ``[slots, Hkv, 128]``), by `config` (`launch`)."""
    if not fits(q, k, v, layout):
        raise ValueError(f"attention_decode_gluon: this launch does not fit the kernel (q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k.shape)}, max_seqlen_q={layout.max_seqlen_q}, page_size={layout.page_size}); "
                         "see fits()")
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    if q.shape[0] and layout.seq_lens.shape[0]:
        launch(q, k, v, layout, scale, out, lse, config)
    return out, lse


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, scale: float, out: torch.Tensor,
           lse: torch.Tensor, config: tuple[int, int, int, int, bool] = CONFIGS[0]) -> None:
    """The kernel launch into `out` and `lse`, for a launch that `shape_fits` (unchecked): `config`
    (one of `CONFIGS`: stages, programs an SM, consumer and producer registers, scores ahead),
    (sequence, KV head) tiles from a global counter, one KV head's sequences after another
    (`gluon_support.grid_tile`'s order)."""
    stages, per_sm, consumer_regs, producer_regs, ahead = config
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k.shape[-2]
    k_rows, v_rows = k.reshape(-1, kv_heads * dim), v.reshape(-1, kv_heads * dim)
    n_seqs = layout.seq_lens.shape[0]
    n_tiles = n_seqs * kv_heads
    ordered = layout.seq_order is not None
    order = layout.seq_order if ordered else layout.cu_seqlens_q  # unread (ORDERED false); a partition takes no None
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    max_regs = (consumer_regs * 2 + producer_regs) // 3 // 8 * 8
    _gqa_decode_ws_kernel[(min(n_tiles, per_sm * num_sms(q.device)), )](
        q, tma_descriptor(k_rows, [BLOCK_N, dim]), tma_descriptor(v_rows, [BLOCK_N, dim]), out, lse,
        layout.cu_seqlens_q, layout.seq_lens, layout.block_table, order, counter, layout.page_size,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        layout.block_table.stride(0), n_tiles, n_seqs, GROUP=heads // kv_heads, R=MAX_GROUP, D=dim, BLOCK_N=BLOCK_N,
        STAGES=stages, SUM_LEVELS=row_sum_levels(BLOCK_N), ORDERED=ordered, AHEAD=ahead, CONSUMER_REGS=consumer_regs,
        PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=max_regs)
