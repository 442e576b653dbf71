"""The Gumbel-max sampler's Triton kernels vs the CPU reference, and its block filter vs the
unfiltered kernel; see check_triton_kernels."""

import math
import sys
from pathlib import Path

import pytest
import torch

# pytest's importlib mode does not put this folder on sys.path; importing the shared helpers
# also applies their skip rule (conftest.py patches the interpreter's tl.dot)
sys.path.insert(0, str(Path(__file__).parent))
from check_triton_kernels import DEVICE, rand, ref

from vexact_models.kernels import sample_tokens


def test_sampling_matches_reference():
    logits = rand(16, 3000) * 2
    temps = torch.tensor([0.0, 0.5, 1.0, 1.5] * 4, device=DEVICE)
    seeds = (torch.arange(16) * 1_000_003 + (1 << 40)).to(DEVICE)
    steps = (torch.arange(16) * 7).to(DEVICE)
    thr = torch.where(torch.arange(16) % 3 == 0, torch.tensor(1.0), torch.tensor(float("-inf"))).to(DEVICE)
    got = sample_tokens(logits, temps, seeds, steps, thr)
    want = ref(sample_tokens, logits, temps, seeds, steps, thr)
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunk_blocks", [4, 8, 32])
def test_sampling_over_row_chunks_keeps_the_token(monkeypatch, chunk_blocks):
    """A row split over programs of `chunk_blocks` blocks of 512 (3, 2 and 1 chunks of a
    5,000-column row) picks the reference token; greedy ties across chunks take the first column."""
    from vexact_models.kernels import sampling

    monkeypatch.setattr(sampling, "_CHUNK_BLOCKS", chunk_blocks)
    logits = rand(12, 5000) * 2
    logits[0, 100] = logits[0, 4500] = logits[0, 2100] = 50.0  # a tie over three chunks (chunk_blocks 4)
    logits[1, 4999] = 50.0  # the last column, in a partial block
    temps = torch.tensor([0.0, 0.0] + [0.7, 1.0, 0.0, 1.3] * 2 + [1.0, 0.5], device=DEVICE)
    seeds = (torch.arange(12) * 999_983 + 17).to(DEVICE)
    steps = (torch.arange(12) * 3 + 1).to(DEVICE)
    thr = torch.where(torch.arange(12) % 4 == 3, torch.tensor(0.5), torch.tensor(float("-inf"))).to(DEVICE)
    got = sample_tokens(logits, temps, seeds, steps, thr)
    assert got[0] == 100 and got[1] == 4999
    assert torch.equal(got, ref(sample_tokens, logits, temps, seeds, steps, thr))


@pytest.mark.parametrize("filter_blocks", [True, False])
def test_no_token_outside_the_distribution_at_the_top_interval(filter_blocks):
    """At the (step, column) pairs whose uniform lies in the top interval (its centre rounds to
    1.0 in fp32, `tests/kernels/test_sampling.py::TOP_BIN`), the kernel samples the row's only
    likely token (or a mask's only finite one), as the reference does, with the block filter and
    without: never the top interval's column."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "kernels"))
    from test_sampling import TOP_BIN

    from vexact_models.kernels.sampling import sample_tokens_triton

    vocab = 65_536  # (the two pairs below it: the interpreter's time in CI)
    steps = torch.tensor([step for step, col in TOP_BIN if col < vocab], device=DEVICE)
    rows = len(steps)
    peaked = rand(rows, vocab) * 2
    peaked[:, 7] = 40.0
    masked = torch.full_like(peaked, float("-inf"))
    masked[:, 7] = -3.0
    for logits in (peaked, masked):
        args = (logits, torch.ones(rows, device=DEVICE), torch.full((rows,), 12345, device=DEVICE), steps,
                torch.full((rows,), float("-inf"), device=DEVICE))
        got = sample_tokens_triton(*args, filter_blocks=filter_blocks)
        assert got.tolist() == [7] * rows
        assert torch.equal(got, ref(sample_tokens, *args))


def _score(x: float, u: float, temperature: float) -> float:
    """The reference's fp32 score of one column (`sampling.sample_tokens_reference`)."""
    from vexact_models.kernels import exact_math

    x32 = torch.tensor([x], dtype=torch.float32)
    if temperature == 0:
        return float(x32[0])
    noise = exact_math.log(-exact_math.log(torch.tensor([u], dtype=torch.float32)))
    return float((x32 / temperature - noise)[0])


def _planted_logit(target: float, u: float, temperature: float, above: bool) -> float | None:
    """A logit whose column scores exactly `target` (``above``: the smallest score above it),
    found by walking float steps from the real-valued solution; None if the float grid skips it."""
    x = torch.tensor(target if temperature == 0 else (target + math.log(-math.log(u))) * temperature)
    for _ in range(400):
        got = _score(float(x), u, temperature)
        if got == target and not above:
            return float(x)
        down = got > target
        nxt = torch.nextafter(x, torch.tensor(float("-inf") if down else float("inf")))
        if above and down and _score(float(nxt), u, temperature) <= target:
            return float(x)  # x scores above the target, the next step down does not
        x = nxt
    return None


@pytest.mark.parametrize("temperature", [0.0, 0.6, 1.0])
def test_sampling_block_filter_keeps_every_token(temperature):
    """The block filter (`sampling._may_beat`) skips exact scores only where no column can beat
    the running best: language-model-shaped rows (most blocks skippable) give the unfiltered
    kernel's and the reference's tokens, at every block width; so do rows where a column two
    blocks on ties the first block's best (in the reference's arithmetic: the kernel's logarithm
    may round it an ulp apart, so these rows compare with the unfiltered kernel only) or passes
    it by the least a logit can. A filter that dropped such a block would pick another token."""
    from vexact_models.kernels.sampling import philox_uniform_reference, sample_tokens_triton

    vocab, rows = 4608, 4
    gen = torch.Generator().manual_seed(int(temperature * 10))
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    logits = (-1.2 * ranks.log() + 0.3 * torch.randn(rows, vocab, generator=gen))
    logits = logits.gather(1, torch.argsort(torch.rand(rows, vocab, generator=gen), dim=1))
    seeds, steps = torch.arange(rows) * 31 + 3, torch.full((rows,), 9)
    for r, above in ((0, False), (1, True), (2, True)):
        logits[r, 2048:] -= 40.0  # nothing after the first block competes but the planted column
        u = philox_uniform_reference(torch.arange(vocab), int(steps[r]), int(seeds[r]))
        first = [_score(float(logits[r, j]), float(u[j]), temperature) for j in range(2048)]
        best = max(first)
        for col in range(4100, 4200):  # a column where the float grid reaches the score asked for
            x = _planted_logit(best, float(u[col]), temperature, above)
            if x is not None:
                break
        assert x is not None
        logits[r, col] = x
        score = _score(x, float(u[col]), temperature)
        assert score > best if above else score == best
    temps = torch.full((rows,), temperature)
    args = (logits.to(DEVICE), temps.to(DEVICE), seeds.to(DEVICE), steps.to(DEVICE),
            torch.full((rows,), float("-inf"), device=DEVICE))
    want = sample_tokens_triton(*args, filter_blocks=False)
    assert torch.equal(want.cpu()[3:], ref(sample_tokens, *args).cpu()[3:])
    for block in (2048, 256):
        assert torch.equal(sample_tokens_triton(*args, block_v=block), want), block


@pytest.mark.parametrize("block_v", [8, 384, 32768])
def test_sampling_rejects_block_widths_that_do_not_tile_a_program(block_v):
    from vexact_models.kernels.sampling import sample_tokens_triton

    rows = torch.zeros(2, device=DEVICE)
    with pytest.raises(ValueError, match=f"block_v={block_v} must be a power of two >= 16 dividing the 16384"):
        sample_tokens_triton(rand(2, 100), rows, rows.long(), rows.long(), rows - float("inf"), block_v=block_v)
