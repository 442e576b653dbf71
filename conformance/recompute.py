"""The conformance suite's recompute: every sampled token's logprob again from the training
variant, in every batch layout (packed, right- and left-padded, and as a training step with
autograd on), in forwards of bounded size, compared bitwise with what the rollout reported."""

from __future__ import annotations

import random

import torch

GRAD_SAMPLES = 8  # samples recomputed with autograd on, per scenario
GRAD_TOKENS = 16384  # ... and at most this many of their tokens (the first always), so long runs keep activations small


RECOMPUTE_TOKENS = 65536  # tokens of one recompute forward (a trainer's micro-batch; the rest wait their turn)


def recompute_groups(samples: list, budget: int = RECOMPUTE_TOKENS) -> list[range]:
    """Consecutive runs of (prompt, tokens) samples of at most `budget` tokens each (a sample
    longer than that alone): the recompute's forwards, so that a big model's recompute of a long
    rollout fits beside its engine. Batch invariance makes the split invisible in the bits."""
    groups, start, total = [], 0, 0
    for i, (prompt, tokens) in enumerate(samples):
        n = len(prompt) + len(tokens)
        if i > start and total + n > budget:
            groups.append(range(start, i))
            start, total = i, 0
        total += n
    if start < len(samples):
        groups.append(range(start, len(samples)))
    return groups


def grad_sample_count(samples: list) -> int:
    """How many leading (prompt, tokens) samples the autograd recompute takes: at most
    `GRAD_SAMPLES`, and no more than `GRAD_TOKENS` tokens in all, but always the first."""
    count, total = 0, 0
    for prompt, tokens in samples[:GRAD_SAMPLES]:
        total += len(prompt) + len(tokens)
        if count and total > GRAD_TOKENS:
            break
        count += 1
    return count


def _recompute(model, samples, temperatures, device, padding: str, rng: random.Random) -> list[torch.Tensor]:
    """Training-variant logprobs of each sample's output tokens, packed (shuffled) or padded;
    detached, so that a forward with autograd on keeps no graph (and no activations) alive."""
    order = list(range(len(samples)))
    rng.shuffle(order)
    seqs = [samples[i][0] + samples[i][1] for i in order]
    temps = torch.tensor([temperatures[i] for i in order], dtype=torch.float32)
    if padding == "packed":
        ids = torch.tensor([t for s in seqs for t in s], device=device)
        cu = torch.tensor([0] + list(torch.tensor([len(s) for s in seqs]).cumsum(0)), dtype=torch.int32)
        flat = model.token_logprobs(ids, cu_seqlens=cu.to(device), temperature=temps.to(device))
        per_seq = list(torch.split(flat.detach().cpu(), [len(s) for s in seqs]))
    else:
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            sl = slice(width - len(s), width) if padding == "left" else slice(0, len(s))
            ids[r, sl], mask[r, sl] = torch.tensor(s), 1
        lp = model.token_logprobs(ids.to(device), attention_mask=mask.to(device), temperature=temps.to(device)).detach().cpu()
        per_seq = [lp[r, width - len(s):] if padding == "left" else lp[r, :len(s)] for r, s in enumerate(seqs)]
    out = [None] * len(samples)
    for pos, i in enumerate(order):
        prompt_len = len(samples[i][0])
        out[i] = per_seq[pos][prompt_len:]
    return out


def recompute_and_compare(model, samples: list, reported: list, temps: list, device: torch.device,
                           rng: random.Random, budget: int = RECOMPUTE_TOKENS) -> tuple[int, float, int]:
    """(mismatching logprobs, their largest difference, logprobs checked) of the samples recomputed
    by the training forward in every batch layout, in forwards of at most `budget` tokens
    (`recompute_groups`; a longer sample alone). The last layout runs as a training step does,
    autograd on (separate q/k/v and gate/up GEMMs, the differentiable kernels), over a few samples
    to bound activation memory (`grad_sample_count`)."""
    mismatches, max_diff, tokens = 0, 0.0, 0
    for padding, grad in (("packed", False), ("right", False), ("left", False), ("packed", True)):
        count = grad_sample_count(samples) if grad else len(samples)
        recomputed = []
        with torch.set_grad_enabled(grad):
            for group in recompute_groups(samples[:count], budget):
                part = slice(group.start, group.stop)
                recomputed += _recompute(model, samples[part], temps[part], device, padding, rng)
        for got, want in zip(recomputed, reported[:count]):
            tokens += want.numel()
            if not torch.equal(got, want):
                mismatches += int((got != want).sum())
                max_diff = max(max_diff, float((got - want).abs().max()))
    return mismatches, max_diff, tokens
