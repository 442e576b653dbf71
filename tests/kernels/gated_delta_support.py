"""Inputs and rollout helpers the gated delta rule's tests share (test_gated_delta_rule.py,
test_gated_delta_rollout.py)."""

import torch

from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout

def make_inputs(lengths, hk, hv, dk, dv, *, dtype=torch.float32, device="cpu", seed=0, initial=True):
    gen = torch.Generator().manual_seed(seed)
    t, b = sum(lengths), len(lengths)
    q, k = (torch.randn(t, hk, dk, generator=gen) for _ in range(2))
    v = torch.randn(t, hv, dv, generator=gen)
    g = -torch.rand(t, hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, hv, generator=gen) * 0.9 + 0.05
    state = torch.randn(b, hv, dk, dv, generator=gen) * 0.2 if initial else None
    cast = [x.to(dtype) for x in (q, k, v)] + [g, beta.to(dtype)]
    return [x.to(device) for x in cast], (None if state is None else state.to(device))


def cu(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def rollout_outputs(inputs, lengths, pieces, *, initial=None, device="cpu"):
    """Roll the sequences out in steps: ``pieces[s]`` lists how many tokens sequence ``s`` adds at
    each step (0: it pauses; all sequences share each step's launch, in an order that changes from
    step to step); returns the outputs in packed order and the rollout."""
    q, k, v, g, beta = inputs
    offsets = cu(lengths)
    hk, dk, hv, dv = k.shape[1], k.shape[2], v.shape[1], v.shape[2]
    roll = GatedDeltaRollout(len(lengths), (hk, hv), (dk, dv), device=device, initial_state=initial,
                             dtype=torch.float64 if k.dtype == torch.float64 else torch.float32)
    out = torch.zeros(k.shape[0], hv, dv, dtype=q.dtype, device=device)
    done = [0] * len(lengths)
    for step in range(max(len(p) for p in pieces)):
        slots = [s for s in range(len(lengths)) if step < len(pieces[s])]
        slots = slots[step % len(slots):] + slots[:step % len(slots)]  # vary the order
        slots = slots[::-1 if step % 2 else 1]
        counts = [pieces[s][step] for s in slots]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(slots, counts)])
        rows = rows.to(device)
        got = roll.step(*(x[rows] for x in (q, k, v, g, beta)), slots, counts)
        out[rows] = got
        for s, m in zip(slots, counts):
            done[s] += m
    assert done == list(lengths)
    return out, roll


def pieces_for(lengths):
    """Prefill pieces of several sizes (one token, odd and power-of-two sizes, a pause: 0), then
    one token at a time."""
    cuts = [[19, 0, 13, 16], [1, 31, 0], [7, 1, 40], [64]]
    out = []
    for s, n in enumerate(lengths):
        prefill = []
        for m in cuts[s % len(cuts)]:
            if sum(prefill) + m < n:
                prefill.append(m)
        out.append(prefill + [1] * (n - sum(prefill)))
    return out


QWEN35_HEADS = (16, 32, 128, 128)  # Qwen3.5-35B-A3B, Qwen3.5's default text config, Qwen3-Next-80B-A3B
