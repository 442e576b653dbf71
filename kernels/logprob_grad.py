"""logprob_grad: the gradient of target-token log-probabilities with respect to the logits.

For ``logp[i] = log_softmax(logits[i] / T[i])[t[i]]`` and an incoming gradient ``g[i]``:

    d loss / d logits[i, j] = g[i] / T[i] * (onehot(t[i])[j] - exp(logits[i, j] / T[i] - lse[i]))

where ``lse[i]`` is the forward's ``logsumexp(logits[i] / T[i])``. `token_logprobs`'s backward
needs it for every chunk of tokens times the whole vocabulary; written as torch expressions it
was eight passes over an fp32 ``[tokens, vocab]`` tensor (cast, divide, subtract, exp, negate,
scatter, scale, cast back). The Triton kernel reads the fp32 logits once and writes the
gradient once, in the dtype the weight-gradient GEMMs take.

No invariance contract: this is backward math (docs/design.md rule 8), checked against the
float64 reference (tests/kernels/test_logprob_grad.py, and the interpreter).
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .backend import select

BLOCK_V = 1024


@triton.jit
def _logprob_grad_kernel(logits_ptr, lse_ptr, target_ptr, temp_ptr, grad_ptr, out_ptr, V, stride_x, stride_out,
                         BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < V
    temperature = tl.load(temp_ptr + row)
    lse = tl.load(lse_ptr + row)
    target = tl.load(target_ptr + row)
    scale = tl.load(grad_ptr + row) / temperature
    x = tl.load(logits_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    grad = (tl.where(cols == target, 1.0, 0.0) - tl.exp(x / temperature - lse)) * scale
    tl.store(out_ptr + row * stride_out + cols, grad.to(out_ptr.dtype.element_ty), mask=mask)


def logprob_grad_triton(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                        grad: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    require_triton("logprob_grad")
    rows, vocab = logits.shape
    out = torch.empty((rows, vocab), device=logits.device, dtype=out_dtype)
    if rows:
        grid = (rows, triton.cdiv(vocab, BLOCK_V))
        _logprob_grad_kernel[grid](logits, lse, targets, temps, grad, out, vocab, logits.stride(0), out.stride(0),
                                   BLOCK_V=BLOCK_V, num_warps=4, enable_fp_fusion=True)
    return out


def logprob_grad_reference(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                           grad: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    t = temps.to(compute)[:, None]
    out = -torch.exp(logits.to(compute) / t - lse.to(compute)[:, None])
    out[torch.arange(logits.shape[0], device=logits.device), targets] += 1.0
    out *= grad.to(compute)[:, None] / t
    return out.to(out_dtype)


def logprob_grad(logits: torch.Tensor, lse: torch.Tensor, targets: torch.Tensor, temps: torch.Tensor,
                 grad: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``grad[i] / temps[i] * (onehot(targets[i]) - softmax(logits[i] / temps[i]))``, ``[rows, vocab]``.

    Args:
        logits: ``[rows, vocab]`` logits (fp32, or fp64 on the reference backend), unit column stride.
        lse: ``[rows]`` the forward's ``logsumexp(logits / temps)`` per row.
        targets: ``[rows]`` int64 target token ids.
        temps: ``[rows]`` positive fp32 temperatures.
        grad: ``[rows]`` incoming gradient of each row's log-probability.
        out_dtype: dtype of the result (default: the logits' dtype), e.g. the LM head weight's
            bf16 so that the weight-gradient GEMMs read it directly.
    """
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logprob_grad: logits must be [rows, vocab] with unit column stride, got "
                         f"{tuple(logits.shape)} strides {logits.stride()}")
    rows = logits.shape[0]
    for name, t in (("lse", lse), ("targets", targets), ("temps", temps), ("grad", grad)):
        if t.shape != (rows,):
            raise ValueError(f"logprob_grad: {name} must have shape ({rows},), got {tuple(t.shape)}")
    out_dtype = out_dtype or logits.dtype
    args = (logits, lse.contiguous(), targets.long().contiguous(), temps.contiguous(), grad.contiguous(), out_dtype)
    if select("logprob_grad", logits, dtypes=(torch.float32,)) == "triton":
        return logprob_grad_triton(*args)
    return logprob_grad_reference(*args)
