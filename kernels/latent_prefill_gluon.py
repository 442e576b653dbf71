"""Latent MLA prefill and training attention in Gluon (Hopper): the decode kernel's warpgroup MMAs
and TMA key ring (`latent_decode_gluon`), for causal launches of many query tokens a sequence.

Why: the Triton launch's 64-row training/prefill tiles (`latent_attention._latent_fwd_kernel`,
8 warps, two stages) hold the 64 x 512 fp32 output across 255 registers a thread, spill, and run
the Moonlight prompt step's latent attention at ~150 TFLOP/s (`benchmarks/decode_profile.py
--prompt-steps`, H200, 2026-11-28), a fifth of the step. Here a program runs 64 query rows of one sequence ((token, head)
pairs: 4 tokens of Moonlight's 16 heads, half a token of DeepSeek-V3's 128; every head reads the
same latent key) with two warpgroups, key-major as in the decode kernel:

- ``S^T [keys, rows] = K . Q^T``: the warpgroups split the rows, 32 each, so a row's softmax never
  leaves its warpgroup;
- the causal online softmax of `latent_attention._latent_block`, a row per column;
- ``O^T [512, rows] += V^T . P^T``: the warpgroups split the value dims, 256 each (128 fp32
  registers a thread), over all 64 rows, reading the probabilities that both stored.

Same bits as the Triton kernels (docs/design.md rule 2), for the reasons `latent_decode_gluon`
gives: each output element is the same chain of 16-wide MMA K steps and the same fp32 softmax
operations in the same order; the rows a warpgroup holds do not change any of them. The causal
mask is the Triton kernel's ``k_pos <= q_pos``; key blocks are aligned to absolute positions.

Where it runs (`fits`): Hopper with Gluon (`gluon_support.GLUON_VERIFIED`), `HEADS`,
512 + 64 dims, 16-bit tensors that TMA can read, and either a paged cache whose pages hold whole
64-key blocks (chunked prefill) or the packed training tensors (``contiguous``: a sequence's keys
are consecutive rows). ``VEXACT_LATENT_PREFILL=triton`` keeps the Triton launch. On the H200
(`benchmarks/latent_prefill.py`): 1.44x the Triton launch on a rollout's prompt step, 1.49-1.60x on
chunked prefill and packed training (333-346 TFLOP/s; 2026-11-28).
"""

from __future__ import annotations

import math

import torch

from . import latent_decode_gluon as decode
from ._triton import has_tma, tma_rows_aligned
from .gluon_support import HAS_GLUON, tma_descriptor
from .kernel_switch import KernelSwitch
from .latent_key_block import key_block
from .row_sum import row_sum_levels

__all__ = ["HEADS", "LATENT_PREFILL", "ROWS", "fits", "latent_prefill_gluon", "launch", "shape_fits"]

#: query head counts the kernel takes: a program's 64 rows are (token, head) pairs whatever the count,
#: and the two checked on the GPU are Moonlight's 16 and DeepSeek-V3's 128
HEADS = (16, 32, 64, 128)

#: ``VEXACT_LATENT_PREFILL``: ``gluon`` (the default: this kernel, where it `fits`) or ``triton``
LATENT_PREFILL = KernelSwitch("VEXACT_LATENT_PREFILL", ("gluon", "triton"), "gluon", "latent prefill kernel")
ROWS = 64  # query rows (token, head) a program: 4 tokens of 16 heads, one warpgroup MMA's M
WARPS = 8  # two warpgroups: the rows split for the scores, the value dims for the output
#: key blocks in shared memory. One: with the 64 x 576 query (72 KB), one 72 KB key block, the
#: probabilities and the scores' layout change take 168 KB; a second stage would need 240 KB of
#: the SM's 227. (32 rows with two stages fit, 192 KB, but ran 1.1-1.2x slower on the H200.)
STAGES = 1

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, warpgroup_mma_wait
    from .gluon_support import block_slot, prefill_tile, tile_keys  # defined only where Gluon is


def fits(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, contiguous: bool = False) -> bool:
    """Whether this kernel takes a launch: a Hopper GPU with a verified Gluon and a launch that
    `shape_fits`."""
    return HAS_GLUON and q.is_cuda and has_tma(q.device) and shape_fits(q, kv, v_dim, layout, contiguous)


def shape_fits(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, contiguous: bool = False) -> bool:
    """Whether the tensors suit the kernel, whatever the device: 16-bit, one KV head of 512 latent +
    64 rope dims, a query head count in `HEADS`, more than one query token in the longest
    sequence (one token is the decode kernel's), 16-byte aligned rows that TMA can read, and key
    blocks that TMA can copy whole: pages of a multiple of the key block, or (`contiguous`, the
    packed training layout) each sequence's keys in consecutive rows."""
    heads = q.shape[1]
    pages_ok = layout.page_size % key_block(q.dtype) == 0 or (contiguous and layout.page_size == 1)
    return (layout.max_seqlen_q > 1 and q.dtype in (torch.bfloat16, torch.float16) and kv.dtype == q.dtype
            and kv.dim() == 3 and kv.shape[1] == 1 and v_dim == 512 and q.shape[-1] == kv.shape[-1] == 576
            and heads in HEADS and pages_ok
            and q.stride(-1) == 1 and q.stride(1) == q.shape[-1] and q.stride(0) == heads * q.shape[-1]
            and kv.stride(-1) == 1 and kv.stride(0) == kv.shape[-1] and tma_rows_aligned(q, kv))


if HAS_GLUON:
    @gluon.jit
    def _causal_softmax(s, block, q_pos, n_keys, m_i, l_i, scale_log2, cols: gl.constexpr, BLOCK_N: gl.constexpr,
                        SUM_LEVELS: gl.constexpr):
        """`latent_attention._latent_block`'s softmax step on ``S^T [keys, rows]`` of key block
        `block`, a query row per column: scale, the causal mask (key position <= the row's
        position, and a key of the launch), running max, exponents, denominators by halves."""
        s = gl.convert_layout(s, cols) * scale_log2
        k_pos = block * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, cols))
        s = gl.where((k_pos[:, None] <= q_pos[None, :]) & (k_pos < n_keys)[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_i = gl.fma(l_i, alpha, gl.convert_layout(decode.key_sum_halves(p, SUM_LEVELS), gl.SliceLayout(0, cols)))
        return p, m_new, l_i, alpha

    @gluon.jit
    def _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, q_start, q_len, tile, stride_ot, stride_oh, mma: gl.constexpr,
                    GROUP: gl.constexpr, ROWS: gl.constexpr, LAT: gl.constexpr):
        """``out = O / l`` and ``lse = m + log2(l)`` of the tile's rows that are query tokens of the
        sequence (a last tile's other rows computed something else and are dropped)."""
        out = acc / gl.convert_layout(l_i, gl.SliceLayout(0, mma))[None, :]
        rows = tile * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(0, mma))
        token = (q_start + rows // GROUP).to(gl.int64)
        dims = gl.arange(0, LAT, layout=gl.SliceLayout(1, mma))
        ptrs = o_ptr + token[None, :] * stride_ot + (rows % GROUP)[None, :] * stride_oh + dims[:, None]
        gl.store(ptrs, out.to(o_ptr.dtype.element_ty), mask=(rows < q_len * GROUP)[None, :])
        rows_l = tile * ROWS + gl.arange(0, ROWS, layout=l_i.type.layout)
        gl.store(lse_ptr + q_start.to(gl.int64) * GROUP + rows_l, m_i + gl.log2(l_i), mask=rows_l < q_len * GROUP)

    @gluon.jit(do_not_specialize=["page_size", "stride_bt"])  # as the Triton launch: one compile for every batch
    def _latent_prefill_kernel(q_lat_desc, q_rope_desc, lat_desc, rope_desc, kv_ptr, stride_ks, o_ptr, lse_ptr,
                               cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr, seq_order_ptr,
                               page_size, scale_log2, stride_ot, stride_oh, stride_bt,
                               GROUP: gl.constexpr, ROWS: gl.constexpr, LAT: gl.constexpr, ROPE: gl.constexpr,
                               BLOCK_N: gl.constexpr, STAGES: gl.constexpr, SUM_LEVELS: gl.constexpr,
                               ORDERED: gl.constexpr, num_warps: gl.constexpr):
        seq, q_start, q_len, tile = prefill_tile(cu_seqlens_q_ptr, seq_order_ptr, ORDERED, GROUP, ROWS)
        if tile < 0:
            return
        # a tile holds 4 tokens of 16 heads, half a token of 128
        context, n_keys = tile_keys(seq_lens_ptr, seq, q_len, tile, GROUP, ROWS)
        n_blocks = gl.cdiv(n_keys, BLOCK_N)
        whole = n_keys // BLOCK_N  # blocks that TMA copies; a partial last one takes pointer loads
        table_row = block_table_ptr + seq.to(gl.int64) * stride_bt

        # S^T [keys, rows]: the warpgroups split the rows; O^T [dims, rows]: they split the dims
        s_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, num_warps // 4],
                                                        instr_shape=[16, ROWS // (num_warps // 4), 16])
        o_mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                        instr_shape=[16, ROWS, 16])
        # the softmax's layout: a row's keys in four lanes of one warp, 16 in each, the rows across lanes and warps
        cols: gl.constexpr = gl.BlockedLayout([BLOCK_N // 4, 1], [4, 8], [1, num_warps], [0, 1])
        rows_c: gl.constexpr = gl.SliceLayout(0, cols)

        k_lat = gl.allocate_shared_memory(lat_desc.dtype, [STAGES, BLOCK_N, LAT], lat_desc.layout)
        k_rope = gl.allocate_shared_memory(rope_desc.dtype, [STAGES, BLOCK_N, ROPE], rope_desc.layout)
        q_lat = gl.allocate_shared_memory(q_lat_desc.dtype, [ROWS, LAT], q_lat_desc.layout)
        q_rope = gl.allocate_shared_memory(q_rope_desc.dtype, [ROWS, ROPE], q_rope_desc.layout)
        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_N], q_lat_desc.dtype)
        p_smem = gl.allocate_shared_memory(q_lat_desc.dtype, [ROWS, BLOCK_N], p_layout)
        bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        # the query: the tile's rows of q (past the tensor's end TMA reads zeros)
        decode._load_query_and_first_blocks(q_lat_desc, q_rope_desc, lat_desc, rope_desc, q_start * GROUP + tile * ROWS,
                                            q_bar, q_lat, q_rope, bars, k_lat, k_rope, table_row, page_size, whole,
                                            STAGES, BLOCK_N, LAT)

        q_pos = context + (tile * ROWS + gl.arange(0, ROWS, layout=rows_c)) // GROUP
        m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=rows_c)
        l_i = gl.zeros([ROWS], gl.float32, layout=rows_c)
        acc = gl.zeros([LAT, ROWS], gl.float32, layout=o_mma)
        for i in range(n_blocks):
            stage = i % STAGES
            lat = k_lat.index(stage)
            refill_slot = block_slot(table_row, i + STAGES, page_size, i + STAGES < whole, BLOCK_N)
            decode._block_ready(bars, k_lat, k_rope, i, whole, n_blocks, kv_ptr, stride_ks, table_row, page_size,
                                n_keys, STAGES, LAT, ROPE, BLOCK_N, num_warps)
            s = decode._issue_scores(lat, k_rope.index(stage), q_lat, q_rope, s_mma, BLOCK_N, ROWS)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            p, m_i, l_i, alpha = _causal_softmax(s, i, q_pos, n_keys, m_i, l_i, scale_log2, cols, BLOCK_N,
                                                 SUM_LEVELS)
            p_smem.store(gl.permute(p.to(p_smem.dtype), (1, 0)))
            fence_async_shared()
            gl.thread_barrier()
            acc = acc * gl.convert_layout(alpha, gl.SliceLayout(0, o_mma))[None, :]
            acc = decode._value_dot(lat, p_smem, acc, 0, 1, LAT)
            gl.thread_barrier()  # every warp's MMA has read this stage before a copy overwrites it
            decode._load_block(lat_desc, rope_desc, refill_slot, bars.index(stage), lat, k_rope.index(stage),
                               i + STAGES < whole, LAT)

        decode._release_barriers(bars, q_bar, STAGES)
        _store_rows(acc, m_i, l_i, o_ptr, lse_ptr, q_start, q_len, tile, stride_ot, stride_oh, o_mma, GROUP, ROWS,
                    LAT)


def latent_prefill_gluon(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, scale: float,
                         contiguous: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, H, v_dim], lse [T, H])`` of a causal launch that `fits` (`kv` the cache or packed
    keys as ``[slots, 1, 576]``; `contiguous`: the packed training layout, page size 1): the
    Triton latent kernel's results, bitwise (the module docstring)."""
    if not fits(q, kv, v_dim, layout, contiguous):
        raise ValueError(f"latent_prefill_gluon: this launch does not fit the kernel (q {tuple(q.shape)} {q.dtype}, "
                         f"kv {tuple(kv.shape)}, v_dim={v_dim}, max_seqlen_q={layout.max_seqlen_q}, "
                         f"page_size={layout.page_size}, contiguous={contiguous}); see fits()")
    n_tokens, heads, _ = q.shape
    out = torch.empty((n_tokens, heads, v_dim), device=q.device, dtype=q.dtype)
    lse = torch.empty((n_tokens, heads), device=q.device, dtype=torch.float32)
    if n_tokens and layout.seq_lens.shape[0]:
        launch(q, kv, v_dim, layout, scale, out, lse)
    return out, lse


def launch(q: torch.Tensor, kv: torch.Tensor, v_dim: int, layout, scale: float, out: torch.Tensor,
           lse: torch.Tensor, rows: int = ROWS, warps: int = WARPS, stages: int = STAGES) -> None:
    """The kernel launch itself, into `out` and `lse`, for inputs that `shape_fits` (unchecked:
    `latent_prefill_gluon` checks; `benchmarks/kernel_resources.py` compiles it for sm_90 on CPU)."""
    n_tokens, heads, dim = q.shape
    rope, block_n = dim - v_dim, key_block(q.dtype)
    q_rows, kv_rows = q.reshape(n_tokens * heads, dim), kv.reshape(kv.shape[0], dim)
    tiles = -(-layout.max_seqlen_q * heads // rows)
    _latent_prefill_kernel[(tiles, layout.seq_lens.shape[0])](
        tma_descriptor(q_rows, [rows, v_dim]), tma_descriptor(q_rows, [rows, rope]),
        tma_descriptor(kv_rows, [block_n, v_dim]), tma_descriptor(kv_rows, [block_n, rope]), kv_rows,
        kv_rows.stride(0), out, lse, layout.cu_seqlens_q, layout.seq_lens, layout.block_table, layout.seq_order,
        layout.page_size, scale * math.log2(math.e), out.stride(0), out.stride(1), layout.block_table.stride(0),
        GROUP=heads, ROWS=rows, LAT=v_dim, ROPE=rope, BLOCK_N=block_n, STAGES=stages,
        SUM_LEVELS=row_sum_levels(block_n), ORDERED=layout.seq_order is not None, num_warps=warps, enable_fp_fusion=True)
