"""GQA attention forward for prefill and training in Gluon (Hopper): 128 query rows a program on
two consumer warpgroups of 64 rows each, fed K/V blocks by a producer warp through a ring of
shared-memory stages that both read (FlashAttention-3's producer/consumer warp specialisation),
one program an SM taking tiles from a queue (persistent).

Why: our Triton launch (128 rows on one warpgroup, two programs an SM) reached 1.22-1.31x SDPA
flash on packed training at 16 x 1,024 tokens, where the target asks 1.3x (docs/design.md section 9), and read paged prompt
K/V by pointer loads (~180 TFLOP/s on a Qwen3-8B prompt step). What this kernel does instead:

- A block's softmax overlaps the tensor cores' work: each consumer issues block ``i``'s scores,
  then block ``i - 1``'s value dot, and runs block ``i``'s softmax while that dot runs
  (FlashAttention-3's intra-warpgroup pipelining); the query stays in registers.
- Nothing holds the two consumers in step: a stage is refilled once each has *arrived* on its
  "empty" barrier after the value dot that read it, and they wait only on the copies. (Two
  warpgroups of one program that met at a CTA barrier before every refill ran 1.1-1.3x slower
  than one, H200, 2026-11-28.)
- The producer warp issues every TMA copy, whole 64-key blocks from their pages or packed rows.
- Tiles come from a global counter (`gluon_support.claim_tile`) in a non-persistent grid's order
  (a sequence's last, heaviest, tiles first; one KV head's tiles together, its keys hot in L2): the
  next tile's first blocks are copied while the consumers finish the last one, and programs that
  finish early take more. A fixed snake-order share per program lost 1-6%, and one program a
  tile 10-15% at 1k and on prompt steps (`benchmarks/attention_prefill.py`, H200, 2026-11-28).

On the H200 (`benchmarks/attention_prefill.py`, 2026-11-28, `launch_config`'s two launches
against the Triton one in the same process): packed training 1.08-1.10x at 1k tokens a sequence
(1.33-1.34x SDPA flash), 1.07-1.17x at 4k, 1.12-1.29x at 8k, 1.04-1.05x at 32k (1.54-1.56x SDPA
flash); a Qwen3-8B prompt step 1.54x, chunked prefill 1.80x.

Same bits as the Triton kernel (docs/design.md rule 2): each consumer's block loop is that
kernel's sequence of fp32 operations (`attention_gluon_consumer`'s docstring says how). Key blocks
of 64 are aligned to absolute positions and masked as the Triton kernel masks them
(``k_pos <= q_pos`` and within the launch's keys). A block past a consumer's last key but inside
the sequence holds later tokens' written, finite keys, which the mask zeroes in ``P`` exactly. The
sequence's partial last block is copied whole too, but its slots past the sequence's last key may
hold anything (NaN in an unwritten page): the producer waits for that copy itself and zeroes those
rows before it signals the consumers, the zeros the Triton kernel's pointer loads read there.

Where it runs (`fits`; `attention.attention_triton` routes it): Hopper with a verified Gluon
(`gluon_support.GLUON_VERIFIED`), head dim 128 for keys and values, 16-bit tensors, launches of
more than `attention_tiles.BLOCK_M` (token, head) rows a sequence (prompt chunks and training;
decode keeps the Triton launch), over pages of a multiple of 64 keys (the engine's on Hopper) or
packed training K/V. ``VEXACT_ATTENTION_PREFILL=triton`` keeps the Triton launch.
"""

from __future__ import annotations

import math

import torch

from ._triton import has_tma, num_sms, tma_rows_aligned
from .attention_tiles import BLOCK_M, BLOCK_N
from .gluon_support import HAS_GLUON, tma_descriptor
from .kernel_switch import KernelSwitch
from .row_sum import row_sum_levels

__all__ = ["ATTENTION_PREFILL", "HEAD_DIM", "LONG_CONFIG", "LONG_TOKENS", "ROWS", "SHORT_CONFIG",
           "attention_prefill_gluon", "fits", "launch", "launch_config", "shape_fits"]

#: ``VEXACT_ATTENTION_PREFILL``: ``gluon`` (the default: this kernel, where it `fits`) or ``triton``
ATTENTION_PREFILL = KernelSwitch("VEXACT_ATTENTION_PREFILL", ("gluon", "triton"), "gluon",
                                 "GQA prefill and training forward kernel")
HEAD_DIM = 128  # the one head dim (keys and values) of every GQA model we ship: Qwen3, Qwen2.5, Llama-3.1
ROWS = 128  # (token, head) query rows a program: two consumer warpgroups of 64 (one warpgroup MMA's M each)
#: A launch's (K/V stages of 32 KB, registers a thread of each consumer warpgroup, of the
#: producer; its one warp is rounded up to a warpgroup): 12 warps share the SM's 65,536 registers,
#: 2 x 128 x consumer + 128 x producer, none spilling (24 for the producer, as FlashAttention-3
#: gives its, spills the last block's zeroing). By the launch's longest sequence (`launch_config`):
#: five stages were as fast or faster than four at 1k-8k tokens in every H200 call, and at 1k the
#: one above 1.3x SDPA flash (1.34x against 1.30x); at 32k (one sequence) four held 1.00-1.04x
#: the Triton launch where five fell to 0.90-0.94x in two of three calls (`benchmarks/attention_prefill.py`, 2026-11-28)
SHORT_CONFIG = (5, 224, 56)
LONG_CONFIG = (4, 232, 40)
LONG_TOKENS = 8192  # longest sequence up to which a launch takes SHORT_CONFIG (16k was not measured)

if HAS_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    from .attention_gluon_consumer import consumer  # Gluon-only, as the helpers below
    from .gluon_support import block_slot, claim_tile, grid_tile


def launch_config(max_seqlen_q: int) -> tuple[int, int, int]:
    """``(stages, consumer_regs, producer_regs)`` of a launch whose longest sequence has
    `max_seqlen_q` query tokens: `SHORT_CONFIG` up to `LONG_TOKENS`, else `LONG_CONFIG` (the same
    bits either way: the stages and registers change when a block is copied, not what is added)."""
    return SHORT_CONFIG if max_seqlen_q <= LONG_TOKENS else LONG_CONFIG


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
    def _zero_tail(smem, valid, D: gl.constexpr, BLOCK_N: gl.constexpr):
        """Zero rows ``valid..BLOCK_N-1`` of one stage's block (8 rows at a time: the swizzle's period)."""
        ld: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
        for r0 in gl.static_range(0, BLOCK_N, 8):
            if r0 + 8 > valid:
                part = smem.slice(r0, 8, dim=0)
                rows = r0 + gl.arange(0, 8, layout=gl.SliceLayout(1, ld))
                x = part.load(ld)
                part.store(gl.where((rows < valid)[:, None], x, gl.zeros_like(x)))

    @gluon.jit
    def _copy_block(k_desc, v_desc, k_smem, v_smem, ready, landed, landed_phase, slot, kv_col, stage, tail,
                    STAGES: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr):
        """One key block into `stage` by TMA. `tail` > 0: the sequence's partial last block, with
        `tail` keys of the sequence: copied, waited for here, and zeroed past them before the
        consumers are signalled (its other slots may hold anything)."""
        if tail == 0:
            mbarrier.expect(ready.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [slot, kv_col], ready.index(stage), k_smem.index(stage))
            mbarrier.expect(ready.index(STAGES + stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [slot, kv_col], ready.index(STAGES + stage), v_smem.index(stage))
        else:
            mbarrier.expect(landed, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [slot, kv_col], landed, k_smem.index(stage))
            tma.async_copy_global_to_shared(v_desc, [slot, kv_col], landed, v_smem.index(stage))
            mbarrier.wait(landed, landed_phase)
            _zero_tail(k_smem.index(stage), tail, D, BLOCK_N)
            _zero_tail(v_smem.index(stage), tail, D, BLOCK_N)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(ready.index(stage), count=1)
            mbarrier.arrive(ready.index(STAGES + stage), count=1)

    @gluon.jit
    def _producer(k_desc, v_desc, k_smem, v_smem, ready, empty, landed, tile_ids, tile_full, tile_free, counter_ptr,
                  n_tiles, tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, block_table_ptr,
                  stride_bt, page_size, ORDERED: gl.constexpr, GROUP: gl.constexpr, STAGES: gl.constexpr,
                  D: gl.constexpr, BLOCK_N: gl.constexpr):
        """Copy each of the program's tiles' key blocks into the ring of stages, each stage once both
        consumers released the block it held."""
        it = 0  # blocks copied so far: the ring's position
        tails = 0  # partial last blocks copied so far: the `landed` barrier's phase
        turn = 0
        t = claim_tile(turn, counter_ptr, tile_ids, tile_full, tile_free)
        while t < n_tiles:
            seq, kv_head, q_start, q_len, tile, context, n_blocks = grid_tile(
                t, tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, ORDERED, GROUP, 128, BLOCK_N)
            if tile >= 0:
                seq_len = context + q_len
                table_row = block_table_ptr + seq.to(gl.int64) * stride_bt
                for j in range(n_blocks):
                    stage = it % STAGES
                    slot = block_slot(table_row, j, page_size, True, BLOCK_N)
                    tail = 0
                    if (j + 1) * BLOCK_N > seq_len:
                        tail = seq_len - j * BLOCK_N
                    mbarrier.wait(empty.index(stage), ((it // STAGES) & 1) ^ 1)  # both consumers done with it
                    _copy_block(k_desc, v_desc, k_smem, v_smem, ready, landed, tails & 1, slot, kv_head * D, stage,
                                tail, STAGES, D, BLOCK_N)
                    if tail > 0:
                        tails += 1
                    it += 1
            turn += 1
            t = claim_tile(turn, counter_ptr, tile_ids, tile_full, tile_free)

    # The batch's shape changes from launch to launch. Specialized on (== 1, multiples of 16), every
    # new combination of these five compiled the whole kernel again, in a rollout's or a training
    # run's first steps of each new shape (the invariance sweep's head-dim-128 shapes: ~70 s each
    # with it, ~40 s without). Index arithmetic only: no bit depends on it.
    @gluon.jit(do_not_specialize=["page_size", "stride_bt", "n_tiles", "tiles_x", "n_seqs"])
    def _gqa_attention_ws_kernel(q_ptr, k_desc, v_desc, o_ptr, lse_ptr, cu_seqlens_q_ptr, seq_lens_ptr,
                                 block_table_ptr, seq_order_ptr, counter_ptr, page_size, scale_log2, stride_qt,
                                 stride_qh, stride_ot, stride_oh, stride_lt, stride_bt, n_tiles, tiles_x, n_seqs,
                                 GROUP: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                                 SUM_LEVELS: gl.constexpr, ORDERED: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                 PRODUCER_REGS: gl.constexpr):
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], mbarrier.MBarrierLayout())  # keys, values
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        landed = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        tile_ids = gl.allocate_shared_memory(gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        tile_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        tile_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for st in gl.static_range(2 * STAGES):
            mbarrier.init(ready.index(st), count=1)
        for st in gl.static_range(STAGES):
            mbarrier.init(empty.index(st), count=2)  # one arrival from each consumer
        mbarrier.init(landed.index(0), count=1)
        for st in gl.static_range(2):
            mbarrier.init(tile_full.index(st), count=1)
            mbarrier.init(tile_free.index(st), count=2)

        # (tuple literals: a partition's constexprs do not survive tuple concatenation)
        gl.warp_specialize([
            (consumer, (q_ptr, o_ptr, lse_ptr, k_smem, v_smem, ready, empty, tile_ids, tile_full, tile_free, n_tiles,
                         tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, 0, ORDERED, GROUP, D, BLOCK_N, STAGES,
                         SUM_LEVELS)),
            (consumer, (q_ptr, o_ptr, lse_ptr, k_smem, v_smem, ready, empty, tile_ids, tile_full, tile_free, n_tiles,
                         tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr, seq_order_ptr, scale_log2,
                         stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, 1, ORDERED, GROUP, D, BLOCK_N, STAGES,
                         SUM_LEVELS)),
            (_producer, (k_desc, v_desc, k_smem, v_smem, ready, empty, landed.index(0), tile_ids, tile_full, tile_free,
                         counter_ptr, n_tiles, tiles_x, n_seqs, cu_seqlens_q_ptr, seq_lens_ptr,
                         seq_order_ptr, block_table_ptr, stride_bt, page_size, ORDERED, GROUP, STAGES, D, BLOCK_N)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])

        for st in gl.static_range(2 * STAGES):
            mbarrier.invalidate(ready.index(st))
        for st in gl.static_range(STAGES):
            mbarrier.invalidate(empty.index(st))
        mbarrier.invalidate(landed.index(0))
        for st in gl.static_range(2):
            mbarrier.invalidate(tile_full.index(st))
            mbarrier.invalidate(tile_free.index(st))


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
           lse: torch.Tensor, stages: int | None = None, consumer_regs: int | None = None,
           producer_regs: int | None = None) -> None:
    """The kernel launch, into `out` and `lse`, for a causal launch that `shape_fits` (unchecked:
    `attention_prefill_gluon` checks; `benchmarks/kernel_resources.py` compiles it for sm_90 on
    CPU): `k`, `v` the paged caches or the packed training K/V as ``[slots, Hkv, 128]``. One
    program an SM (persistent), each taking tiles from a global counter until none is left;
    `stages` and the registers default (each) to `launch_config`'s (`benchmarks/attention_prefill.py`
    times others)."""
    default = launch_config(layout.max_seqlen_q)
    stages, consumer_regs, producer_regs = (given if given is not None else d for given, d in
                                            zip((stages, consumer_regs, producer_regs), default))
    n_tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    k_rows, v_rows = k.reshape(k.shape[0], kv_heads * dim), v.reshape(v.shape[0], kv_heads * dim)
    group = heads // kv_heads
    n_seqs = layout.seq_lens.shape[0]
    tiles_x = -(-layout.max_seqlen_q * group // ROWS)
    n_tiles = tiles_x * n_seqs * kv_heads
    ordered = layout.seq_order is not None
    order = layout.seq_order if ordered else layout.cu_seqlens_q  # unread (ORDERED false); a partition takes no None
    counter = torch.zeros(1, dtype=torch.int32, device=q.device)
    # the default partition's registers: what the launch's 12 warps have left beside the workers'
    max_regs = (consumer_regs * 2 + producer_regs) // 3 // 8 * 8
    _gqa_attention_ws_kernel[(min(n_tiles, num_sms(q.device)), )](
        q, tma_descriptor(k_rows, [BLOCK_N, dim]), tma_descriptor(v_rows, [BLOCK_N, dim]), out, lse,
        layout.cu_seqlens_q, layout.seq_lens, layout.block_table, order, counter, layout.page_size,
        scale * math.log2(math.e), q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        layout.block_table.stride(0), n_tiles, tiles_x, n_seqs, GROUP=group, D=dim, BLOCK_N=BLOCK_N,
        STAGES=stages, SUM_LEVELS=row_sum_levels(BLOCK_N), ORDERED=ordered,
        CONSUMER_REGS=consumer_regs, PRODUCER_REGS=producer_regs, num_warps=4, maxnreg=max_regs, enable_fp_fusion=True)
