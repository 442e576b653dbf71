"""gated_delta_rule: the gated DeltaNet (Qwen3.5, Qwen3-Next) linear attention, chunked at absolute positions.

Per value head, with the state ``S [dk, dv]`` (fp32) and per token a log decay ``g_t <= 0``, a
``beta_t`` in (0, 1) and l2-normalised ``q_t`` (scaled by ``dk ** -0.5``) and ``k_t``:
``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T`` and ``o_t = S_t^T q_t``
(transformers' ``torch_recurrent_gated_delta_rule``). Value head ``h`` reads query/key head
``h // (Hv // Hk)`` (transformers' ``repeat_interleave``).

Invariance contract (docs/design.md section 6b): a sequence is cut into chunks of ``chunk_size``
rows at absolute positions 0, C, 2C, ...; the output of row ``i`` of a chunk is computed from the
state at the chunk's start and the chunk's rows ``0..i`` only, at the fixed chunk shape, so its
bits do not depend on how many of the chunk's rows exist; and the state is advanced over a chunk
(the fold) by one kernel. Training (`gated_delta_rule`) and the rollout (`gated_delta_chunk_rows`
for the rows a step adds, `gated_delta_fold` for a completed chunk) run the same two kernels, so a
token's output is bitwise the same in both.

The l2 normalisation of q and k is inside the op (``use_qk_l2norm``, fla's
``use_qk_l2norm_in_kernel``; Qwen3.5 and Qwen3-Next turn it on), which keeps the normalised
rows out of memory and lets the rollout's chunk buffer hold raw keys.

Dtypes: q, k, v, beta in the model dtype (bf16/fp16/fp32; fp64 on the reference), g in fp32
(any float dtype is widened), states fp32 (fp64 with fp64 inputs), outputs in q's dtype. The
Triton kernels (CUDA, or the interpreter) widen every operand to fp32 and take their products in
``tf32x3``; the reference (CPU) computes in fp32 with `exact_math` (batch-invariant).

Backward (rule 8): on the Triton backend the chunked Triton backward (`gated_delta_backward`:
the fold recomputes the boundary states, a reverse recurrence carries the state gradient, a
kernel per chunk gives the rows' gradients); on the reference backend (CPU), or with
``VEXACT_GATED_DELTA_BACKWARD=autograd``, the forward is recomputed in torch
(`gated_delta_reference.AUTOGRAD`: matmuls, ``exp``, a triangular solve) and differentiated by
autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import gated_delta_reference as ref
from .backend import select
from .gated_delta_backward import backward_mode, training_backward
from .gated_delta_launch import (FoldPlan, RowsPlan, Shapes, chunk_inputs, expand_heads, gather_chunks, launch_fold,
                                 launch_rows, prepare_rows, state_dtype, training_states)

CHUNK = 64  # rows of a chunk (positions 0, 64, 128, ... start one); a power of two from 16
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
Ints = Sequence[int] | torch.Tensor


def _ints(name: str, values: Ints, count: int | None = None) -> list[int]:
    out = [int(x) for x in (values.tolist() if isinstance(values, torch.Tensor) else values)]
    if count is not None and len(out) != count:
        raise ValueError(f"gated_delta_rule: {name} has {len(out)} entries, expected {count}")
    return out


def _check_rows(q: torch.Tensor | None, k, v, g, beta, chunk_size: int) -> Shapes:
    """Shapes and dtypes of the row tensors; raises ValueError naming the argument."""
    if chunk_size < 16 or chunk_size & (chunk_size - 1):
        raise ValueError(f"gated_delta_rule: chunk_size={chunk_size} must be a power of two >= 16")
    if k.dim() != 3 or v.dim() != 3:
        raise ValueError(f"gated_delta_rule: k {tuple(k.shape)} and v {tuple(v.shape)} must be [tokens, heads, dim]")
    t, hk, dk = k.shape
    _, hv, dv = v.shape
    if v.shape[0] != t or hv % hk:
        raise ValueError(f"gated_delta_rule: v {tuple(v.shape)} must have k's {t} rows and a multiple of its {hk} heads")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (t, hv):
            raise ValueError(f"gated_delta_rule: {name} {tuple(x.shape)} must be [tokens, v heads] = {(t, hv)}")
    if q is not None and (q.dim() != 3 or tuple(q.shape[1:]) != (hk, dk)):
        raise ValueError(f"gated_delta_rule: q {tuple(q.shape)} must be [rows, {hk}, {dk}] like k")
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        if x is not None and x.dtype != k.dtype:
            raise ValueError(f"gated_delta_rule: {name} has dtype {x.dtype}, k has {k.dtype}; they must match")
    if not g.is_floating_point():
        raise ValueError(f"gated_delta_rule: g must be floating point, got {g.dtype}")
    return Shapes(hk, hv, dk, dv)


def _check_states(states: torch.Tensor, shapes: Shapes, index: list[int], name: str,
                  dtype: torch.dtype | None = None) -> None:
    want = (shapes.hv, shapes.dk, shapes.dv)
    if states.dim() != 4 or tuple(states.shape[1:]) != want or not states.is_floating_point():
        raise ValueError(f"gated_delta_rule: {name} {tuple(states.shape)} must be float [states, {want[0]}, "
                         f"{want[1]}, {want[2]}]")
    bad = [i for i in index if i < -1 or i >= states.shape[0]]
    if bad:
        raise ValueError(f"gated_delta_rule: state index {bad[0]} is outside -1..{states.shape[0] - 1} ({name})")
    if dtype is not None and states.dtype != dtype:
        raise ValueError(f"gated_delta_rule: {name} has dtype {states.dtype}, must be {dtype} (float32; float64 "
                         "beside float64 rows)")


def _backend(k: torch.Tensor) -> str:
    return select("gated_delta_rule", k, dtypes=_DTYPES)


# ---------------------------------------------------------------------------------------------
# Training: packed sequences from position 0, forward by the two launches, backward by autograd.


def training_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     initial_state: torch.Tensor | None, lengths: list[int], chunk: int, scale: float, l2norm: bool,
                     want_final: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule`'s forward on checked inputs without autograd, on `backend` (``"triton"``
    or ``"reference"``): the fold over every sequence's chunks, then every chunk's rows. Returns the
    outputs and the final states (an empty tensor unless `want_final`). Public for the offline
    sm_90 compile (`benchmarks/sm90_compile.py`)."""
    shapes = Shapes(k.shape[1], v.shape[1], k.shape[2], v.shape[2])
    q, k, v, g, beta = (prepare_rows(x, backend) for x in (q, k, v, g, beta))
    states, rows, bases = training_states(k, v, g, beta, initial_state, lengths, chunk, l2norm, want_final, backend)
    out = torch.empty(k.shape[0], shapes.hv, shapes.dv, dtype=q.dtype, device=q.device)
    launch_rows(backend, q, k, v, g, beta, states, out, rows, shapes, chunk, scale, l2norm)
    if not want_final:
        return out, out.new_empty(0)
    last = [base + -(-n // chunk) for base, n in zip(bases, lengths)]
    return out, states[last]


def _autograd_forward(q, k, v, g, beta, initial_state, lengths: list[int], chunk: int, scale: float, l2norm: bool):
    """`training_forward`'s values recomputed differentiably (`gated_delta_reference.AUTOGRAD`):
    ``(o [T, Hv, dv], final states [B, Hv, dk, dv])`` in fp32 (fp64)."""
    compute = state_dtype(k)
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    shapes = Shapes(k.shape[1], hv, dk, dv)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    chunks = [-(-n // chunk) for n in lengths]
    order = [(c, s) for c in range(max(chunks, default=0)) for s in range(len(lengths)) if chunks[s] > c]
    start = [offsets[s] + c * chunk for c, s in order]
    n_rows = [min(chunk, lengths[s] - c * chunk) for c, s in order]
    kk, vv, gg, bb = chunk_inputs(start, n_rows, k, v, g, beta, shapes, chunk, compute)
    qq = expand_heads(gather_chunks(q, start, [0] * len(start), n_rows, chunk).to(compute), hv)
    state = (initial_state.to(compute) if initial_state is not None
             else torch.zeros(len(lengths), hv, dk, dv, dtype=compute, device=k.device))
    outs, done = [], 0
    for c in range(max(chunks, default=0)):
        live = [s for s in range(len(lengths)) if chunks[s] > c]
        sl = slice(done, done + len(live))
        index = torch.tensor(live, device=k.device)
        o, new = ref.chunk_forward(qq[sl], kk[sl], vv[sl], gg[sl], bb[sl], state[index], ref.AUTOGRAD, scale=scale,
                                   use_qk_l2norm=l2norm)
        state = state.index_copy(0, index, new)
        outs.append(o)
        done += len(live)
    if not outs:
        return torch.zeros(0, hv, dv, dtype=compute, device=k.device), state
    flat = torch.cat(outs).transpose(1, 2).reshape(-1, hv, dv)  # [chunks * C, Hv, dv], chunks in `order`
    slot = {key: i for i, key in enumerate(order)}
    token = [slot[(p // chunk, s)] * chunk + p % chunk for s, n in enumerate(lengths) for p in range(n)]
    return flat[torch.tensor(token, device=k.device)], state


class _GatedDeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, lengths, chunk, scale, l2norm, want_final):
        ctx.backend = _backend(k)
        out, final = training_forward(q, k, v, g, beta, initial_state, lengths, chunk, scale, l2norm, want_final,
                                       ctx.backend)
        ctx.save_for_backward(q, k, v, g, beta, initial_state)
        ctx.args = (lengths, chunk, scale, l2norm)
        ctx.want_final = want_final
        return out, final

    @staticmethod
    def backward(ctx, grad_out, grad_final):
        saved = ctx.saved_tensors
        if ctx.backend == "triton" and backward_mode() == "triton":  # the forward's backend
            d_final = grad_final if ctx.want_final else None
            grads = training_backward(*saved, grad_out, d_final, *ctx.args, "triton")
            result = [x if need else None for x, need in zip(grads, ctx.needs_input_grad)]
            return (*result, None, None, None, None, None)
        leaves = [None if x is None else x.detach().requires_grad_(need) for x, need in zip(saved, ctx.needs_input_grad)]
        with torch.enable_grad():
            out, final = _autograd_forward(*leaves, *ctx.args)
            outputs, grads = [out], [grad_out.to(out.dtype)]
            if ctx.want_final and grad_final is not None:
                outputs.append(final), grads.append(grad_final.to(final.dtype))
            wanted = [x for x in leaves if x is not None and x.requires_grad]
            got = iter(torch.autograd.grad(outputs, wanted, grads, allow_unused=True)) if wanted else iter(())
        result = [next(got) if x is not None and x.requires_grad else None for x in leaves]
        return (*result, None, None, None, None, None)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     cu_seqlens: Ints | None = None, *, initial_state: torch.Tensor | None = None,
                     output_final_state: bool = False, scale: float | None = None, use_qk_l2norm: bool = True,
                     chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over packed sequences, each starting at position 0 (the training
    forward; differentiable in q, k, v, g, beta and `initial_state`).

    q, k: ``[T, Hk, dk]``; v: ``[T, Hv, dv]`` (``Hv`` a multiple of ``Hk``); g (log decay, fp32),
    beta: ``[T, Hv]``; `cu_seqlens`: ``[B + 1]`` token offsets from 0 to T (a list or a tensor;
    None: one sequence); `initial_state`: ``[B, Hv, dk, dv]`` (each sequence's state before its
    first token; zeros when None). `scale` defaults to ``dk ** -0.5``. Returns ``o [T, Hv, dv]``
    in q's dtype and, with `output_final_state`, ``[B, Hv, dk, dv]`` fp32: the state after each
    sequence's last token (a last partial chunk folded as it stands; the rollout keeps the state
    at the last chunk boundary instead, `gated_delta_fold`). Chunks of `chunk_size` rows start at
    positions 0, C, 2C, ... of every sequence (the module docstring's contract)."""
    _check_rows(q, k, v, g, beta, chunk_size)
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"gated_delta_rule: q has {q.shape[0]} rows, k has {k.shape[0]}; they must match")
    offsets = [0, k.shape[0]] if cu_seqlens is None else _ints("cu_seqlens", cu_seqlens)
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != k.shape[0] or any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"gated_delta_rule: cu_seqlens={offsets} must run from 0 to the token count {k.shape[0]}, "
                         "never decreasing")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    shapes = Shapes(k.shape[1], v.shape[1], k.shape[2], v.shape[2])
    if initial_state is not None:
        _check_states(initial_state, shapes, [], "initial_state")
        if initial_state.shape[0] != len(lengths):
            raise ValueError(f"gated_delta_rule: initial_state has {initial_state.shape[0]} states for "
                             f"{len(lengths)} sequences")
    scale = shapes.dk ** -0.5 if scale is None else float(scale)
    out, final = _GatedDeltaFunction.apply(q, k, v, g, beta, initial_state, lengths, chunk_size, scale, use_qk_l2norm,
                                           output_final_state)
    return out, (final if output_final_state else None)


# ---------------------------------------------------------------------------------------------
# The rollout's two entry points (inference only: no autograd).


@torch.no_grad()
def gated_delta_chunk_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           cu_rows: Ints, first_rows: Ints, states: torch.Tensor, state_index: Ints, *,
                           scale: float | None = None, use_qk_l2norm: bool = True,
                           chunk_size: int = CHUNK) -> torch.Tensor:
    """Outputs of the rows a rollout step adds to each sequence's current chunk.

    Segment ``b`` of k, v, g, beta (rows ``cu_rows[b]..cu_rows[b + 1] - 1``, at most
    `chunk_size`) holds rows ``0..n_b - 1`` of that chunk, raw (the chunk's earlier rows, kept by
    the rollout, then the step's new ones); `q` holds, packed in segment order, the queries of rows
    ``first_rows[b]..n_b - 1`` only (``sum(n_b - first_b)`` rows; earlier rows' queries are never
    read). ``states[state_index[b]]`` (``[S, Hv, dk, dv]`` fp32; index -1: zeros) is the state at
    the chunk's start. Returns ``[q rows, Hv, dv]`` in q's dtype: bitwise the rows
    `gated_delta_rule` computes for the same tokens (the module docstring's contract).
    `cu_rows`, `first_rows`, `state_index`: lists or tensors (read on the host)."""
    shapes = _check_rows(q, k, v, g, beta, chunk_size)
    cu = _ints("cu_rows", cu_rows)
    if len(cu) < 1 or cu[0] != 0 or cu[-1] != k.shape[0] or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"gated_delta_chunk_rows: cu_rows={cu} must run from 0 to k's {k.shape[0]} rows, never decreasing")
    n = [b - a for a, b in zip(cu, cu[1:])]
    first = _ints("first_rows", first_rows, len(n))
    index = _ints("state_index", state_index, len(n))
    for b, (rows, f) in enumerate(zip(n, first)):
        if rows > chunk_size or not 0 <= f <= rows:
            raise ValueError(f"gated_delta_chunk_rows: segment {b} has {rows} rows (at most chunk_size={chunk_size}) "
                             f"and first_rows={f} (0..{rows})")
    q_start = [0]
    for rows, f in zip(n, first):
        q_start.append(q_start[-1] + rows - f)
    if q.shape[0] != q_start[-1]:
        raise ValueError(f"gated_delta_chunk_rows: q has {q.shape[0]} rows, the segments ask for {q_start[-1]}")
    _check_states(states, shapes, index, "states", state_dtype(k))
    backend = _backend(k)
    scale = shapes.dk ** -0.5 if scale is None else float(scale)
    out = torch.empty(q.shape[0], shapes.hv, shapes.dv, dtype=q.dtype, device=q.device)
    plan = RowsPlan(cu[:-1], n, first, q_start[:-1], index)
    q, k, v, g, beta = (prepare_rows(x, backend) for x in (q, k, v, g, beta))
    launch_rows(backend, q, k, v, g, beta, states, out, plan, shapes, chunk_size, scale, use_qk_l2norm)
    return out


@torch.no_grad()
def gated_delta_fold(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, starts: Ints,
                     lengths: Ints, states: torch.Tensor, state_index: Ints, *, out: torch.Tensor | None = None,
                     out_index: Ints | None = None, use_qk_l2norm: bool = True, chunk_size: int = CHUNK) -> torch.Tensor:
    """Advance states over runs of whole chunks: the fold, the one kernel training and the rollout
    share.

    Run ``b`` is rows ``starts[b]..starts[b] + lengths[b] - 1`` of k, v, g, beta (``[R, ...]``,
    chunks of `chunk_size` rows back to back; a rollout folds whole chunks only), starting from
    ``states[state_index[b]]`` (index -1: zeros). The state after the run's chunk ``c`` goes to
    ``out[out_index[b] + c]``; by default `out` is a new ``[sum of chunks, Hv, dk, dv]`` tensor in
    states' dtype and runs follow each other. `out` may be `states` itself (a state pool updated in
    place), as long as no run reads a state another run writes. Returns `out`. Bitwise the states
    `gated_delta_rule` reaches at the same chunk boundaries."""
    shapes = _check_rows(None, k, v, g, beta, chunk_size)
    start = _ints("starts", starts)
    length = _ints("lengths", lengths, len(start))
    index = _ints("state_index", state_index, len(start))
    chunks = [-(-n // chunk_size) for n in length]
    for b, (s, n) in enumerate(zip(start, length)):
        if n < 0 or s < 0 or s + n > k.shape[0]:
            raise ValueError(f"gated_delta_fold: run {b} (starts={s}, lengths={n}) is outside k's {k.shape[0]} rows")
    _check_states(states, shapes, index, "states", state_dtype(k))
    if out is None:
        if out_index is not None:
            raise ValueError("gated_delta_fold: out_index needs out")
        out = torch.empty(sum(chunks), shapes.hv, shapes.dk, shapes.dv, dtype=states.dtype, device=states.device)
        where = [sum(chunks[:b]) for b in range(len(chunks))]
    else:
        where = _ints("out_index", [] if out_index is None else out_index, len(start))
        _check_states(out, shapes, [], "out", state_dtype(k))
        for b, (w, c) in enumerate(zip(where, chunks)):
            if w < 0 or w + c > out.shape[0]:
                raise ValueError(f"gated_delta_fold: run {b} writes out[{w}:{w + c}], out has {out.shape[0]} states")
    backend = _backend(k)
    k, v, g, beta = (prepare_rows(x, backend) for x in (k, v, g, beta))
    launch_fold(backend, k, v, g, beta, states, out, FoldPlan(start, length, index, where), shapes, chunk_size, use_qk_l2norm)
    return out
