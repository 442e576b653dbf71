"""The paged K/V layout that the attention kernels read (`attention.py`, `latent_attention.py`,
the Gluon kernels): each sequence's query tokens in a flat batch, its key count, and a block
table from its positions to cache slots; position ``p`` of sequence ``s`` lives in slot
``block_table[s, p // page_size] * page_size + p % page_size``. Training's packed K/V are the
same layout with one position per page (`packed_layout`). `page_shift` and `offsets_fit_int32`
decide, once a launch, how a kernel computes those slots and addresses: by shift and mask where
the page size is a power of two, in 32 bits where the caches allow (`page_slots`, the Triton
kernels' device function); addresses only, never a bit of the result (docs/design.md rule 2)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import require_triton, tl, triton


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
            sequences of mixed lengths; H200, 2026-11-27).
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


@triton.jit
def page_slots(table_row, k_pos, k_ok, page_size, page_shift, POW2_PAGES: tl.constexpr, OFFSETS_32: tl.constexpr):
    """The cache slots of one sequence's key positions `k_pos` (those where `k_ok`; the others read
    page 0) through its block-table row `table_row`. `POW2_PAGES`: the page size is
    ``2 ** page_shift``, so a key's page and offset in it are a shift and a mask (divided by the
    runtime page size they were a quarter of a GQA decode program's instructions: ncu on the H200,
    2026-11-28; tests/test_kernel_resources.py). `OFFSETS_32`: every element of the caches lies within 2**31 elements of their
    starts (`offsets_fit_int32`), so the slots stay 32-bit and so do the addresses computed from
    them; else they widen to 64 bits (a slot always fits in 32, its element offset may not)."""
    if POW2_PAGES:
        page = tl.load(table_row + (k_pos >> page_shift), mask=k_ok, other=0)
        slot = page * page_size + (k_pos & (page_size - 1))
    else:
        page = tl.load(table_row + k_pos // page_size, mask=k_ok, other=0)
        slot = page * page_size + k_pos % page_size
    if not OFFSETS_32:
        slot = slot.to(tl.int64)
    return slot


def shuffled_block_table(lens: list[int], page_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``[S, max pages]`` int32 CPU block table giving sequences of `lens` positions their
    ``ceil(len / page_size)`` pages, numbered 0 .. total - 1 and shuffled over the cache
    (`generator`'s permutation) as a running engine leaves them; rows padded with page 0. For the
    checks and benchmarks that read caches through a realistic table."""
    pages = [-(-n // page_size) for n in lens]
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    for row, ids in zip(table, torch.randperm(sum(pages), generator=generator).split(pages)):
        row[:len(ids)] = ids
    return table


def slots_reference(block_table: torch.Tensor, seq: int, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """The cache slots of sequence `seq`'s key `positions`, by the layout's definition (int64)."""
    positions = positions.to(torch.int64)
    return block_table[seq].to(torch.int64)[positions // page_size] * page_size + positions % page_size


@triton.jit
def _page_slots_kernel(table_ptr, out_ptr, seq, n_keys, page_size, page_shift, stride_bt,
                       BLOCK_N: tl.constexpr, POW2_PAGES: tl.constexpr, OFFSETS_32: tl.constexpr):
    start = tl.program_id(0) * BLOCK_N
    k_pos = start + tl.arange(0, BLOCK_N)
    k_ok = k_pos < n_keys
    slot = page_slots(table_ptr + seq * stride_bt, k_pos, k_ok, page_size, page_shift, POW2_PAGES, OFFSETS_32)
    tl.store(out_ptr + k_pos, slot.to(tl.int64), mask=k_ok)


def page_slots_triton(block_table: torch.Tensor, seq: int, n_keys: int, page_size: int,
                      offsets_32: bool = True) -> torch.Tensor:
    """`page_slots` for positions ``0 .. n_keys - 1`` of sequence `seq`, as a kernel computes them
    (shift and mask where `page_size` is a power of two), into an int64 tensor: for the checks
    against `slots_reference` (tests/triton_checks/check_paged_layout.py)."""
    require_triton("page_slots")
    if block_table.dtype != torch.int32 or block_table.dim() != 2:
        raise ValueError(f"page_slots_triton: block_table must be a 2-D int32 tensor, got {block_table.dtype} "
                         f"with {block_table.dim()} dims")
    if not 0 <= seq < block_table.shape[0]:
        raise ValueError(f"page_slots_triton: seq={seq} must be in 0..{block_table.shape[0] - 1} (the table's rows)")
    if not 0 < n_keys <= block_table.shape[1] * page_size:
        raise ValueError(f"page_slots_triton: n_keys={n_keys} must be in 1..{block_table.shape[1] * page_size} "
                         f"(the table's {block_table.shape[1]} pages of {page_size})")
    out = torch.empty(n_keys, dtype=torch.int64, device=block_table.device)
    shift = page_shift(page_size)
    _page_slots_kernel[(triton.cdiv(n_keys, 64),)](block_table, out, seq, n_keys, page_size, shift or 0,
                                                   block_table.stride(0), BLOCK_N=64, POW2_PAGES=shift is not None,
                                                   OFFSETS_32=offsets_32, enable_fp_fusion=True)
    return out
