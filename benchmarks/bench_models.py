"""The models the benchmark scripts build and the check of their rollouts: a published (or
tiny) config's model with random weights (`build_published`), and every rolled-out token's logprob
recomputed by the training forward (`recompute_mismatches`)."""

from __future__ import annotations

import torch


def packed(seqs: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, total]`` ids and per-sequence positions of `seqs` back to back."""
    ids = torch.tensor([[t for s in seqs for t in s]], device=device)
    pos = torch.tensor([[i for s in seqs for i in range(len(s))]], device=device)
    return ids, pos


def recompute_mismatches(trainer, samples, recompute_tokens: int, device) -> tuple[int, int, float]:
    """(tokens checked, mismatches, max |diff|) of `trainer.token_logprobs` against the rollout's
    logprobs for ``(prompt, completion, logprobs)`` `samples`, packed into micro-batches of about
    `recompute_tokens` tokens. Under FSDP every rank must pass the same samples (the sharded
    forward is a collective)."""
    checked = bad = 0
    worst = 0.0
    batch, size = [], 0
    for k, sample in enumerate(samples):
        batch.append(sample)
        size += len(sample[0]) + len(sample[1])
        if size < recompute_tokens and k + 1 < len(samples):
            continue
        ids, pos = packed([p + c for p, c, _ in batch], device)
        with torch.no_grad():
            lp = trainer.token_logprobs(ids, position_ids=pos)[0].cpu()
        start = 0
        for p, c, want in batch:
            got, want = lp[start + len(p):start + len(p) + len(c)], torch.tensor(want)
            checked += len(c)
            bad += int((got != want).sum())
            worst = max(worst, float((got - want).abs().max()) if len(c) else 0.0)
            start += len(p) + len(c)
        batch, size = [], 0
    return checked, bad, worst


def build_published(args, max_positions: int | None = None):
    """(architecture, config, model) of a benchmark's ``--config`` (``--layers``; ``--tiny``: the
    architecture's tiny config), random weights on ``args.device`` in ``args.dtype``;
    `max_positions` raises the published config's ``max_position_embeddings`` (not the tiny one's)."""
    from vexact_models.conformance.models import architecture_of, build_model, make_config

    arch = architecture_of(args.config)
    config = make_config(arch, None if args.tiny else args.config, args.layers, None if args.tiny else max_positions)
    return arch, config, build_model(arch, config, args.device, args.dtype, args.seed)
