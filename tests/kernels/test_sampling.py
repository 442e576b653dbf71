import torch

from vexact_models.kernels import sample_tokens
from vexact_models.kernels.sampling import philox_uniform_reference


def test_philox_matches_known_answer():
    # Philox4x32-10 known-answer vector (Random123 kat_vectors): ctr=0, key=0 -> first word 0x6627e8d5
    u = philox_uniform_reference(torch.tensor([0]), 0, 0)
    assert float(u[0]) == ((0x6627E8D5 >> 8) + 0.5) / 16777216.0


def test_uniforms_are_in_open_interval_and_uniform():
    u = philox_uniform_reference(torch.arange(200_000), 3, 12345)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 3e-3


def test_greedy_takes_argmax_with_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    out = sample_tokens(logits, torch.zeros(2), torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    assert out.tolist() == [1, 0]


def test_sampling_depends_only_on_row_seed_and_step():
    logits = torch.randn(6, 50)
    temps = torch.full((6,), 0.9)
    seeds = torch.tensor([1, 2, 3, 1, 2, 3])
    steps = torch.tensor([0, 0, 0, 5, 5, 5])
    batch = sample_tokens(logits, temps, seeds, steps)
    for i in range(6):
        assert sample_tokens(logits[i:i + 1], temps[i:i + 1], seeds[i:i + 1], steps[i:i + 1])[0] == batch[i]


def test_sampling_follows_the_distribution_and_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(4000, 3).contiguous()
    steps = torch.arange(4000)
    tokens = sample_tokens(logits, torch.ones(4000), torch.full((4000,), 7), steps)
    freq = torch.bincount(tokens, minlength=3).double() / 4000
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64), atol=0.03)
    thr = torch.full((4000,), float(logits[0, 1]))  # keep only tokens 0 and 1
    kept = sample_tokens(logits, torch.ones(4000), torch.full((4000,), 7), steps, thr)
    assert set(kept.tolist()) == {0, 1}
