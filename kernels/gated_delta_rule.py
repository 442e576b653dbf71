"""gated_delta_rule: the gated DeltaNet (Qwen3.5, Qwen3-Next) linear attention over packed sequences.

Per value head, with the state ``S [dk, dv]`` (fp32) and per token a log decay ``g_t <= 0``, a
``beta_t`` in (0, 1) and l2-normalised ``q_t`` (scaled by ``dk ** -0.5``) and ``k_t``:
``S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T`` and ``o_t = S_t^T q_t``
(transformers' ``torch_recurrent_gated_delta_rule``). Value head ``h`` reads query/key head
``h // (Hv // Hk)`` (transformers' ``repeat_interleave``).

Invariance contract (docs/design.md section 6b): the forward is the recurrence itself, token by
token, by `gated_delta_recurrent` (one program a value block of a head of a sequence, the state
in registers, every step in a fixed order); the rollout runs the same kernel on each step's new
tokens from the state it kept, so a token's output is bitwise the same in both whatever the
split of the sequence into steps. The training forward runs as the dispatcher op
``torch.ops.vexact.gated_delta_forward``, whose outputs activation checkpointing keeps
(`saved_by_checkpointing`): a checkpointed layer's backward recomputes everything but the walk,
which it does not need again (the backward reads q, k, v, g, beta, not the outputs).

The l2 normalisation of q and k is inside the op (``use_qk_l2norm``, fla's
``use_qk_l2norm_in_kernel``; Qwen3.5 and Qwen3-Next turn it on).

Dtypes: q, k, v, beta in the model dtype (bf16/fp16/fp32; fp64 on the reference), g in fp32
(any float dtype is widened), states fp32 (fp64 with fp64 inputs), outputs in q's dtype.

Backward (rule 8: gradients correct, not invariant): the chunked form of the same function, in
chunks of ``chunk_size`` rows. On the Triton backend the chunked Triton backward
(`gated_delta_backward`: the fold recomputes the boundary states, a reverse recurrence carries
the state gradient, a kernel per chunk gives the rows' gradients); on the reference backend
(CPU), or with ``VEXACT_GATED_DELTA_BACKWARD=autograd``, the forward is recomputed chunk-wise in
torch (`gated_delta_reference.AUTOGRAD`: matmuls, ``exp``, a triangular solve) and
differentiated by autograd.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import gated_delta_reference as ref
from .backend import select
from .gated_delta_backward import backward_mode, training_backward
from .gated_delta_launch import Shapes, chunk_inputs, expand_heads, gather_chunks, prepare_rows, state_dtype
from .gated_delta_recurrent import RecurrentPlan, launch_recurrent

CHUNK = 64  # rows of the backward's chunks (positions 0, 64, 128, ... start one); a power of two from 16
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
                     initial_state: torch.Tensor | None, lengths: list[int], scale: float, l2norm: bool,
                     want_final: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`gated_delta_rule`'s forward on checked inputs without autograd, on `backend` (``"triton"``
    or ``"reference"``): one recurrent launch, a segment per sequence (`gated_delta_recurrent`, the
    rollout's kernel). Returns the outputs and the final states (an empty tensor unless
    `want_final`). Public for the offline sm_90 compile (`benchmarks/sm90_compile.py`)."""
    q, k, v, g, beta = (prepare_rows(x, backend) for x in (q, k, v, g, beta))
    hv, dk, dv = v.shape[1], k.shape[2], v.shape[2]
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    seqs = range(len(lengths))
    if initial_state is not None:
        states = initial_state.detach().to(state_dtype(k)).contiguous().clone()
    else:
        states = torch.zeros(len(lengths) if want_final else 1, hv, dk, dv, dtype=state_dtype(k), device=k.device)
    plan = RecurrentPlan(starts, list(lengths), [b if initial_state is not None else -1 for b in seqs],
                         [b if want_final else -1 for b in seqs])
    out = torch.empty(k.shape[0], hv, dv, dtype=q.dtype, device=q.device)
    launch_recurrent(backend, q, k, v, g, beta, states, out, plan, scale, l2norm)
    return out, (states if want_final else out.new_empty(0))


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


def _gated_delta_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                         initial_state: torch.Tensor | None, lengths: list[int], scale: float, l2norm: bool,
                         want_final: bool, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """`training_forward` as one dispatcher op, ``torch.ops.vexact.gated_delta_forward`` (no
    autograd of its own), so that activation checkpointing can keep its outputs
    (`saved_by_checkpointing`)."""
    return training_forward(q, k, v, g, beta, initial_state, lengths, scale, l2norm, want_final, backend)


def _gated_delta_forward_fake(q, k, v, g, beta, initial_state, lengths, scale, l2norm, want_final, backend):
    out = q.new_empty((k.shape[0], v.shape[1], v.shape[2]))
    if not want_final:
        return out, q.new_empty((0,))  # as `training_forward`: an empty tensor of the outputs' dtype
    return out, k.new_empty((len(lengths), v.shape[1], k.shape[2], v.shape[2]), dtype=state_dtype(k))


# Registered once, under the package's name (`attention_packed` says why).
if __name__ == "vexact_models.kernels.gated_delta_rule":
    gated_delta_forward = torch.library.custom_op("vexact::gated_delta_forward", mutates_args=())(_gated_delta_forward)
    gated_delta_forward.register_fake(_gated_delta_forward_fake)
else:
    from vexact_models.kernels.gated_delta_rule import gated_delta_forward  # noqa: F401


class _GatedDeltaFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, lengths, chunk, scale, l2norm, want_final):
        ctx.backend = _backend(k)
        out, final = torch.ops.vexact.gated_delta_forward(q, k, v, g, beta, initial_state, lengths, scale, l2norm,
                                                          want_final, ctx.backend)
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
    sequence's last token, the state a rollout keeps there. `chunk_size` (a power of two from 16)
    cuts the backward's chunks at positions 0, C, 2C, ... of every sequence; the forward is
    token by token (the module docstring)."""
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
