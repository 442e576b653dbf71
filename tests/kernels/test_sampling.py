import pytest
import torch

from vexact_models.kernels import sample_tokens
from vexact_models.kernels.sampling import philox4x32_reference, philox_uniform_reference


@pytest.mark.parametrize("counter, key, words", [
    # Random123's kat_vectors for philox4x32 with 10 rounds: counter words, key words, output words
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
])
def test_philox_matches_known_answers(counter, key, words):
    out = philox4x32_reference(torch.tensor([counter[0]]), counter[1:], key)
    assert [int(w) for w in out[:, 0]] == list(words)


def test_each_column_takes_one_word_of_a_counter_shared_by_four():
    cols = torch.arange(12)
    words = philox4x32_reference(torch.arange(3), (5, 0, 0), (99, 0))  # [4, 3]: counters (n, step 5), key seed 99
    u = philox_uniform_reference(cols, 5, 99)
    want = (((words.t().reshape(-1) >> 8).to(torch.float32) + 0.5) / 16777216.0).clamp(max=1 - 2 ** -24)
    assert torch.equal(u, want)
    assert torch.equal(philox_uniform_reference(cols[5:9], 5, 99), u[5:9])  # a column's value is its own


def test_per_row_words_give_each_row_its_own_uniforms():
    """`step` and `seed` as ``[rows, 1]`` tensors (64-bit, negative seeds too): each row's uniforms
    are those of its ints."""
    cols, steps, seeds = torch.arange(37), [0, 5, 2 ** 40 + 3], [99, -12345, 2 ** 62 + 7]
    rows = philox_uniform_reference(cols, torch.tensor(steps)[:, None], torch.tensor(seeds)[:, None])
    assert rows.shape == (3, 37)
    for row, step, seed in zip(rows, steps, seeds):
        assert torch.equal(row, philox_uniform_reference(cols, step, seed))


def test_reference_sampler_rows_are_independent_of_how_many_are_scored_at_once(monkeypatch):
    """`sample_tokens_reference` scores rows `_SAMPLE_ELEMENTS` logits at a time; one row at a
    time, two, or all give the same tokens, and a row's token is the one it gets alone (greedy,
    sampled and threshold-filtered rows mixed)."""
    from vexact_models.kernels import sampling

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 301, generator=gen) * 3
    temps = torch.tensor([0.0, 0.7, 1.0, 1.3, 0.0, 0.5, 2.0])
    seeds, steps = torch.arange(7) * 7919 - 3, torch.arange(7) * 3
    thresholds = torch.tensor([float("-inf"), 0.5, float("-inf"), 1.0, 0.0, float("-inf"), 2.0])
    outs = []
    for elements in (1, 2 * 301, 1 << 20):
        monkeypatch.setattr(sampling, "_SAMPLE_ELEMENTS", elements)
        outs.append(sampling.sample_tokens_reference(logits, temps, seeds, steps, thresholds))
    assert all(torch.equal(out, outs[0]) for out in outs[1:])
    alone = [int(sampling.sample_tokens_reference(logits[i:i + 1], temps[i:i + 1], seeds[i:i + 1], steps[i:i + 1],
                                                  thresholds[i:i + 1])) for i in range(7)]
    assert outs[0].tolist() == alone
    assert outs[0][0] == logits[0].argmax() and all(logits[i, outs[0][i]] >= thresholds[i] for i in range(7))


def test_uniforms_are_in_open_interval_and_uniform():
    u = philox_uniform_reference(torch.arange(200_000), 3, 12345)
    assert float(u.min()) > 0 and float(u.max()) < 1
    assert abs(float(u.mean()) - 0.5) < 3e-3


#: (step, column) under seed 12345 whose word's top 24 bits are all ones (found by scanning steps
#: 0-399 of a 151,936-column row: 7 such steps), the interval whose centre rounds to 1.0 in fp32
TOP_BIN = [(114, 144783), (142, 56829), (164, 88750), (174, 60968), (209, 92712), (291, 134143), (377, 101877)]


def test_the_top_uniform_interval_stays_below_one():
    """u = 1.0 would give the column the noise -log(-log 1) = +inf: sampled whatever its logit
    (a masked one too: -inf + inf is NaN, which argmax takes)."""
    for step, col in TOP_BIN:
        word = philox4x32_reference(torch.tensor([col // 4]), (step, 0, 0), (12345, 0))[col % 4, 0]
        assert int(word) >> 8 == 0xFFFFFF
        u = philox_uniform_reference(torch.tensor([col]), step, 12345)
        assert float(u) == 1 - 2 ** -24


def test_no_token_outside_the_distribution_at_the_top_interval():
    """At the steps of `TOP_BIN`, a row whose mass is all on token 7 samples 7, and a row whose
    only finite logit is token 7 (a grammar's mask) samples 7, not the top interval's column."""
    vocab, steps = 151_936, torch.tensor([step for step, _ in TOP_BIN])
    peaked = torch.randn(len(TOP_BIN), vocab, generator=torch.Generator().manual_seed(0)) * 2
    peaked[:, 7] = 40.0
    masked = torch.full_like(peaked, float("-inf"))
    masked[:, 7] = -3.0
    for logits in (peaked, masked):
        out = sample_tokens(logits, torch.ones(len(TOP_BIN)), torch.full((len(TOP_BIN),), 12345), steps)
        assert out.tolist() == [7] * len(TOP_BIN)


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
