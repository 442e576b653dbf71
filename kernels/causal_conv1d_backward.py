"""The backward of `causal_conv1d` past its pre-activation gradient ``dpre`` (docs/design.md rule 8:
correct, no invariance): every input feeds the ``K`` outputs at offsets ``0 .. K - 1`` after it in
its sequence, so ``grad_x[t] = sum_j w_j * dpre[t + K - 1 - j]``, ``grad_w[:, j] = sum_t dpre[t] *
x[t - (K - 1 - j)]`` and ``grad_b = sum_t dpre[t]``, within each sequence. On CUDA one Triton pass
(`_conv_bwd_kernel`, per-program partial weight gradients summed after), on the CPU torch ops.
`causal_conv1d.causal_conv1d_backward` forms ``dpre`` and calls these.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, tl, triton


def token_offsets(cu_seqlens: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequence index, offset in its chunk) of every packed token (tokens past the last
    sequence: index -1), without a host sync."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    covered = int(cu_seqlens[-1]) if cu_seqlens.device.type == "cpu" else tokens
    seq = torch.repeat_interleave(torch.arange(lens.numel(), device=cu_seqlens.device), lens,
                                  output_size=covered)
    seq = torch.cat([seq, seq.new_full((tokens - covered,), -1)])
    local = torch.arange(tokens, device=cu_seqlens.device) - cu_seqlens.long()[seq.clamp_min(0)]
    return seq, local



BWD_TOKENS = 1024  # tokens of a sequence per backward program (its weight-gradient partial)


@triton.jit
def _conv_bwd_kernel(x_ptr, dpre_ptr, w_ptr, cu_ptr, dx_ptr, dw_ptr, C, n_chunks, stride_x, stride_dp, stride_dx,
                     K: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_C: tl.constexpr):
    """Program (sequence, chunk of `CHUNK` tokens, channel block): grad_x of its tokens (each input
    feeds the K outputs at offsets 0 .. K - 1 after it, within its sequence) and its partial weight
    gradient ``[BLOCK_C, KP]`` (tap j: dpre at t times the input at t - (K - 1 - j)), then the bias's
    in column K."""
    seq = tl.program_id(0)
    start = tl.load(cu_ptr + seq)
    n = tl.load(cu_ptr + seq + 1) - start
    cols = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = cols < C
    taps = tl.arange(0, KP)
    dw = tl.zeros((BLOCK_C, KP), tl.float32)
    end = tl.minimum(n, (tl.program_id(1) + 1) * CHUNK)
    for t0 in range(tl.program_id(1) * CHUNK, end, BLOCK_T):
        local = t0 + tl.arange(0, BLOCK_T)
        t_ok = local < end
        ok = t_ok[:, None] & c_ok[None, :]
        rows = (start + local)[:, None].to(tl.int64)
        g = tl.load(dpre_ptr + rows * stride_dp + cols[None, :], mask=ok, other=0.0)
        dx = tl.zeros((BLOCK_T, BLOCK_C), tl.float32)
        for j in tl.static_range(K):
            w = tl.load(w_ptr + cols * K + j, mask=c_ok, other=0.0).to(tl.float32)
            later = tl.load(dpre_ptr + (rows + (K - 1 - j)) * stride_dp + cols[None, :],
                            mask=ok & (local + (K - 1 - j) < n)[:, None], other=0.0)
            dx += later * w[None, :]
            earlier = tl.load(x_ptr + (rows - (K - 1 - j)) * stride_x + cols[None, :],
                              mask=ok & (local >= K - 1 - j)[:, None], other=0.0).to(tl.float32)
            dw += tl.where(taps[None, :] == j, tl.sum(g * earlier, axis=0)[:, None], 0.0)
        dw += tl.where(taps[None, :] == K, tl.sum(g, axis=0)[:, None], 0.0)
        tl.store(dx_ptr + rows * stride_dx + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
    part = seq * n_chunks + tl.program_id(1)
    tl.store(dw_ptr + (part.to(tl.int64) * C + cols[:, None]) * KP + taps[None, :], dw, mask=c_ok[:, None])


def conv_grads_triton(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                      dpre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, fp32 grad_weight, fp32 grad_bias) from ``dpre`` by `_conv_bwd_kernel`."""
    tokens, channels = x.shape
    k = weight.shape[1]
    kp = next_power_of_2(k + 1)
    batch, chunks = cu_seqlens.numel() - 1, triton.cdiv(max(max_seqlen, 1), BWD_TOKENS)
    grad_x = torch.zeros_like(x)
    partial = torch.zeros(max(batch, 1) * chunks, channels, kp, device=x.device, dtype=torch.float32)
    block_c = min(128, max(16, next_power_of_2(channels)))
    if tokens and batch:
        _conv_bwd_kernel[(batch, chunks, triton.cdiv(channels, block_c))](
            x, dpre, weight, cu_seqlens, grad_x, partial, channels, chunks, x.stride(0), dpre.stride(0), grad_x.stride(0),
            K=k, KP=kp, CHUNK=BWD_TOKENS, BLOCK_T=16, BLOCK_C=block_c, num_warps=4, enable_fp_fusion=True)
    summed = partial.sum(0)
    return grad_x, summed[:, :k], summed[:, k]


def conv_grads_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
                         dpre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(grad_x, grad_weight, grad_bias or None) from ``dpre`` by torch ops in dpre's precision."""
    k, tokens = weight.shape[1], x.shape[0]
    seq, local = token_offsets(cu_seqlens, tokens)
    ends = cu_seqlens.long()[1:][seq.clamp_min(0)]
    xf, w = x.to(dpre.dtype), weight.to(dpre.dtype)
    grad_x = torch.zeros_like(dpre)
    grad_w = torch.empty(weight.shape, dtype=dpre.dtype, device=x.device)
    idx = torch.arange(tokens, device=x.device)
    for j in range(k):
        back = k - 1 - j
        # output t + back reads input t as its tap j (same sequence: t + back < the sequence's end)
        later = torch.cat([dpre[back:], dpre.new_zeros(back, dpre.shape[1])])
        grad_x += torch.where(((idx + back < ends) & (seq >= 0))[:, None], later, 0.0) * w[:, j]
        earlier = torch.cat([xf.new_zeros(back, xf.shape[1]), xf[:tokens - back]])
        grad_w[:, j] = (torch.where(((local >= back) & (seq >= 0))[:, None], earlier, 0.0) * dpre).sum(0)
    grad_b = dpre.sum(0).to(bias.dtype) if bias is not None else None
    return grad_x.to(x.dtype), grad_w.to(weight.dtype), grad_b
