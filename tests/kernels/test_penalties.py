"""`kernels.apply_penalties` on the reference backend: the repetition penalty is bitwise
transformers' ``RepetitionPenaltyLogitsProcessor`` over prompt + outputs, frequency and presence
penalties are OpenAI's definition with each operation rounded once, off penalties and rows
without a slot keep their bits, and a row's result does not depend on the other rows."""

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from vexact_models.kernels import apply_penalties


def _case(rows=5, vocab=300, slots=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 5
    counts = torch.randint(0, 4, (slots, vocab), generator=g, dtype=torch.int32)
    counts *= torch.rand(slots, vocab, generator=g) < 0.1
    in_prompt = torch.rand(slots, vocab, generator=g) < 0.05
    return logits, counts, in_prompt


def _per_row(rows, value):
    return torch.full((rows,), value, dtype=torch.float32)


def test_repetition_is_transformers_processor_over_prompt_and_outputs():
    logits, counts, in_prompt = _case()
    slots = torch.tensor([3, 0, 6, 1, 2])
    got = apply_penalties(logits, counts, in_prompt, slots, _per_row(5, 1.7), _per_row(5, 0.0), _per_row(5, 0.0))
    for i, slot in enumerate(slots.tolist()):
        # the tokens seen: the prompt's, and the generated ones (repeated as often as generated)
        seen = in_prompt[slot].nonzero().flatten().tolist() + counts[slot].nonzero().flatten().tolist()
        want = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits[i:i + 1].clone())
        assert torch.equal(got[i], want[0])


def test_frequency_and_presence_are_the_definition_rounded_per_operation():
    logits, counts, in_prompt = _case(seed=1)
    slots = torch.tensor([5, 2, 2, 0, 4])
    freq = torch.tensor([0.5, -1.25, 2.0, 0.3, 0.0])
    pres = torch.tensor([1.0, 0.75, -2.0, 0.0, 0.6])
    got = apply_penalties(logits, counts, in_prompt, slots, _per_row(5, 1.0), freq, pres)
    c = counts[slots]
    want = (logits - freq[:, None] * c.float()) - pres[:, None] * (c > 0).float()
    assert torch.equal(got, want)
    exact = logits.double() - freq[:, None].double() * c - pres[:, None].double() * (c > 0)
    assert torch.allclose(got.double(), exact, rtol=0, atol=1e-5)
    untouched = c == 0
    assert torch.equal(got[untouched], logits[untouched])  # the prompt alone does not count here


def test_off_penalties_and_rows_without_a_slot_keep_their_bits():
    logits, counts, in_prompt = _case(seed=2)
    logits[0, :4] = logits[4, :4] = torch.tensor([0.0, -0.0, float("-inf"), float("nan")])
    counts[1, :4] = 2
    slots = torch.tensor([1, -1, 3, -1, 1])
    rep, freq, pres = torch.tensor([1.0, 3.0, 1.0, 0.5, 1.0]), torch.zeros(5), torch.zeros(5)
    got = apply_penalties(logits, counts, in_prompt, slots, rep, freq, pres)
    assert torch.equal(got.view(torch.int32), logits.view(torch.int32))  # -0.0 and NaN bits too
    rep[4] = 2.0
    got = apply_penalties(logits, counts, in_prompt, slots, rep, freq, pres)
    assert torch.equal(got[:4].view(torch.int32), logits[:4].view(torch.int32))
    assert got[4, 2] == float("-inf") and got[4, 3].isnan() and not torch.equal(got[4, 4:], logits[4, 4:])


def test_a_rows_result_does_not_depend_on_the_other_rows():
    logits, counts, in_prompt = _case(rows=9, seed=3)
    slots = torch.tensor([0, 1, -1, 2, 3, 4, 5, 6, 0])
    rep, freq, pres = torch.linspace(0.5, 2, 9), torch.linspace(-2, 2, 9), torch.linspace(2, -2, 9)
    full = apply_penalties(logits, counts, in_prompt, slots, rep, freq, pres)
    for i in (0, 4, 8):
        one = apply_penalties(logits[i:i + 1], counts, in_prompt, slots[i:i + 1], rep[i:i + 1], freq[i:i + 1],
                              pres[i:i + 1])
        assert torch.equal(one[0], full[i])


def test_bad_shapes_are_refused():
    logits, counts, in_prompt = _case()
    args = (torch.zeros(5, dtype=torch.int64), _per_row(5, 1.0), _per_row(5, 0.0), _per_row(5, 0.0))
    with pytest.raises(ValueError, match=r"logits must be fp32 \[rows, vocab\], got torch.float16"):
        apply_penalties(logits.half(), counts, in_prompt, *args)
    with pytest.raises(ValueError, match=r"counts \(7, 299\) and in_prompt \(7, 300\) must be \[slots, 300\]"):
        apply_penalties(logits, counts[:, 1:], in_prompt, *args)
