"""Backward of packed causal GQA attention (training), recompute style.

Needs no invariance (docs/design.md rule 8), only correctness and speed. The Triton version is the
FlashAttention-2 scheme: ``delta = rowsum(dO * O)``; one kernel per key block accumulates dK and
dV over the query blocks (and over the query heads of its KV group, so no atomics); one kernel
per query tile accumulates dQ over the key blocks. Probabilities are recomputed from the
forward's log2-sum-exp2. The reference is autograd through `attention_math`.
"""

from __future__ import annotations

import math

import torch

from ._triton import next_power_of_2, require_triton, tl, triton

DKDV_BLOCK_M, DKDV_BLOCK_N = 32, 64
DQ_BLOCK_M, DQ_BLOCK_N = 64, 32


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                   scale: float, window: int | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch causal attention within each packed sequence (the test oracle), in q's dtype
    math (run it on float64 inputs for a float64 oracle). Differentiable, `sinks` included.
    `window`: the query at position p sees keys p - window + 1 .. p; `sinks` ``[Hq]``: HF's GPT-OSS
    arithmetic, each head's logit a softmax column of its own whose probability is dropped."""
    group = q.shape[1] // k.shape[1]
    outs = []
    bounds = cu_seqlens.tolist()
    for start, stop in zip(bounds[:-1], bounds[1:]):
        qs = q[start:stop].transpose(0, 1)
        ks = k[start:stop].repeat_interleave(group, dim=1).transpose(0, 1)
        vs = v[start:stop].repeat_interleave(group, dim=1).transpose(0, 1)
        scores = (qs @ ks.transpose(1, 2)) * scale
        n = stop - start
        visible = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        if window is not None:
            visible = visible & ~torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-window)
        scores = scores.masked_fill(~visible, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            column = sinks.to(scores.dtype).reshape(-1, 1, 1).expand(-1, n, 1)
            probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        outs.append((probs @ vs).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_empty((0, q.shape[1], v.shape[-1]))


def attention_backward_reference(grad_out, q, k, v, cu_seqlens, scale, window: int | None = None,
                                 sinks: torch.Tensor | None = None):
    """``(dq, dk, dv, dsinks)`` by autograd through `attention_math` in fp32 (fp64 for fp64
    inputs); `dsinks` None without `sinks`."""
    compute = torch.float64 if q.dtype == torch.float64 else torch.float32
    with torch.enable_grad():
        qc, kc, vc = (t.detach().to(compute).requires_grad_() for t in (q, k, v))
        inputs = (qc, kc, vc)
        sc = None
        if sinks is not None:
            sc = sinks.detach().to(compute).requires_grad_()
            inputs = (*inputs, sc)
        out = attention_math(qc, kc, vc, cu_seqlens, scale, window, sc)
        grads = torch.autograd.grad(out, inputs, grad_out.to(compute))
    dsinks = grads[3].to(sinks.dtype) if sinks is not None else None
    return grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype), dsinks


def sinks_grad(grad_out: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """The sinks' gradient ``[Hq]`` from the forward's `out` and log2-sum-exp2 `lse` (which holds
    the sink's term): a sink has no value, so ``d sink_h = -sum_t p_sink(t, h) * delta(t, h)`` with
    ``p_sink = exp2(sink_h * log2(e) - lse)`` and ``delta = rowsum(dO * O)``, in fp32."""
    delta = (grad_out.float() * out.float()).sum(-1)
    p_sink = torch.exp2(sinks.float() * math.log2(math.e) - lse)
    return -(p_sink * delta).sum(0).to(sinks.dtype)


@triton.jit
def _dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, cu_ptr, scale, scale_log2,
                 n_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
                 window, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    start_n = tl.program_id(0) * BLOCK_N
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    seq_start = tl.load(cu_ptr + seq)
    seq_len = tl.load(cu_ptr + seq + 1) - seq_start
    if start_n >= seq_len:
        return
    k_pos = start_n + tl.arange(0, BLOCK_N)
    k_ok = k_pos < seq_len
    k_tok = (seq_start + k_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # HEAD_DIM padded to a power of two (masked lanes)
    d_ok = d < HEAD_DIM
    dv_idx = tl.arange(0, HEAD_DIM_V)
    k = tl.load(k_ptr + k_tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                mask=k_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(v_ptr + k_tok[:, None] * stride_vt + kv_head * stride_vh + dv_idx[None, :], mask=k_ok[:, None], other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM_V), tl.float32)
    stop_m = seq_len
    if WINDOWED:  # no query past the block's last key + window - 1 sees it
        stop_m = tl.minimum(seq_len, start_n + BLOCK_N - 1 + window)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start_m in range((start_n // BLOCK_M) * BLOCK_M, stop_m, BLOCK_M):
            q_pos = start_m + tl.arange(0, BLOCK_M)
            q_ok = q_pos < seq_len
            q_tok = (seq_start + q_pos).to(tl.int64)
            q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head * stride_qh + d[None, :],
                        mask=q_ok[:, None] & d_ok[None, :], other=0.0)
            do = tl.load(do_ptr + q_tok[:, None] * stride_dot + head * stride_doh + dv_idx[None, :],
                         mask=q_ok[:, None], other=0.0)
            lse = tl.load(lse_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
            delta = tl.load(delta_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale_log2
            visible = (k_pos[None, :] <= q_pos[:, None]) & q_ok[:, None] & k_ok[None, :]
            if WINDOWED:
                visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            dv = tl.dot(tl.trans(p.to(do.dtype)), do, dv)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk = tl.dot(tl.trans(ds.to(q.dtype)), q, dk)
    dk = dk * scale
    tl.store(dk_ptr + k_tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :], dk.to(dk_ptr.dtype.element_ty),
             mask=k_ok[:, None] & d_ok[None, :])
    tl.store(dv_ptr + k_tok[:, None] * stride_vt + kv_head * stride_vh + dv_idx[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=k_ok[:, None])


@triton.jit
def _dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr, scale, scale_log2,
               n_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_dot, stride_doh,
               window, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WINDOWED: tl.constexpr):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    kv_head = tl.program_id(2)
    seq_start = tl.load(cu_ptr + seq)
    seq_len = tl.load(cu_ptr + seq + 1) - seq_start
    if tile * BLOCK_M >= seq_len * GROUP:
        return
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    q_pos = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    q_ok = q_pos < seq_len
    q_tok = (seq_start + q_pos).to(tl.int64)
    d = tl.arange(0, BLOCK_D)  # HEAD_DIM padded to a power of two (masked lanes)
    d_ok = d < HEAD_DIM
    dv_idx = tl.arange(0, HEAD_DIM_V)
    q = tl.load(q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=q_ok[:, None] & d_ok[None, :], other=0.0)
    do = tl.load(do_ptr + q_tok[:, None] * stride_dot + head[:, None] * stride_doh + dv_idx[None, :],
                 mask=q_ok[:, None], other=0.0)
    lse = tl.load(lse_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
    delta = tl.load(delta_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    n_keys = tl.minimum(seq_len, (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    lo = 0
    if WINDOWED:  # the blocks before the tile's first query's window hold no key any row sees
        lo = tl.maximum(tile * BLOCK_M // GROUP - window + 1, 0) // BLOCK_N * BLOCK_N
    for start_n in range(lo, n_keys, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_ok = k_pos < n_keys
        k_tok = (seq_start + k_pos).to(tl.int64)
        k = tl.load(k_ptr + k_tok[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_ptr + k_tok[:, None] * stride_vt + kv_head * stride_vh + dv_idx[None, :],
                    mask=k_ok[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale_log2
        visible = (k_pos[None, :] <= q_pos[:, None]) & q_ok[:, None] & k_ok[None, :]
        if WINDOWED:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq)
    dq = dq * scale
    tl.store(dq_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], dq.to(dq_ptr.dtype.element_ty),
             mask=q_ok[:, None] & d_ok[None, :])


def attention_backward_triton(grad_out, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, window: int | None = None):
    """Gradients (dq, dk, dv) of packed causal attention; `lse` is the forward's log2-sum-exp2
    (with sinks, their term included: the probabilities come out right, and `sinks_grad` gives
    theirs). `window`: the forward's sliding window (`attention_window.py`)."""
    require_triton("attention backward")
    n_tokens, n_heads, head_dim = q.shape
    n_kv_heads, head_dim_v = k.shape[1], v.shape[2]
    group = n_heads // n_kv_heads
    q, k, v, grad_out = q.contiguous(), k.contiguous(), v.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    n_seqs = cu_seqlens.shape[0] - 1
    if n_tokens == 0:
        return dq, dk, dv
    cu = cu_seqlens.to(torch.int32)
    scale_log2 = scale * math.log2(math.e)
    block_d, num_warps = next_power_of_2(head_dim), 8 if head_dim > 128 else 4
    args = (n_heads, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            grad_out.stride(0), grad_out.stride(1), window or 0)
    _dkdv_kernel[(triton.cdiv(max_seqlen, DKDV_BLOCK_N), n_seqs, n_kv_heads)](
        q, k, v, grad_out, lse, delta, dk, dv, cu, scale, scale_log2, *args,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_M=DKDV_BLOCK_M, BLOCK_N=DKDV_BLOCK_N,
        WINDOWED=window is not None, num_warps=num_warps, num_stages=1, enable_fp_fusion=True)
    _dq_kernel[(triton.cdiv(max_seqlen * group, DQ_BLOCK_M), n_seqs, n_kv_heads)](
        q, k, v, grad_out, lse, delta, dq, cu, scale, scale_log2, *args,
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, BLOCK_D=block_d, BLOCK_M=DQ_BLOCK_M, BLOCK_N=DQ_BLOCK_N,
        WINDOWED=window is not None, num_warps=num_warps, num_stages=1, enable_fp_fusion=True)
    return dq, dk, dv
