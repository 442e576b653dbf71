"""The decode launch (`kernels.gated_delta_decode`): row ``i`` of a chunk from the rows of ``T`` kept by
earlier launches, bitwise the rows launch's row and ``T`` row, and its fold at the chunk's last row
bitwise the fold launch's state; on the Triton kernels under TRITON_INTERPRET=1 on CPU and on a GPU
(docs/design.md section 6b, "Decode cost"). The engine's steps through it: check_gated_delta_step.py."""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.gated_delta_decode import DecodePlan, launch_decode  # noqa: E402
from vexact_models.kernels.gated_delta_launch import RowsPlan, Shapes, launch_fold, launch_rows  # noqa: E402
from vexact_models.kernels.gated_delta_launch import FoldPlan  # noqa: E402

SHAPES = [(1, 2, 16, 16, 16), (1, 2, 16, 16, 32)] if INTERPRET else [(1, 2, 16, 16, 16), (16, 32, 128, 128, 64),
                                                                     (4, 4, 128, 128, 64)]


def chunk_inputs(shapes: Shapes, chunk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    q, k = (torch.randn(chunk, shapes.hk, shapes.dk, generator=gen).to(DEVICE, dtype) for _ in range(2))
    v = torch.randn(chunk, shapes.hv, shapes.dv, generator=gen).to(DEVICE, dtype)
    g = (-torch.rand(chunk, shapes.hv, generator=gen) * 0.6 - 0.01).to(DEVICE)
    beta = (torch.rand(chunk, shapes.hv, generator=gen) * 0.9 + 0.05).to(DEVICE, dtype)
    state = (torch.randn(1, shapes.hv, shapes.dk, shapes.dv, generator=gen) * 0.2).to(DEVICE)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("hk,hv,dk,dv,chunk", SHAPES)
@pytest.mark.parametrize("prefill", [0, 5])
def test_decode_rows_equal_the_rows_launch_bitwise(hk, hv, dk, dv, chunk, prefill):
    """A chunk's first `prefill` rows by the rows launch (keeping their rows of ``T``), then every
    later row by the decode launch: each output == the rows launch's for that row, each kept row of
    ``T`` == the whole chunk's, and the fold at the last row == the fold launch's state."""
    shapes = Shapes(hk, hv, dk, dv)
    q, k, v, g, beta, state = chunk_inputs(shapes, chunk, seed=chunk + prefill)
    scale = dk ** -0.5
    args = (shapes, chunk, scale, True)
    with use_backend("triton"):
        whole_t = torch.full((chunk, hv, chunk), float("nan"), device=DEVICE)
        whole = torch.empty(chunk, hv, dv, dtype=q.dtype, device=DEVICE)
        launch_rows("triton", q, k, v, g, beta, state, whole, RowsPlan([0], [chunk], [0], [0], [0], [0]), *args,
                    t_cache=whole_t)
        folded = torch.empty_like(state)
        launch_fold("triton", k, v, g, beta, state, folded, FoldPlan([0], [chunk], [0], [0]), shapes, chunk, True)
        pool_t = torch.full((chunk, hv, chunk), float("nan"), device=DEVICE)  # rows never written are never read
        pool_state = state.clone()
        out = torch.empty(1, hv, dv, dtype=q.dtype, device=DEVICE)
        if prefill:
            launch_rows("triton", q, k, v, g, beta, pool_state, torch.empty_like(whole),
                        RowsPlan([0], [prefill], [0], [0], [0], [0]), *args, t_cache=pool_t)
        for i in range(prefill, chunk):
            want = torch.empty(1, hv, dv, dtype=q.dtype, device=DEVICE)
            launch_rows("triton", q[i:], k, v, g, beta, state, want, RowsPlan([0], [i + 1], [i], [0], [0]), *args)
            launch_decode("triton", q[i:], k, v, g, beta, pool_t, pool_state, out, DecodePlan([0], [i], [0], [0], [0], [0]),
                          *args)
            assert torch.equal(out, want), f"row {i}"
            assert torch.equal(out[0], whole[i]), f"row {i} vs the whole chunk"
            assert torch.equal(pool_t[i], whole_t[i]), f"row {i} of T"
    assert torch.equal(pool_state, folded)


def test_padding_entries_write_nothing():
    """Entries of row -1 exit; ``t_out = -1`` keeps no row of ``T``; a fold goes where ``state_out`` says."""
    shapes = Shapes(1, 2, 16, 16)
    q, k, v, g, beta, state = chunk_inputs(shapes, 16, seed=1)
    with use_backend("triton"):
        pool_t = torch.zeros(16, 2, 16, device=DEVICE)
        states = torch.cat([state, torch.zeros_like(state)])
        launch_rows("triton", q, k, v, g, beta, states, torch.empty(16, 2, 16, dtype=q.dtype, device=DEVICE),
                    RowsPlan([0], [15], [0], [0], [0], [0]), shapes, 16, 0.25, True, t_cache=pool_t)
        before = pool_t.clone()
        out = torch.full((2, 2, 16), 7.0, dtype=q.dtype, device=DEVICE)
        launch_decode("triton", q[15:].repeat(2, 1, 1), k, v, g, beta, pool_t, states, out,
                      DecodePlan([0, 0], [-1, 15], [0, 1], [0, 0], [0, 1], [0, -1]), shapes, 16, 0.25, True)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0)) and torch.equal(pool_t, before)
    assert torch.equal(states[0], state[0]) and not torch.equal(states[1], torch.zeros_like(states[1]))
