"""Latent MLA attention: MQA-style attention whose value is the first dims of its key.

With ``kv_b_proj`` absorbed (docs/mla-kv-cache.md), DeepSeek-V3 attention attends every query
head ``[T, H, L + R]`` (L = ``kv_lora_rank`` latent dims, R = rope dims; 512 + 64 at the real
shapes) over one shared key head per token, the normalised latent ``c`` followed by the rotated
rope key, and its value is that same ``c``: the key's first L dims. The KV cache therefore holds
the key alone and the value is a view of it (`value_in_key`); `kernels.attention` and
`kernels.attention_packed` route such calls here on the triton backend (the reference backend's
`attention_reference` takes any dims and strides already).

The forward kernel is `kernels.attention`'s with the key split into its latent and rope parts:
``s = q_lat . k_lat + q_rope . k_rope`` (two dots accumulated in that order), and the loaded
latent key tile is the value tile, so the cache is read once. Invariance contract (docs/design.md
rule 2), as for `kernels.attention`: keys reduced in blocks of ``BLOCK_N`` aligned to absolute
positions with an fp32 online softmax whose denominators are summed in one fixed order
(`row_sum.row_sum_halves`), the key block fixed per dtype (`key_block`; ``page_size`` is not
specialized; the pointer loads find a key's slot by `paged_layout.page_slots`, shift and mask over
pages of a power of two and 32-bit addresses where the cache allows), no split-KV; `pick_config`'s
other launch parameters (rows per program, warps, stages, value chunks) follow the launch's shape
and do not change a row's arithmetic. A query's
output is the same packed (training), in chunked prefill or in decode. When
``value_chunks`` > 1 (decode: few query rows per sequence), the latent dims of the value are split
over that many programs per sequence, each recomputing the same scores: more programs for the
GPU, the cache read once per chunk (from L2 after the first). On Hopper, a decode launch that
`latent_decode_gluon.fits` (Moonlight's 16 heads) runs the Gluon kernel there instead, by default
(``VEXACT_LATENT_DECODE``): the same bits, 1.2-1.5x faster; launches of more query rows (prefill,
packed training) run `latent_prefill_gluon` there (``VEXACT_LATENT_PREFILL``), the same bits,
1.4-1.6x faster. The backward is in `latent_attention_backward.py`.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

import torch

from . import latent_decode_gluon, latent_prefill_gluon
from ._triton import has_tma, launch_staged, next_power_of_2, num_sms, require_triton, tl, tma_rows_aligned, triton
from .latent_key_block import key_block
from .paged_layout import offsets_fit_int32, page_shift, page_slots
from .row_sum import lane_sums, row_sum_halves, row_sum_levels


def value_in_key(k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when `v` is a view of `k`'s leading dims (``v = k[..., :Dv]`` with ``Dv < D``): the
    latent MLA layout, cache or packed training tensors."""
    return (v.dim() == k.dim() and v.dtype == k.dtype and v.data_ptr() == k.data_ptr()
            and v.shape[:-1] == k.shape[:-1] and v.shape[-1] < k.shape[-1]
            and v.stride()[:-1] == k.stride()[:-1] and v.stride(-1) == k.stride(-1) == 1)




@dataclass(frozen=True)
class LatentConfig:
    """Launch parameters of the latent forward.

    ``block_n`` is the key block, the absolute-position alignment of the KV reduction (rule 2):
    one value per dtype (`key_block`), never a function of the batch; the field exists only so
    that the GPU sweeps can try other values. The others may follow the launch's shape
    (`pick_config`), as rule 1's tile shapes do, because they leave every output element's
    floating-point sequence unchanged: ``block_m`` (query rows per program), warps and stages
    move work between programs, and ``value_chunks`` > 1 splits the 512 value dims over that many
    programs, each recomputing the same scores with the same dots (a value column's sum over a
    key block is one dot whatever the N width of the tile). `conformance/kernel_invariance.py`
    ("latent configs") checks on the GPU that every candidate gives bitwise the same output."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    value_chunks: int = 1


DECODE_ROWS = 128  # launches with at most this many rows per sequence take DECODE_BLOCK_M-row tiles
DECODE_BLOCK_M = 16
FEW_VALUE_CHUNKS = 4  # value chunks of a TMA decode launch with at most sm_count / 4 programs


def pick_config(dtype: torch.dtype, rows_per_seq: int, n_seqs: int, sm_count: int,
                kv_descriptors: bool = False) -> LatentConfig:
    """The launch parameters for `dtype`, for a launch of `n_seqs` (sequence, KV head) pairs
    whose longest sequence has `rows_per_seq` (query token, head) rows, on a GPU of `sm_count` SMs. Chosen by
    `benchmarks/attention_configs.py` on the H200 (figures in docs/performance.md); every choice gives the
    same bits (the module docstring). Decode and short chunks (<= `DECODE_ROWS` rows: 16 heads
    of Moonlight, 128 of DeepSeek-V3, one token each) take 16-row tiles, 1.3-1.4x the 64-row
    ones: 4 warps when there are more programs than SMs, else 8 (1.3x at 16 sequences of
    DeepSeek-V3); with `kv_descriptors` (whole key blocks by TMA, `page_descriptors_fit`) 8 warps
    and three stages, whose two TMA buffers overlap a block's copy with the previous block's math
    (1.2x at 256 Moonlight sequences of 528 tokens, 1.6x at 32 of 4,096; H200, 2026-11-25).
    A TMA launch of at most ``sm_count / 4`` programs (a rollout's tail: the last few sequences)
    splits the value dims over `FEW_VALUE_CHUNKS` programs of 4 warps, each with its own TMA copy
    of its slice: 1.36-1.51x at 8-32 Moonlight sequences of 1.5k-8k tokens (0.69x at 64, where the
    one-chunk launch already fills the GPU; H200, 2026-11-27).
    Longer launches take 64-row tiles, 64-key blocks, 8 warps, two stages (1.4x
    the first-guess 64/32/8/1 in training); value chunks did not pay."""
    if dtype == torch.float32:
        return LatentConfig(16, key_block(dtype), 4, 1)
    if rows_per_seq <= DECODE_ROWS:
        programs = n_seqs * -(-rows_per_seq // DECODE_BLOCK_M)
        if kv_descriptors:
            if programs * FEW_VALUE_CHUNKS <= sm_count:
                return LatentConfig(DECODE_BLOCK_M, key_block(dtype), 4, 3, FEW_VALUE_CHUNKS)
            return LatentConfig(DECODE_BLOCK_M, key_block(dtype), 8, 3)
        return LatentConfig(DECODE_BLOCK_M, key_block(dtype), 4 if programs > sm_count else 8, 2)
    return LatentConfig(64, key_block(dtype), 8, 2)


def page_descriptors_fit(kv: torch.Tensor, page_size: int, v_dim: int, rows_per_seq: int) -> bool:
    """Whether a launch over the latent cache ``kv [slots, Hkv, D]`` may read its whole key blocks
    through TMA tensor descriptors: a Hopper or newer GPU, a 16-bit cache, a decode launch (<=
    `DECODE_ROWS` rows per sequence, the tiles whose shared memory holds two 64-key buffers),
    pages of a multiple of the key block (a block then lies in one page: vLLM's FlashMLA asks for
    pages of 64 too, and `LLM` takes 64 for latent caches), latent and rope dims that are powers
    of two (no padded lanes) and 16-byte aligned rows with the heads side by side."""
    dtype = kv.dtype
    rope = kv.shape[-1] - v_dim
    return (dtype in (torch.bfloat16, torch.float16) and rows_per_seq <= DECODE_ROWS and page_size % key_block(dtype) == 0
            and v_dim >= 16 and rope >= 16 and v_dim & (v_dim - 1) == 0 and rope & (rope - 1) == 0
            and kv.dim() == 3 and kv.stride(-1) == 1 and kv.stride(1) == kv.shape[-1]
            and has_tma(kv.device) and tma_rows_aligned(kv))


def _kv_descriptors(kv: torch.Tensor, v_dim: int, block_n: int, value_chunks: int = 1) -> tuple:
    """TMA descriptors over ``kv [slots, Hkv, D]`` seen as ``[slots, Hkv*D]``: blocks of
    `block_n` rows of a head's latent dims, of its rope dims, and (`value_chunks` > 1) of one value
    chunk's dims, else None (the value is the latent block itself)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    flat = kv.reshape(kv.shape[0], -1)

    def blocks_of(dims: int):
        return TensorDescriptor(flat, list(flat.shape), [flat.stride(0), 1], [block_n, dims])

    value = blocks_of(v_dim // value_chunks) if value_chunks > 1 else None
    return blocks_of(v_dim), blocks_of(kv.shape[-1] - v_dim), value


@triton.jit
def latent_scores(q_lat, q_rope, k_lat, k_rope, scale_log2):
    """Scaled scores in the one order the forward and the backward share: the latent dot, then
    the rope dot accumulated onto it."""
    s = tl.dot(q_lat, tl.trans(k_lat))
    return tl.dot(q_rope, tl.trans(k_rope), s) * scale_log2


@triton.jit
def _latent_block(q_lat, q_rope, k_lat, k_rope, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2,
                  SUM_LEVELS: tl.constexpr, LANE_SUMS: tl.constexpr):
    """One key block of the online softmax, whichever way its tiles were loaded: scores (latent
    dot, then rope dot), the causal mask, running max, denominators in a fixed order, output."""
    s = latent_scores(q_lat, q_rope, k_lat, k_rope, scale_log2)
    s = tl.where((k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = tl.fma(l_i, alpha, row_sum_halves(p, SUM_LEVELS, LANE_SUMS))  # a fixed order for every tile shape
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["page_size", "page_shift", "stride_bt"])
def _latent_fwd_kernel(
    q_ptr, kv_ptr, lat_desc, rope_desc, v_desc, o_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr, block_table_ptr, seq_order_ptr,
    page_size, page_shift, scale_log2,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
    SUM_LEVELS: tl.constexpr, LANE_SUMS: tl.constexpr, KV_DESC: tl.constexpr, ORDERED: tl.constexpr,
    POW2_PAGES: tl.constexpr = False, OFFSETS_32: tl.constexpr = False,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    if ORDERED:  # PagedLayout.seq_order: which sequence this program's slot of the grid runs
        seq = tl.load(seq_order_ptr + seq)
    kv_head = tl.program_id(2) // CHUNKS
    chunk = tl.program_id(2) % CHUNKS
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len * GROUP:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    # row r of the tile: query token (tile*BLOCK_M + r) // GROUP, head (tile*BLOCK_M + r) % GROUP
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_idx = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = q_idx < q_len
    q_pos = context + q_idx
    token = (q_start + q_idx).to(tl.int64)
    dl = tl.arange(0, BLOCK_L)  # latent dims, padded to a power of two (pad lanes load zeros)
    dl_ok = dl < LAT
    dr = tl.arange(0, BLOCK_R)  # rope dims, padded to a power of two >= 16 (tl.dot's minimum)
    dr_ok = dr < ROPE
    q_row = q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=row_ok[:, None] & dl_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + LAT + dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0)

    dv = chunk * BLOCK_V + tl.arange(0, BLOCK_V)  # this program's value dims
    dv_ok = dv < LAT
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_V), tl.float32)
    last_q = tl.minimum(q_len - 1, (tile * BLOCK_M + BLOCK_M - 1) // GROUP)
    n_keys = context + last_q + 1
    table_row = block_table_ptr + seq.to(tl.int64) * stride_bt
    first = 0
    if KV_DESC:
        # Whole key blocks through TMA (pages hold whole blocks): the copies take no address
        # arithmetic or registers, and the next block's first slot is read a block ahead, so the
        # compiler double-buffers them (a copy whose address waits on a load in the same iteration
        # gets one buffer). The same rows as the pointer loads below, so the same bits.
        first = n_keys // BLOCK_N * BLOCK_N
        col = kv_head * (LAT + ROPE)
        slot = tl.load(table_row, mask=first > 0, other=0) * page_size
        for start in range(0, first, BLOCK_N):
            k_lat = lat_desc.load([slot, col])
            k_rope = rope_desc.load([slot, col + LAT])
            if CHUNKS == 1:
                v = k_lat
            else:  # this chunk's dims of the same rows (the latent copy just read them into L2)
                v = v_desc.load([slot, col + chunk * BLOCK_V])
            ahead = start + BLOCK_N
            slot = tl.load(table_row + ahead // page_size, mask=ahead < first, other=0) * page_size + ahead % page_size
            k_pos = start + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _latent_block(q_lat, q_rope, k_lat, k_rope, v, k_pos, k_pos < n_keys, q_pos, m_i, l_i,
                                          acc, scale_log2, SUM_LEVELS, LANE_SUMS)
    for start in range(first, n_keys, BLOCK_N):  # every block through the block table (KV_DESC: the partial last one)
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < n_keys
        slots = page_slots(table_row, k_pos, k_ok, page_size, page_shift, POW2_PAGES, OFFSETS_32)
        k_row = kv_ptr + slots[:, None] * stride_ks + kv_head * stride_kh
        k_lat = tl.load(k_row + dl[None, :], mask=k_ok[:, None] & dl_ok[None, :], other=0.0)
        k_rope = tl.load(k_row + LAT + dr[None, :], mask=k_ok[:, None] & dr_ok[None, :], other=0.0)
        if CHUNKS == 1:
            v = k_lat  # the value is the latent key: the tile just loaded
        else:  # this chunk's dims of the same rows (the score's load left them in L1/L2)
            v = tl.load(k_row + dv[None, :], mask=k_ok[:, None] & dv_ok[None, :], other=0.0)
        m_i, l_i, acc = _latent_block(q_lat, q_rope, k_lat, k_rope, v, k_pos, k_ok, q_pos, m_i, l_i, acc, scale_log2,
                                      SUM_LEVELS, LANE_SUMS)
    out = acc / l_i[:, None]
    tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :],
             out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_ok[None, :])
    if chunk == 0:
        tl.store(lse_ptr + token * (GROUP * (tl.num_programs(2) // CHUNKS)) + head, m_i + tl.log2(l_i), mask=row_ok)


def latent_dims(q: torch.Tensor, v_dim: int) -> dict:
    """The kernels' dim arguments for queries `q` whose first `v_dim` dims are latent: the latent
    and rope dims, each padded to a power of two (>= 16, `tl.dot`'s minimum)."""
    rope = q.shape[-1] - v_dim
    return dict(LAT=v_dim, ROPE=rope, BLOCK_L=next_power_of_2(max(v_dim, 16)), BLOCK_R=next_power_of_2(max(rope, 16)))


def latent_attention_triton(q: torch.Tensor, kv_cache: torch.Tensor, v_dim: int, layout, scale: float,
                            config: LatentConfig | None = None, kv_descriptors: bool | None = None,
                            packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [T, Hq, v_dim], lse [T, Hq])`` of `q` ``[T, Hq, D]`` over the paged key cache
    ``[..., Hkv, D]`` whose first `v_dim` dims are the value (`kernels.attention`'s contract).
    `config` (default `pick_config`'s) and `kv_descriptors` (whole key blocks by TMA; default:
    where `page_descriptors_fit`) are for the GPU sweeps that compare launch parameters; neither
    changes a bit. `packed`: the keys are packed training tensors (`packed_layout`), whose
    sequences' keys are consecutive rows. Without `config` or `kv_descriptors`, a launch that a
    Gluon kernel fits runs there (same bits): `latent_decode_gluon` for one query token a sequence,
    `latent_prefill_gluon` for more than `DECODE_ROWS` rows (short chunks keep the 16-row decode
    tiles)."""
    require_triton("attention (latent MLA)")
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads = kv_cache.shape[-2]
    n_seqs = layout.seq_lens.shape[0]
    if n_tokens == 0 or n_seqs == 0:
        return q.new_empty((n_tokens, n_heads, v_dim)), q.new_empty((n_tokens, n_heads), dtype=torch.float32)
    group = n_heads // n_kv_heads
    kv = kv_cache.reshape(-1, n_kv_heads, head_dim)
    rows = layout.max_seqlen_q * group
    if config is None and kv_descriptors is None:
        if latent_decode_gluon.LATENT_DECODE.mode() == "gluon" and latent_decode_gluon.fits(q, kv, v_dim, layout):
            chunks = latent_decode_gluon.value_chunks(n_seqs, num_sms(q.device))
            return latent_decode_gluon.latent_decode_gluon(q, kv, v_dim, layout, scale, chunks)
        if (rows > DECODE_ROWS and latent_prefill_gluon.LATENT_PREFILL.mode() == "gluon"
                and latent_prefill_gluon.fits(q, kv, v_dim, layout, contiguous=packed)):
            return latent_prefill_gluon.latent_prefill_gluon(q, kv, v_dim, layout, scale, contiguous=packed)
    out = torch.empty((n_tokens, n_heads, v_dim), device=q.device, dtype=q.dtype)  # the Gluon kernels allocate their own
    lse = torch.empty((n_tokens, n_heads), device=q.device, dtype=torch.float32)
    if kv_descriptors is None:
        kv_descriptors = config is None and page_descriptors_fit(kv, layout.page_size, v_dim, rows)
    cfg = config or pick_config(q.dtype, rows, n_seqs * n_kv_heads, num_sms(q.device), kv_descriptors)
    dims = latent_dims(q, v_dim)
    if dims["BLOCK_L"] % cfg.value_chunks:
        raise ValueError(f"latent_attention_triton: value_chunks={cfg.value_chunks} must divide {dims['BLOCK_L']}")
    if kv_descriptors and layout.page_size % cfg.block_n:
        raise ValueError(f"latent_attention_triton: kv_descriptors=True needs pages of a multiple of block_n="
                         f"{cfg.block_n}, got page_size={layout.page_size}")
    descs = _kv_descriptors(kv, v_dim, cfg.block_n, cfg.value_chunks) if kv_descriptors else (None, None, None)
    grid = (triton.cdiv(rows, cfg.block_m), n_seqs, n_kv_heads * cfg.value_chunks)
    shift, offsets_32 = page_shift(layout.page_size), offsets_fit_int32(kv)
    args = (q, kv, *descs, out, lse, layout.cu_seqlens_q, layout.seq_lens, layout.block_table, layout.seq_order,
            layout.page_size, shift or 0, scale * math.log2(math.e),
            q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), out.stride(0), out.stride(1),
            layout.block_table.stride(0))
    kwargs = dict(GROUP=group, **dims, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CHUNKS=cfg.value_chunks,
                  BLOCK_V=dims["BLOCK_L"] // cfg.value_chunks, SUM_LEVELS=row_sum_levels(cfg.block_n),
                  LANE_SUMS=lane_sums(cfg.block_m, cfg.num_warps), KV_DESC=kv_descriptors,
                  ORDERED=layout.seq_order is not None, POW2_PAGES=shift is not None, OFFSETS_32=offsets_32,
                  num_warps=cfg.num_warps)
    # Hopper's tiles need two stages' shared memory; smaller GPUs fall back to one (a sweep's
    # explicit candidate runs as given, or fails)
    launch_staged(_latent_fwd_kernel, grid, args, kwargs, cfg.num_stages,
                  ("latent", q.device, q.dtype, group, head_dim, v_dim, cfg, kv_descriptors, shift is not None, offsets_32),
                  fp_fusion=True, fallback=config is None)
    return out, lse
