"""Latent MLA attention's backward: the FlashAttention-2 scheme with the value gradient folded
into the key's latent dims (the value is the key's first ``kv_lora_rank`` dims,
`latent_attention.py`). Correct, not invariant (docs/design.md rule 8): its launch parameters
are free to tune."""

from __future__ import annotations

import math

import torch

from ._triton import launch_staged, require_triton, tl, triton
from .latent_attention import latent_dims, latent_scores

# Launch parameters (BLOCK_M, BLOCK_N, warps, stages): free to tune (rule 8); the
# fastest of benchmarks/attention_configs.py's candidates on the H200 (1.3x each over 32/32/8/1).
DKDV_CONFIG = (64, 32, 8, 2)
DQ_CONFIG = (64, 64, 8, 1)


@triton.jit
def _latent_dkv_kernel(q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, dkv_ptr, cu_ptr, scale, scale_log2, n_heads,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh,
                       GROUP: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One key block: dK = scale * dS^T Q over every query head of its group, plus dV = P^T dO
    added into the latent dims (the value is the latent key)."""
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
    dl = tl.arange(0, BLOCK_L)
    dl_ok = dl < LAT
    dr = tl.arange(0, BLOCK_R)
    dr_ok = dr < ROPE
    k_row = kv_ptr + k_tok[:, None] * stride_kt + kv_head * stride_kh
    k_lat = tl.load(k_row + dl[None, :], mask=k_ok[:, None] & dl_ok[None, :], other=0.0)
    k_rope = tl.load(k_row + LAT + dr[None, :], mask=k_ok[:, None] & dr_ok[None, :], other=0.0)
    dk_lat = tl.zeros((BLOCK_N, BLOCK_L), tl.float32)
    dk_rope = tl.zeros((BLOCK_N, BLOCK_R), tl.float32)
    for g in range(GROUP):
        head = kv_head * GROUP + g
        for start_m in range((start_n // BLOCK_M) * BLOCK_M, seq_len, BLOCK_M):
            q_pos = start_m + tl.arange(0, BLOCK_M)
            q_ok = q_pos < seq_len
            q_tok = (seq_start + q_pos).to(tl.int64)
            q_row = q_ptr + q_tok[:, None] * stride_qt + head * stride_qh
            q_lat = tl.load(q_row + dl[None, :], mask=q_ok[:, None] & dl_ok[None, :], other=0.0)
            q_rope = tl.load(q_row + LAT + dr[None, :], mask=q_ok[:, None] & dr_ok[None, :], other=0.0)
            do = tl.load(do_ptr + q_tok[:, None] * stride_dot + head * stride_doh + dl[None, :],
                         mask=q_ok[:, None] & dl_ok[None, :], other=0.0)
            lse = tl.load(lse_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
            delta = tl.load(delta_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
            s = latent_scores(q_lat, q_rope, k_lat, k_rope, scale_log2)
            visible = (k_pos[None, :] <= q_pos[:, None]) & q_ok[:, None] & k_ok[None, :]
            p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
            dk_lat = tl.dot(tl.trans(p.to(do.dtype)), do, dk_lat)  # dV, into the latent dims
            dp = tl.dot(do, tl.trans(k_lat))
            ds = (p * (dp - delta[:, None]) * scale).to(q_lat.dtype)
            dk_lat = tl.dot(tl.trans(ds), q_lat, dk_lat)
            dk_rope = tl.dot(tl.trans(ds), q_rope, dk_rope)
    out_row = dkv_ptr + k_tok[:, None] * stride_kt + kv_head * stride_kh
    tl.store(out_row + dl[None, :], dk_lat.to(dkv_ptr.dtype.element_ty), mask=k_ok[:, None] & dl_ok[None, :])
    tl.store(out_row + LAT + dr[None, :], dk_rope.to(dkv_ptr.dtype.element_ty), mask=k_ok[:, None] & dr_ok[None, :])


@triton.jit
def _latent_dq_kernel(q_ptr, kv_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, cu_ptr, scale, scale_log2, n_heads,
                      stride_qt, stride_qh, stride_kt, stride_kh, stride_dot, stride_doh,
                      GROUP: tl.constexpr, LAT: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
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
    dl = tl.arange(0, BLOCK_L)
    dl_ok = dl < LAT
    dr = tl.arange(0, BLOCK_R)
    dr_ok = dr < ROPE
    q_row = q_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh
    q_lat = tl.load(q_row + dl[None, :], mask=q_ok[:, None] & dl_ok[None, :], other=0.0)
    q_rope = tl.load(q_row + LAT + dr[None, :], mask=q_ok[:, None] & dr_ok[None, :], other=0.0)
    do = tl.load(do_ptr + q_tok[:, None] * stride_dot + head[:, None] * stride_doh + dl[None, :],
                 mask=q_ok[:, None] & dl_ok[None, :], other=0.0)
    lse = tl.load(lse_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
    delta = tl.load(delta_ptr + q_tok * n_heads + head, mask=q_ok, other=0.0)
    dq_lat = tl.zeros((BLOCK_M, BLOCK_L), tl.float32)
    dq_rope = tl.zeros((BLOCK_M, BLOCK_R), tl.float32)
    n_keys = tl.minimum(seq_len, (tile * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
    for start_n in range(0, n_keys, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_ok = k_pos < n_keys
        k_row = kv_ptr + (seq_start + k_pos).to(tl.int64)[:, None] * stride_kt + kv_head * stride_kh
        k_lat = tl.load(k_row + dl[None, :], mask=k_ok[:, None] & dl_ok[None, :], other=0.0)
        k_rope = tl.load(k_row + LAT + dr[None, :], mask=k_ok[:, None] & dr_ok[None, :], other=0.0)
        s = latent_scores(q_lat, q_rope, k_lat, k_rope, scale_log2)
        visible = (k_pos[None, :] <= q_pos[:, None]) & q_ok[:, None] & k_ok[None, :]
        p = tl.where(visible, tl.exp2(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(k_lat))
        ds = (p * (dp - delta[:, None])).to(k_lat.dtype)
        dq_lat = tl.dot(ds, k_lat, dq_lat)
        dq_rope = tl.dot(ds, k_rope, dq_rope)
    dq_row = dq_ptr + q_tok[:, None] * stride_qt + head[:, None] * stride_qh
    tl.store(dq_row + dl[None, :], (dq_lat * scale).to(dq_ptr.dtype.element_ty), mask=q_ok[:, None] & dl_ok[None, :])
    tl.store(dq_row + LAT + dr[None, :], (dq_rope * scale).to(dq_ptr.dtype.element_ty),
             mask=q_ok[:, None] & dr_ok[None, :])


def latent_attention_backward_triton(grad_out: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor,
                                     lse: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                                     scale: float, dkdv_config: tuple[int, int, int, int] | None = None,
                                     dq_config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dkv)`` of packed causal latent attention (the value gradient is already in dkv's
    first ``out.shape[-1]`` dims); `lse` is the forward's log2-sum-exp2. The configs ((BLOCK_M,
    BLOCK_N, warps, stages), default `DKDV_CONFIG` / `DQ_CONFIG`) are for the GPU sweeps."""
    require_triton("attention backward (latent MLA)")
    n_tokens, n_heads, _ = q.shape
    n_kv_heads = kv.shape[1]
    group = n_heads // n_kv_heads
    q, kv, grad_out = q.contiguous(), kv.contiguous(), grad_out.contiguous()
    delta = (grad_out.float() * out.float()).sum(-1)
    dq, dkv = torch.empty_like(q), torch.empty_like(kv)
    if n_tokens == 0:
        return dq, dkv
    n_seqs = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int32)
    args = (scale, scale * math.log2(math.e), n_heads, q.stride(0), q.stride(1), kv.stride(0), kv.stride(1),
            grad_out.stride(0), grad_out.stride(1))
    dims = latent_dims(q, out.shape[-1])
    key = (q.device, q.dtype, group, tuple(dims.values()))
    bm, bn, warps, stages = dkdv_config or DKDV_CONFIG
    launch_staged(_latent_dkv_kernel, (triton.cdiv(max_seqlen, bn), n_seqs, n_kv_heads),
                  (q, kv, grad_out, lse, delta, dkv, cu, *args),
                  dict(GROUP=group, **dims, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps), stages,
                  ("latent dkv", *key, bm, bn, warps, stages), fp_fusion=True, fallback=dkdv_config is None)
    bm, bn, warps, stages = dq_config or DQ_CONFIG
    launch_staged(_latent_dq_kernel, (triton.cdiv(max_seqlen * group, bm), n_seqs, n_kv_heads),
                  (q, kv, grad_out, lse, delta, dq, cu, *args),
                  dict(GROUP=group, **dims, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps), stages,
                  ("latent dq", *key, bm, bn, warps, stages), fp_fusion=True, fallback=dq_config is None)
    return dq, dkv
