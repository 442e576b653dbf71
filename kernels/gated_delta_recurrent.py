"""gated_delta_recurrent: the gated delta rule token by token, the one form training and rollout share.

Per value head ``h`` (query/key head ``h // (Hv // Hk)``), with the state ``S [dk, dv]`` in fp32
and per token ``t`` a log decay ``g_t``, a ``beta_t`` and the l2-normalised ``q_t`` (times
`scale`) and ``k_t``, one step is (transformers' ``torch_recurrent_gated_delta_rule``, in this
order, every operation rounded to fp32 on its own):

1. ``S = S * exp(g_t)``;
2. ``kS = sum_dk(S * k_t)`` (``[dv]``), ``u = (v_t - kS) * beta_t``;
3. ``S = S + k_t u^T``;
4. ``o_t = sum_dk(S * q_t)``.

The sums over dk are `row_sum.row_sum_halves` (halves added until one is left: fixed by logical
position, not by the register layout), the l2 norm is ``x / sqrt(sum_dk(x * x) + 1e-6)`` by the
same sums. The walk launches with FMA contraction off, so each product is rounded before its sum
as the steps say. With it on, the compiler (LLVM, in the PTX already) fused a product into the
first add of a sum or into the update where the register layout let it, and the layout follows
the walk's shape: at dk 16 the 8-column blocks (split halves) fused one product an element of the
state and the lane-sum blocks two, and the final states differed in their last bits (sm_90
compile and the H200, tests/triton_checks/check_gated_delta_rule.py; at dk 128 both fused two an
element, by chance). The l2 norms and the scale run first, in a pass of their own over every row
(`unit_rows`: fp32 q and k, each row alone), so the walk does not repeat them for every value block
and value head of a key head (in the walk they were two thirds of a token's step: 1,476 SASS
instructions at Qwen3.5's heads, 500 without, in 16-column blocks with contraction on; with it
off 442 in 8-column blocks and 635 in 16; docs/performance.md section 5 has the timings). A
program owns one block of ``BV`` value columns (`walk_shape`) of one head of one segment and walks the segment's
tokens in order with its block of the state in registers; no program reads another's data; it loads
a token's rows while it computes the token before. So a token's output and the state after it
depend on the segment's state before its first token and on the tokens so far only, bitwise,
whatever else shares the launch, how a sequence is cut into segments (a training forward's whole
sequence, a prompt in prefill pieces, one decode token a step) or where a segment sits in the
launch (docs/design.md section 6b). The same holds for `recurrent_reference`, the CPU twin: the
same steps on ``[segments, Hv, dv, dk]`` tensors (elementwise products and adds, `exact_math.exp`,
`row_sum_reference`), which the reference backend runs for training and rollout alike. The two
backends agree to fp32 rounding (their ``exp`` differ), not bitwise; each is bitwise consistent
with itself.

A segment ``b`` covers tokens ``q_start[b] .. q_start[b] + count[b] - 1`` of the packed rows; it
starts from ``states[state_in[b]]`` (zeros where ``state_in[b] < 0``) and, where
``state_out[b] >= 0``, leaves its last state in ``states[state_out[b]]`` (the same slot as
``state_in`` in a rollout step: a program reads its block before it writes it, and no other
program touches that block). A state one segment writes must not be one another segment of the
launch reads (the programs run in no fixed order; the callers' slots are distinct). A segment of
``count[b] = 0`` writes nothing: a CUDA graph's padding entry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .gated_delta_launch import device_ints
from .gated_delta_triton import l2norm_rows
from .row_sum import row_sum_halves, row_sum_levels, row_sum_reference

__all__ = ["L2NORM_EPS", "LONG_WALK", "LONG_WALK_SHAPES", "RecurrentPlan", "launch_grid", "launch_recurrent",
           "recurrent_reference", "register_cap", "unit_reference", "unit_rows", "WalkShape", "WALK_SHAPES", "walk_shape"]

L2NORM_EPS = 1e-6  # transformers' and fla's l2norm epsilon
#: a cap on the walk's registers a thread (ptxas ``maxnreg``) where a program's state block is at
#: most `CAPPED_STATE_ELEMENTS` (dk 128 and 16 value columns: Qwen3.5's and Qwen3-Next's heads);
#: None for the compiler's own count. At those heads the compiler takes 191 with the one-axis grid
#: (10 one-warp programs an SM; 168 with the old three-axis grid): 168 keeps 12 programs an SM
#: and spills nothing, 160 spills nothing but still fits 12, 128 (16 programs) spills 200 bytes
#: (sm_90 compile, `benchmarks/sm90_compile.py`)
RECURRENT_MAX_REGISTERS: int | None = 168
CAPPED_STATE_ELEMENTS = 128 * 16
UNIT_ROWS_BLOCK = 16  # (token, head) rows of q or k one program of `unit_rows` prepares


@dataclass(frozen=True)
class RecurrentPlan:
    """The segments of a launch, one entry each: lists of ints, or int32 tensors on the rows'
    device (a rollout step's staged plan, read in place: a CUDA graph captures the launch)."""

    q_start: list[int] | torch.Tensor  #: the segment's first row in q, k, v, g, beta and out
    count: list[int] | torch.Tensor  #: its rows (0: no work, no write)
    state_in: list[int] | torch.Tensor  #: the state it starts from (-1: zeros)
    state_out: list[int] | torch.Tensor  #: where its last state goes (-1: nowhere)


@dataclass(frozen=True)
class WalkShape:
    """How the walk's work is cut: the value columns a program owns (its state block is
    ``[columns, dk]``) and the program's warps. A launch parameter only: every column's sums run
    in the same order whatever program and warp hold it, and no product is contracted into an FMA
    (the launch turns contraction off), so every shape gives the same bits
    (`benchmarks/gated_delta.py --walk-launches` compares them on the GPU)."""

    columns: int
    warps: int


#: The walk's shape by the launch's state heads (segments x value heads): the first entry whose
#: least count the launch reaches. Few long walks (a training forward's sequences) are latency
#: bound, and narrow blocks put more programs on the SMs; many short ones (a rollout step's
#: sequences) move their states, and wide blocks read each head's state in longer pieces. H200,
#: Qwen3.5's heads (docs/performance.md section 5): a 4,096-token sequence's forward 2.20 ms at
#: 8 x 1 against 3.43 at 16 x 1; 8 sequences of 1,024 tokens 2.16 ms at 16 x 1 against 2.48 at
#: 8 x 1; a decode step of 256 sequences 289 us at 32 x 2 against 356 at 16 x 1.
WALK_SHAPES: tuple[tuple[int, WalkShape], ...] = ((1024, WalkShape(32, 2)), (129, WalkShape(16, 1)),
                                                  (0, WalkShape(8, 1)))
#: `WALK_SHAPES` for walks of `LONG_WALK` tokens or more a segment (known on the host: a training
#: forward's plan), where the wide blocks no longer pay: 32 sequences of 512 tokens 3.49 ms at
#: 16 x 1 against 5.22 at 32 x 2; of 64 tokens 0.45 against 0.67 (H200, the same section).
LONG_WALK_SHAPES: tuple[tuple[int, WalkShape], ...] = ((129, WalkShape(16, 1)), (0, WalkShape(8, 1)))
LONG_WALK = 16  # 64 sequences of 16 tokens: 0.27 ms at 16 x 1 against 0.34 at 32 x 2; level at 4 tokens


def walk_shape(segments: int, heads: int, dv: int, longest: int | None = None) -> WalkShape:
    """The launch shape of a walk over `segments` segments of `heads` value heads of `dv` columns:
    `LONG_WALK_SHAPES` where the `longest` segment (None: not known on the host, a rollout step's
    staged plan) has at least `LONG_WALK` tokens, `WALK_SHAPES` otherwise; a block never wider
    than `dv`."""
    table = LONG_WALK_SHAPES if longest is not None and longest >= LONG_WALK else WALK_SHAPES
    shape = next(shape for least, shape in table if segments * heads >= least)
    return WalkShape(min(shape.columns, dv), shape.warps)


@triton.jit
def _unit_rows_kernel(x_ptr, out_ptr, rows, heads, stride_xt, stride_xh, scale,
                      BLOCK: tl.constexpr, DK: tl.constexpr, LOG_DK: tl.constexpr, L2NORM: tl.constexpr):
    """``BLOCK`` (token, head) rows of ``x [T, H, dk]``: widened to fp32, l2-normalised where
    `L2NORM`, times `scale`, into the contiguous fp32 ``out [T, H, dk]``."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    dk = tl.arange(0, DK)
    live = (r < rows)[:, None]
    src = (r // heads).to(tl.int64)[:, None] * stride_xt + (r % heads)[:, None] * stride_xh + dk[None, :]
    x = l2norm_rows(tl.load(x_ptr + src, mask=live, other=1.0).to(tl.float32), L2NORM, LOG_DK) * scale
    tl.store(out_ptr + r.to(tl.int64)[:, None] * DK + dk[None, :], x, mask=live)


def unit_rows(x: torch.Tensor, scale: float, l2norm: bool) -> torch.Tensor:
    """``x [T, H, dk]`` (dk a power of two) as the recurrence reads it: fp32, l2-normalised where
    `l2norm` (`L2NORM_EPS`; the sum over dk by `row_sum_halves`), times `scale`; a new contiguous
    tensor. Every row on its own, so its bits do not depend on the batch (rules 3, 5)."""
    t, h, dk = x.shape
    out = torch.empty(t, h, dk, dtype=torch.float32, device=x.device)
    if t * h:
        _unit_rows_kernel[(triton.cdiv(t * h, UNIT_ROWS_BLOCK),)](
            x, out, t * h, h, x.stride(0), x.stride(1), scale,
            BLOCK=UNIT_ROWS_BLOCK, DK=dk, LOG_DK=row_sum_levels(dk), L2NORM=l2norm, num_warps=4, enable_fp_fusion=True)
    return out


@triton.jit
def _token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t, live, h, cols, dk, stride_vt, stride_vh, stride_gt, stride_bt,
           HK: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr):
    """Token ``t``'s rows for head ``h`` (zeros where not `live`): the prepared k and q ``[DK]``,
    v's columns `cols` and g, beta, all fp32."""
    row = (t * HK + h // GROUP) * DK + dk
    k = tl.load(k_ptr + row, mask=live & (dk < DK), other=0.0)
    q = tl.load(q_ptr + row, mask=live & (dk < DK), other=0.0)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + cols, mask=live & (cols >= 0), other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_gt + h, mask=live, other=0.0).to(tl.float32)
    beta = tl.load(b_ptr + t * stride_bt + h, mask=live, other=0.0).to(tl.float32)
    return k, q, v, g, beta


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, out_ptr, state_ptr,
                      q_start_ptr, count_ptr, state_in_ptr, state_out_ptr,
                      stride_vt, stride_vh, stride_gt, stride_bt, stride_ot, stride_oh,
                      stride_sn, stride_sh, stride_sk, HK: tl.constexpr, HV: tl.constexpr, NV: tl.constexpr,
                      GROUP: tl.constexpr, DK: tl.constexpr, BV: tl.constexpr, LOG_DK: tl.constexpr,
                      LANE_SUMS: tl.constexpr):
    """One program: value columns ``[vb * BV, (vb + 1) * BV)`` of head ``h`` of segment ``b``,
    its block of the state held transposed (``[BV, dk]``: the sums over dk run along rows). q and
    k come prepared (`unit_rows`: contiguous fp32 ``[T, HK, DK]``, normalised and scaled). The
    grid is one axis, value blocks fastest, then heads, then segments: programs launched together
    read and write neighbouring bytes of one state (`launch_grid`)."""
    pid = tl.program_id(0)
    vb, h, b = pid % NV, (pid // NV) % HV, pid // (NV * HV)
    n = tl.load(count_ptr + b)  # no early return on n: the four loads issue together, one round
    start = tl.load(q_start_ptr + b)  # trip before the state's
    src = tl.where(n > 0, tl.load(state_in_ptr + b), -1)
    dst = tl.where(n > 0, tl.load(state_out_ptr + b), -1)
    cols = vb * BV + tl.arange(0, BV)  # value columns
    dk = tl.arange(0, DK)
    block = (h * stride_sh + dk[None, :] * stride_sk + cols[:, None]).to(tl.int64)  # S[dk, col] at [col, dk]
    state = tl.zeros((BV, DK), dtype=tl.float32)
    if src >= 0:
        state = tl.load(state_ptr + src.to(tl.int64) * stride_sn + block)
    k, q, v, g, beta = _token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, start.to(tl.int64), n > 0, h, cols, dk,
                              stride_vt, stride_vh, stride_gt, stride_bt, HK, GROUP, DK)
    for i in range(n):
        t = (start + i).to(tl.int64)
        # the next token's rows are loaded before this token's step, so their latency overlaps it
        k_next, q_next, v_next, g_next, beta_next = _token(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, t + 1, i + 1 < n, h,
                                                           cols, dk, stride_vt, stride_vh, stride_gt, stride_bt,
                                                           HK, GROUP, DK)
        state = state * tl.exp(g)
        u = (v - row_sum_halves(state * k[None, :], LOG_DK, LANE_SUMS)) * beta
        state = state + u[:, None] * k[None, :]
        out = row_sum_halves(state * q[None, :], LOG_DK, LANE_SUMS)
        tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, out.to(out_ptr.dtype.element_ty))
        k, q, v, g, beta = k_next, q_next, v_next, g_next, beta_next
    if dst >= 0:
        tl.store(state_ptr + dst.to(tl.int64) * stride_sn + block, state)


def register_cap(dk: int, bv: int) -> dict[str, int]:
    """The walk's launch options for a state block of ``[bv, dk]``: ``maxnreg`` =
    `RECURRENT_MAX_REGISTERS` where the block has at most `CAPPED_STATE_ELEMENTS` elements (a
    larger block needs more registers than the cap; no cap there), none otherwise."""
    if RECURRENT_MAX_REGISTERS is None or dk * bv > CAPPED_STATE_ELEMENTS:
        return {}
    return {"maxnreg": RECURRENT_MAX_REGISTERS}


def launch_grid(segments: int, heads: int, value_blocks: int) -> tuple[int]:
    """The walk's grid: one program per (segment, head, value block), on one axis with the value
    blocks fastest. A state's row of dv columns is ``value_blocks`` programs' pieces (`walk_shape`'s
    columns each): launched side by side, they read and write the head's state as one contiguous
    stretch, where segments fastest put consecutive programs a state (2 MiB at Qwen3.5's heads)
    apart. Only the order programs start in changes; no program's arithmetic does. A ValueError
    past CUDA's 2**31 - 1 programs an axis."""
    programs = segments * heads * value_blocks
    if programs >= 2 ** 31:
        raise ValueError(f"gated_delta_rule: {segments} segments x {heads} heads x {value_blocks} value blocks = "
                         f"{programs} programs, past the launch limit of 2**31 - 1")
    return (programs,)


def _launch_triton(q, k, v, g, beta, states, out, plan: RecurrentPlan, scale: float, l2norm: bool) -> None:
    require_triton("gated_delta_rule")
    hk, dk = k.shape[1], k.shape[2]
    hv, dv = v.shape[1], v.shape[2]
    for name, d in (("dk", dk), ("dv", dv)):
        if d < 2 or d & (d - 1) or d > 256:
            raise ValueError(f"gated_delta_rule: the Triton kernel takes {name}={d} only as a power of two in 2..256")
    fields = [device_ints(x, k.device) for x in (plan.q_start, plan.count, plan.state_in, plan.state_out)]
    if states.stride(3) != 1:
        raise ValueError(f"gated_delta_rule: states must have unit stride along dv, got strides {states.stride()}")
    q, k = unit_rows(q, scale, l2norm), unit_rows(k, 1.0, l2norm)
    longest = max(plan.count, default=0) if isinstance(plan.count, list) else None
    shape = walk_shape(len(fields[0]), hv, dv, longest)
    bv = shape.columns
    _recurrent_kernel[launch_grid(len(fields[0]), hv, dv // bv)](
        q, k, v, g, beta, out, states, *fields,
        v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        out.stride(0), out.stride(1), states.stride(0), states.stride(1), states.stride(2), HK=hk, HV=hv,
        NV=dv // bv, GROUP=hv // hk, DK=dk, BV=bv, LOG_DK=row_sum_levels(dk),
        LANE_SUMS=bv >= 16 * shape.warps, num_warps=shape.warps, enable_fp_fusion=False,
        **register_cap(dk, bv))


def _dk_sum(x: torch.Tensor) -> torch.Tensor:
    """`row_sum_reference` over dk, zero-padded to a power of two: the kernel's order where dk is
    one (no padding), a fixed order for any other dk (the reference takes any head dims)."""
    width = 1 << (x.shape[-1] - 1).bit_length()
    if width != x.shape[-1]:
        x = torch.nn.functional.pad(x, (0, width - x.shape[-1]))
    return row_sum_reference(x)


def unit_reference(x: torch.Tensor, l2norm: bool) -> torch.Tensor:
    """`unit_rows`'s normalisation in torch (without the scale): ``x / sqrt(sum_dk(x * x) + eps)``
    with the sum by halves (`_dk_sum`), where `l2norm`; `x` itself otherwise."""
    if not l2norm:
        return x
    return x / torch.sqrt(_dk_sum(x * x) + L2NORM_EPS)[..., None]


def recurrent_reference(q, k, v, g, beta, states, out, plan: RecurrentPlan, scale: float, l2norm: bool) -> None:
    """The Triton launch's steps in torch on host plans (the reference backend): every segment's
    step ``i`` in one set of elementwise operations on ``[segments, Hv, dv, dk]``, so a segment's
    bits do not depend on the others (rules 1, 3, 5). Writes `out` and `states` as the launch does."""
    fields = [[int(x) for x in (f.tolist() if isinstance(f, torch.Tensor) else f)]
              for f in (plan.q_start, plan.count, plan.state_in, plan.state_out)]
    segs = [s for s in zip(*fields) if s[1] > 0]
    if not segs:
        return
    compute = states.dtype
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    group = hv // k.shape[1]
    dev = k.device
    state = torch.stack([states[src].transpose(-1, -2).to(compute) if src >= 0 else
                         torch.zeros(hv, dv, dk, dtype=compute, device=dev) for _, _, src, _ in segs])
    # every row's element-wise and per-row terms at once (the same values row by row: rule 1)
    k_all = unit_reference(k.to(compute), l2norm).repeat_interleave(group, dim=1)[:, :, None, :]
    q_all = (unit_reference(q.to(compute), l2norm) * scale).repeat_interleave(group, dim=1)[:, :, None, :]
    decay_all = exact_math.exp(g.to(compute))[:, :, None, None]
    v_all, beta_all = v.to(compute), beta.to(compute)[..., None]
    for i in range(max(s[1] for s in segs)):
        live = [j for j, s in enumerate(segs) if s[1] > i]
        rows = torch.tensor([segs[j][0] + i for j in live], device=dev)
        kk = k_all[rows]
        index = torch.tensor(live, device=dev)
        s = state[index] * decay_all[rows]
        u = (v_all[rows] - _dk_sum(s * kk)) * beta_all[rows]
        s = s + u[..., None] * kk
        out[rows] = _dk_sum(s * q_all[rows]).to(out.dtype)
        state = state.index_copy(0, index, s)
    for j, (_, _, _, dst) in enumerate(segs):
        if dst >= 0:
            states[dst] = state[j].transpose(-1, -2).to(states.dtype)


def launch_recurrent(backend: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, states: torch.Tensor, out: torch.Tensor, plan: RecurrentPlan, scale: float,
                     l2norm: bool) -> None:
    """The plan's segments on `backend` (``"triton"`` or ``"reference"``): q, k ``[T, Hk, dk]``, v
    ``[T, Hv, dv]``, g, beta ``[T, Hv]`` (unit stride along the last dim on Triton), `states`
    ``[N, Hv, dk, dv]`` (fp32; fp64 beside fp64 rows on the reference) read and written in place,
    `out` ``[T, Hv, dv]`` written at the segments' rows. Checked by the callers
    (`gated_delta_rule`, `gated_delta_step`)."""
    if backend == "triton":
        _launch_triton(q, k, v, g, beta, states, out, plan, scale, l2norm)
    else:
        recurrent_reference(q, k, v, g, beta, states, out, plan, scale, l2norm)
