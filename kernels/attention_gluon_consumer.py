"""One consumer warpgroup of `attention_gluon`'s warp-specialised kernel: 64 query rows of each
128-row tile its program takes, attended over the K/V blocks the producer warp copies into a ring
of shared-memory stages (`ready` barriers signal a copy, `empty` barriers take one arrival from
each consumer once its value dot has read the stage).

The block loop: block ``i``'s scores are issued (asynchronous wgmma, the query in registers as the
A operand, loaded once), then block ``i - 1``'s value dot (P in registers, V from shared memory);
once the scores land, block ``i``'s softmax runs while that dot is still on the tensor cores
(FlashAttention-3's intra-warpgroup pipelining), then ``O`` is rescaled for block ``i``.

Same bits as the Triton kernel (docs/design.md rule 2): a row's output is the same sequence of
fp32 operations. Each dot is one chain of 16-wide K steps in the same order (head dims 0..127 for
the scores, keys 0..63 of the block for the value dot) into the same accumulator, whichever
operand sits in registers, and the running max, exponents (one FMA with the scale, as
`attention._attend_block`), denominators by halves (`row_sum.row_sum_halves`' order) and
rescaling ``acc * alpha`` before the next block's dot are `_attend_block`'s, in its order; moving
the value dot of a block past the next block's scores changes when it runs, not what it adds.
"""

from __future__ import annotations

from .gluon_support import HAS_GLUON

__all__ = ["consumer"]

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

    from .gluon_support import grid_tile, receive_tile, tile_keys  # defined only where Gluon is

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
        l_i = gl.fma(l_i, alpha, _row_sum_halves(p, SUM_LEVELS))
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
    def _attend_rows(q_ptr, o_ptr, lse_ptr, k_smem, v_smem, ready, empty, it, seq_lens_ptr, seq, q_start, q_len,
                     context, sub, kv_head, scale_log2, stride_qt, stride_qh, stride_ot, stride_oh, stride_lt,
                     GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                     SUM_LEVELS: gl.constexpr):
        """64-row tile `sub` of a sequence on one consumer warpgroup, its blocks at ring position `it`
        on: the block loop of the module docstring, each stage released after the value dot that
        read it. Returns the blocks it read."""
        HALF: gl.constexpr = 64
        s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16])
        p_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_mma, k_width=2)
        rows_s: gl.constexpr = gl.SliceLayout(1, s_mma)
        _, n_keys = tile_keys(seq_lens_ptr, seq, q_len, sub, GROUP, HALF)
        n_blocks = gl.cdiv(n_keys, BLOCK_N)
        unmasked = (context + sub * HALF // GROUP + 1) // BLOCK_N
        q = _load_query(q_ptr, q_start, q_len, sub, kv_head, stride_qt, stride_qh,
                        gl.DotOperandLayout(operand_index=0, parent=s_mma, k_width=2), GROUP, HALF, D, 4)
        q_pos = context + (sub * HALF + gl.arange(0, HALF, layout=rows_s)) // GROUP
        m_i = gl.full([HALF], float("-inf"), gl.float32, layout=rows_s)
        l_i = gl.zeros([HALF], gl.float32, layout=rows_s)
        acc = gl.zeros([HALF, D], gl.float32, layout=o_mma)
        zeros_s = gl.zeros([HALF, BLOCK_N], gl.float32, layout=s_mma)

        mbarrier.wait(ready.index(it % STAGES), (it // STAGES) & 1)
        s = warpgroup_mma(q, k_smem.index(it % STAGES).permute((1, 0)), zeros_s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        p, m_i, l_i, alpha = _softmax_step(s, 0, unmasked, q_pos, n_keys, m_i, l_i, scale_log2, BLOCK_N, SUM_LEVELS)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
        p = gl.convert_layout(p.to(k_smem.dtype), p_op)
        for i in range(1, n_blocks):
            cur = (it + i) % STAGES
            mbarrier.wait(ready.index(cur), ((it + i) // STAGES) & 1)
            s = warpgroup_mma(q, k_smem.index(cur).permute((1, 0)), zeros_s, is_async=True)
            prev = (it + i - 1) % STAGES
            mbarrier.wait(ready.index(STAGES + prev), ((it + i - 1) // STAGES) & 1)
            acc = warpgroup_mma(p, v_smem.index(prev), acc, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # block i's scores; i-1's value dot runs on
            p_next, m_i, l_i, alpha = _softmax_step(s, i, unmasked, q_pos, n_keys, m_i, l_i, scale_log2, BLOCK_N,
                                                    SUM_LEVELS)
            acc, p = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p))
            mbarrier.arrive(empty.index(prev), count=1)  # block i-1's stage: read by both of its dots
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_mma))[:, None]
            p = gl.convert_layout(p_next.to(k_smem.dtype), p_op)
        last = (it + n_blocks - 1) % STAGES
        mbarrier.wait(ready.index(STAGES + last), ((it + n_blocks - 1) // STAGES) & 1)
        acc = warpgroup_mma(p, v_smem.index(last), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        mbarrier.arrive(empty.index(last), count=1)
        _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, q_start, q_len, sub, kv_head, stride_ot, stride_oh, stride_lt,
                    o_mma, GROUP, HALF, D)
        return n_blocks

    @gluon.jit
    def consumer(q_ptr, o_ptr, lse_ptr, k_smem, v_smem, ready, empty, tile_ids, tile_full, tile_free, n_tiles,
                  tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2, stride_qt,
                  stride_qh, stride_ot, stride_oh, stride_lt, WG: gl.constexpr, ORDERED: gl.constexpr,
                  GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  SUM_LEVELS: gl.constexpr):
        """The warp-specialised kernel's consumer warpgroup `WG`: rows ``64 * WG ..`` of each of the
        program's 128-row tiles. After its own blocks it releases the tile's further ones (the other consumer's: a last tile's
        upper half may hold no row of the sequence and reads none) as each lands: waiting for the
        copy keeps its arrivals in the order of the stage's uses."""
        it = 0  # the ring's position, as the producer's
        turn = 0
        t = receive_tile(turn, tile_ids, tile_full, tile_free, 4)
        while t < n_tiles:
            seq, kv_head, q_start, q_len, tile, context, n_blocks = grid_tile(
                t, tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, ORDERED, GROUP, 128, BLOCK_N)
            if tile >= 0:
                mine = 0
                if (tile * 2 + WG) * 64 < q_len * GROUP:
                    mine = _attend_rows(q_ptr, o_ptr, lse_ptr, k_smem, v_smem, ready, empty, it, seq_lens_ptr, seq,
                                        q_start, q_len, context, tile * 2 + WG, kv_head, scale_log2, stride_qt,
                                        stride_qh, stride_ot, stride_oh, stride_lt, GROUP, D, BLOCK_N, STAGES,
                                        SUM_LEVELS)
                for j in range(mine, n_blocks):
                    mbarrier.wait(ready.index((it + j) % STAGES), ((it + j) // STAGES) & 1)
                    mbarrier.arrive(empty.index((it + j) % STAGES), count=1)
                it += n_blocks
            turn += 1
            t = receive_tile(turn, tile_ids, tile_full, tile_free, 4)
