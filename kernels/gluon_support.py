"""What the Gluon kernels (`latent_decode_gluon`, `latent_prefill_gluon`, `attention_gluon`) share:
whether Gluon is here in a Triton release they were checked under, their TMA descriptors, how a
prefill program finds its tile, and (`claim_tile`, `receive_tile`) the tile queue of a persistent
warp-specialised one.

Gluon (``triton.experimental.gluon``, in the Triton wheel from 3.5 on) is experimental: its API
and lowering move between releases, and each kernel's bits were checked against the Triton
launches on the GPU under one. So the kernels run only under the releases in `GLUON_VERIFIED`
(`HAS_GLUON`); elsewhere every launch keeps its Triton kernel, with the same bits.
"""

from __future__ import annotations

import functools

import torch

from ._triton import HAS_TRITON

__all__ = ["GLUON_VERIFIED", "HAS_GLUON", "block_slot", "claim_tile", "grid_tile", "prefill_tile", "receive_tile",
           "sequence_tile", "supported_triton", "tile_keys", "tma_descriptor"]

#: Triton releases whose Gluon the kernels were checked under, bitwise, on the GPU
GLUON_VERIFIED = ("3.6.",)


def supported_triton(version: str) -> bool:
    """Whether Triton `version` is one the Gluon kernels were checked under (`GLUON_VERIFIED`)."""
    return version.startswith(GLUON_VERIFIED)


try:
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
    HAS_GLUON = HAS_TRITON and supported_triton(triton.__version__)
except ImportError:  # pragma: no cover - older Triton
    HAS_GLUON = False

if HAS_GLUON:
    @gluon.jit
    def block_slot(table_row, block, page_size, pred, BLOCK_N: gl.constexpr):
        """The cache slot of key block `block`'s first key, through the sequence's block table row
        (0 where `pred` is false). The kernels read it a step before the block's TMA copy is
        issued: read at the copy, its latency sat between a stage's release and its refill."""
        start = block * BLOCK_N
        return gl.load(table_row + start // page_size, mask=pred, other=0) * page_size + start % page_size

    @gluon.jit
    def prefill_tile(cu_seqlens_q_ptr, seq_order_ptr, ORDERED: gl.constexpr, GROUP: gl.constexpr,
                     ROWS: gl.constexpr):
        """``(seq, q_start, q_len, tile)`` of a prefill program, whose grid runs a sequence's
        `ROWS`-row tiles of (token, head) rows along axis 0, the last (longest) first, and the
        sequences along axis 1 (in `PagedLayout.seq_order` where `ORDERED`). ``tile < 0``: the
        program has no tile of its sequence."""
        return sequence_tile(gl.program_id(0), gl.program_id(1), cu_seqlens_q_ptr, seq_order_ptr, ORDERED, GROUP, ROWS)

    @gluon.jit
    def sequence_tile(x, y, cu_seqlens_q_ptr, seq_order_ptr, ORDERED: gl.constexpr, GROUP: gl.constexpr,
                      ROWS: gl.constexpr):
        """`prefill_tile` of grid position ``(x, y)``: a persistent kernel's programs walk the grid
        themselves."""
        seq = y
        if ORDERED:
            seq = gl.load(seq_order_ptr + seq)
        q_start = gl.load(cu_seqlens_q_ptr + seq)
        q_len = gl.load(cu_seqlens_q_ptr + seq + 1) - q_start
        return seq, q_start, q_len, gl.cdiv(q_len * GROUP, ROWS) - 1 - x

    @gluon.jit
    def tile_keys(seq_lens_ptr, seq, q_len, tile, GROUP: gl.constexpr, ROWS: gl.constexpr):
        """``(context, n_keys)`` of a prefill tile: the sequence's cached positions before its new
        tokens, and the keys through the tile's last token (a tile may hold several tokens' heads or
        part of one token's)."""
        context = gl.load(seq_lens_ptr + seq) - q_len
        return context, context + gl.minimum(q_len - 1, (tile * ROWS + ROWS - 1) // GROUP) + 1

    @gluon.jit
    def grid_tile(t, tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, ORDERED: gl.constexpr,
                  GROUP: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
        """Tile `t` of a persistent prefill launch, in a non-persistent grid's order: a sequence's
        `ROWS`-row tiles last (heaviest) first, then the sequences, then the KV heads (one head's
        keys stay hot in L2 while its tiles run). ``(seq, kv_head, q_start, q_len, tile, context,
        n_blocks)``; ``tile < 0``: the sequence has no tile there; `n_blocks`: key blocks of
        `BLOCK_N` through the tile's last row."""
        seq, q_start, q_len, tile = sequence_tile(t % tiles_x, t // tiles_x % n_seqs, cu_seqlens_q_ptr, seq_order_ptr,
                                                  ORDERED, GROUP, ROWS)
        context, n_keys = tile_keys(seq_lens_ptr, seq, q_len, tile, GROUP, ROWS)
        return seq, t // (tiles_x * n_seqs), q_start, q_len, tile, context, gl.cdiv(n_keys, BLOCK_N)

    @gluon.jit
    def claim_tile(turn, counter_ptr, tile_ids, tile_full, tile_free):
        """A persistent warp-specialised program's next tile, claimed by its one-warp producer: the
        launch's next unclaimed tile (a global counter: programs that finish early take more, so the
        heavy causal tiles spread by themselves), handed to the consumer partitions through a
        two-slot ring in shared memory (`tile_ids`; `tile_full` signals a slot, `tile_free`, one
        arrival per consumer, frees it). A tile past the launch's last ends the program."""
        t = gl.atomic_add(counter_ptr, 1)
        slot = turn % 2
        mbarrier.wait(tile_free.index(slot), ((turn // 2) & 1) ^ 1)
        tile_ids.index(slot).store(gl.full([1], t, gl.int32, layout=gl.BlockedLayout([1], [32], [1], [0])))
        mbarrier.arrive(tile_full.index(slot), count=1)
        return t

    @gluon.jit
    def receive_tile(turn, tile_ids, tile_full, tile_free, WARPS: gl.constexpr):
        """The tile `claim_tile` handed over on `turn`, read by a consumer partition of `WARPS` warps."""
        slot = turn % 2
        mbarrier.wait(tile_full.index(slot), (turn // 2) & 1)
        t = gl.max(tile_ids.index(slot).load(gl.BlockedLayout([1], [32], [WARPS], [0])), axis=0)
        mbarrier.arrive(tile_free.index(slot), count=1)
        return t


@functools.lru_cache(maxsize=None)
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype):
    """The swizzled shared-memory layout of a TMA block: built once per (block, dtype), since an
    eager prefill launch (a prompt step's 27-36) pays its construction on the host each time."""
    return gl.NVMMASharedLayout.get_default_for(list(block), gl.bfloat16 if dtype == torch.bfloat16 else gl.float16)


def tma_descriptor(x: torch.Tensor, block: list[int]):
    """A Gluon TMA descriptor over the 16-bit tensor `x` (its shape and strides) copying `block`
    at a time into the swizzled shared layout the warpgroup MMAs read."""
    return TensorDescriptor(x, list(x.shape), list(x.stride()), block, _shared_layout(tuple(block), x.dtype))
