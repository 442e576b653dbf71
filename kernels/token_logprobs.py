"""token_logprobs: log-probabilities of target tokens from hidden states and the LM head.

``token_logprobs(h, W, t, T)[i] == log_softmax(linear(h, W, fp32) / T)[i, t[i]]``, computed in
chunks of tokens so that training never holds ``[tokens, vocab]`` fp32 logits at once.

Invariance contract: the logits rows come from `linear` (row-invariant) with an fp32 output and
the log-probabilities from `gather_logprobs`, the same two calls the sampler makes for a
sampled token, so a rollout's reported logprob equals the training logprob bitwise (docs/design.md
rule 7) whatever the chunk size or batch. The backward recomputes each chunk's logits and uses
``d logp / d logits = (onehot - softmax) / T`` with torch matmuls (rule 8).
"""

from __future__ import annotations

import torch

from .linear import linear
from .log_softmax import gather_logprobs

DEFAULT_CHUNK_TOKENS = 512


def _chunk_rows(chunk_tokens: int | None) -> int:
    if chunk_tokens is None:
        return DEFAULT_CHUNK_TOKENS
    if chunk_tokens < 1:
        raise ValueError(f"token_logprobs: chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temps, chunk):
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprobs = torch.empty(hidden.shape[0], device=hidden.device, dtype=out_dtype)
        lse = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            logits = linear(hidden[start:stop], weight, out_dtype=out_dtype)
            logprobs[start:stop], lse[start:stop] = gather_logprobs(
                logits, targets[start:stop], temps[start:stop], return_lse=True)
        ctx.save_for_backward(hidden, weight, targets, temps, lse)
        ctx.chunk = chunk
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, temps, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=lse.dtype) \
            if ctx.needs_input_grad[1] else None
        rows = torch.arange(min(ctx.chunk, hidden.shape[0]), device=hidden.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:stop]
            t = temps[start:stop, None]
            logits = torch.matmul(h, weight.t()).to(lse.dtype)
            # d logp/d logits = (onehot - softmax(logits / T)) / T, scaled by the incoming grad.
            grad_logits = -torch.exp(logits / t - lse[start:stop, None])
            grad_logits[rows[: stop - start], targets[start:stop]] += 1.0
            grad_logits *= grad_logprobs[start:stop, None] / t
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight += grad_logits.t().to(hidden.dtype) @ h
        return grad_hidden, (grad_weight.to(weight.dtype) if grad_weight is not None else None), None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0, chunk_tokens: int | None = None) -> torch.Tensor:
    """Log-probabilities ``[tokens]`` (fp32; fp64 for fp64 input) of `targets` under ``softmax(hidden @ weight.T / T)``.

    Args:
        hidden: ``[tokens, hidden_size]`` final hidden states (after the last norm).
        weight: ``[vocab, hidden_size]`` LM head weight.
        targets: ``[tokens]`` token ids whose log-probabilities are wanted.
        temperature: positive float or ``[tokens]`` tensor (use 1.0 for greedy rollouts).
        chunk_tokens: tokens per chunk (bounds the fp32 logits held at once); any value gives
            bitwise the same result.
    Differentiable in `hidden` and `weight`.
    """
    if hidden.dim() != 2 or targets.shape != (hidden.shape[0],):
        raise ValueError(f"token_logprobs: hidden must be [tokens, hidden] and targets [tokens]; got "
                         f"{tuple(hidden.shape)} and {tuple(targets.shape)}")
    if isinstance(temperature, torch.Tensor):
        temps = temperature.to(device=hidden.device, dtype=torch.float32).expand(hidden.shape[0]).contiguous()
    else:
        if temperature <= 0:
            raise ValueError(f"token_logprobs: temperature must be > 0 (use 1.0 for greedy), got {temperature}")
        temps = torch.full((hidden.shape[0],), float(temperature), device=hidden.device, dtype=torch.float32)
    return _TokenLogprobsFunction.apply(hidden, weight, targets.long(), temps, _chunk_rows(chunk_tokens))
