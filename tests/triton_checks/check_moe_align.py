"""moe_align's Triton kernel vs its torch version: the same layout, element for
element (see check_triton_kernels for the two ways to run it)."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE

from vexact_models.kernels.moe_align import MAX_TRITON_PAIRS, moe_align_triton, moe_align, moe_align_reference


def _same_layout(got, want):
    for name in ("sorted_pairs", "pair_pos", "block_expert", "expert_offsets"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), name
    assert got.num_pairs == want.num_pairs


# (tokens, top_k, experts, block_m): DeepSeek-V3 decode (16 x 8 of 256), Moonlight decode
# (256 x 6 of 64), Qwen3-30B-A3B (128 experts), one token, an odd count, the kernel's limit,
# experts not a power of two, the large tile padding
CASES = [(16, 8, 256, 64), (256, 6, 64, 64), (96, 8, 128, 64), (1, 8, 256, 64), (37, 3, 12, 16),
         (MAX_TRITON_PAIRS // 8, 8, 256, 128), (5, 2, 6, 4), (300, 4, 48, 128)]


@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES)
def test_kernel_layout_equals_the_torch_layout(tokens, top_k, experts, block_m):
    gen = torch.Generator().manual_seed(tokens * 31 + experts)
    # distinct experts per token (as top-k gives), with some experts left empty
    used = max(top_k, experts * 3 // 4)
    ids = torch.stack([torch.randperm(used, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
    _same_layout(moe_align_triton(ids, experts, block_m), moe_align_reference(ids, experts, block_m))


@pytest.mark.parametrize("num_warps,pairs", [(1, 8), (2, 64), (8, 256)])
def test_launch_shape_leaves_the_layout_unchanged(num_warps, pairs):
    """Warps and pairs per program (what `benchmarks/moe_routing.py` sweeps) change which program
    places which pairs and blocks, never where they go: Moonlight and DeepSeek-V3 decode batches."""
    gen = torch.Generator().manual_seed(pairs)
    for tokens, top_k, experts in ((64, 6, 64), (40, 8, 256)):
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).to(DEVICE)
        _same_layout(moe_align_triton(ids, experts, 64, num_warps=num_warps, pairs_per_program=pairs),
                     moe_align_reference(ids, experts, 64))


def test_launch_shape_arguments_are_checked():
    ids = torch.zeros(4, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="num_warps=3 must be 1, 2, 4 or 8"):
        moe_align_triton(ids, 8, 64, num_warps=3)
    with pytest.raises(ValueError, match="pairs_per_program=48 must be a power of two from 8 to 256"):
        moe_align_triton(ids, 8, 64, pairs_per_program=48)


def test_every_pair_in_one_expert_and_the_dispatch():
    """All pairs on the last expert (one segment at the end, every other empty); and `moe_align`
    takes the kernel up to MAX_TRITON_PAIRS pairs and the torch ops above it."""
    ids = torch.full((50, 4), 31, dtype=torch.int64, device=DEVICE)
    _same_layout(moe_align_triton(ids, 32, 64), moe_align_reference(ids, 32, 64))
    big = torch.randint(0, 64, (MAX_TRITON_PAIRS // 4 + 1, 4), device=DEVICE)
    _same_layout(moe_align(big, 64, 64), moe_align_reference(big, 64, 64))


def test_kernel_refuses_batches_past_its_limit():
    ids = torch.zeros(MAX_TRITON_PAIRS + 1, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=f"ids.numel\\(\\)={MAX_TRITON_PAIRS + 1} must be in 1..{MAX_TRITON_PAIRS}"):
        moe_align_triton(ids, 8, 64)
