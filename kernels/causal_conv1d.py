"""causal_conv1d: the short causal depthwise convolution of the gated-DeltaNet layers (Qwen3.5,
Qwen3-Next), with an optional SiLU, over packed sequences; and its rollout form with a conv state.

For channel ``c`` of token ``t`` at position ``p`` of its sequence, with kernel size ``K``::

    pre[t, c] = bias[c] + sum_{j=0..K-1} weight[c, j] * input(p - (K - 1) + j, c)
    out[t, c] = silu(pre rounded to x's dtype)   (or the rounded pre without the activation)

where ``input(q, c)`` is 0 for ``q < 0``. This is transformers' torch path (``F.conv1d`` with
``K - 1`` zeros of left padding and ``groups = channels``, then ``ACT2FN["silu"]``) at its rounding
points: the convolution's output in the model dtype, the SiLU computed in fp32 and rounded once.

**Rollout form.** A chunk of a sequence (a prompt piece of chunked prefill, one decode token)
reads the inputs before its first token from the sequence's conv state: ``conv_state[slot, i]``
holds the input at position ``context - (K - 1) + i`` (``i < K - 1``), the last ``K - 1`` inputs
before the chunk; `conv_state_update` moves them on after the chunk. Training is the same kernel
with every chunk at context 0 and no state.

Invariance contract (docs/design.md rule 5, an element-wise op over a fixed window): every output
element is one fixed sequence of operations on its own ``K`` inputs: ``acc = bias`` (or 0), then
``acc = fma(w_j, v_j, acc)`` for ``j = 0 .. K - 1`` in fp32, rounded to x's dtype, then the SiLU.
The kernel that computes it is the same one (`_conv_window`) whether ``v_j`` comes from the packed
input, from the conv state or is a zero before the sequence's start, so training over a whole
sequence and a rollout over any split into pieces, in any batch, give the same bits; tiles only
move work between programs. The reference does the same in torch with ``acc = acc + w_j * v_j``
(two roundings, no fused multiply-add on the CPU) and `exact_math.sigmoid`, the same function for
both forms.

The backward (docs/design.md rule 8: correct, no invariance) recomputes ``pre``, forms ``dpre =
dy * silu'(pre)`` (the forward kernel in its gradient mode on CUDA) and the input, weight and bias
gradients from it (`causal_conv1d_backward.py`: one more Triton pass on CUDA, torch ops on CPU).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .causal_conv1d_backward import conv_grads_reference, conv_grads_triton, token_offsets

ACTIVATIONS = ("silu", None)
CONV_TILE = 2048  # (tokens x channels) elements per program


def conv_tile(max_seqlen: int, channels: int) -> tuple[int, int]:
    """(BLOCK_T tokens, BLOCK_C channels) of a launch whose longest chunk is `max_seqlen`: decode
    chunks (one token) take one token and 1,024 channels a program. Element-wise, so any tile gives
    the same bits."""
    block_t = min(16, next_power_of_2(max(1, max_seqlen)))
    block_c = min(max(16, next_power_of_2(channels)), CONV_TILE // block_t, 1024)
    return block_t, block_c


@triton.jit
def _conv_window(x_ptr, w_ptr, b_ptr, state_ptr, start, local, t_ok, cols, c_ok, context, slot, stride_x,
                 stride_ss, stride_sk, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
                 HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr):
    """``pre`` (fp32) of the tokens at chunk offsets `local` (``[BLOCK_T]``) and channels `cols`:
    the one sequence of operations every path runs (the module docstring)."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(K):
        src = local - (K - 1 - j)  # the input's offset in the chunk
        in_chunk = src >= 0
        ok = t_ok[:, None] & c_ok[None, :]
        v = tl.load(x_ptr + (start + src)[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=ok & in_chunk[:, None], other=0.0)
        if HAS_STATE:  # before the chunk: the state's entry src + K - 1 (position context + src >= 0)
            from_state = (~in_chunk) & (context + src >= 0) & (slot >= 0)
            s = tl.load(state_ptr + slot.to(tl.int64) * stride_ss + (src + K - 1)[:, None] * stride_sk + cols[None, :],
                        mask=ok & from_state[:, None], other=0.0)
            v = tl.where(in_chunk[:, None], v, s.to(v.dtype))
        w = tl.load(w_ptr + cols * K + j, mask=c_ok, other=0.0).to(tl.float32)
        acc = tl.fma(w[None, :], v.to(tl.float32), acc)
    return acc


@triton.jit
def _causal_conv1d_kernel(x_ptr, w_ptr, b_ptr, state_ptr, cu_ptr, ctx_ptr, idx_ptr, dy_ptr, out_ptr, C, stride_x,
                          stride_ss, stride_sk, stride_dy, stride_out, K: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr,
                          SILU: tl.constexpr, GRAD: tl.constexpr):
    """Program (sequence, token block, channel block): the outputs, or with `GRAD` the fp32
    ``dpre = dy * silu'(pre)`` of the backward (recomputing ``pre``)."""
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    if tl.program_id(1) * BLOCK_T < n:
        local = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        t_ok, c_ok = local < n, cols < C
        if HAS_STATE:
            context = tl.load(ctx_ptr + seq)
            slot = tl.load(idx_ptr + seq)
        else:
            context = 0
            slot = -1
        acc = _conv_window(x_ptr, w_ptr, b_ptr, state_ptr, start, local, t_ok, cols, c_ok, context, slot, stride_x,
                           stride_ss, stride_sk, K, BLOCK_T, BLOCK_C, HAS_BIAS, HAS_STATE)
        pre = acc.to(x_ptr.dtype.element_ty).to(tl.float32)  # the convolution's output in the model dtype
        rows = (start + local)[:, None].to(tl.int64)
        ok = t_ok[:, None] & c_ok[None, :]
        if GRAD:
            dy = tl.load(dy_ptr + rows * stride_dy + cols[None, :], mask=ok, other=0.0).to(tl.float32)
            if SILU:
                sig = 1.0 / (1.0 + tl.exp(-pre))
                dy = dy * sig * (1.0 + pre * (1.0 - sig))
            tl.store(out_ptr + rows * stride_out + cols[None, :], dy, mask=ok)
        else:
            y = pre / (1.0 + tl.exp(-pre)) if SILU else pre
            tl.store(out_ptr + rows * stride_out + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=ok)


def _launch(x, weight, bias, cu_seqlens, max_seqlen, silu, state=None, dy=None):
    """The forward (``dy`` None: outputs in x's dtype) or the backward's ``dpre`` (fp32), by the
    Triton kernel. `state`: ``(conv_state, state_indices, context_lens)`` or None (training)."""
    require_triton("causal_conv1d")
    tokens, channels = x.shape
    k = weight.shape[1]
    out = torch.empty(tokens, channels, device=x.device, dtype=torch.float32 if dy is not None else x.dtype)
    batch = cu_seqlens.numel() - 1
    if tokens == 0 or batch == 0 or max_seqlen == 0:
        return out
    block_t, block_c = conv_tile(max_seqlen, channels)
    conv_state, indices, context = state if state is not None else (out, cu_seqlens, cu_seqlens)
    grid = (batch, triton.cdiv(max_seqlen, block_t), triton.cdiv(channels, block_c))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, cu_seqlens, context, indices,
        dy if dy is not None else x, out, channels, x.stride(0), conv_state.stride(0) if state is not None else 0,
        conv_state.stride(1) if state is not None else 0, dy.stride(0) if dy is not None else 0, out.stride(0),
        K=k, BLOCK_T=block_t, BLOCK_C=block_c, HAS_BIAS=bias is not None, HAS_STATE=state is not None, SILU=silu,
        GRAD=dy is not None, num_warps=4, enable_fp_fusion=True)
    return out


def _windows_reference(x, cu_seqlens, k, state):
    """The ``K`` inputs of every token, ``[K, T, C]`` (zeros before a sequence's start), from the
    chunk and, before it, the conv state."""
    tokens = x.shape[0]
    seq, local = token_offsets(cu_seqlens, tokens)
    out = x.new_zeros(k, tokens, x.shape[1])
    for j in range(k):
        src = local - (k - 1 - j)
        in_chunk = (src >= 0) & (seq >= 0)
        rows = (torch.arange(tokens) - (k - 1 - j)).clamp_min(0)
        out[j] = torch.where(in_chunk[:, None], x[rows], out[j])
        if state is not None:
            conv_state, indices, context = state
            slot = indices.long()[seq.clamp_min(0)]
            from_state = (~in_chunk) & (seq >= 0) & (context.long()[seq.clamp_min(0)] + src >= 0) & (slot >= 0)
            vals = conv_state[slot.clamp_min(0), (src + k - 1).clamp(0, k - 2)].to(x.dtype)
            out[j] = torch.where(from_state[:, None], vals, out[j])
    return out


def causal_conv1d_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                            activation: str | None = "silu", state=None) -> torch.Tensor:
    """The CPU reference of `causal_conv1d` (and of its rollout form, `state` = ``(conv_state,
    state_indices, context_lens)``): the same element-wise sequence for both forms."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    windows = _windows_reference(x, cu_seqlens, weight.shape[1], state)
    acc = torch.zeros(x.shape, dtype=compute) if bias is None else bias.to(compute).expand(x.shape).clone()
    w = weight.to(compute)
    for j in range(weight.shape[1]):
        acc = acc + w[:, j] * windows[j].to(compute)
    pre = acc.to(x.dtype)
    if activation is None:
        return pre
    p = pre.to(compute)
    return (p * exact_math.sigmoid(p).to(compute)).to(x.dtype)


@triton.jit
def _conv_state_update_kernel(x_ptr, state_ptr, cu_ptr, ctx_ptr, idx_ptr, C, stride_x, stride_ss, stride_sk,
                              KEEP: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (sequence, channel block): the sequence's last `KEEP` inputs (positions before 0:
    zeros) from its chunk and its old state, loaded whole before the state is overwritten."""
    seq = tl.program_id(0)
    slot = tl.load(idx_ptr + seq)
    if slot >= 0:
        start = tl.load(cu_ptr + seq)
        n = tl.load(cu_ptr + seq + 1) - start
        context = tl.load(ctx_ptr + seq)
        i = tl.arange(0, BLOCK_K)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = (i < KEEP)[:, None] & (cols < C)[None, :]
        src = n - KEEP + i  # offset in the chunk of the new entry i
        in_chunk = src >= 0
        base = state_ptr + slot.to(tl.int64) * stride_ss
        v = tl.load(x_ptr + (start + src)[:, None].to(tl.int64) * stride_x + cols[None, :],
                    mask=ok & in_chunk[:, None], other=0.0)
        old = tl.load(base + (src + KEEP)[:, None] * stride_sk + cols[None, :],
                      mask=ok & ((~in_chunk) & (context + src >= 0))[:, None], other=0.0)
        new = tl.where(in_chunk[:, None], v.to(state_ptr.dtype.element_ty), old)
        tl.debug_barrier()  # every load of the old state before any store
        tl.store(base + i[:, None] * stride_sk + cols[None, :], new, mask=ok)


def conv_state_update_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                                state_indices: torch.Tensor, context_lens: torch.Tensor) -> None:
    """`conv_state_update` in torch (CPU): a copy, no arithmetic."""
    keep = conv_state.shape[1]
    for seq in range(cu_seqlens.numel() - 1):
        slot = int(state_indices[seq])
        if slot < 0:
            continue
        start, n, context = int(cu_seqlens[seq]), int(cu_seqlens[seq + 1] - cu_seqlens[seq]), int(context_lens[seq])
        new = torch.zeros_like(conv_state[slot])
        for i in range(keep):
            src = n - keep + i
            if src >= 0:
                new[i] = x[start + src]
            elif context + src >= 0:
                new[i] = conv_state[slot, src + keep]
        conv_state[slot] = new


def _check_state(x, k, cu_seqlens, conv_state, state_indices, context_lens, op):
    """Raise a ValueError naming the argument unless the rollout form's tensors fit `x` and
    kernel size `k` (nothing to check without a `conv_state`)."""
    if conv_state is None:
        return
    batch = cu_seqlens.numel() - 1
    if conv_state.dim() != 3 or conv_state.shape[1:] != (k - 1, x.shape[1]) or conv_state.stride(-1) != 1:
        raise ValueError(f"{op}: conv_state must be [slots, {k - 1}, {x.shape[1]}] with unit channel stride, got "
                         f"{tuple(conv_state.shape)}")
    if conv_state.dtype != x.dtype or conv_state.device != x.device:
        raise ValueError(f"{op}: conv_state {conv_state.dtype} on {conv_state.device} must match x "
                         f"{x.dtype} on {x.device}")
    for name, t in (("state_indices", state_indices), ("context_lens", context_lens)):
        if t is None or t.shape != (batch,) or t.dtype != torch.int32:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise ValueError(f"{op}: {name} must be int32 [{batch}] (one per sequence) with conv_state, got {got}")


def _check(x, weight, bias, cu_seqlens, activation, op):
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"{op}: x must be [tokens, channels] with unit channel stride, got {tuple(x.shape)} "
                         f"strides {x.stride()}")
    if weight.dim() != 2 or weight.shape[0] != x.shape[1] or not 2 <= weight.shape[1] <= 8 or not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous [{x.shape[1]}, kernel size 2..8] (conv1d.weight "
                         f"squeezed), got {tuple(weight.shape)}")
    if weight.dtype != x.dtype or (bias is not None and (bias.shape != (x.shape[1],) or bias.dtype != x.dtype)):
        raise ValueError(f"{op}: weight {weight.dtype} and bias {None if bias is None else (tuple(bias.shape), bias.dtype)}"
                         f" must have x's dtype {x.dtype} (bias: [{x.shape[1]}])")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"{op}: cu_seqlens must be int32 [sequences + 1], got {tuple(cu_seqlens.shape)} "
                         f"{cu_seqlens.dtype}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation={activation!r} is not one of {ACTIVATIONS}")


def conv_state_update(x: torch.Tensor, cu_seqlens: torch.Tensor, conv_state: torch.Tensor,
                      state_indices: torch.Tensor, context_lens: torch.Tensor) -> None:
    """Move each sequence's conv state past its chunk, in place: ``conv_state[state_indices[s]]``
    becomes the last ``K - 1`` inputs up to the chunk's end (the chunk's own rows of `x`, then the
    old state's; zeros for positions before 0). A copy. Call it after `causal_conv1d` has read the
    old state (`causal_conv1d(..., conv_state=...)` does). Sequences with a negative index (the
    padding of a captured step) are skipped; two sequences must not share a slot."""
    if conv_state.dim() != 3 or x.dim() != 2 or conv_state.shape[2] != x.shape[1]:
        raise ValueError(f"conv_state_update: conv_state {tuple(conv_state.shape)} must be [slots, K - 1, "
                         f"channels] for x {tuple(x.shape)}")
    _check_state(x, conv_state.shape[1] + 1, cu_seqlens, conv_state, state_indices, context_lens, "conv_state_update")
    if select("causal_conv1d", x) != "triton":
        conv_state_update_reference(x, cu_seqlens, conv_state, state_indices, context_lens)
        return
    require_triton("causal_conv1d")
    keep, channels = conv_state.shape[1], x.shape[1]
    batch = cu_seqlens.numel() - 1
    if batch == 0 or keep == 0:
        return
    block_c = min(1024, max(16, next_power_of_2(channels)))
    _conv_state_update_kernel[(batch, triton.cdiv(channels, block_c))](
        x, conv_state, cu_seqlens, context_lens, state_indices, channels, x.stride(0), conv_state.stride(0),
        conv_state.stride(1), KEEP=keep, BLOCK_K=next_power_of_2(keep), BLOCK_C=block_c, num_warps=4, enable_fp_fusion=True)


def _forward(x, weight, bias, cu_seqlens, max_seqlen, activation, state=None):
    if select("causal_conv1d", x) == "triton":
        return _launch(x, weight, bias, cu_seqlens, max_seqlen, activation == "silu", state)
    return causal_conv1d_reference(x, weight, bias, cu_seqlens, activation, state)


def _grad_pre(x, weight, bias, cu_seqlens, max_seqlen, activation, grad_out):
    """fp32 (fp64) ``dpre = dy * silu'(pre)`` (``dy`` without the activation)."""
    if select("causal_conv1d", x) == "triton":
        return _launch(x, weight, bias, cu_seqlens, max_seqlen, activation == "silu", dy=grad_out)
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    dy = grad_out.to(compute)
    if activation is None:
        return dy
    pre = causal_conv1d_reference(x, weight, bias, cu_seqlens, None).to(compute)
    sig = torch.sigmoid(pre)
    return dy * sig * (1.0 + pre * (1.0 - sig))


def causal_conv1d_backward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                           max_seqlen: int, activation: str | None, grad_out: torch.Tensor):
    """(grad_x, grad_weight, grad_bias or None) of the training form (every sequence from position
    0), in fp32 (fp64) from ``dpre`` (docs/design.md rule 8; `causal_conv1d_backward.py`)."""
    dpre = _grad_pre(x, weight, bias, cu_seqlens, max_seqlen, activation, grad_out)
    if select("causal_conv1d", x) == "triton":
        grad_x, grad_w, grad_b = conv_grads_triton(x, weight, cu_seqlens, max_seqlen, dpre)
        return grad_x, grad_w.to(weight.dtype), grad_b.to(bias.dtype) if bias is not None else None
    return conv_grads_reference(x, weight, bias, cu_seqlens, dpre)


class _CausalConv1dFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, cu_seqlens, max_seqlen, activation):
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.max_seqlen, ctx.activation = max_seqlen, activation
        return _forward(x, weight, bias, cu_seqlens, max_seqlen, activation)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        grad_x, grad_w, grad_b = causal_conv1d_backward(x, weight, bias, cu_seqlens, ctx.max_seqlen, ctx.activation,
                                                        grad_out.contiguous())
        return grad_x, grad_w, grad_b, None, None, None


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                  max_seqlen: int, activation: str | None = "silu", *, conv_state: torch.Tensor | None = None,
                  state_indices: torch.Tensor | None = None, context_lens: torch.Tensor | None = None) -> torch.Tensor:
    """The causal depthwise conv1d (+ SiLU) of packed chunks, ``[tokens, channels]`` in x's dtype.

    Args:
        x: ``[tokens, channels]`` (unit channel stride; a row-strided view is fine), chunk after
            chunk as `cu_seqlens` (int32 ``[sequences + 1]``) says; tokens past ``cu_seqlens[-1]``
            (padding) get no defined output.
        weight: ``[channels, K]`` (HF's ``conv1d.weight`` ``[channels, 1, K]`` squeezed), K 2..8;
            bias ``[channels]`` or None; both of x's dtype.
        max_seqlen: the longest chunk (a host int: it sizes the launch; an upper bound is fine).
        activation: ``"silu"`` or None.
        conv_state, state_indices, context_lens: the rollout form. ``conv_state [slots, K - 1,
            channels]`` (x's dtype), ``state_indices`` int32 ``[sequences]`` (a sequence's slot;
            negative: a padding sequence, no state), ``context_lens`` int32 ``[sequences]`` (the
            sequence's tokens before this chunk). The chunk reads the inputs before it from its
            slot, then the slot is moved past the chunk (`conv_state_update`). Without them
            (training) every chunk is a whole sequence from position 0, and the result is
            differentiable in x, weight and bias.

    A token's output is bitwise the same in training and in any rollout split (the module docstring).
    """
    _check(x, weight, bias, cu_seqlens, activation, "causal_conv1d")
    _check_state(x, weight.shape[1], cu_seqlens, conv_state, state_indices, context_lens, "causal_conv1d")
    if conv_state is not None:
        out = _forward(x, weight, bias, cu_seqlens, max_seqlen, activation, (conv_state, state_indices, context_lens))
        conv_state_update(x, cu_seqlens, conv_state, state_indices, context_lens)
        return out
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)):
        return _CausalConv1dFunction.apply(x, weight, bias, cu_seqlens, max_seqlen, activation)
    return _forward(x, weight, bias, cu_seqlens, max_seqlen, activation)
