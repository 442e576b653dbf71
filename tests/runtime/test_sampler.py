"""Sampler (runtime/sampler.py) and filter_thresholds (kernels/sampling.py), on crafted logits.

The sampler's contract (docs/design.md rule 7): the token depends only on (logits row, seed, token
index) after min_tokens/top-k/top-p filtering, and the reported logprob is
``gather_logprobs(logits, token, T)`` on the UNFILTERED logits (T = 1 for greedy).
"""

import numpy as np
import pytest
import torch

from vexact_models.kernels import gather_logprobs
from vexact_models.kernels.sampling import filter_thresholds
from vexact_models.runtime.sampler import Sampler
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.sequence import Sequence

VOCAB = 64
EOS = 1
STOP = 7


def make_seq(params: SamplingParams, seed: int = 0, num_outputs: int = 0, request_id: int = 0) -> Sequence:
    """A sequence with ``num_outputs`` generated tokens (so its next token index is num_outputs)."""
    seq = Sequence(request_id, 0, [3, 4, 5], params, seed)
    for _ in range(num_outputs):
        seq.append_token(2, -1.0)
    return seq


def crafted_logits(rows: int, big: dict[int, float], seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, VOCAB, generator=gen)
    for tok, value in big.items():
        logits[:, tok] = value
    return logits


def expected_logprob(logits_row: torch.Tensor, token: int, temperature: float) -> float:
    t = temperature if temperature > 0 else 1.0
    return float(gather_logprobs(logits_row[None], torch.tensor([token]), t)[0])


# -- min_tokens, stop tokens, ignore_eos -----------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
@pytest.mark.parametrize("filters", [dict(), dict(top_k=3), dict(top_p=0.5), dict(top_k=2, top_p=0.9)])
def test_min_tokens_bans_eos_and_stop_tokens_until_reached(temperature, filters):
    sampler = Sampler(EOS)
    min_tokens = 3
    for banned, other in ((EOS, {}), (STOP, {"stop_token_ids": [STOP]})):
        # `banned` has by far the largest logit: without the ban it is always sampled.
        logits = crafted_logits(1, {banned: 60.0})
        params = SamplingParams(temperature=temperature, min_tokens=min_tokens, max_tokens=8, **other, **filters)
        for step in range(6):
            for seed in range(4):
                seq = make_seq(params, seed=seed, num_outputs=step)
                [token], [logprob] = sampler(logits, [seq])
                if step < min_tokens:
                    assert token != banned, (banned, step, seed)
                else:
                    assert token == banned, (banned, step, seed)
                # The logprob is from the unfiltered distribution, where `banned` holds almost all
                # the mass: a banned-step token gets a logprob near -(60 - its logit).
                assert logprob == expected_logprob(logits[0], token, temperature)
                if step < min_tokens:
                    assert logprob < -40


def test_min_tokens_ban_comes_before_top_k():
    """With EOS the largest and top_k=1, the kept candidate before min_tokens is the runner-up."""
    logits = crafted_logits(1, {EOS: 50.0, 9: 40.0, 10: 30.0})
    params = SamplingParams(temperature=1.0, top_k=1, min_tokens=1, max_tokens=4)
    for seed in range(8):
        [token], _ = Sampler(EOS)(logits, [make_seq(params, seed=seed)])
        assert token == 9
        [token], _ = Sampler(EOS)(logits, [make_seq(params, seed=seed, num_outputs=1)])
        assert token == EOS


def test_ignore_eos_lets_eos_be_sampled_but_still_bans_stop_tokens():
    sampler = Sampler(EOS)
    logits = crafted_logits(1, {EOS: 60.0, STOP: 50.0})
    params = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=8, ignore_eos=True, stop_token_ids=[STOP])
    # ignore_eos: EOS is an ordinary token, so min_tokens does not ban it.
    assert sampler(logits, [make_seq(params, num_outputs=0)])[0] == [EOS]
    # ... while the stop token stays banned before min_tokens
    logits = crafted_logits(1, {STOP: 60.0})
    assert sampler(logits, [make_seq(params, num_outputs=0)])[0] != [STOP]
    assert sampler(logits, [make_seq(params, num_outputs=2)])[0] == [STOP]
    # Without ignore_eos, EOS is banned before min_tokens.
    logits = crafted_logits(1, {EOS: 60.0})
    plain = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=8)
    assert sampler(logits, [make_seq(plain, num_outputs=1)])[0] != [EOS]
    assert sampler(logits, [make_seq(plain, num_outputs=2)])[0] == [EOS]


def test_no_eos_token_model():
    """A model without EOS: only stop_token_ids are banned, token 1 is an ordinary token."""
    logits = crafted_logits(1, {EOS: 60.0})
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=8)
    assert Sampler(None)(logits, [make_seq(params)])[0] == [EOS]


# -- filtering and the reported logprob -------------------------------------------------------------

def test_top_k_top_p_samples_stay_in_the_kept_set_and_logprob_is_unfiltered():
    logits = crafted_logits(1, {}, seed=3) * 3
    sampler = Sampler(EOS)
    order = torch.argsort(logits[0], descending=True).tolist()
    for params, allowed in ((SamplingParams(temperature=1.5, top_k=4), set(order[:4])),
                            (SamplingParams(temperature=1.5, top_k=1), {order[0]}),
                            (SamplingParams(temperature=0.8, top_k=6, top_p=1e-6), {order[0]})):
        seen = set()
        for step in range(60):
            [token], [logprob] = sampler(logits, [make_seq(params, seed=11, num_outputs=step)])
            assert token in allowed
            seen.add(token)
            assert logprob == expected_logprob(logits[0], token, params.temperature)
            filtered = logits.clone()
            filtered[0, [t for t in range(VOCAB) if t not in allowed]] = float("-inf")
            if len(allowed) < VOCAB:
                assert logprob < expected_logprob(filtered[0], token, params.temperature)
        if len(allowed) == 4:
            assert len(seen) > 1  # it does sample, not just take the argmax


def test_greedy_takes_argmax_and_reports_logprob_at_temperature_one():
    logits = crafted_logits(5, {}, seed=1) * 4
    seqs = [make_seq(SamplingParams(temperature=0.0, top_k=3, top_p=0.5), seed=s, request_id=s) for s in range(5)]
    tokens, logprobs = Sampler(EOS)(logits, seqs)
    assert tokens == logits.argmax(1).tolist()
    assert torch.equal(torch.tensor(logprobs), gather_logprobs(logits, torch.tensor(tokens), 1.0))
    assert all(isinstance(t, int) for t in tokens) and all(isinstance(x, float) for x in logprobs)


def test_sampled_token_depends_only_on_row_seed_and_index():
    """A row's (token, logprob) is the same alone or in any batch, in any order."""
    logits = crafted_logits(8, {}, seed=2) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.6, top_k=5), SamplingParams(temperature=1.3, top_p=0.8),
              SamplingParams(temperature=0.9, top_k=10, top_p=0.7, min_tokens=4, stop_token_ids=[STOP]),
              SamplingParams(temperature=1.0, ignore_eos=True), SamplingParams(temperature=2.0, top_p=0.3),
              SamplingParams(temperature=0.5, min_tokens=2)]
    seqs = [make_seq(p, seed=100 + i, num_outputs=i % 3, request_id=i) for i, p in enumerate(params)]
    sampler = Sampler(EOS)
    batch = sampler(logits, seqs)
    for i, seq in enumerate(seqs):
        alone = sampler(logits[i:i + 1], [seq])
        assert (alone[0][0], alone[1][0]) == (batch[0][i], batch[1][i])
    perm = [5, 2, 7, 0, 3, 6, 1, 4]
    shuffled = sampler(logits[perm], [seqs[i] for i in perm])
    assert shuffled[0] == [batch[0][i] for i in perm] and shuffled[1] == [batch[1][i] for i in perm]
    # the seed and the token index matter
    diff_seed = [sampler(logits[1:2], [make_seq(params[1], seed=s, num_outputs=1)])[0][0] for s in range(20)]
    diff_step = [sampler(logits[1:2], [make_seq(params[1], seed=101, num_outputs=k)])[0][0] for k in range(20)]
    assert len(set(diff_seed)) > 1 and len(set(diff_step)) > 1


def test_empty_batch():
    assert Sampler(EOS)(torch.zeros(0, VOCAB), []) == ([], [])


def test_parameters_reused_for_the_same_sequences_give_what_a_fresh_sampler_gives():
    """The sampler keeps the last list's per-row parameters (params and seeds are fixed per
    sequence) and re-reads only the token index: still exactly a fresh sampler's answer, also
    when called again without a new token, and when the list changes."""
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=5),
              SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[STOP]),
              SamplingParams(temperature=1e-60, top_p=0.5), SamplingParams(temperature=1.3, min_tokens=1)]
    seqs = [make_seq(p, seed=50 + i, request_id=i) for i, p in enumerate(params)]
    reused = Sampler(EOS)
    for step in range(8):
        logits = crafted_logits(len(seqs), {EOS: 4.0, STOP: 4.0}, seed=step) * 2
        kept = reused._rows
        got = reused(logits, list(seqs))  # a new list object with the same sequences
        assert got == Sampler(EOS)(logits, seqs), step
        if kept is not None and kept.seqs == seqs:
            assert reused._rows is kept
        if step % 3 != 1:  # some steps sample without appending: the index must be re-read
            for seq, token, logprob in zip(seqs, *got):
                seq.append_token(token, logprob)
        if step == 4:
            seqs = seqs[1:]


# -- filter_thresholds ----------------------------------------------------------------------------

def thresholds(logits, temps, top_k, top_p):
    return filter_thresholds(logits, torch.tensor(temps, dtype=torch.float32), torch.tensor(top_k),
                             torch.tensor(top_p, dtype=torch.float64))


def test_top_k_keeps_exactly_the_k_largest():
    logits = crafted_logits(6, {}, seed=4)
    ks = [1, 2, 5, 17, VOCAB, VOCAB + 10]
    thr = thresholds(logits, [1.0] * 6, ks, [1.0] * 6)
    for i, k in enumerate(ks):
        kept = (logits[i] >= thr[i]).nonzero().squeeze(1)
        assert set(kept.tolist()) == set(torch.topk(logits[i], min(k, VOCAB)).indices.tolist())
        assert float(thr[i]) == float(torch.sort(logits[i], descending=True).values[min(k, VOCAB) - 1])


def test_top_k_keeps_ties_at_the_kth_value():
    logits = torch.tensor([[0.5, 3.0, 2.0, 3.0, 2.0, 2.0, -1.0, 2.0]])
    for k, n_kept in ((1, 2), (2, 2), (3, 6), (4, 6), (6, 6), (7, 7)):
        thr = thresholds(logits, [1.0], [k], [1.0])
        assert int((logits[0] >= thr[0]).sum()) == n_kept, k


def float64_top_p_keep(row: torch.Tensor, temperature: float, top_k: int, top_p: float) -> int:
    """Number of tokens top-k then top-p keep, computed in float64."""
    x = row.double() / temperature
    if top_k > 0:
        kth = torch.sort(row, descending=True).values[min(top_k, row.numel()) - 1]
        x = torch.where(row >= kth, x, torch.tensor(float("-inf"), dtype=torch.float64))
    probs = torch.sort(torch.softmax(x, 0), descending=True).values
    cum = torch.cumsum(probs, 0)
    return int((cum < top_p).sum()) + 1  # the smallest prefix whose mass reaches top_p


def midpoint_top_p(row: torch.Tensor, temperature: float, top_k: int, keep: int) -> float:
    """A top_p halfway between the masses of the best keep-1 and keep tokens (far from rounding)."""
    x = row.double() / temperature
    if top_k > 0:
        kth = torch.sort(row, descending=True).values[top_k - 1]
        x = torch.where(row >= kth, x, torch.tensor(float("-inf"), dtype=torch.float64))
    cum = torch.cumsum(torch.sort(torch.softmax(x, 0), descending=True).values, 0)
    low = float(cum[keep - 2]) if keep > 1 else 0.0
    assert float(cum[keep - 1]) - low > 1e-4
    return (low + float(cum[keep - 1])) / 2


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k", [-1, 10])
def test_top_p_keeps_the_smallest_prefix_reaching_p(temperature, top_k):
    logits = crafted_logits(1, {}, seed=5) * 2
    row = logits[0]
    order = torch.sort(row, descending=True).values
    for keep in (1, 2, 3, 5, 8):
        p = midpoint_top_p(row, temperature, top_k, keep)
        assert float64_top_p_keep(row, temperature, top_k, p) == keep
        thr = thresholds(logits, [temperature], [top_k], [p])
        assert float(thr[0]) == float(order[keep - 1])
        assert int((row >= thr[0]).sum()) == keep
    # a top_p at or below the top token's mass keeps only the top token
    assert float(thresholds(logits, [temperature], [top_k], [1e-9])[0]) == float(order[0])
    # top_p = 1 with top-k: top-k alone decides
    thr = thresholds(logits, [temperature], [top_k], [1.0])
    assert float(thr[0]) == (float(order[top_k - 1]) if top_k > 0 else float("-inf"))


def test_top_p_on_random_rows_matches_float64():
    logits = crafted_logits(12, {}, seed=6) * 3
    temps = [0.3, 0.7, 1.0, 1.5] * 3
    top_k = [-1, 5, 20] * 4
    top_p = []
    for i in range(12):
        keep = 1 + i % 4
        k = top_k[i]
        top_p.append(midpoint_top_p(logits[i], temps[i], k, keep))
    thr = thresholds(logits, temps, top_k, top_p)
    for i in range(12):
        keep = float64_top_p_keep(logits[i], temps[i], top_k[i], top_p[i])
        assert keep == 1 + i % 4
        assert int((logits[i] >= thr[i]).sum()) == keep


def test_greedy_rows_and_disabled_filters_give_minus_infinity():
    logits = crafted_logits(5, {}, seed=7)
    thr = thresholds(logits, [0.0, 0.0, 1.0, 1.0, 0.8], [5, -1, -1, 0, 3], [0.5, 0.1, 1.0, 1.0, 1.0])
    assert thr[:4].tolist() == [float("-inf")] * 4
    assert float(thr[4]) == float(torch.sort(logits[4], descending=True).values[2])
    assert thr.dtype == torch.float32 and thr.shape == (5,)
    none = thresholds(logits[:2], [1.0, 0.0], [-1, 4], [1.0, 0.2])
    assert none.tolist() == [float("-inf")] * 2


def test_thresholds_are_per_row_independent():
    logits = crafted_logits(9, {}, seed=8) * 2.5
    temps = [1.0, 0.0, 0.7, 1.3, 0.9, 2.0, 0.5, 1.0, 1.1]
    top_k = [5, 3, -1, 12, 40, -1, 1, -1, 7]
    top_p = [1.0, 0.5, 0.8, 0.95, 0.6, 0.35, 0.9, 1.0, 0.75]
    batch = thresholds(logits, temps, top_k, top_p)
    for i in range(9):
        alone = thresholds(logits[i:i + 1], temps[i:i + 1], top_k[i:i + 1], top_p[i:i + 1])
        assert torch.equal(alone[0], batch[i]), i
    perm = [8, 3, 0, 5, 1, 7, 2, 6, 4]
    shuffled = thresholds(logits[perm], [temps[i] for i in perm], [top_k[i] for i in perm], [top_p[i] for i in perm])
    assert torch.equal(shuffled, batch[perm])


def test_filter_thresholds_with_the_filtering_rows_given_equal_those_found_on_the_device():
    from vexact_models.runtime.sampler import filtering_rows

    logits = crafted_logits(6, {}, seed=9)
    temps, top_k, top_p = [1.0, 0.0, 0.7, 1.2, 0.9, 1.0], [0, 5, 3, 0, 0, 0], [0.9, 0.5, 1.0, 1.0, 0.8, 1.0]
    with np.errstate(divide="ignore"):
        log_min_p = np.log(np.array([0.0, 0.3, 0.0, 0.0, 0.0, 0.2])).astype(np.float32)
    rows = filtering_rows(np.array(temps, np.float32), np.array(top_k), np.array(top_p), log_min_p)
    assert rows.tolist() == [0, 2, 4, 5]  # greedy row 1 and unfiltered row 3 are left out
    args = (logits, torch.tensor(temps, dtype=torch.float32), torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64))
    assert torch.equal(filter_thresholds(*args, torch.from_numpy(rows), torch.from_numpy(log_min_p)),
                       filter_thresholds(*args, None, torch.from_numpy(log_min_p)))


def test_min_p_keeps_the_tokens_at_least_min_p_times_as_probable_as_the_best():
    """min-p: the kept set is ``{p >= min_p * p_max}`` under ``softmax(x / T)`` (float64, away
    from the boundary); then top-k and top-p act on what it kept; off (-inf) changes nothing."""
    logits = crafted_logits(8, {}, seed=12)
    temps = [1.0, 0.7, 1.5, 1.0, 1.0, 0.8, 1.2, 1.0]
    min_p = [0.05, 0.1, 0.3, 0.5, 0.02, 0.1, 0.1, 0.0]
    top_k, top_p = [0, 0, 0, 0, 3, 0, 0, 4], [1.0, 1.0, 1.0, 1.0, 1.0, 0.6, 1.0, 1.0]
    log_min_p = torch.log(torch.tensor(min_p, dtype=torch.float64)).float()
    thr = filter_thresholds(logits, torch.tensor(temps), torch.tensor(top_k), torch.tensor(top_p, dtype=torch.float64),
                            None, log_min_p)
    for i in range(8):
        p = torch.softmax(logits[i].double() / temps[i], 0)
        by_min_p = p >= min_p[i] * p.max()
        kept = logits[i] >= thr[i]
        if top_k[i] == 0 and top_p[i] == 1.0:
            margin = (p / p.max() - min_p[i]).abs() > 1e-6
            assert torch.equal(kept[margin], by_min_p[margin]), i
        else:
            assert bool((kept <= by_min_p).all()) and int(kept.sum()) <= (top_k[i] or VOCAB), i
    base = thresholds(logits, temps, top_k, top_p)
    assert float(thr[7]) == float(base[7])  # min_p 0: top-k alone
    assert float(thr[4]) == float(base[4])  # min_p 0.02 keeps more than top-k's 3 here
    for i in range(8):  # a row alone: the batch's bits
        alone = filter_thresholds(logits[i:i + 1], torch.tensor(temps[i:i + 1]), torch.tensor(top_k[i:i + 1]),
                                  torch.tensor(top_p[i:i + 1], dtype=torch.float64), None, log_min_p[i:i + 1])
        assert torch.equal(alone[0], thr[i]), i
