"""moe_align: the (token, rank) pairs of a MoE batch grouped by expert, padded per expert.

Pair ``p = t * k + r`` of ``ids [T, k]`` goes to expert ``ids[t, r]``. Each expert's pairs keep
their order (a stable sort by expert) and its segment is padded to a multiple of ``block_m``
rows, so that a grouped GEMM tile never spans two experts. The output buffer's size is a bound
known from the shapes alone (no host sync: CUDA-graph safe).

Two implementations give the same `MoeLayout`, element for element:

- `moe_align_reference`: about twenty torch ops (scatter-add, cumsum, a stable sort, index
  writes, searchsorted). Any batch size.
- `_moe_align_kernel`: one Triton launch for up to `MAX_TRITON_PAIRS` pairs, as in decode and
  small prefill steps, where the launches of the torch version cost more than their work (about
  25 of them in each MoE layer of every decode step). Program p takes `PAIRS_PER_PROGRAM` pairs
  and a share of the padded row blocks; each program recomputes the histogram and segment starts
  of the whole batch (a few thousand ids), places its pairs (a pair's rank in its expert's
  segment is the count of earlier pairs of that expert: the stable order, with no sort), and
  writes its blocks' experts and padding rows. Pair rows and padding rows are disjoint, so the
  programs never write the same element. (A single program with a bitonic sort took 21-23 us
  per Moonlight decode layer on the H200; this launch takes ~8 at 256 tokens.)

The layout only says where each pair's row is computed; the rows' values do not depend on it
(kernels/moe.py), so this file has no numerical contract, only the equality of the two layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._triton import launch_warps, next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

#: the largest batch (``T * k`` pairs) the single-program kernel takes; larger ones use torch ops
MAX_TRITON_PAIRS = 4096
#: the most experts the kernel's histogram takes
MAX_TRITON_EXPERTS = 1024
#: pairs each program of the kernel places (Moonlight decode, 1,536 pairs: 96 programs). A
#: program's rank loop compares its pairs with every earlier pair, so fewer pairs per program
#: shorten the launch's longest program: 16 took 0.65-0.75x the time of 32 at 64-256 tokens of
#: Moonlight, DeepSeek-V3 and Qwen3-30B-A3B (`benchmarks/moe_routing.py`, H200, 2026-11-28)
PAIRS_PER_PROGRAM = 16
#: warps of a program: 4 was the fastest or within 0.1 us of it in every case of that sweep (1, 2, 4,
#: 8). Neither this nor `PAIRS_PER_PROGRAM` changes the layout.
ALIGN_WARPS = 4


@dataclass
class MoeLayout:
    """The pairs (token t, rank r) = pair ``t * k + r`` grouped by expert, padded per expert.

    Attributes:
        sorted_pairs: ``[P]`` pair index at each padded position (``num_pairs`` = padding).
        pair_pos: ``[num_pairs]`` padded position of each pair.
        block_expert: ``[P / BLOCK_M]`` expert of each row block (-1: unused block).
        expert_offsets: ``[E + 1]`` start of each expert's padded segment.
        num_pairs: ``T * k``.
        config: the tile config the layout was padded for.
    """

    sorted_pairs: torch.Tensor
    pair_pos: torch.Tensor
    block_expert: torch.Tensor
    expert_offsets: torch.Tensor
    num_pairs: int
    config: "object | None" = None


def padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Rows of the padded buffer: enough for any split of `num_pairs` over `num_experts`."""
    return -(-(num_pairs + num_experts * (block_m - 1)) // block_m) * block_m


def moe_align_reference(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeLayout:
    """`moe_align` with torch ops only (no host sync), for any number of pairs."""
    flat = ids.reshape(-1)
    n = flat.numel()
    device = flat.device
    # scatter_add, not bincount: bincount syncs with the host to size its output (no CUDA graphs)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.sort(flat, stable=True).indices
    sorted_expert = flat[order]
    unpadded_start = torch.cumsum(counts, 0) - counts
    pos = starts[sorted_expert] + torch.arange(n, device=device) - unpadded_start[sorted_expert]
    size = padded_size(n, num_experts, block_m)
    sorted_pairs = torch.full((size,), n, dtype=torch.int64, device=device)
    sorted_pairs[pos] = order
    pair_pos = torch.empty(n, dtype=torch.int64, device=device)
    pair_pos[order] = pos
    block_start = torch.arange(size // block_m, device=device) * block_m
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1).to(torch.int32)
    offsets = torch.cat([starts, ends[-1:]])
    return MoeLayout(sorted_pairs, pair_pos, block_expert, offsets, n)


@triton.jit
def _moe_align_kernel(ids_ptr, sorted_pairs_ptr, pair_pos_ptr, block_expert_ptr, offsets_ptr, n, num_blocks, E,
                      BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
                      KEYS: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr = False):
    """Program p: pairs ``p * PAIRS ...`` and its share of the padded row blocks. Every program
    recomputes the histogram and segment starts of the whole batch (a few thousand ids)."""
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    i = tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + i, mask=i < n, other=0).to(tl.int32)
    counts = tl.histogram(ids, BLOCK_E, mask=i < n)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    if pid == 0:
        e = tl.arange(0, BLOCK_E)
        tl.store(offsets_ptr + e, starts.to(tl.int64), mask=e < E)
        tl.store(offsets_ptr + E, tl.sum(padded, 0).to(tl.int64))

    # this program's pairs: a pair's place in its expert's segment is the number of earlier pairs
    # of the same expert (a stable sort by expert, with no sort)
    pair = pid * PAIRS + tl.arange(0, PAIRS)
    pair_ok = pair < n
    expert = tl.load(ids_ptr + pair, mask=pair_ok, other=0).to(tl.int32)
    rank = tl.zeros((PAIRS,), tl.int32)
    for c in range(0, tl.cdiv(tl.minimum(n, pid * PAIRS + PAIRS), KEYS)):
        j = c * KEYS + tl.arange(0, KEYS)
        other = tl.load(ids_ptr + j, mask=j < n, other=-1).to(tl.int32)
        earlier = (other[None, :] == expert[:, None]) & (j[None, :] < pair[:, None])
        rank += tl.sum(earlier.to(tl.int32), 1)
    pos = tl.gather(starts, tl.minimum(expert, BLOCK_E - 1), 0) + rank
    tl.store(pair_pos_ptr + pair, pos.to(tl.int64), mask=pair_ok)
    tl.store(sorted_pairs_ptr + pos, pair.to(tl.int64), mask=pair_ok)

    # this program's row blocks: each block's expert (the segments ending at or before it), and
    # the padding rows past its expert's pairs (the pairs' rows are written above)
    per_program = tl.cdiv(num_blocks, tl.num_programs(0))
    rows = tl.arange(0, BLOCK_M)
    for c in range(0, tl.cdiv(per_program, CHUNK)):
        block = pid * per_program + c * CHUNK + tl.arange(0, CHUNK)
        mine = (block < num_blocks) & (c * CHUNK + tl.arange(0, CHUNK) < per_program)
        first_row = block * BLOCK_M
        owner = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), 1)
        in_use = owner < E
        tl.store(block_expert_ptr + block, tl.where(in_use, owner, -1), mask=mine)
        owner = tl.minimum(owner, BLOCK_E - 1)
        offset = first_row[:, None] + rows[None, :] - tl.gather(starts, owner, 0)[:, None]
        padding = ~in_use[:, None] | (offset >= tl.gather(counts, owner, 0)[:, None])
        tl.store(sorted_pairs_ptr + first_row[:, None] + rows[None, :], tl.full((CHUNK, BLOCK_M), 0, tl.int64) + n,
                 mask=mine[:, None] & padding)


def moe_align_triton(ids: torch.Tensor, num_experts: int, block_m: int, num_warps: int | None = None,
                     pairs_per_program: int | None = None) -> MoeLayout:
    """`moe_align` in one Triton launch; for up to `MAX_TRITON_PAIRS` pairs and
    `MAX_TRITON_EXPERTS` experts (ValueError beyond). `num_warps` (1, 2, 4 or 8; None:
    `ALIGN_WARPS`) and `pairs_per_program` (a power of two from 8 to 256; None:
    `PAIRS_PER_PROGRAM`) shape the launch only: every choice gives the same layout."""
    require_triton("moe_align")
    if not 0 < ids.numel() <= MAX_TRITON_PAIRS or num_experts > MAX_TRITON_EXPERTS:
        raise ValueError(f"moe_align_triton: ids.numel()={ids.numel()} must be in 1..{MAX_TRITON_PAIRS} and "
                         f"num_experts={num_experts} at most {MAX_TRITON_EXPERTS}")
    warps = launch_warps("moe_align_triton", num_warps, ALIGN_WARPS)
    pairs = PAIRS_PER_PROGRAM if pairs_per_program is None else pairs_per_program
    if not 8 <= pairs <= 256 or pairs & (pairs - 1):
        raise ValueError(f"moe_align_triton: pairs_per_program={pairs} must be a power of two from 8 to 256")
    flat = ids.reshape(-1)
    n = flat.numel()
    size = padded_size(n, num_experts, block_m)
    device = flat.device
    sorted_pairs = torch.empty(size, dtype=torch.int64, device=device)
    pair_pos = torch.empty(n, dtype=torch.int64, device=device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=device)
    _moe_align_kernel[(triton.cdiv(n, pairs),)](
        flat, sorted_pairs, pair_pos, block_expert, offsets, n, size // block_m, num_experts,
        BLOCK_N=max(16, next_power_of_2(n)), BLOCK_E=max(16, next_power_of_2(num_experts)), BLOCK_M=block_m,
        PAIRS=pairs, KEYS=256, CHUNK=max(1, min(32, 2048 // block_m)), num_warps=warps,
        **dependent_launch_kwargs(flat.device), enable_fp_fusion=True)
    return MoeLayout(sorted_pairs, pair_pos, block_expert, offsets, n)


def moe_align(ids: torch.Tensor, num_experts: int, block_m: int) -> MoeLayout:
    """Group the pairs of ``ids [T, k]`` (int64 expert ids) by expert, each expert's segment
    padded to a multiple of `block_m` (a power of two), with device work only (no host sync).
    One Triton launch for up to `MAX_TRITON_PAIRS` pairs on the Triton backend, torch ops
    otherwise; both give the same layout."""
    n = ids.numel()
    if (0 < n <= MAX_TRITON_PAIRS and num_experts <= MAX_TRITON_EXPERTS
            and select("moe_align", ids, dtypes=(torch.int64, torch.int32)) == "triton"):
        return moe_align_triton(ids, num_experts, block_m)
    return moe_align_reference(ids, num_experts, block_m)
