"""A rollout step of the gated delta rule from a fixed-shape plan (`kernels.gated_delta_step`, what
a CUDA graph replays) on the Triton kernels: padded plans (rows launches whose padding programs
exit at once, runs of length 0, copies to the padding state), its dry run, pieces of prompts across
several chunks and decode tokens, bitwise the Triton training forward. Under TRITON_INTERPRET=1
on CPU and on a GPU (docs/design.md section 6b)."""

import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.gated_delta_rule import gated_delta_rule  # noqa: E402
from vexact_models.kernels.gated_delta_step import StepPlan, dry_run, gated_delta_step, plan_step  # noqa: E402

HK, HV, DK, DV = 1, 2, 16, 16


@pytest.mark.parametrize("chunk", [16] if INTERPRET else [16, 64])
def test_triton_padded_steps_equal_training_bitwise(chunk):
    """Three sequences in slots 3, 0, 1 of a pool of 4: pieces on and off chunk boundaries, one
    spanning three chunks (a fold run past chunk 0, rows from the scratch), decode tokens, pauses;
    each step's plan at a capacity past its sizes (NaN in the padding tokens), its dry run first."""
    c = chunk
    pieces = [[5, 2 * c + 7, 1, 1], [c, 0, 1, c - 1], [c - 1, 1, 0, 1]]
    lengths = [sum(p) for p in pieces]
    slots = [3, 0, 1]
    gen = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k = (torch.randn(t, HK, DK, generator=gen) for _ in range(2))
    v = torch.randn(t, HV, DV, generator=gen)
    g = -torch.rand(t, HV, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, HV, generator=gen) * 0.9 + 0.05
    rows_all = [x.to(DEVICE) for x in (q, k, v, g, beta)]
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    with use_backend("triton"):
        want, _ = gated_delta_rule(*rows_all, offsets.tolist(), chunk_size=c)
        pool_rows = (torch.zeros(4 * c + 1, HK, DK, device=DEVICE), torch.zeros(4 * c + 1, HV, DV, device=DEVICE),
                     torch.zeros(4 * c + 1, HV, device=DEVICE), torch.zeros(4 * c + 1, HV, device=DEVICE))
        pool_states = torch.full((5, HV, DK, DV), float("nan"), device=DEVICE)  # never read before written
        pool_t = torch.full((4 * c, HV, c), float("nan"), device=DEVICE)
        got = torch.zeros_like(want)
        done = [0, 0, 0]
        for step in range(4):
            order = [s for s in (2, 0, 1) if pieces[s][step]]
            counts = [pieces[s][step] for s in order]
            index = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(order, counts)])
            n = len(index)
            plan = plan_step([slots[s] for s in order], [done[s] for s in order], counts, c, 4, n + 3, len(order) + 2)
            max_q = 1 << (max(counts) - 1).bit_length()
            pad = [torch.cat([x[index.to(DEVICE)], torch.full((3, *x.shape[1:]), float("nan"), device=DEVICE)])
                   for x in rows_all]
            for arrays in (dry_run(plan, c, 4), plan):
                staged = {name: torch.from_numpy(a).to(DEVICE) for name, a in arrays.items()}
                out = gated_delta_step(*pad, pool_rows, pool_states, StepPlan(staged, c, max_q), pool_t=pool_t)
            got[index.to(DEVICE)] = out[:n]
            for s, m in zip(order, counts):
                done[s] += m
    assert done == lengths
    assert torch.equal(got, want)
