"""The k most probable tokens of each row of logits, and the rank of a given token in its row:
what vLLM's ``logprobs=k`` reports beside each sampled token (`runtime.top_logprobs`).

Order: by logit, highest first; equal logits by token id, lowest first, so the k tokens of a
row and their order are fixed by the row alone (rule 3: nothing depends on the batch). Rank: one
plus the count of the row's logits strictly above the given token's (vLLM's rank; equal logits
share it).

Triton: a row is cut into chunks of `BLOCK` columns, one program each (row, chunk). A program
keys its columns by (logit, then the id complemented) as one int64: the fp32 bits mapped to an
order-preserving int32 in the high half (a negative float's magnitude bits flipped, so -0.0 sits
just below +0.0), ``2**32 - 1 - id`` in the low half. It keeps its `K_SLOTS` largest keys
(``tl.topk``) and counts its logits above the given token's. The launch's second half takes the
k largest of the chunks' candidates (``torch.topk`` over the int64 keys, which are distinct) and
sums the counts. Both halves are integer work, so the result is the reference's bit for bit: the
same keys over the whole row, by torch. Against ``torch.topk`` over the logits it gives the same
tokens where no two of a row's logits tie at the k-th place, and one fixed choice where they do.
"""

from __future__ import annotations

import torch

from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select

BLOCK = 2048  #: columns of one program (a 151,936-token vocabulary: 75 chunks)
_LOW = (1 << 32) - 1  #: the low half of a key: ``_LOW - id``
_LOW_IN_KERNEL = tl.constexpr(_LOW)  # (a kernel reads only constexpr globals)


@triton.jit(do_not_specialize=["V"])
def _chunk_top_kernel(x_ptr, own_ptr, keys_ptr, counts_ptr, V, stride_x, n_chunks, BLOCK: tl.constexpr,
                      K_SLOTS: tl.constexpr):
    """Program (row, chunk): the chunk's `K_SLOTS` largest keys (descending) and its count of
    logits above the row's own token's."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < V
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=float("-inf"))
    own = tl.load(x_ptr + row * stride_x + tl.load(own_ptr + row))
    tl.store(counts_ptr + row * n_chunks + chunk, tl.sum((mask & (x > own)).to(tl.int32), axis=0))
    bits = x.to(tl.int32, bitcast=True)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(tl.int64)
    keys = tl.where(mask, (ordered << 32) + (_LOW_IN_KERNEL - cols), -9223372036854775807 - 1)
    top = tl.topk(keys, K_SLOTS)
    tl.store(keys_ptr + (row * n_chunks + chunk) * K_SLOTS + tl.arange(0, K_SLOTS), top)


def _tokens_of(keys: torch.Tensor) -> torch.Tensor:
    return _LOW - (keys & _LOW)


def top_tokens_triton(logits: torch.Tensor, own: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`top_tokens` by the Triton kernel, then ``torch.topk`` over the chunks' int64 keys."""
    require_triton("top_tokens")
    rows, vocab = logits.shape
    n_chunks = triton.cdiv(vocab, BLOCK)
    slots = next_power_of_2(max(k, 2))  # (tl.topk of one slot fails under the interpreter)
    keys = torch.empty(rows, n_chunks * slots, dtype=torch.int64, device=logits.device)
    counts = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    if rows:
        _chunk_top_kernel[(rows, n_chunks)](logits, own, keys, counts, vocab, logits.stride(0), n_chunks,
                                            BLOCK=BLOCK, K_SLOTS=slots, num_warps=4, enable_fp_fusion=False)
    return _tokens_of(torch.topk(keys, k, dim=1).values), counts.sum(dim=1) + 1


def top_tokens_reference(logits: torch.Tensor, own: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The module docstring's keys over each whole row, by torch."""
    bits = logits.contiguous().view(torch.int32)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF).to(torch.int64)
    ids = torch.arange(logits.shape[1], device=logits.device, dtype=torch.int64)
    keys = (ordered << 32) + (_LOW - ids)
    ranks = (logits > logits.gather(1, own[:, None])).sum(dim=1) + 1
    return _tokens_of(torch.topk(keys, k, dim=1).values), ranks


def top_tokens(logits: torch.Tensor, own: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens int64 [R, k], ranks int64 [R])`` of fp32 ``[R, V]`` `logits`: each row's k
    largest logits' token ids, highest first (ties: the lower id first), and the rank of token
    ``own[r]`` in row r (one plus the count of logits above it). A ValueError names a bad shape,
    dtype or k (0 <= k <= V)."""
    if logits.dim() != 2 or logits.dtype != torch.float32:
        raise ValueError(f"top_tokens: logits must be fp32 [rows, vocab], got {logits.dtype} {tuple(logits.shape)}")
    if own.shape != logits.shape[:1]:
        raise ValueError(f"top_tokens: own must be [{logits.shape[0]}] (a token per row), got {tuple(own.shape)}")
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= logits.shape[1]:
        raise ValueError(f"top_tokens: k={k!r} must be an int in [0, {logits.shape[1]}] (the vocabulary)")
    own = own.to(torch.int64).contiguous()
    if select("top_tokens", logits) == "reference":
        return top_tokens_reference(logits, own, k)
    return top_tokens_triton(logits.contiguous(), own, k)
