"""Latent MLA decode attention in Gluon (Hopper): both dots on warpgroup MMAs with every operand
in shared memory, the keys streamed by TMA through a ring of stages.

Why: the Triton decode launch (`latent_attention._latent_fwd_kernel`, 16-row tiles on mma.sync)
holds the 16 x 576 query operand in every warp's registers, spills, and reads the latent cache
at ~51% of the copy bandwidth at Moonlight's shape (`VEXACT_PDL=off benchmarks/decode_profile.py`, H200,
2026-11-27).
Here a program runs one sequence's query heads (Moonlight: 16) with one warpgroup, key-major:

- ``S^T [keys, heads] = K [keys, 576] . Q^T`` (the latent dot, then the rope dot accumulated onto
  it), A = the key block and B = the query, both read by the MMA from shared memory;
- the online softmax of `latent_attention._latent_block`, column by column (a head per column);
- ``O^T [512, heads] += V^T . P^T``, A = the same key block's latent dims (the value) and B = the
  probabilities, stored to shared memory.

Same bits as the Triton kernels (docs/design.md rule 2): every output element is the same
sequence of fp32 operations. Each dot is one chain of 16-wide K steps in the same order (keys
0..63 for the value dot, dims 0..575 for the scores); transposing a product swaps which operand
is A, not the products or their order. The denominators are summed by halves over the keys
(`key_sum_halves`, `row_sum.row_sum_halves`'s order), and the masks, maxima, exponents, rescaling,
division and lse are written as in `_latent_block`. A decode launch only: one query token per
sequence, 16 heads (`HEADS`), the 512 + 64 dims, bf16/fp16, pages of a multiple of 64 and
TMA-able tensors (`fits`); few sequences split the value dims over 2 or 4 programs each
(`value_chunks`), as the Triton launch does. On the H200: 1.2-1.5x the Triton launch (Moonlight,
128 sequences of 1,024 tokens: 85% of the copy bandwidth), the Moonlight rollout 1.02x
(`benchmarks/attention_configs.py`, `benchmarks/throughput.py`, 2026-11-28).

Gluon is experimental and its API moves between Triton releases, and the bits above were
checked on one: the kernel runs only under the Triton versions in `gluon_support.GLUON_VERIFIED`;
elsewhere the Triton launch decodes.
"""

from __future__ import annotations

import math

import torch

from ._triton import has_tma, tma_rows_aligned
from .gluon_support import GLUON_VERIFIED, HAS_GLUON, supported_triton, tma_descriptor
from .kernel_switch import KernelSwitch
from .latent_key_block import key_block
from .row_sum import row_sum_levels

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from .gluon_support import block_slot  # defined only where Gluon is

__all__ = ["GLUON_VERIFIED", "LATENT_DECODE", "fits", "latent_decode_gluon", "launch", "shape_fits", "supported_triton",
           "value_chunks"]

#: ``VEXACT_LATENT_DECODE``: ``gluon`` (the default: this kernel, where it `fits`) or ``triton`` (the
#: Triton launch everywhere, the default until 2026-11-28)
LATENT_DECODE = KernelSwitch("VEXACT_LATENT_DECODE", ("gluon", "triton"), "gluon", "latent decode kernel")
MAX_VALUE_CHUNKS = 4  # the most programs per sequence (`value_chunks`)
#: query heads a program runs: Moonlight's 16, the one count checked on the GPU. (Other counts need
#: their own check: 64 heads' O^T tile alone would take 256 registers a thread; DeepSeek-V3's 128
#: could run as 8 programs of 16 heads each.)
HEADS = 16
STAGES = 2  # key blocks in shared memory: 2 x 72 KB, with the query and probabilities, fits an SM's 227 KB


def value_chunks(n_seqs: int, sm_count: int) -> int:
    """Programs per sequence for a launch of `n_seqs` sequences on `sm_count` SMs: as many value
    chunks (each program one slice of the value dims, the same scores) as keep every program on
    an SM of its own, up to `MAX_VALUE_CHUNKS`. H200, us per launch: 64 x 1,536 tokens 48.7 -> 46.2
    with 2, 32 x 4,096 116.8 -> 104.2 with 4 (8: 202); at 128 sequences 2 chunks took 1.8x."""
    chunks = MAX_VALUE_CHUNKS
    while chunks > 1 and n_seqs * chunks > sm_count:
        chunks //= 2
    return chunks


def fits(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout) -> bool:
    """Whether this kernel takes a launch: a Hopper GPU with Gluon and a launch `shape_fits`."""
    return HAS_GLUON and q.is_cuda and has_tma(q.device) and shape_fits(q, kv, v_dim, layout)


def shape_fits(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout) -> bool:
    """Whether the tensors suit the kernel, whatever the device: a 16-bit decode launch (one query
    token per sequence), one KV head, 512 latent + 64 rope dims, `HEADS` query heads (the shape
    checked on the GPU, Moonlight's), pages of a multiple of the key block and 16-byte aligned
    rows that TMA can read."""
    heads = q.shape[1]
    return (layout.max_seqlen_q == 1 and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and kv.dim() == 3 and kv.shape[1] == 1 and v_dim == 512 and q.shape[-1] == kv.shape[-1] == 576
            and heads == HEADS and layout.page_size % key_block(q.dtype) == 0
            and q.stride(-1) == 1 and q.stride(1) == q.shape[-1] and q.stride(0) == heads * q.shape[-1]
            and kv.stride(-1) == 1 and kv.stride(0) == kv.shape[-1] and tma_rows_aligned(q, kv))


if HAS_GLUON:
    @gluon.jit
    def key_sum_halves(x, LEVELS: gl.constexpr):
        """``[H]`` sums over the keys (axis 0) of ``x [2**LEVELS, H]`` in `row_sum.row_sum_halves`'s
        order: the second half added onto the first, elementwise, until one key is left."""
        for _ in gl.static_range(LEVELS - 1):
            x = gl.sum(gl.reshape(x, (2, x.shape[0] // 2, x.shape[1])), axis=0)
        return gl.sum(x, axis=0)

    @gluon.jit
    def _load_block(lat_desc, rope_desc, slot, bar, k_lat, k_rope, pred, LAT: gl.constexpr):
        """Issue the TMA copies of a key block (its latent and rope dims, from cache slot `slot` on)
        into one stage."""
        mbarrier.expect(bar, lat_desc.block_type.nbytes + rope_desc.block_type.nbytes, pred=pred)
        tma.async_copy_global_to_shared(lat_desc, [slot, 0], bar, k_lat, pred=pred)
        tma.async_copy_global_to_shared(rope_desc, [slot, LAT], bar, k_rope, pred=pred)

    @gluon.jit
    def _fill_partial_block(kv_ptr, stride_ks, table_row, block, page_size, n_keys, k_lat, k_rope,
                            LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
        """The last, partial key block by pointer loads, zeros past the sequence's last key (whose
        slots may hold anything: they were never written), stored into one stage for the MMAs.
        The rows before it are the ones TMA would copy, so the same bits as the Triton launch,
        whose pointer loads read this block the same way."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld))
        ok = k_pos < n_keys
        page = gl.load(table_row + k_pos // page_size, mask=ok, other=0)
        rows = kv_ptr + (page.to(gl.int64) * page_size + k_pos % page_size)[:, None] * stride_ks
        cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ld))  # 64-wide column chunks, the rope dims' width
        for c in gl.static_range(LAT // ROPE):
            k_lat.slice(c * ROPE, ROPE, dim=1).store(gl.load(rows + c * ROPE + cols[None, :], mask=ok[:, None],
                                                             other=0.0))
        k_rope.store(gl.load(rows + LAT + cols[None, :], mask=ok[:, None], other=0.0))

    @gluon.jit
    def _block_ready(bars, k_lat, k_rope, block, whole, n_blocks, kv_ptr, stride_ks, table_row, page_size, n_keys,
                     STAGES: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
                     num_warps: gl.constexpr):
        """Wait until key block `block` is in its stage: its TMA copies, or (the partial last block)
        its pointer loads, done here. Nothing past the last block."""
        stage = block % STAGES
        if block < whole:
            mbarrier.wait(bars.index(stage), phase=(block // STAGES) & 1)
        elif block < n_blocks:  # its stage's barrier is not used again
            _fill_partial_block(kv_ptr, stride_ks, table_row, block, page_size, n_keys, k_lat.index(stage),
                                k_rope.index(stage), LAT, ROPE, BLOCK_N, num_warps)
            fence_async_shared()
            gl.thread_barrier()

    @gluon.jit
    def _load_query_and_first_blocks(q_lat_desc, q_rope_desc, lat_desc, rope_desc, row, q_bar, q_lat, q_rope, bars,
                                     k_lat, k_rope, table_row, page_size, whole, STAGES: gl.constexpr,
                                     BLOCK_N: gl.constexpr, LAT: gl.constexpr):
        """The prologue both Gluon latent kernels share: the barriers set up, the query rows from
        `row` of q (viewed as ``[tokens * heads, 576]``) copied in, the first `STAGES` key blocks'
        copies issued, and the query waited for."""
        for st in gl.static_range(STAGES):
            mbarrier.init(bars.index(st), count=1)
        mbarrier.init(q_bar, count=1)
        mbarrier.expect(q_bar, q_lat_desc.block_type.nbytes + q_rope_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_lat_desc, [row, 0], q_bar, q_lat)
        tma.async_copy_global_to_shared(q_rope_desc, [row, LAT], q_bar, q_rope)
        for st in gl.static_range(STAGES):
            _load_block(lat_desc, rope_desc, block_slot(table_row, st, page_size, st < whole, BLOCK_N), bars.index(st),
                        k_lat.index(st), k_rope.index(st), st < whole, LAT)
        mbarrier.wait(q_bar, phase=0)

    @gluon.jit
    def _release_barriers(bars, q_bar, STAGES: gl.constexpr):
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(bars.index(st))
        mbarrier.invalidate(q_bar)

    @gluon.jit
    def _issue_scores(k_lat, k_rope, q_lat, q_rope, layout: gl.constexpr, BLOCK_N: gl.constexpr, GROUP: gl.constexpr):
        """``S^T = K . Q^T``, asynchronously: the latent dot, then the rope dot accumulated onto it."""
        s = warpgroup_mma(k_lat, q_lat.permute((1, 0)), gl.zeros([BLOCK_N, GROUP], gl.float32, layout=layout),
                          is_async=True)
        return warpgroup_mma(k_rope, q_rope.permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _online_softmax(s, block, n_keys, m_i, l_i, scale_log2, cols: gl.constexpr, BLOCK_N: gl.constexpr,
                        SUM_LEVELS: gl.constexpr):
        """`latent_attention._latent_block`'s softmax step on the scores ``S^T [keys, heads]`` of key
        block `block`, a head per column: ``(p, m_new, l_new, alpha)``, the same operations in the
        same order (scale, mask, running max, exponents, denominators by halves)."""
        s = gl.convert_layout(s, cols) * scale_log2
        k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cols))
        s = gl.where((k_pos < n_keys)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = gl.fma(l_i, alpha, gl.convert_layout(key_sum_halves(p, SUM_LEVELS), gl.SliceLayout(0, cols)))
        return p, m_new, l_i, alpha

    @gluon.jit
    def _value_dot(lat, p_smem, acc, chunk, CHUNKS: gl.constexpr, DV: gl.constexpr):
        """``O^T += V^T . P^T`` over this program's `DV` value dims (the stage's latent columns),
        waited for."""
        if CHUNKS == 1:
            acc = warpgroup_mma(lat.permute((1, 0)), p_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        else:  # shared memory slices take constant offsets: one branch per chunk
            for c in gl.static_range(CHUNKS):
                if chunk == c:
                    acc = warpgroup_mma(lat.slice(c * DV, DV, dim=1).permute((1, 0)), p_smem.permute((1, 0)), acc)
        return acc

    @gluon.jit
    def _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, token, chunk, stride_ot, stride_oh, mma: gl.constexpr,
                       GROUP: gl.constexpr, DV: gl.constexpr):
        """``out = O / l`` (this program's value dims) and, from the first chunk, ``lse = m + log2(l)``."""
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, mma))[None, :]
        dims = chunk * DV + gl.arange(0, DV, layout=gl.SliceLayout(1, mma))
        heads = gl.arange(0, GROUP, layout=gl.SliceLayout(0, mma))
        gl.store(o_ptr + token * stride_ot + heads[None, :] * stride_oh + dims[:, None], out.to(o_ptr.dtype.element_ty))
        if chunk == 0:
            gl.store(lse_ptr + token * GROUP + gl.arange(0, GROUP, layout=l_i.type.layout), m_i + gl.log2(l_i))

    @gluon.jit(do_not_specialize=["page_size", "stride_bt"])  # as the Triton launch: one compile for every batch
    def _latent_decode_kernel(q_lat_desc, q_rope_desc, lat_desc, rope_desc, kv_ptr, stride_ks, o_ptr, lse_ptr,
                              cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr, seq_order_ptr,
                              page_size, scale_log2, stride_ot, stride_oh, stride_bt,
                              GROUP: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr, BLOCK_N: gl.constexpr,
                              STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr, ORDERED: gl.constexpr,
                              CHUNKS: gl.constexpr, num_warps: gl.constexpr):
        seq = gl.program_id(0)
        chunk = gl.program_id(1)  # this program's slice of the value dims (CHUNKS > 1: few sequences)
        DV: gl.constexpr = LAT // CHUNKS
        if ORDERED:  # PagedLayout.seq_order: which sequence this program's slot of the grid runs
            seq = gl.load(seq_order_ptr + seq)
        q_start = gl.load(cu_seqlens_q_ptr + seq)
        q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        if q_len == 0:  # a padding sequence of a CUDA graph bucket
            return
        n_keys = gl.load(seq_lens_ptr + seq)  # one query token: it sees every key, its own last
        n_blocks = gl.cdiv(n_keys, BLOCK_N)
        whole = n_keys // BLOCK_N  # blocks that TMA copies; a partial last one takes pointer loads
        table_row = block_table_ptr + seq.to(gl.int64) * stride_bt

        # scores S^T [keys, heads] and output O^T [dims, heads]: warpgroup MMA accumulators
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                      instr_shape=[16, GROUP, 16])
        # the softmax's layout: a head's keys in two lanes of one warp, the heads across lanes
        cols: gl.constexpr = gl.BlockedLayout([BLOCK_N // 2, 1], [2, 16], [1, num_warps], [0, 1])
        heads_c: gl.constexpr = gl.SliceLayout(0, cols)

        k_lat = gl.allocate_shared_memory(lat_desc.dtype, [STAGES, BLOCK_N, LAT], lat_desc.layout)
        k_rope = gl.allocate_shared_memory(rope_desc.dtype, [STAGES, BLOCK_N, ROPE], rope_desc.layout)
        q_lat = gl.allocate_shared_memory(q_lat_desc.dtype, [GROUP, LAT], q_lat_desc.layout)
        q_rope = gl.allocate_shared_memory(q_rope_desc.dtype, [GROUP, ROPE], q_rope_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([GROUP, BLOCK_N], q_lat_desc.dtype)
        p_smem = gl.allocate_shared_memory(q_lat_desc.dtype, [GROUP, BLOCK_N], p_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # the query: the token's heads, from row q_start * GROUP of q
        _load_query_and_first_blocks(q_lat_desc, q_rope_desc, lat_desc, rope_desc, q_start * GROUP, q_bar, q_lat,
                                     q_rope, bars, k_lat, k_rope, table_row, page_size, whole, STAGES, BLOCK_N, LAT)

        m_i = gl.full([GROUP], float("-inf"), gl.float32, layout=heads_c)
        l_i = gl.zeros([GROUP], gl.float32, layout=heads_c)
        acc = gl.zeros([DV, GROUP], gl.float32, layout=mma)
        for i in range(n_blocks):
            stage = i % STAGES
            lat = k_lat.index(stage)
            refill_slot = block_slot(table_row, i + STAGES, page_size, i + STAGES < whole, BLOCK_N)
            _block_ready(bars, k_lat, k_rope, i, whole, n_blocks, kv_ptr, stride_ks, table_row, page_size, n_keys,
                         STAGES, LAT, ROPE, BLOCK_N, num_warps)
            s = _issue_scores(lat, k_rope.index(stage), q_lat, q_rope, mma, BLOCK_N, GROUP)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, m_i, l_i, alpha = _online_softmax(s, i, n_keys, m_i, l_i, scale_log2, cols, BLOCK_N, SUM_LEVELS)
            p_smem.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, mma))[None, :]
            acc = _value_dot(lat, p_smem, acc, chunk, CHUNKS, DV)
            gl.thread_barrier()  # every warp's MMA has read this stage before a copy overwrites it
            _load_block(lat_desc, rope_desc, refill_slot, bars.index(stage), lat, k_rope.index(stage),
                        i + STAGES < whole, LAT)

        _release_barriers(bars, q_bar, STAGES)
        _store_outputs(acc, m_i, l_i, o_ptr, lse_ptr, q_start.to(gl.int64), chunk, stride_ot, stride_oh, mma,
                       GROUP, DV)


def latent_decode_gluon(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, scale: float,
                        value_chunks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, v_dim], lse [T, H])`` of a decode launch (`fits`): the Triton latent kernel's
    results, bitwise (the module docstring). `kv` is the cache as ``[slots, 1, 576]``.
    `value_chunks` (1, 2, 4 or 8) programs per sequence each compute the same scores and one
    slice of the value dims: more programs when there are few sequences, the same bits."""
    if value_chunks not in (1, 2, 4, 8):
        raise ValueError(f"latent_decode_gluon: value_chunks={value_chunks} must be 1, 2, 4 or 8")
    if not fits(q, kv, v_dim, layout):
        raise ValueError(f"latent_decode_gluon: this launch does not fit the kernel (q {tuple(q.shape)} {q.dtype}, "
                         f"kv {tuple(kv.shape)}, v_dim={v_dim}, max_seqlen_q={layout.max_seqlen_q}, "
                         f"page_size={layout.page_size}); see fits()")
    n_tokens, heads, _ = q.shape
    out = torch.empty((n_tokens, heads, v_dim), device=q.device, dtype=q.dtype)
    lse = torch.empty((n_tokens, heads), device=q.device, dtype=torch.float32)
    if n_tokens and layout.seq_lens.shape[0]:
        launch(q, kv, v_dim, layout, scale, value_chunks, out, lse)
    return out, lse


def launch(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, scale: float, value_chunks: int,
           out: torch.Tensor, lse: torch.Tensor) -> None:
    """The kernel launch itself, into `out` and `lse`, for inputs that `shape_fits` (unchecked:
    `latent_decode_gluon` checks; `benchmarks/kernel_resources.py` compiles it for sm_90 on CPU)."""
    n_tokens, heads, dim = q.shape
    rope, block_n = dim - v_dim, key_block(q.dtype)
    q_rows, kv_rows = q.reshape(n_tokens * heads, dim), kv.reshape(kv.shape[0], dim)
    _latent_decode_kernel[(layout.seq_lens.shape[0], value_chunks)](
        tma_descriptor(q_rows, [heads, v_dim]), tma_descriptor(q_rows, [heads, rope]),
        tma_descriptor(kv_rows, [block_n, v_dim]), tma_descriptor(kv_rows, [block_n, rope]), kv_rows,
        kv_rows.stride(0),
        out, lse, layout.cu_seqlens_q, layout.seq_lens, layout.block_table, layout.seq_order,
        layout.page_size, scale * math.log2(math.e), out.stride(0), out.stride(1), layout.block_table.stride(0),
        GROUP=heads, LAT=v_dim, ROPE=rope, BLOCK_N=block_n, STAGES=STAGES, SUM_LEVELS=row_sum_levels(block_n),
        ORDERED=layout.seq_order is not None, CHUNKS=value_chunks, num_warps=4, enable_fp_fusion=True)
