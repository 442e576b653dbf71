"""`kernels.top_tokens`' Triton kernel against its reference: the same tokens and ranks (integer
work: chunks' int64 keys, then the largest of their candidates), over chunk boundaries, ties
across chunks, -0.0 beside +0.0, -inf and k = 0; see check_triton_kernels."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, ref  # noqa: E402

from vexact_models.kernels import top_tokens  # noqa: E402


@pytest.mark.parametrize("k", [20, 0, 64, 2048])  # 64, 2048: LLM(max_logprobs=...) above the default
def test_top_tokens_are_the_references(k):
    torch.manual_seed(0)
    logits = torch.randn(2, 4500) * 3  # three chunks, the last ragged
    logits[0, :4] = torch.tensor([0.0, -0.0, float("-inf"), 50.0])
    logits[1, [7, 2100, 4400]] = 50.0  # a tie at the top, across chunks
    own = torch.tensor([1, 2100])
    got = top_tokens(logits.to(DEVICE), own.to(DEVICE), k)
    want = ref(top_tokens, logits, own, k)
    assert all(torch.equal(g.cpu(), w.cpu()) for g, w in zip(got, want))
    if k:
        assert got[0][1, :3].tolist() == [7, 2100, 4400]
