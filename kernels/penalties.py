"""apply_penalties: vLLM's repetition, frequency and presence penalties on the sampler's logits.

For a row whose request uses them, with ``c[j]`` its generated tokens' count of token j and
``p[j]`` whether j is in its prompt (both read from the row's slot of `counts` / `in_prompt`):

    x[j] = x[j] / r   if (c[j] > 0 or p[j]) and x[j] > 0   (r: repetition_penalty, 1 = off)
    x[j] = x[j] * r   if (c[j] > 0 or p[j]) and x[j] <= 0
    x[j] = x[j] - f * c[j] - e * (c[j] > 0)                  (f: frequency, e: presence penalty)

in that order, in fp32, each operation rounded once (no fused multiply-add), as vLLM's
``apply_penalties`` orders them (repetition as transformers' ``RepetitionPenaltyLogitsProcessor``
computes it: a division). Other rows are copied unchanged; an off penalty (r = 1, f = e = 0) leaves
every value's bits as they were.

The penalised logits steer which token is sampled only: the logprob the sampler reports stays
the unpenalised one training recomputes (docs/design.md rule 7), as vLLM's default
``logprobs_mode`` reports the raw logprobs.

Invariance contract (rule 7): element-wise, each element from its own logit, count and prompt
flag, whatever the batch; the Triton kernel takes no size specialization. The reference is the
same expression in torch (IEEE ``+ - * /``).
"""

from __future__ import annotations

import torch

from ._triton import require_triton, tl, triton
from .backend import select

BLOCK = 2048  # columns per program


@triton.jit(do_not_specialize=["V"])
def _penalties_kernel(x_ptr, out_ptr, counts_ptr, prompt_ptr, slot_ptr, rep_ptr, freq_ptr, pres_ptr, V, stride_x,
                      stride_out, stride_counts, stride_prompt, BLOCK: tl.constexpr):
    """Program (row, block): `BLOCK` columns of one row, penalised through the row's slot (-1:
    copied)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    slot = tl.load(slot_ptr + row)
    if slot >= 0:
        count = tl.load(counts_ptr + slot * stride_counts + cols, mask=mask, other=0)
        in_prompt = tl.load(prompt_ptr + slot * stride_prompt + cols, mask=mask, other=0)
        rep = tl.load(rep_ptr + row)
        seen = count > 0
        scaled = tl.where(x > 0, tl.math.div_rn(x, rep), x * rep)
        x = tl.where(seen | (in_prompt != 0), scaled, x)
        x = x - tl.load(freq_ptr + row) * count.to(tl.float32)
        x = x - tl.load(pres_ptr + row) * seen.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, x, mask=mask)


def apply_penalties_triton(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                           slots: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                           presence: torch.Tensor) -> torch.Tensor:
    """`apply_penalties` by the Triton kernel (no fused multiply-add: the reference's roundings)."""
    require_triton("apply_penalties")
    out = torch.empty_like(logits)
    rows, vocab = logits.shape
    if rows and vocab:
        _penalties_kernel[(rows, triton.cdiv(vocab, BLOCK))](
            logits, out, counts, in_prompt, slots, repetition, frequency, presence, vocab, logits.stride(0),
            out.stride(0), counts.stride(0), in_prompt.stride(0), BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False)
    return out


def apply_penalties_reference(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor,
                              slots: torch.Tensor, repetition: torch.Tensor, frequency: torch.Tensor,
                              presence: torch.Tensor) -> torch.Tensor:
    """The module docstring's expression in torch, on the rows whose slot is >= 0."""
    out = logits.clone()
    rows = (slots >= 0).nonzero().squeeze(1)
    if not len(rows):
        return out
    slot = slots[rows]
    x, count = logits[rows], counts[slot]
    seen = count > 0
    r = repetition[rows, None]
    x = torch.where(seen | in_prompt[slot].bool(), torch.where(x > 0, x / r, x * r), x)
    x = x - frequency[rows, None] * count.float()
    x = x - presence[rows, None] * seen.float()
    out[rows] = x
    return out


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor, slots: torch.Tensor,
                    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:
    """The penalised copy of fp32 ``[R, V]`` `logits` (the module docstring).

    Args:
        counts: int32 ``[S, V]``: per slot, how often each token was generated.
        in_prompt: uint8 or bool ``[S, V]``: per slot, whether each token is in the prompt.
        slots: int64 ``[R]``: each row's slot, -1 for a row without penalties (copied).
        repetition, frequency, presence: fp32 ``[R]``: each row's penalties.
    """
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"apply_penalties: logits must be fp32 [rows, vocab], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if counts.shape[1:] != logits.shape[1:] or in_prompt.shape != counts.shape:
        raise ValueError(f"apply_penalties: counts {tuple(counts.shape)} and in_prompt {tuple(in_prompt.shape)} must "
                         f"be [slots, {logits.shape[1]}]")
    if select("apply_penalties", logits) == "reference":
        return apply_penalties_reference(logits, counts, in_prompt, slots, repetition, frequency, presence)
    return apply_penalties_triton(logits, counts, in_prompt.view(torch.uint8), slots, repetition.float(),
                                  frequency.float(), presence.float())
