"""The penalties' Triton kernel (`kernels.apply_penalties`) against its reference: the same bits
(element-wise IEEE operations, no fused multiply-add), rows without a slot copied, slots read
through each row's index; see check_triton_kernels."""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, ref  # noqa: E402

from vexact_models.kernels import apply_penalties  # noqa: E402


def test_penalties_are_the_references_bits():
    torch.manual_seed(0)
    rows, vocab, slots = 6, 5000, 9  # a vocabulary over two blocks and a ragged one
    logits = torch.randn(rows, vocab) * 7
    logits[0, :3] = torch.tensor([0.0, -0.0, float("-inf")])
    counts = torch.randint(0, 3, (slots, vocab), dtype=torch.int32) * (torch.rand(slots, vocab) < 0.1)
    in_prompt = torch.rand(slots, vocab) < 0.05
    row_slots = torch.tensor([4, -1, 0, 8, 2, -1])
    rep = torch.tensor([1.3, 2.0, 0.7, 1.0, 1.1, 1.0])
    freq = torch.tensor([0.5, 1.0, -0.3, 0.0, 1.7, 0.0])
    pres = torch.tensor([0.25, 1.0, 0.0, 1.5, -2.0, 0.0])
    args = [t.to(DEVICE) for t in (logits, counts, in_prompt, row_slots, rep, freq, pres)]
    got = apply_penalties(*args)
    want = ref(apply_penalties, *args)
    assert torch.equal(got.cpu(), want.cpu())
    assert torch.equal(got[1].cpu(), logits[1]) and torch.equal(got[5].cpu(), logits[5])
    assert not torch.equal(got[0].cpu(), logits[0])
