"""log_softmax over rows of logits at a temperature, and its gather at target tokens.

``log_softmax(logits / T)`` in fp32, where T is a per-row temperature. `gather_logprobs` returns
``log_softmax(logits / T)[row, target]`` without writing the row: it is the op that both the
sampler (the logprob reported for a sampled token) and training (`token_logprobs`) call, which
is what makes those two numbers bitwise equal (docs/design.md rule 7).

Invariance contract: one program per row; the row is scanned in fixed blocks of `BLOCK_V`
columns with a per-lane running max/sum, combined in one fixed order at the end (rule 3). The
same kernel computes the full row and the gathered entry, with the same ``x / T - lse``
expression, so ``log_softmax(x, T)[i, t] == gather_logprobs(x, t, T)[i]`` bitwise. The
reference uses `exact_math` (its own exp/log and block reduction).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

BLOCK_V = 2048
_NUM_WARPS = 8


@triton.jit
def _log_softmax_kernel(x_ptr, temp_ptr, target_ptr, out_ptr, logprob_ptr, lse_ptr, V, stride_x, stride_out,
                        WRITE_ROW: tl.constexpr, GATHER: tl.constexpr, BLOCK_V: tl.constexpr,
                        PDL: tl.constexpr = False):
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    temperature = tl.load(temp_ptr + row)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK_V)
    m_lane = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s_lane = tl.zeros((BLOCK_V,), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(x_row + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32) / temperature
        m_new = tl.maximum(m_lane, x)
        alive = m_new != float("-inf")
        s_lane = tl.where(alive, s_lane * tl.exp(m_lane - m_new) + tl.exp(x - m_new), 0.0)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    lse = m + tl.log(tl.sum(tl.where(m_lane != float("-inf"), s_lane * tl.exp(m_lane - m), 0.0), axis=0))
    tl.store(lse_ptr + row, lse)
    if GATHER:
        target = tl.load(target_ptr + row)
        x_t = tl.load(x_row + target).to(tl.float32) / temperature
        tl.store(logprob_ptr + row, x_t - lse)
    if WRITE_ROW:
        out_row = out_ptr + row * stride_out
        for start in range(0, V, BLOCK_V):
            mask = start + cols < V
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32) / temperature
            tl.store(out_row + start + cols, x - lse, mask=mask)


def _temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """A per-row fp32 temperature tensor (one code path for scalar and per-row temperatures)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != (rows,):
            raise ValueError(f"temperature tensor must have shape ({rows},), got {tuple(temperature.shape)}")
        t = temperature.to(device=device, dtype=torch.float32)
    else:
        t = torch.full((rows,), float(temperature), device=device, dtype=torch.float32)
    if rows and device.type == "cpu" and bool((t <= 0).any()):
        raise ValueError(f"temperature must be > 0 for log-probabilities (use 1.0 for greedy), got {t.min().item()}")
    return t


def _launch(logits, temps, targets, write_row):
    require_triton("log_softmax")
    rows, vocab = logits.shape
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    logprobs = torch.empty(rows, device=logits.device, dtype=torch.float32) if targets is not None else lse
    out = torch.empty((rows, vocab), device=logits.device, dtype=torch.float32) if write_row else lse
    if rows:
        _log_softmax_kernel[(rows,)](
            logits, temps, targets if targets is not None else temps, out, logprobs, lse, vocab,
            logits.stride(0), out.stride(0) if write_row else 0,
            WRITE_ROW=write_row, GATHER=targets is not None, BLOCK_V=BLOCK_V, num_warps=_NUM_WARPS,
            **dependent_launch_kwargs(logits.device))
    return out, logprobs, lse


def _scaled(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.to(compute) / temps.to(compute)[:, None]


def log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dim of ``[rows, vocab]`` logits, fp32.

    `temperature` is a positive float or a ``[rows]`` tensor. Not differentiable (training
    uses `token_logprobs`).
    """
    logits = _rows(logits)
    temps = _temperatures(temperature, logits.shape[0], logits.device)
    if select("log_softmax", logits) == "triton":
        return _launch(logits, temps, None, True)[0]
    x = _scaled(logits, temps)
    return x - exact_math.logsumexp(x)[:, None]


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                    return_lse: bool = False):
    """``log_softmax(logits / temperature)[row, targets[row]]`` for each row, fp32 ``[rows]``.

    Bitwise equal to indexing `log_softmax`. With ``return_lse`` also returns the row
    ``logsumexp(logits / temperature)`` ``[rows]``.
    """
    logits = _rows(logits)
    if targets.shape != (logits.shape[0],):
        raise ValueError(f"gather_logprobs: targets must have shape ({logits.shape[0]},), got {tuple(targets.shape)}")
    temps = _temperatures(temperature, logits.shape[0], logits.device)
    if select("log_softmax", logits) == "triton":
        _, logprobs, lse = _launch(logits, temps, targets.to(torch.int64).contiguous(), False)
    else:
        x = _scaled(logits, temps)
        lse = exact_math.logsumexp(x)
        logprobs = x.gather(1, targets.long()[:, None])[:, 0] - lse
    return (logprobs, lse) if return_lse else logprobs


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()
