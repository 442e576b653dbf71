"""GQA attention for chunked prefill in Gluon (Hopper): 64 query rows a program on one warpgroup,
K/V blocks by TMA from whole-block pages through a ring of stages, and the softmax of one key
block overlapping the tensor cores' work on the previous block's values (FlashAttention-3's
intra-warpgroup pipelining).

Why: the Triton launch reads a prompt step's paged K/V by pointer loads (its TMA path takes
packed training K/V and decode pages only) and runs scores, softmax and value dot of a block one
after another: ~180 TFLOP/s on a Qwen3-8B prompt step, ~285 on chunked prefill after 3,072
tokens. Here, for key block ``i``:

- ``S_i = Q . K_i^T`` is issued (asynchronous wgmma; the query in registers, loaded once), then
  ``O += P_{i-1} . V_{i-1}`` (P in registers, V from shared memory);
- once ``S_i`` lands, its softmax runs while the value dot of block ``i - 1`` is still on the
  tensor cores; then ``O`` is rescaled for block ``i``.

On the H200 (`benchmarks/attention_prefill.py`, docs/gpu-results.md, thirty-fourth session):
1.39x the Triton launch on a Qwen3-8B prompt step and 1.45-1.48x on chunked prefill. On packed
training K/V, which the Triton launch reads by TMA (430-510 TFLOP/s), this kernel ran at
0.83-1.03x of it (below 1.0x in all but one case), so training keeps the Triton launch; `launch`
still takes that layout (``contiguous``) for the comparison.

Same bits as the Triton kernel (docs/design.md rule 2): a row's output is the same sequence of
fp32 operations. Each dot is one chain of 16-wide K steps in the same order (head dims 0..127 for
the scores, keys 0..63 of the block for the value dot) into the same accumulator, whichever
operand sits in registers, and the running max, exponents (one FMA with the scale, as
`attention._attend_block`), denominators by halves (`row_sum.row_sum_halves`' order) and
rescaling ``acc * alpha`` before the next block's dot are `_attend_block`'s, in its order; moving
the value dot of a block past the next block's scores changes when it runs, not what it adds.
Key blocks of 64 are aligned to absolute positions and masked as the Triton kernel masks them
(``k_pos <= q_pos`` and within the launch's keys); whole blocks come by TMA, a partial last block
by pointer loads with zeros past the last key, as there.

Where it runs (`fits`, and `attention.attention_triton` routes it): Hopper with a verified Gluon
(`gluon_support.GLUON_VERIFIED`), head dim 128 for keys and values, 16-bit tensors,
launches of more than `attention_tiles.BLOCK_M` (token, head) rows a sequence (prompt chunks;
decode keeps the Triton launch), over pages of a multiple of 64 keys (the engine's on Hopper).
``VEXACT_ATTENTION_PREFILL=triton`` keeps the Triton launch.
"""

from __future__ import annotations

import math

import torch

from ._triton import has_tma, tma_rows_aligned
from .attention_tiles import BLOCK_M, BLOCK_N
from .gluon_support import HAS_GLUON, tma_descriptor
from .kernel_switch import KernelSwitch
from .row_sum import row_sum_levels

__all__ = ["ATTENTION_PREFILL", "HEAD_DIM", "ROWS", "attention_prefill_gluon", "fits", "launch", "shape_fits"]

#: ``VEXACT_ATTENTION_PREFILL``: ``gluon`` (the default: this kernel, where it `fits`) or ``triton``
ATTENTION_PREFILL = KernelSwitch("VEXACT_ATTENTION_PREFILL", ("gluon", "triton"), "gluon", "GQA prefill kernel")
HEAD_DIM = 128  # the one head dim (keys and values) of every GQA model we ship: Qwen3, Qwen2.5, Llama-3.1
#: (token, head) query rows a program, one warpgroup's MMA M. Two programs share an SM (227
#: registers, 104 KB of shared memory each) and run independently: 128 rows on two warpgroups of
#: one program, which must meet at a barrier every block before a stage is refilled, ran 1.1-1.3x
#: slower on the H200 (docs/gpu-results.md, thirty-fourth session)
ROWS = 64
WARPS = 4
STAGES = 3  # K/V blocks in flight: 3 x 32 KB (two lost 3-8%, four or five gained nothing)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from .gluon_support import block_slot, prefill_tile, tile_keys  # defined only where Gluon is


def fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, contiguous: bool = False) -> bool:
    """Whether this kernel takes a launch: a Hopper GPU with a verified Gluon and a launch that
    `shape_fits`."""
    return HAS_GLUON and q.is_cuda and has_tma(q.device) and shape_fits(q, k, v, layout, contiguous)


def shape_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, contiguous: bool = False) -> bool:
    """Whether the tensors suit the kernel, whatever the device: 16-bit ``q [T, Hq, 128]`` and
    K/V ``[slots, Hkv, 128]`` with heads side by side in 16-byte aligned rows (TMA), a whole GQA
    group, more than `BLOCK_M` (token, head) rows in the longest sequence (prompt chunks and
    training: the launches the Triton kernel gives 128-row tiles), and key blocks that TMA can
    copy whole: pages of a multiple of 64 keys, or (`contiguous`, the packed training layout)
    each sequence's keys in consecutive rows."""
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3 or k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        return False
    if layout.max_seqlen_q * (q.shape[1] // k.shape[1]) <= BLOCK_M:  # decode and short chunks: the Triton tiles
        return False
    pages_ok = layout.page_size % BLOCK_N == 0 or (contiguous and layout.page_size == 1)
    dims_ok = q.shape[-1] == k.shape[-1] == v.shape[-1] == HEAD_DIM and k.shape[1] == v.shape[1]
    return (dims_ok and pages_ok and q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype
            and all(t.stride(-1) == 1 and t.stride(-2) == HEAD_DIM for t in (q, k, v))  # heads side by side
            and tma_rows_aligned(k, v))


if HAS_GLUON:
    @gluon.jit
    def _row_sum_halves(x, LEVELS: gl.constexpr):
        """``[M]`` row sums of ``x [M, 2**LEVELS]`` in `row_sum.row_sum_halves`' order (the second
        half added onto the first, elementwise, until one column is left), in x's row layout (the
        reshapes' inferred layout is the same map of rows to threads: the conversion moves nothing)."""
        rows: gl.constexpr = gl.SliceLayout(1, x.type.layout)
        for _ in gl.static_range(LEVELS):
            x = gl.sum(gl.reshape(x, (x.shape[0], 2, x.shape[1] // 2)), axis=1)
        return gl.convert_layout(gl.reshape(x, (x.shape[0], )), rows, assert_trivial=True)

    @gluon.jit
    def _load_kv(k_desc, v_desc, slot, block, kv_col, bars, k_smem, v_smem, pred, STAGES: gl.constexpr):
        """Issue the TMA copies of key block `block` (from cache slot `slot` on) into its stage: the
        keys signal barrier ``stage``, the values (needed one step later) barrier ``STAGES + stage``."""
        stage = block % STAGES
        mbarrier.expect(bars.index(stage), k_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(k_desc, [slot, kv_col], bars.index(stage), k_smem.index(stage), pred=pred)
        mbarrier.expect(bars.index(STAGES + stage), v_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(v_desc, [slot, kv_col], bars.index(STAGES + stage), v_smem.index(stage),
                                        pred=pred)

    @gluon.jit
    def _fill_partial_block(k_ptr, v_ptr, stride_ks, stride_vs, kv_col, table_row, block, page_size, n_keys, k_smem,
                            v_smem, D: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """The partial last key block by pointer loads, zeros past the launch's last key (whose
        slots may hold anything), into one stage: what the Triton kernel's pointer loads read."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        ok = k_pos < n_keys
        page = gl.load(table_row + k_pos // page_size, mask=ok, other=0)
        slot = (page.to(gl.int64) * page_size + k_pos % page_size)[:, None]
        cols = kv_col + gl.arange(0, D, layout=gl.SliceLayout(0, ld))[None, :]
        k_smem.store(gl.load(k_ptr + slot * stride_ks + cols, mask=ok[:, None], other=0.0))
        v_smem.store(gl.load(v_ptr + slot * stride_vs + cols, mask=ok[:, None], other=0.0))

    @gluon.jit
    def _kv_ready(bars, k_smem, v_smem, block, whole, k_ptr, v_ptr, stride_ks, stride_vs, kv_col, table_row,
                  page_size, n_keys, STAGES: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr,
                  num_warps: gl.constexpr):
        """Wait until key block `block`'s keys are in its stage: their TMA copy, or (the partial last
        block) the pointer loads of its keys and values, done here."""
        stage = block % STAGES
        if block < whole:
            mbarrier.wait(bars.index(stage), phase=(block // STAGES) & 1)
        else:
            _fill_partial_block(k_ptr, v_ptr, stride_ks, stride_vs, kv_col, table_row, block, page_size, n_keys,
                                k_smem.index(stage), v_smem.index(stage), D, BLOCK_N, num_warps)
            fence_async_shared()
            gl.thread_barrier()

    @gluon.jit
    def _values_ready(bars, block, whole, STAGES: gl.constexpr):
        """Wait for key block `block`'s values (a partial last block's came with its keys)."""
        if block < whole:
            mbarrier.wait(bars.index(STAGES + block % STAGES), phase=(block // STAGES) & 1)

    @gluon.jit
    def _softmax_step(s, block, unmasked, q_pos, n_keys, m_i, l_i, scale_log2, BLOCK_N: gl.constexpr,
                      SUM_LEVELS: gl.constexpr):
        """`attention._attend_block`'s softmax on the raw scores ``s [rows, keys]`` of key block
        `block`: the causal mask on blocks from `unmasked` on, the running max (the scale applied
        to the raw max), exponents by one FMA, denominators by halves. ``(p, m, l, alpha)``."""
        if block >= unmasked:
            k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
            s = gl.where((k_pos[None, :] <= q_pos[:, None]) & (k_pos < n_keys)[None, :], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(gl.fma(s, scale_log2, -m_new[:, None]))
        l_i = l_i * alpha + _row_sum_halves(p, SUM_LEVELS)
        return p, m_new, l_i, alpha

    @gluon.jit
    def _load_query(q_ptr, q_start, q_len, tile, kv_head, stride_qt, stride_qh, q_op: gl.constexpr,
                    GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
        """The tile's query rows (row r: token ``r // GROUP``, head ``r % GROUP`` of the KV head's
        group; zeros past the sequence) as the score MMA's A operand in registers (`q_op`): loaded
        once, they spare every block's MMA a read of the query from shared memory, whose bandwidth
        a 64 x 64 score tile with both operands there uses up."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, ld))
        token = (q_start + rows // GROUP).to(gl.int64)
        head = kv_head * GROUP + rows % GROUP
        d = gl.arange(0, D, layout=gl.SliceLayout(0, ld))
        q = gl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=(rows < q_len * GROUP)[:, None], other=0.0)
        return gl.convert_layout(q, q_op)

    @gluon.jit
    def _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, q_start, q_len, tile, kv_head, stride_ot, stride_oh, stride_lt,
                    o_mma: gl.constexpr, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr):
        """``out = O / l`` and ``lse = m + log2(l)`` of the tile's rows that are query tokens of the
        sequence (a last tile's other rows computed something else and are dropped)."""
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(1, o_mma))[:, None]
        rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_mma))
        token = (q_start + rows // GROUP).to(gl.int64)
        head = kv_head * GROUP + rows % GROUP
        d = gl.arange(0, D, layout=gl.SliceLayout(0, o_mma))
        gl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=(rows < q_len * GROUP)[:, None])
        rows_l = tile * ROWS + gl.arange(0, ROWS, layout=l_i.type.layout)
        token_l = (q_start + rows_l // GROUP).to(gl.int64)
        gl.store(lse_ptr + token_l * stride_lt + kv_head * GROUP + rows_l % GROUP, m_i + gl.log2(l_i),
                 mask=rows_l < q_len * GROUP)

    @gluon.jit
    def _gqa_prefill_kernel(q_ptr, k_desc, v_desc, k_ptr, v_ptr, o_ptr, lse_ptr,
                            cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr, seq_order_ptr,
                            page_size, scale_log2, stride_qt, stride_qh, stride_ks, stride_vs, stride_ot, stride_oh,
                            stride_lt, stride_bt, GROUP: gl.constexpr, D: gl.constexpr, ROWS: gl.constexpr,
                            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr,
                            ORDERED: gl.constexpr, num_warps: gl.constexpr):
        kv_head = gl.program_id(2)
        seq, q_start, q_len, tile = prefill_tile(cu_seqlens_q_ptr, seq_order_ptr, ORDERED, GROUP, ROWS)
        if tile < 0:
            return
        context, n_keys = tile_keys(seq_lens_ptr, seq, q_len, tile, GROUP, ROWS)
        n_blocks = gl.cdiv(n_keys, BLOCK_N)
        whole = n_keys // BLOCK_N  # blocks that TMA copies; a partial last one takes pointer loads
        # blocks below `unmasked` lie wholly at or below the tile's first query position: nothing to mask
        unmasked = (context + tile * ROWS // GROUP + 1) // BLOCK_N
        table_row = block_table_ptr + seq.to(gl.int64) * stride_bt
        kv_col = kv_head * D

        s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, D, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_mma)

        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())  # keys, values
        for st in gl.static_range(2 * STAGES):
            mbarrier.init(bars.index(st), count=1)
        for st in gl.static_range(STAGES):
            _load_kv(k_desc, v_desc, block_slot(table_row, st, page_size, st < whole, BLOCK_N), st, kv_col, bars,
                     k_smem, v_smem, st < whole, STAGES)
        q = _load_query(q_ptr, q_start, q_len, tile, kv_head, stride_qt, stride_qh,
                        gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2), GROUP, ROWS, D, num_warps)

        q_pos = context + (tile * ROWS + gl.arange(0, ROWS, layout=rows_s)) // GROUP
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([ROWS], gl.float32, layout=rows_s)
        acc = gl.zeros([ROWS, D], gl.float32, layout=o_mma)
        zeros_s = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=s_mma)

        # block 0: scores and softmax; its value dot is issued with block 1's scores
        _kv_ready(bars, k_smem, v_smem, 0, whole, k_ptr, v_ptr, stride_ks, stride_vs, kv_col, table_row, page_size,
                  n_keys, STAGES, D, BLOCK_N, num_warps)
        s = warpgroup_mma(q, k_smem.index(0).permute((1, 0)), zeros_s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, m_i, l_i, alpha = _softmax_step(s, 0, unmasked, q_pos, n_keys, m_i, l_i, scale_log2, BLOCK_N, SUM_LEVELS)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        p = gl.convert_layout(p.to(k_desc.dtype), p_op)
        for i in range(1, n_blocks):
            # the block this step's end refills its stage with: its slot read now, off the copy's path
            refill = i - 1 + STAGES
            refill_slot = block_slot(table_row, refill, page_size, refill < whole, BLOCK_N)
            _kv_ready(bars, k_smem, v_smem, i, whole, k_ptr, v_ptr, stride_ks, stride_vs, kv_col, table_row,
                      page_size, n_keys, STAGES, D, BLOCK_N, num_warps)
            s = warpgroup_mma(q, k_smem.index(i % STAGES).permute((1, 0)), zeros_s, is_async=True)
            _values_ready(bars, i - 1, whole, STAGES)
            acc = warpgroup_mma(p, v_smem.index((i - 1) % STAGES), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # block i's scores; block i-1's value dot runs on
            p_next, m_i, l_i, alpha = _softmax_step(s, i, unmasked, q_pos, n_keys, m_i, l_i, scale_log2, BLOCK_N,
                                                    SUM_LEVELS)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
            p = gl.convert_layout(p_next.to(k_desc.dtype), p_op)
            gl.thread_barrier()  # every warp's value dot has read block i-1's stage: refill it
            _load_kv(k_desc, v_desc, refill_slot, refill, kv_col, bars, k_smem, v_smem, refill < whole, STAGES)
        _values_ready(bars, n_blocks - 1, whole, STAGES)
        acc = warpgroup_mma(p, v_smem.index((n_blocks - 1) % STAGES), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))

        for st in gl.static_range(2 * STAGES):
            mbarrier.invalidate(bars.index(st))
        _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, q_start, q_len, tile, kv_head, stride_ot, stride_oh, stride_lt,
                    o_mma, GROUP, ROWS, D)


def attention_prefill_gluon(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, scale: float,
                            contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, 128], lse [T, Hq])`` of a causal launch that `fits` (`k`, `v` the paged caches
    or the packed training K/V as ``[slots, Hkv, 128]``; `contiguous`: the packed training layout,
    page size 1): the Triton GQA kernel's results, bitwise (the module docstring)."""
    if not fits(q, k, v, layout, contiguous):
        raise ValueError(f"attention_prefill_gluon: this launch does not fit the kernel (q {tuple(q.shape)} {q.dtype}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, max_seqlen_q={layout.max_seqlen_q}, "
                         f"page_size={layout.page_size}, contiguous={contiguous}); see fits()")
    out = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    lse = torch.empty(q.shape[:2], device=q.device, dtype=torch.float32)
    if q.shape[0] and layout.seq_lens.shape[0]:
        launch(q, k, v, layout, scale, out, lse)
    return out, lse


def launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout, scale: float, out: torch.Tensor,
           lse: torch.Tensor, rows: int = ROWS, warps: int = WARPS, stages: int = STAGES) -> None:
    """The kernel launch itself, into `out` and `lse`, for inputs that `shape_fits` (unchecked:
    `attention_prefill_gluon` checks; `benchmarks/kernel_resources.py` compiles it for sm_90 on CPU)."""
    n_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    k_rows, v_rows = k.reshape(k.shape[0], kv_heads * dim), v.reshape(v.shape[0], kv_heads * dim)
    group = heads // kv_heads
    tiles = -(-layout.max_seqlen_q * group // rows)
    _gqa_prefill_kernel[(tiles, layout.seq_lens.shape[0], kv_heads)](
        q, tma_descriptor(k_rows, [BLOCK_N, dim]), tma_descriptor(v_rows, [BLOCK_N, dim]),
        k_rows, v_rows, out, lse, layout.cu_seqlens_q, layout.seq_lens, layout.block_table, layout.seq_order,
        layout.page_size, scale * math.log2(math.e), q.stride(0), q.stride(1), k_rows.stride(0), v_rows.stride(0),
        out.stride(0), out.stride(1), lse.stride(0), layout.block_table.stride(0),
        GROUP=group, D=dim, ROWS=rows, BLOCK_N=BLOCK_N, STAGES=stages, SUM_LEVELS=row_sum_levels(BLOCK_N),
        ORDERED=layout.seq_order is not None, num_warps=warps)
