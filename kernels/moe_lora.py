"""LoRA on routed experts: ``rows += (x_p A_e^T) B_e^T * scaling`` over `fused_moe`'s expert-sorted
rows, batch-invariant and shared by training and rollouts (docs/design.md section 8, drop-in).

PEFT adapts a fused expert tensor (``target_parameters``, its ``ParamWrapper``) with one
``lora_A`` of ``[E * r, K]`` (expert e's rows ``e*r .. e*r + r - 1``) and one ``lora_B`` of
``[N, r * E]`` (expert e's rank-j column at ``j * E + e``); `ExpertLora` holds them as they are
(read in place, fp32 or the activations' dtype) with the scaling. PEFT adds ``scaling * B_e A_e``
to the expert's weight on every forward; we add the update to the expert GEMM's rounded output
instead, with `kernels.lora`'s arithmetic per row (the same steps, the same constants):

1. shrink: ``u_p = x_p A_e^T`` with 16-bit operands (fp32 A split into ``hi + lo``) and fp32
   accumulation, K in fixed chunks of `lora.CHUNK_K` whose partials are added in chunk order;
2. expand: ``acc = sum_j u_p[j] * B_e[n, j]`` in fp32, j in rank order, element-wise, each
   product rounded before it is added (FMA contraction off, as in `kernels.lora`'s expand);
3. ``out = round(float(base) + acc * scaling)``: the base output (bias included) plus the update.

Two launches per adapted GEMM, the shrink over tiles of `ROWS` sorted rows (every row block of
a layout is a multiple of it, so a tile holds one expert's rows), then the expand in place on the
base rows, in one of two forms with the same products and sums:
- the training forward's: the shrink stores its K chunks' partials; the expand adds them as it
  reads u and stores u for the backward, a block of ranks of u and B at a time read as tiles and
  walked in registers (`lora_expand.u_tile_kept`, `lora_expand.rank_column`);
- the rollout's (no u kept): the shrink adds its chunks' partials itself, in chunk order, and
  stores u rank-major ``[r, P]`` (`SUM_CHUNKS`); the expand's rank loop is unrolled and loads
  each rank's u row and B column (`_moe_lora_expand_u_kernel`), so no column is picked out of a
  tile (0.7-0.9x the other's time with the same B, `benchmarks/moe.py --lora 16`'s launch
  table). Tiles of padding rows alone (an expert's segment past its last pair) are skipped by
  both launches. In a CUDA-graph capture without autograd the shrink and B's copy begin on the
  side stream beside the expert GEMM, which reads the same input (`moe_lora_shrink_beside`,
  `kernels/streams.py`).

From one pair an expert on average B is copied by expert first (`expert_b_operand`,
`expert_lora.py`): in PEFT's layout an expert's ranks lie E values apart, so that each value of a B
tile is a 32-byte sector of its own.

Invariance contract: a row's result depends on its own row, its expert's adapter and its base
row only (fixed tiles, K chunks that depend on K only, an element-wise expand), so a pair's bits
are the same whatever its expert's load or the batch (`conformance/kernel_invariance.py --only moe`);
the CPU reference runs the same steps per expert with `lora_reference.lora_shrink_reference` /
`lora_expand_reference`.

The gate/up rows of the forward's ``preact`` buffer are gate columns first; GPT-OSS's weights
interleave them (gate row n at 2n): `GATE_FIRST_FROM_INTERLEAVED` maps a preact column to its B row.
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .lora import BLOCK_K, BLOCK_R, num_chunks, shrink_chunk
from .lora_expand import EXPAND_RANK_BLOCK, rank_column, u_tile_kept
from .lora_reference import CHUNK_K, lora_expand_reference, lora_shrink_reference, split_a
from .expert_lora import ExpertLora, expert_b_operand, expert_b_rows
from .moe_align import MoeLayout
from .streams import LORA_SHRINK, begin_beside, forks_here

ROWS = 16  # sorted rows per shrink and expand program: every layout's row block is a multiple
EXPAND_BLOCK_N = 128
IDENTITY, GATE_FIRST_FROM_INTERLEAVED = 0, 1  # column -> B row maps of the expand


@triton.jit(do_not_specialize=["num_pairs"])
def _moe_lora_shrink_kernel(x_ptr, a_ptr, p_ptr, sorted_pairs_ptr, block_expert_ptr, num_pairs, P, K, R,
                            stride_x, stride_a, GATHER: tl.constexpr, TOP_K: tl.constexpr,
                            BLOCK_EXPERT_ROWS: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                            SPLIT_A: tl.constexpr, CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, SKIP_PADDING: tl.constexpr,
                            SUM_CHUNKS: tl.constexpr = False, PDL: tl.constexpr = False):
    """Partial ``p[s, rows, ranks]`` of ``x_p A_e^T`` over K chunk s for a tile of sorted rows of
    expert e (program (row tile, rank tile, s)); x's row is the pair's token (`GATHER`) or the
    sorted row itself. With `SUM_CHUNKS` (grid (row tile, rank tile, 1)) the program computes
    every chunk's partial and adds them in chunk order, as the expand would (``((p0 + p1) + p2)
    ...``), and stores u rank-major, ``p[ranks, rows]`` of ``[R, P]``. With `SKIP_PADDING` a tile of
    padding rows alone writes nothing."""
    wait_for_inputs(PDL)
    pid_m, pid_r, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // BLOCK_EXPERT_ROWS).to(tl.int64)
    if expert < 0:
        return
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = tl.load(sorted_pairs_ptr + rows) < num_pairs
    if SKIP_PADDING:
        if tl.max(valid.to(tl.int32), axis=0) == 0:
            return
    if GATHER:
        x_rows = (tl.load(sorted_pairs_ptr + rows) // TOP_K).to(tl.int64)
    else:
        x_rows = rows.to(tl.int64)
    ranks = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rank_ok = ranks < R
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + x_rows[:, None] * stride_x + offs_k[None, :]
    a_ptrs = a_ptr + (expert * R + ranks[None, :]) * stride_a + offs_k[:, None]
    acc = shrink_chunk(x_ptrs, a_ptrs, valid, rank_ok, pid_s * CHUNK, K, INPUT_PRECISION, SPLIT_A, CHUNK, BLOCK_M,
                       BLOCK_R, BLOCK_K)
    if SUM_CHUNKS:
        for start in range(CHUNK, K, CHUNK):
            acc += shrink_chunk(x_ptrs, a_ptrs, valid, rank_ok, start, K, INPUT_PRECISION, SPLIT_A, CHUNK, BLOCK_M,
                                BLOCK_R, BLOCK_K)
        out = p_ptr + ranks[None, :].to(tl.int64) * P + rows[:, None]
    else:
        out = p_ptr + (pid_s * P + rows[:, None]).to(tl.int64) * R + ranks[None, :]
    tl.store(out, acc, mask=rank_ok[None, :])


@triton.jit(do_not_specialize=["P", "num_pairs"])
def _moe_lora_expand_kernel(base_ptr, p_ptr, b_ptr, u_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, P, N, R, S,
                            scaling, stride_base, stride_be, stride_bn, stride_br, BLOCK_EXPERT_ROWS: tl.constexpr,
                            COLUMNS: tl.constexpr, WRITE_U: tl.constexpr, SKIP_PADDING: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, RANK_BLOCK: tl.constexpr,
                            PDL: tl.constexpr = False):
    """``base[rows] = round(base + (u B_e^T) * scaling)`` in place, u the sum of the shrink's `S`
    partials ``p[S, P, R]`` in chunk order, expert e's B at ``b + e * stride_be`` (PEFT's layout or
    `expert_b_operand`'s copy by expert: the same values); with `WRITE_U` the first N tile's
    programs store u ``[P, R]`` (the backward's). With `SKIP_PADDING` a tile of padding rows alone
    is left as it is."""
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // BLOCK_EXPERT_ROWS).to(tl.int64)
    if expert < 0:
        return
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    if SKIP_PADDING:
        if tl.max((tl.load(sorted_pairs_ptr + rows) < num_pairs).to(tl.int32), axis=0) == 0:
            return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    b_ptrs = expert_b_rows(b_ptr, expert, cols, N, stride_be, stride_bn, COLUMNS)
    step = P.to(tl.int64) * R
    p_rows = p_ptr + rows * R
    row_ok = rows < P  # every row of the grid (the padded sorted rows)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for first in range(0, R, RANK_BLOCK):  # u and B a block of ranks at a time, as kernels/lora.py's expand
        ranks = first + tl.arange(0, RANK_BLOCK)
        u = u_tile_kept(u_ptr, p_rows, row_ok, step, rows, ranks, R, R, 0, S, WRITE_U)
        bt = tl.load(b_ptrs[:, None] + ranks[None, :].to(tl.int64) * stride_br,
                     mask=col_ok[:, None] & (ranks < R)[None, :], other=0.0).to(tl.float32)
        for j in range(first, tl.minimum(first + RANK_BLOCK, R)):
            acc += rank_column(u, ranks, j)[:, None] * rank_column(bt, ranks, j)[None, :]
    ptrs = base_ptr + rows[:, None] * stride_base + cols[None, :]
    base = tl.load(ptrs, mask=col_ok[None, :], other=0.0)
    tl.store(ptrs, (base.to(tl.float32) + acc * scaling).to(base_ptr.dtype.element_ty), mask=col_ok[None, :])


@triton.jit(do_not_specialize=["P", "num_pairs"])
def _moe_lora_expand_u_kernel(base_ptr, u_ptr, b_ptr, block_expert_ptr, sorted_pairs_ptr, num_pairs, P, N, scaling,
                              stride_base, stride_be, stride_bn, stride_br, BLOCK_EXPERT_ROWS: tl.constexpr,
                              COLUMNS: tl.constexpr, R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              PDL: tl.constexpr = False):
    """The rollout's expand: `_moe_lora_expand_kernel`'s products and sums, u read rank-major ``[R,
    P]`` (the shrink's `SUM_CHUNKS`), tiles of padding rows alone skipped. The rank loop is unrolled
    and each rank's step loads its own u row (`BLOCK_M` rows side by side, the same for every
    thread: broadcast loads) and B column: a thread holds one column of the tile, so that a rank
    costs it one B value and `BLOCK_M` products and sums, no picking of a column out of a tile."""
    wait_for_inputs(PDL)
    pid_m = tl.program_id(0)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    # the tile's expert and its pairs read at once (two loads in flight, not one after the other)
    expert = tl.load(block_expert_ptr + (pid_m * BLOCK_M) // BLOCK_EXPERT_ROWS).to(tl.int64)
    pairs = tl.max((tl.load(sorted_pairs_ptr + rows) < num_pairs).to(tl.int32), axis=0)
    if (expert < 0) | (pairs == 0):
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ptrs = base_ptr + rows[:, None] * stride_base + cols[None, :]
    base = tl.load(ptrs, mask=col_ok[None, :], other=0.0)  # in flight beside the rank loop's loads
    b_ptrs = expert_b_rows(b_ptr, expert, cols, N, stride_be, stride_bn, COLUMNS)
    u_rows = u_ptr + tl.max_contiguous(tl.multiple_of(rows, BLOCK_M), BLOCK_M)
    u_step = tl.multiple_of(P.to(tl.int64), BLOCK_M)  # P: a multiple of every layout's row block
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for j in tl.static_range(R):  # ranks in order: acc = (u0 b0 + u1 b1) + ..., each product rounded
        uj = tl.load(u_rows + j * u_step)
        bj = tl.load(b_ptrs + j * stride_br, mask=col_ok, other=0.0).to(tl.float32)
        acc += uj[:, None] * bj[None, :]
    tl.store(ptrs, (base.to(tl.float32) + acc * scaling).to(base_ptr.dtype.element_ty), mask=col_ok[None, :])


def moe_lora_shrink_triton(x: torch.Tensor, lora: ExpertLora, layout: MoeLayout, experts: int, top_k: int,
                           gather: bool, skip_padding: bool, sum_chunks: bool = False) -> torch.Tensor:
    """The shrink's partials ``[S, P, r]`` fp32 of ``x_p A_e^T`` over `layout`'s padded sorted rows, K
    in `CHUNK_K` chunks (one launch); with `sum_chunks`, u itself (the partials added in chunk
    order), rank-major ``[r, P]`` as `moe_lora_expand_u_triton` reads it. `skip_padding` leaves
    tiles of padding rows alone unwritten."""
    require_triton("fused_moe")
    rows, k, rank = layout.sorted_pairs.shape[0], x.shape[1], lora.rank(experts)
    s = num_chunks(k)
    shape = (rank, rows) if sum_chunks else (s, rows, rank)
    partials = torch.empty(shape, device=x.device, dtype=torch.float32)
    if rows == 0:
        return partials
    a = lora.a if lora.a.stride(-1) == 1 else lora.a.contiguous()
    _moe_lora_shrink_kernel[(rows // ROWS, triton.cdiv(rank, BLOCK_R), 1 if sum_chunks else s)](
        x, a, partials, layout.sorted_pairs, layout.block_expert, layout.num_pairs, rows, k, rank, x.stride(0),
        a.stride(0), GATHER=gather, TOP_K=top_k, BLOCK_EXPERT_ROWS=layout.config.block_m,
        INPUT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SPLIT_A=split_a(x.dtype, a.dtype),
        CHUNK=CHUNK_K, BLOCK_M=ROWS, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, SKIP_PADDING=skip_padding,
        SUM_CHUNKS=sum_chunks, num_warps=4, num_stages=3, **dependent_launch_kwargs(x.device), enable_fp_fusion=True)
    return partials


def moe_lora_expand_triton(base: torch.Tensor, partials: torch.Tensor, lora: ExpertLora, layout: MoeLayout,
                           experts: int, columns: int, u: torch.Tensor | None,
                           b_operand: tuple[torch.Tensor, tuple[int, int, int]]) -> None:
    """``base += (u B_e^T) * scaling`` in place over the sorted rows (one launch), u the sum of
    `partials` in chunk order, B as `expert_b_operand` gives it; with `u` ``[P, r]`` also stores u
    there (the training forward's), else skips tiles of padding rows alone."""
    require_triton("fused_moe")
    rows, n = base.shape
    if rows == 0:
        return
    b, b_strides = b_operand
    # maxnreg: left to itself, ptxas gave the training forward's fp32 gate/up expand 96 registers
    # and a spill (tests/test_sm90_model_kernels.py); 128 holds every variant without one
    _moe_lora_expand_kernel[(rows // ROWS, triton.cdiv(n, EXPAND_BLOCK_N))](
        base, partials, b, partials if u is None else u, layout.block_expert, layout.sorted_pairs, layout.num_pairs,
        rows, n, partials.shape[2], partials.shape[0], float(lora.scaling), base.stride(0), *b_strides,
        BLOCK_EXPERT_ROWS=layout.config.block_m, COLUMNS=columns, WRITE_U=u is not None, SKIP_PADDING=u is None,
        BLOCK_M=ROWS, BLOCK_N=EXPAND_BLOCK_N, RANK_BLOCK=EXPAND_RANK_BLOCK, num_warps=4, enable_fp_fusion=False,
        maxnreg=128, **dependent_launch_kwargs(base.device))


def moe_lora_expand_u_triton(base: torch.Tensor, u_t: torch.Tensor, lora: ExpertLora, layout: MoeLayout,
                             experts: int, columns: int, b_operand: tuple[torch.Tensor, tuple[int, int, int]]) -> None:
    """The rollout's expand: ``base += (u B_e^T) * scaling`` in place over the sorted rows (one
    launch), u rank-major ``[r, P]`` (`moe_lora_shrink_triton` with `sum_chunks`), B as
    `expert_b_operand` gives it; tiles of padding rows alone are skipped. The same bits as
    `moe_lora_expand_triton` of u's partials."""
    require_triton("fused_moe")
    rows, n = base.shape
    if rows == 0:
        return
    b, b_strides = b_operand
    _moe_lora_expand_u_kernel[(rows // ROWS, triton.cdiv(n, EXPAND_BLOCK_N))](
        base, u_t, b, layout.block_expert, layout.sorted_pairs, layout.num_pairs, rows, n, float(lora.scaling),
        base.stride(0), *b_strides, BLOCK_EXPERT_ROWS=layout.config.block_m, COLUMNS=columns, R=u_t.shape[0],
        BLOCK_M=ROWS, BLOCK_N=EXPAND_BLOCK_N, num_warps=4, enable_fp_fusion=False,
        **dependent_launch_kwargs(base.device))


RolloutOperands = tuple[torch.Tensor, tuple[torch.Tensor, tuple[int, ...]]]  # u rank-major, B's operand


def rollout_operands(x: torch.Tensor, lora: ExpertLora, layout: MoeLayout, experts: int, top_k: int,
                     gather: bool) -> RolloutOperands:
    """What the rollout's expand reads besides the base rows: u rank-major (the summing shrink) and
    B as `expert_b_operand` picks it. Both read only the GEMM's input and the adapter."""
    return (moe_lora_shrink_triton(x, lora, layout, experts, top_k, gather, skip_padding=True, sum_chunks=True),
            expert_b_operand(lora, experts, layout.num_pairs))


def moe_lora_shrink_beside(x: torch.Tensor, lora: ExpertLora, layout: MoeLayout, experts: int, top_k: int,
                           gather: bool) -> tuple[RolloutOperands, torch.cuda.Event] | None:
    """`rollout_operands` begun on the side stream (`streams.begin_beside`), to run beside the expert
    tensor's base GEMM, which reads the same input, while a CUDA graph is being captured without
    autograd (`streams.forks_here`); `moe_lora_add_triton`'s ``started`` takes the result. None
    elsewhere, and with ``VEXACT_LORA_SHRINK=inline`` (the launcher then runs them in line)."""
    if LORA_SHRINK.mode() == "inline" or not forks_here(x):
        return None
    return begin_beside(lambda: rollout_operands(x, lora, layout, experts, top_k, gather), x.device)


def moe_lora_add_triton(base: torch.Tensor, x: torch.Tensor, lora: ExpertLora, layout: MoeLayout, experts: int,
                        top_k: int, gather: bool, columns: int = IDENTITY, keep_u: bool = False,
                        started: tuple[RolloutOperands, torch.cuda.Event] | None = None) -> torch.Tensor | None:
    """Add the adapter's update to the sorted rows `base` ``[P, N]`` in place: the shrink
    (`moe_lora_shrink_triton`), then the expand with B as `expert_b_operand` picks it. The training
    forward (`keep_u`) keeps the shrink's partials and its expand (`moe_lora_expand_triton`) adds
    them and stores u; otherwise the shrink adds them itself and `moe_lora_expand_u_triton` reads
    u. Both give every pair's row the same bits.

    Args:
        base: the expert GEMM's rounded output over `layout`'s padded sorted rows.
        x: the GEMM's input: tokens ``[T, K]`` (`gather`: row p reads its pair's token) or the
            sorted rows ``[P, K]`` themselves.
        columns: `IDENTITY`, or `GATE_FIRST_FROM_INTERLEAVED` (gate-first base over interleaved B rows).
        keep_u: also return u ``[P, r]`` fp32 (the backward's); else None, and tiles of padding rows
            alone are skipped.
        started: without `keep_u`, u and B begun on the side stream (`moe_lora_shrink_beside`): the
            current stream waits for them, then expands.
    """
    if not keep_u:
        if started is None:
            u_t, b_operand = rollout_operands(x, lora, layout, experts, top_k, gather)
        else:
            (u_t, b_operand), ready = started
            torch.cuda.current_stream(base.device).wait_event(ready)
        moe_lora_expand_u_triton(base, u_t, lora, layout, experts, columns, b_operand)
        return None
    if started is not None:
        raise ValueError("moe_lora_add_triton: started (the rollout's operands) was given with keep_u=True")
    partials = moe_lora_shrink_triton(x, lora, layout, experts, top_k, gather, skip_padding=False)
    u = torch.empty(base.shape[0], lora.rank(experts), device=x.device, dtype=torch.float32)
    moe_lora_expand_triton(base, partials, lora, layout, experts, columns, u,
                           expert_b_operand(lora, experts, layout.num_pairs))
    return u


def moe_lora_add_reference(base: torch.Tensor, x: torch.Tensor, lora: ExpertLora, expert: int,
                           experts: int) -> torch.Tensor:
    """Rows `base` ``[M, N]`` of one expert (`x` ``[M, K]`` their inputs, B rows in the base's column
    order) plus the adapter's update: `lora_reference.lora_shrink_reference`, then `lora_expand_reference`."""
    u = lora_shrink_reference(x, lora.expert_a(expert, experts))
    return lora_expand_reference(base, u, lora.expert_b(expert, experts), None, (base.shape[1],), (lora.scaling,),
                                 torch.empty_like(base))


def expert_lora_math(x: torch.Tensor, lora: ExpertLora, expert: int, experts: int) -> torch.Tensor:
    """Plain differentiable torch: expert `expert`'s update ``scaling * (x A_e^T) B_e^T`` (the tests'
    oracle and the reference backward's)."""
    a, b = lora.expert_a(expert, experts), lora.expert_b(expert, experts)
    return (x @ a.to(x.dtype).t()) @ b.to(x.dtype).t() * lora.scaling
