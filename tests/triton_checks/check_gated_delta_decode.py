"""The decode launch (`kernels.gated_delta_decode`): row ``i`` of a chunk from the rows of ``T`` kept by
earlier launches, bitwise the rows launch's row and ``T`` row, the boundary state only read (the
fold launch folds a completed chunk); on the Triton kernels under TRITON_INTERPRET=1 on CPU and on a GPU
(docs/design.md section 6b, "Decode cost"). The engine's steps through it: check_gated_delta_step.py."""

import os

import numpy as np
import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

from vexact_models.kernels import use_backend  # noqa: E402
from vexact_models.kernels.gated_delta_decode import DecodePlan, launch_decode  # noqa: E402
from vexact_models.kernels.gated_delta_launch import RowsPlan, Shapes, launch_rows  # noqa: E402

SHAPES = [(1, 2, 16, 128, 16), (1, 2, 16, 16, 32)] if INTERPRET else [(1, 2, 16, 16, 16), (16, 32, 128, 128, 64),
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
@pytest.mark.parametrize("prefill,split", [(0, False), (5, True)])
def test_decode_rows_equal_the_rows_launch_bitwise(hk, hv, dk, dv, chunk, prefill, split):
    """A chunk's first `prefill` rows by the rows launch (keeping their rows of ``T``), then every
    later row by the decode launch (`split`: one program a value block): each output == the rows
    launch's for that row, each kept row of ``T`` == the whole chunk's, and the boundary state
    unchanged (the decode launch never writes a state)."""
    shapes = Shapes(hk, hv, dk, dv)
    q, k, v, g, beta, state = chunk_inputs(shapes, chunk, seed=chunk + prefill)
    scale = dk ** -0.5
    args = (shapes, chunk, scale, True)
    with use_backend("triton"):
        whole_t = torch.full((chunk, hv, chunk), float("nan"), device=DEVICE)
        whole = torch.empty(chunk, hv, dv, dtype=q.dtype, device=DEVICE)
        launch_rows("triton", q, k, v, g, beta, state, whole, RowsPlan([0], [chunk], [0], [0], [0], [0]), *args,
                    t_cache=whole_t)
        pool_t = torch.full((chunk, hv, chunk), float("nan"), device=DEVICE)  # rows never written are never read
        pool_state = state.clone()
        out = torch.empty(1, hv, dv, dtype=q.dtype, device=DEVICE)
        if prefill:
            launch_rows("triton", q, k, v, g, beta, pool_state, torch.empty_like(whole),
                        RowsPlan([0], [prefill], [0], [0], [0], [0]), *args, t_cache=pool_t)
        for i in range(prefill, chunk):
            want = torch.empty(1, hv, dv, dtype=q.dtype, device=DEVICE)
            launch_rows("triton", q[i:], k, v, g, beta, state, want, RowsPlan([0], [i + 1], [i], [0], [0]), *args)
            launch_decode("triton", q[i:], k, v, g, beta, pool_t, pool_state, out, DecodePlan([0], [i], [0], [0], [0]),
                          *args, split_values=split)
            assert torch.equal(out, want), f"row {i}"
            assert torch.equal(out[0], whole[i]), f"row {i} vs the whole chunk"
            assert torch.equal(pool_t[i], whole_t[i]), f"row {i} of T"
    assert torch.equal(pool_state, state)


def test_padding_entries_write_nothing():
    """Entries of row -1 exit; ``t_out = -1`` keeps no row of ``T``; the last row of a chunk writes its
    output and no state."""
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
                      DecodePlan([0, 0], [-1, 15], [0, 1], [0, 0], [0, -1]), shapes, 16, 0.25, True)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0)) and torch.equal(pool_t, before)
    assert not torch.equal(out[1], torch.full_like(out[1], 7.0))
    assert torch.equal(states[0], state[0]) and torch.equal(states[1], torch.zeros_like(states[1]))


ENGINE = [(1, 2, 16, 16, 32)] if INTERPRET else [(1, 2, 16, 16, 16), (16, 32, 128, 128, 64)]


@pytest.mark.parametrize("hk,hv,dk,dv,chunk", ENGINE)
def test_engine_steps_through_the_decode_launch_equal_training(hk, hv, dk, dv, chunk):
    """`LinearStateCache` steps (`LinearStep.delta_rule`) of four sequences, decoding through several
    chunks: A prefills ``C - 3`` tokens, decodes across two boundaries (the fold launch after the decode) and
    pauses mid-chunk; the leader L prefills to mid-chunk, its sibling S takes its slot's state by
    `copy_slots` (n > 1) and both decode their own tokens; P is preempted mid-chunk and prefills
    again from position 0 in a slot whose contents are stale, then decodes on. Prefill pieces share
    steps with decodes (the rows and decode launches in one step). Every output == the training
    forward's, bitwise."""
    from vexact_models.kernels.gated_delta_rule import gated_delta_rule
    from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStateSpec, LinearStep

    c, share = chunk, chunk // 2 + 3
    lengths = {"A": 2 * c + 6, "L": c + 10, "S": share + c + 4, "P": c + 5}
    shapes = Shapes(hk, hv, dk, dv)
    rows = {name: chunk_inputs_of(shapes, n, seed=i) for i, (name, n) in enumerate(lengths.items())}
    rows["S"] = [torch.cat([a[:share], b[share:]]) for a, b in zip(rows["L"], rows["S"])]  # the prompt it shares
    with use_backend("triton"):
        want = dict(zip(lengths, gated_delta_rule(*(torch.cat([rows[n][j] for n in lengths]) for j in range(5)),
                                                  [0, *torch.tensor(list(lengths.values())).cumsum(0).tolist()],
                                                  chunk_size=c)[0].split(list(lengths.values()))))
        spec = LinearStateSpec((0,), (hk, hv), (dk, dv), 1, 2, c)
        cache = LinearStateCache(spec, slots=5, device=torch.device(DEVICE), dtype=rows["A"][1].dtype)
        for t in (cache.states[0], cache.t_rows[0], *cache.rows[0]):
            t.fill_(float("nan"))  # stale: a sequence at position 0 reads nothing of its slot
        slot, done = {"A": 1, "L": 0, "P": 2}, {name: 0 for name in lengths}
        got = {name: torch.full_like(want[name], float("nan")) for name in lengths}
        pieces = {"A": [c - 3], "L": [share], "P": [3]}  # the tokens each adds per step (1 once its pieces are run)
        for step in range(2 * c + 4):
            if step == 1:  # S takes L's state at the share point (in the step before its first)
                cache.copy_slots(torch.tensor([0], device=DEVICE), torch.tensor([3], device=DEVICE))
                slot["S"], done["S"] = 3, share
                got["S"][:share] = got["L"][:share]  # its prompt's outputs are the leader's
            if step == c // 2 + 2:  # P preempted mid-chunk: its slot 2 freed, taken by no one
                del slot["P"]
            if step == c // 2 + 5:  # ... and prefilled again from position 0 in slot 4 (stale contents)
                slot["P"], pieces["P"], done["P"] = 4, [c // 2 + 1], 0
            order = [n for n in slot if done[n] < lengths[n] and not (n == "A" and c < step < c + 3)]
            counts = [min(pieces[n].pop(0) if pieces.get(n) else 1, lengths[n] - done[n]) for n in order]
            if not order:
                continue
            index = [torch.arange(done[n], done[n] + m) for n, m in zip(order, counts)]
            inputs = [torch.cat([rows[n][j][i.to(DEVICE)] for n, i in zip(order, index)]) for j in range(5)]
            cu = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
            plan = LinearStep(cache, np.array([slot[n] for n in order]), np.array([done[n] for n in order]),
                              np.array(counts), cu, max(counts))
            out = plan.delta_rule(0, *inputs).split(counts)
            for n, i, o in zip(order, index, out):
                got[n][i.to(DEVICE)] = o
                done[n] += len(i)
    assert done == lengths
    for name in lengths:
        assert torch.equal(got[name], want[name]), name


def chunk_inputs_of(shapes: Shapes, length: int, seed: int):
    """`length` rows of q, k, v, g, beta (no state: sequences start at position 0)."""
    return list(chunk_inputs(shapes, length, seed)[:5])
