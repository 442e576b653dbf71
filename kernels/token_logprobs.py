"""token_logprobs: log-probabilities of target tokens from hidden states and the LM head.

``token_logprobs(h, W, t, T)[i] == log_softmax(lm_head_logits(h, W) / T)[i, t[i]]``, computed in
chunks of tokens so that training never holds ``[tokens, vocab]`` fp32 logits at once.
`lm_head_logits` is ``linear(h, W, fp32)``, soft-capped (`logit_softcap`) when the model's config
asks for it (Gemma's ``final_logit_softcapping``): every LM head's logits come from it.

Invariance contract: the logits rows come from `lm_head_logits` (`linear`, row-invariant, with an
fp32 output; the element-wise cap) and the log-probabilities from `gather_logprobs`, the same
calls that give the sampler its logits and the logprob of a sampled token, so a rollout's
reported logprob equals the training logprob bitwise (docs/design.md rule 7) whatever the chunk
size or batch. The backward (rule 8: speed, not bits) recomputes each chunk's logits in fp32
with cuBLAS (capped by torch's ``tanh``), turns them into ``d logp / d logits = (onehot -
softmax) / T`` in one pass (`logprob_grad`; times the cap's derivative ``1 - (z / cap)**2``), and
accumulates the weight gradient in fp32 inside the GEMM. Its chunks are larger than the
forward's unless the caller bounds them (`backward_rows`).
"""

from __future__ import annotations

import torch

from .linear import linear
from .log_softmax import gather_logprobs
from .logit_softcap import check_softcap, logit_softcap
from .logprob_grad import logprob_grad

DEFAULT_CHUNK_TOKENS = 512
BACKWARD_LOGITS_BYTES = 1 << 31  # fp32 logits per backward chunk when chunk_tokens is not given


def _chunk_rows(chunk_tokens: int | None) -> int:
    if chunk_tokens is None:
        return DEFAULT_CHUNK_TOKENS
    if chunk_tokens < 1:
        raise ValueError(f"token_logprobs: chunk_tokens must be >= 1, got {chunk_tokens}")
    return chunk_tokens


def backward_rows(chunk_tokens: int | None, forward_rows: int, vocab: int) -> int:
    """Tokens per backward chunk: the caller's `chunk_tokens` when given (it bounds the memory),
    else as many as keep the chunk's fp32 logits under `BACKWARD_LOGITS_BYTES` (at least the
    forward's chunk). Fewer chunks mean fewer passes of the fp32 ``[vocab, hidden]`` weight
    gradient accumulator, which at Qwen3-8B is 2.5 GB per pass."""
    if chunk_tokens is not None:
        return forward_rows
    return max(forward_rows, BACKWARD_LOGITS_BYTES // (4 * max(vocab, 1)) // 256 * 256)


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """The LM head's fp32 logits (fp64 for fp64 `hidden`) ``[rows, vocab]`` of final hidden states
    ``[rows, hidden]`` and the head's ``[vocab, hidden]`` weight: ``linear(hidden, weight, fp32)``,
    then ``softcap * tanh(logits / softcap)`` when `softcap` is given (`logit_softcap`). The one
    place the training forward, `token_logprobs` and the rollout get logits from (rule 7)."""
    out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    logits = linear(hidden, weight, out_dtype=out_dtype)
    return logits if softcap is None else logit_softcap(logits, softcap)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` in `out_dtype` (cuBLAS writes fp32 from bf16 operands without a rounding step)."""
    if a.dtype == out_dtype:
        return a @ b
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=out_dtype)
    return a.to(out_dtype) @ b.to(out_dtype)


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with `acc` wider than `a` and `b` (one GEMM with beta = 1 on CUDA)."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif a.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a.to(acc.dtype) @ b.to(acc.dtype)


class _TokenLogprobsFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temps, chunk, backward_chunk, softcap):
        out_dtype = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        logprobs = torch.empty(hidden.shape[0], device=hidden.device, dtype=out_dtype)
        lse = torch.empty_like(logprobs)
        for start in range(0, hidden.shape[0], chunk):
            stop = start + chunk
            logits = lm_head_logits(hidden[start:stop], weight, softcap)
            logprobs[start:stop], lse[start:stop] = gather_logprobs(
                logits, targets[start:stop], temps[start:stop], return_lse=True)
        ctx.save_for_backward(hidden, weight, targets, temps, lse)
        ctx.chunk = backward_chunk
        ctx.softcap = softcap
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs):
        hidden, weight, targets, temps, lse = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, device=weight.device, dtype=lse.dtype) \
            if ctx.needs_input_grad[1] else None
        grad_logprobs = grad_logprobs.to(lse.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk):
            stop = min(start + ctx.chunk, hidden.shape[0])
            h = hidden[start:stop]
            # fp32 logits again (cuBLAS; rule 8: the backward need not match the forward's bits)
            logits = _mm(h, weight.t(), lse.dtype)
            capped = None if ctx.softcap is None else torch.tanh(logits / ctx.softcap)
            if capped is not None:
                logits = capped * ctx.softcap
            grad_logits = logprob_grad(logits, lse[start:stop], targets[start:stop], temps[start:stop],
                                       grad_logprobs[start:stop], out_dtype=weight.dtype if capped is None else lse.dtype)
            del logits
            if capped is not None:  # through the cap: d (cap tanh(x / cap)) / dx = 1 - tanh(x / cap)**2
                grad_logits = (grad_logits * (1.0 - capped * capped)).to(weight.dtype)
                del capped
            if grad_hidden is not None:
                grad_hidden[start:stop] = (grad_logits @ weight).to(hidden.dtype)
            if grad_weight is not None:
                _addmm_(grad_weight, grad_logits.t(), h.to(weight.dtype))
        grad_weight = grad_weight.to(weight.dtype) if grad_weight is not None else None
        return grad_hidden, grad_weight, None, None, None, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                   temperature: float | torch.Tensor = 1.0, chunk_tokens: int | None = None,
                   softcap: float | None = None) -> torch.Tensor:
    """Log-probabilities ``[tokens]`` (fp32; fp64 for fp64 input) of `targets` under
    ``softmax(lm_head_logits(hidden, weight, softcap) / T)``.

    Args:
        hidden: ``[tokens, hidden_size]`` final hidden states (after the last norm).
        weight: ``[vocab, hidden_size]`` LM head weight.
        targets: ``[tokens]`` token ids whose log-probabilities are wanted.
        temperature: positive float or ``[tokens]`` tensor (use 1.0 for greedy rollouts).
        chunk_tokens: tokens per chunk (bounds the fp32 logits held at once, in the forward and
            the backward); any value gives bitwise the same result. Default: 512 in the
            forward, and in the backward as many as keep the chunk's fp32 logits under 2 GiB.
        softcap: the model's final logit soft cap (``config.final_logit_softcapping``), None: none.
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
    rows = _chunk_rows(chunk_tokens)
    softcap = None if softcap is None else check_softcap(softcap, "token_logprobs")
    return _TokenLogprobsFunction.apply(hidden, weight, targets.long(), temps, rows,
                                        backward_rows(chunk_tokens, rows, weight.shape[0]), softcap)
