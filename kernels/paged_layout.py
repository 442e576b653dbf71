"""The paged K/V layout that the attention kernels read (`attention.py`, `latent_attention.py`,
the Gluon kernels): each sequence's query tokens in a flat batch, its key count, and a block
table from its positions to cache slots; position ``p`` of sequence ``s`` lives in slot
``block_table[s, p // page_size] * page_size + p % page_size``. Training's packed K/V are the
same layout with one position per page (`packed_layout`). `page_shift` and `offsets_fit_int32`
decide, once a launch, how a kernel computes those slots and addresses: by shift and mask where
the page size is a power of two, in 32 bits where the caches allow; addresses only, never a
bit of the result (docs/design.md rule 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedLayout:
    """Where each query token's keys live. All tensors int32 on the queries' device.

    Attributes:
        cu_seqlens_q: ``[S+1]`` offsets of each sequence's query tokens in the flat batch.
        seq_lens: ``[S]`` total keys per sequence (cached context + new query tokens).
        block_table: ``[S, max_pages]`` page ids of each sequence.
        page_size: positions per page.
        max_seqlen_q: the largest query count of any sequence (host int; sizes the grid).
        seq_order: ``[S]`` a permutation of the sequences: the order the attention kernels' programs
            take them (the engine's: most attention work first, `runtime.step_inputs`), or None
            for 0..S-1. Each sequence's programs compute the same rows whichever programs they
            are, so the order changes the schedule, never a bit; longest first keeps a few long
            sequences from running alone at the end of a decode launch (1.2-1.4x at 128-256
            sequences of mixed lengths, twenty-eighth session).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    page_size: int
    max_seqlen_q: int
    seq_order: torch.Tensor | None = None


def page_shift(page_size: int) -> int | None:
    """``log2(page_size)`` where the page size is a power of two, else None: the attention kernel
    then finds a key's page and its offset in it with a shift and a mask instead of dividing."""
    return page_size.bit_length() - 1 if page_size > 0 and page_size & (page_size - 1) == 0 else None


def offsets_fit_int32(*tensors: torch.Tensor) -> bool:
    """Whether every element of each tensor lies fewer than 2**31 elements past its first (its
    strides and shape; views included): the attention kernel then addresses the K/V caches in 32
    bits."""
    return all(sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()) if n) < 2 ** 31 for t in tensors)


def packed_layout(cu_seqlens: torch.Tensor, max_seqlen: int) -> PagedLayout:
    """The trivial layout of packed training sequences: token ``cu_seqlens[s] + p`` is position
    ``p`` of sequence ``s``, as a block table with ``page_size = 1``."""
    cu = cu_seqlens.to(torch.int32)
    seq_lens = cu[1:] - cu[:-1]
    table = cu[:-1, None] + torch.arange(max(max_seqlen, 1), device=cu.device, dtype=torch.int32)[None, :]
    return PagedLayout(cu, seq_lens.contiguous(), table.contiguous(), 1, max_seqlen)
