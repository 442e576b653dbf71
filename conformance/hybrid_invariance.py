"""Invariance of the gated-DeltaNet hybrids' own ops (Qwen3.5, Qwen3-Next), part of
`kernel_invariance` (``--only hybrid``), and the rollout simulation its CPU tests share.

- causal_conv1d: every token's output of a rollout, sequences cut into random pieces (prompt
  chunks, single decode tokens) run in steps of varied batches with per-sequence conv states in
  shuffled slots and padding sequences, equals the packed training forward bitwise; each sequence
  alone equals it in the batch.
- gated_rms_norm, sigmoid_gate, zero-centred rms_norm (and add_rms_norm): rows alone == rows in
  batches (rules 3, 5).
- gated_delta_gates: rows alone == rows in batches (rule 5), read from a fused projection's
  columns as the rollout's GEMM group leaves them; every element == the CPU reference's bits.
- partial rotary (rotary over the first quarter of head dim 256): rows alone == in batches; the
  rollout's fused `rotary_cache_write` at Qwen3.5's heads (zero-centred norms) == the separate ops.

The attention at head dim 256 is in `attention_invariance` (its ``qwen3.5`` shapes).
"""

from __future__ import annotations

import random

import torch

from vexact_models.kernels import (add_rms_norm, apply_rotary, causal_conv1d, conv_state_update, gated_rms_norm, rms_norm,
                                   rope_table, sigmoid_gate)
from vexact_models.kernels.causal_conv1d import conv_state_update_reference
from vexact_models.kernels.gated_delta_gates import gated_delta_gates, gated_delta_gates_reference


def random_steps(lens: list[int], rng: random.Random, max_piece: int = 9) -> list[list[tuple[int, int]]]:
    """A rollout's schedule of `lens`' sequences: steps of ``(sequence, tokens)`` pieces, each step
    a random subset of the unfinished sequences in random order, each taking 1..`max_piece` tokens
    (one, a decode step, half the time)."""
    done = [0] * len(lens)
    steps = []
    while any(d < n for d, n in zip(done, lens)):
        live = [s for s, (d, n) in enumerate(zip(done, lens)) if d < n]
        rng.shuffle(live)
        step = []
        for s in live[:rng.randint(1, len(live))]:
            take = min(lens[s] - done[s], 1 if rng.random() < 0.5 else rng.randint(1, max_piece))
            step.append((s, take))
            done[s] += take
        steps.append(step)
    return steps


def conv_by_steps(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, lens: list[int],
                  steps: list[list[tuple[int, int]]], activation: str | None = "silu",
                  padding: bool = True) -> torch.Tensor:
    """`kernels.causal_conv1d` of the packed sequences `x` (``lens`` tokens each, back to back) run
    as a rollout by `steps` (`random_steps`): each step one launch over its pieces, with a conv
    state per sequence in a shuffled slot of a larger pool, a padding sequence (slot -1) and a
    padding token when `padding`; the outputs in `x`'s packed order."""

    k = weight.shape[1]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    slots = torch.randperm(2 * len(lens) + 1, generator=torch.Generator().manual_seed(len(lens)))[:len(lens)]
    state = torch.full((2 * len(lens) + 1, k - 1, x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    done = [0] * len(lens)
    out = torch.full_like(x, float("nan"))
    for step in steps:
        rows, cu, ctx, idx = [], [0], [], []
        for s, n in step:
            rows.append(torch.arange(starts[s] + done[s], starts[s] + done[s] + n))
            cu.append(cu[-1] + n)
            ctx.append(done[s])
            idx.append(int(slots[s]))
        if padding:  # an empty padding sequence and a token that belongs to no sequence
            cu.append(cu[-1])
            ctx.append(0)
            idx.append(-1)
        rows_t = torch.cat(rows).to(x.device)
        chunk = torch.cat([x[rows_t], x[:1]]) if padding else x[rows_t]
        as_i32 = dict(dtype=torch.int32, device=x.device)
        y = causal_conv1d(chunk, weight, bias, torch.tensor(cu, **as_i32), max(n for _, n in step), activation,
                          conv_state=state, state_indices=torch.tensor(idx, **as_i32),
                          context_lens=torch.tensor(ctx, **as_i32))
        out[rows_t] = y[:rows_t.numel()]
        for s, n in step:
            done[s] += n
    return out


def packed_cu(lens: list[int], device) -> torch.Tensor:
    """int32 ``cu_seqlens`` of sequences of `lens` tokens back to back."""
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def check_causal_conv1d(result, quick: bool) -> None:
    """Qwen3.5's convolution (8,192 channels: q, k and v of 16 key and 32 value heads of 128, kernel
    4) in bf16: the packed training forward of sequences of 1 to 4,096 tokens against a rollout of
    them in random pieces and steps (`conv_by_steps`), and each sequence alone, with and without a
    bias; the state update bitwise its reference."""

    channels = 8192
    lens = [1, 3, 64, 257, 1000] + ([] if quick else [4096, 2049])
    x = torch.randn(sum(lens), channels, device="cuda").bfloat16()
    w = (torch.randn(channels, 4, device="cuda") / 2).bfloat16()
    b = torch.randn(channels, device="cuda").bfloat16()
    cu = packed_cu(lens, "cuda")
    for bias in (None, b):
        label = "bias" if bias is not None else "no bias"
        train = causal_conv1d(x, w, bias, cu, max(lens))
        for seed in range(1 if quick else 3):
            steps = random_steps(lens, random.Random(seed), max_piece=700)
            result.compare(conv_by_steps(x, w, bias, lens, steps), train, f"causal_conv1d {label}: rollout {seed}")
        start = 0
        for n in lens:
            alone = causal_conv1d(x[start:start + n], w, bias, packed_cu([n], "cuda"), n)
            result.compare(alone, train[start:start + n], f"causal_conv1d {label}: a sequence of {n} alone")
            start += n
    state = torch.randn(9, 3, channels, device="cuda").bfloat16()
    idx = torch.tensor([3, 0, -1, 8, 5], dtype=torch.int32, device="cuda")
    ctx = torch.tensor([0, 1, 4, 2, 100], dtype=torch.int32, device="cuda")
    step_cu = packed_cu([1, 2, 1, 700, 1], "cuda")
    want = state.cpu()
    conv_state_update_reference(x[:705].cpu(), step_cu.cpu(), want, idx.cpu(), ctx.cpu())
    conv_state_update(x[:705], step_cu, state, idx, ctx)
    result.compare(state.cpu(), want, "conv_state_update == its reference")


def row_counts(quick: bool) -> list[int]:
    """The batch sizes (rows) of the row checks: 1 .. 4,096 (1,024 with `quick`)."""
    return [m for m in (1, 2, 3, 7, 16, 64, 127, 512, 1000, 4096) if m <= (1024 if quick else 4096)]


def rows_alone(result, fn, inputs: list[torch.Tensor], label: str, quick: bool) -> None:
    """``fn(*inputs)`` over the first M rows (`row_counts`) equals each row computed alone."""
    ms = row_counts(quick)
    single = torch.cat([fn(*(t[i:i + 1] for t in inputs)) for i in range(max(ms))])
    for m in ms:
        result.compare(fn(*(t[:m] for t in inputs)), single[:m], f"{label} M={m}")


def check_gated_rms_norm(result, quick: bool) -> None:
    """The gated-DeltaNet's output norm at its rows (32 value heads of 128 a token), bf16."""

    m = max(row_counts(quick))
    x, z = torch.randn(m, 32, 128, device="cuda").bfloat16(), (torch.randn(m, 32, 128, device="cuda") * 3).bfloat16()
    w = (torch.rand(128, device="cuda") + 0.5).bfloat16()
    rows_alone(result, lambda a, b: gated_rms_norm(a, b, w, 1e-6), [x, z], "gated_rms_norm 32 x 128", quick)


def check_zero_centred_rms_norm(result, quick: bool) -> None:
    """Qwen3-Next's and Qwen3.5's ``(1 + weight)`` norm: hidden rows of 2,048 and 4,096 (with the
    residual add) and per-head q/k rows of 256, bf16; add + norm == the add, then the norm."""

    m = max(row_counts(quick))
    for n in (256, 2048, 4096):
        x, r = torch.randn(m, n, device="cuda").bfloat16(), torch.randn(m, n, device="cuda").bfloat16()
        w = (torch.randn(n, device="cuda") / 4).bfloat16()
        rows_alone(result, lambda a: rms_norm(a, w, 1e-6, zero_centred=True), [x], f"rms_norm zero-centred N={n}", quick)
        rows_alone(result, lambda a, b: add_rms_norm(a, b, w, 1e-6, zero_centred=True)[0], [x, r],
                   f"add_rms_norm zero-centred N={n}", quick)
        result.compare(add_rms_norm(x, r, w, 1e-6, zero_centred=True)[0], rms_norm(x + r, w, 1e-6, zero_centred=True),
                       f"zero-centred add+norm == add, then norm N={n}")
    heads = torch.randn(m, 20, 256, device="cuda").bfloat16()[:, 2:18]  # q heads of a fused projection: a view
    w = (torch.randn(256, device="cuda") / 4).bfloat16()
    rows_alone(result, lambda a: rms_norm(a, w, 1e-6, zero_centred=True), [heads], "q norm zero-centred 16 x 256", quick)


def check_sigmoid_gate(result, quick: bool) -> None:
    """The gated attention's output gate (16 heads of 256, the gate a strided view of the q_proj
    output) and the shared expert's (one gate value per 2,048-wide row), bf16."""

    m = max(row_counts(quick))
    q_proj = (torch.randn(m, 16, 512, device="cuda") * 3).bfloat16()
    x = torch.randn(m, 16, 256, device="cuda").bfloat16()
    rows_alone(result, sigmoid_gate, [x, q_proj[..., 256:]], "sigmoid_gate attention 16 x 256", quick)
    h, g = torch.randn(m, 2048, device="cuda").bfloat16(), torch.randn(m, 1, device="cuda").bfloat16()
    rows_alone(result, sigmoid_gate, [h, g], "sigmoid_gate shared expert 2048", quick)


def check_gated_delta_gates(result, quick: bool) -> None:
    """The gated DeltaNet's g and beta at Qwen3.5's 32 value heads, bf16 projections as columns of
    the layer's fused projection output (``in_proj_b``, ``in_proj_a`` after qkv and z): rows
    alone == in batches, and the GPU's bits == the CPU reference's (the kernel repeats its float64
    operations)."""

    m = max(row_counts(quick))
    fused = (torch.randn(m, 128, device="cuda") * torch.logspace(-3, 1.5, m, device="cuda")[:, None]).bfloat16()
    b, a = fused[:, 32:64], fused[:, 64:96]
    a_log = torch.rand(32, device="cuda") * 4 - 1
    dt_bias = torch.randn(32, device="cuda").bfloat16()
    for i, name in enumerate(("g", "beta")):
        rows_alone(result, lambda x, y: gated_delta_gates(x, y, a_log, dt_bias)[i], [a, b],
                   f"gated_delta_gates {name} 32 heads", quick)
    g, beta = gated_delta_gates(a, b, a_log, dt_bias)
    want_g, want_beta = gated_delta_gates_reference(a.cpu(), b.cpu(), a_log.cpu(), dt_bias.cpu())
    result.compare(g, want_g.cuda(), "gated_delta_gates g == CPU reference")
    result.compare(beta, want_beta.cuda(), "gated_delta_gates beta == CPU reference")


def check_partial_rotary(result, quick: bool) -> None:
    """Partial rotary (the first 64 of 256 dims, Qwen3.5's 16 query heads) rows alone == in batches.
    (The rollout's fused q/k norm + rotation + cache write at Qwen3.5's heads is
    `kernel_invariance.check_rotary_cache_write`'s, run in this group.)"""

    m, d = max(row_counts(quick)), 256
    cos, sin = (t.cuda() for t in rope_table(1.0 / (1e4 ** (torch.arange(0, 64, 2) / 64)), 32768))
    pos = torch.randint(0, 32768, (m,), device="cuda")
    q = torch.randn(m, 16, d, device="cuda").bfloat16()
    rows_alone(result, lambda a, p: apply_rotary(a, p, cos, sin), [q, pos], "partial rotary 16 x 256 (64 rotated)", quick)


HYBRID_CHECKS = ("causal_conv1d", "gated_rms_norm", "rms_norm zero-centred", "sigmoid_gate", "gated_delta_gates",
                 "partial rotary")


def run_hybrid(results: dict, quick: bool) -> None:
    """Every check of this module into ``results[name]`` (`kernel_invariance.Result`s named by
    `HYBRID_CHECKS`)."""
    check_causal_conv1d(results["causal_conv1d"], quick)
    check_gated_rms_norm(results["gated_rms_norm"], quick)
    check_zero_centred_rms_norm(results["rms_norm zero-centred"], quick)
    check_sigmoid_gate(results["sigmoid_gate"], quick)
    check_gated_delta_gates(results["gated_delta_gates"], quick)
    check_partial_rotary(results["partial rotary"], quick)
