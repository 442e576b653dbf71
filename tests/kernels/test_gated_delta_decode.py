"""gated_delta_decode's CPU reference (the decode twin of `gated_delta_reference.chunk_forward`):
every row of a chunk from the kept rows of T, bitwise the reference rows launch's row and row of
T (the state only read: a completed chunk is the fold launch's), at chunks of 16, 32 and 64 (one
block and the block rows); and the Triton decode kernel compiled for sm_90 on the CPU at Qwen3.5's
head dims (chunk 64). The Triton kernel's bits: tests/triton_checks/check_gated_delta_decode.py
(interpreter and GPU), `kernel_invariance --only gdn`."""

from pathlib import Path

import pytest
import torch

from vexact_models.kernels.gated_delta_decode import DecodePlan, decode_solve, launch_decode
from vexact_models.kernels.gated_delta_launch import RowsPlan, Shapes, launch_rows
from vexact_models.kernels.gated_delta_reference import EXACT


def _chunk(shapes: Shapes, chunk: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(chunk, shapes.hk, shapes.dk, generator=gen) for _ in range(2))
    v = torch.randn(chunk, shapes.hv, shapes.dv, generator=gen)
    g = -torch.rand(chunk, shapes.hv, generator=gen) * 0.6 - 0.01
    beta = torch.rand(chunk, shapes.hv, generator=gen) * 0.9 + 0.05
    return q, k, v, g, beta, torch.randn(1, shapes.hv, shapes.dk, shapes.dv, generator=gen) * 0.2


@pytest.mark.parametrize("chunk,prefill", [(16, 0), (32, 7), (64, 21)])
def test_reference_decode_rows_equal_the_rows_launch_bitwise(chunk, prefill):
    shapes = Shapes(1, 2, 16, 8)
    q, k, v, g, beta, state = _chunk(shapes, chunk, seed=chunk)
    args = (shapes, chunk, 0.3, True)
    whole_t = torch.zeros(chunk, shapes.hv, chunk)
    whole = torch.empty(chunk, shapes.hv, shapes.dv)
    launch_rows("reference", q, k, v, g, beta, state, whole, RowsPlan([0], [chunk], [0], [0], [0], [0]), *args,
                t_cache=whole_t)
    pool_t = torch.full((chunk, shapes.hv, chunk), float("nan"))  # rows never written are never read
    pool_state = state.clone()
    if prefill:
        launch_rows("reference", q, k, v, g, beta, pool_state, torch.empty_like(whole),
                    RowsPlan([0], [prefill], [0], [0], [0], [0]), *args, t_cache=pool_t)
    out = torch.empty(1, shapes.hv, shapes.dv)
    for i in range(prefill, chunk):
        want = torch.empty_like(out)
        launch_rows("reference", q[i:], k, v, g, beta, state, want, RowsPlan([0], [i + 1], [i], [0], [0]), *args)
        launch_decode("reference", q[i:], k, v, g, beta, pool_t, pool_state, out, DecodePlan([0], [i], [0], [0], [0]),
                      *args)
        assert torch.equal(out, want) and torch.equal(out[0], whole[i]), i
        assert torch.equal(pool_t[i], whole_t[i]), i
    assert torch.equal(pool_state, state)  # read, never written


def test_decode_solve_is_the_block_solve_row():
    """Row i of `decode_solve` from the block solve's rows < i is the block solve's row i, for every
    i of a 64-row chunk (four blocks), with rows past i absent (zeros of L)."""
    gen = torch.Generator().manual_seed(0)
    c = 64
    strict = torch.arange(c)[None, :] < torch.arange(c)[:, None]
    lower = torch.where(strict, torch.randn(2, c, c, generator=gen) * 0.2, torch.zeros(()))
    for i in range(c):
        present = torch.where((torch.arange(c) <= i)[:, None], lower, torch.zeros(()))
        full = EXACT.solve(present)
        kept = torch.where((torch.arange(c) < i)[:, None], full, torch.full((), float("nan")))
        assert torch.equal(decode_solve(present, kept, i)[:, i], full[:, i]), i


def test_triton_decode_kernel_compiles_for_hopper_on_cpu(monkeypatch):
    """The decode kernel compiles for sm_90 without a GPU at Qwen3.5's head dims (128 x 128, chunk 64,
    8 warps), its products on the tensor cores in the rows kernel's instruction shapes, within
    Hopper's shared memory."""
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from sm90_compile import compile_only, resources

    shapes, c = Shapes(1, 2, 128, 128), 64
    q = torch.zeros(1, 1, 128, dtype=torch.bfloat16)
    k, v = torch.zeros(c, 1, 128, dtype=torch.bfloat16), torch.zeros(c, 2, 128, dtype=torch.bfloat16)
    g, beta = torch.zeros(c, 2), torch.zeros(c, 2, dtype=torch.bfloat16)
    t, states, out = torch.zeros(c, 2, c), torch.zeros(1, 2, 128, 128), torch.zeros(1, 2, 128, dtype=torch.bfloat16)
    with compile_only() as compiled:
        launch_decode("triton", q, k, v, g, beta, t, states, out, DecodePlan([0], [40], [0], [0], [0]), shapes, c,
                      0.1, True)
    assert [kernel.name for kernel in compiled] == ["decode_kernel"]
    found = resources(compiled[0])
    ptx = compiled[0].asm["ptx"]
    shapes_used = {line.split("wgmma.mma_async.sync.aligned.")[1].split(".")[0] for line in ptx.splitlines()
                   if "wgmma.mma_async" in line}
    assert found.wgmma > 0 and found.num_warps == 8 and shapes_used == {"m64n32k8", "m64n64k8"}
    assert found.shared_bytes <= 227 * 1024


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("hk,hv", [(16, 32), (4, 4)])
def test_gpu_decode_equals_the_rows_launch_and_training(hk, hv):
    """On the Triton kernels at 128 x 128 heads, chunk 64: every row decoded from the rows of T kept
    after every prefill length == the whole chunk's row, the states only read; rollouts through the
    state cache's decode and fold launches (a sibling's slot copied mid-chunk) == training."""
    from vexact_models.conformance.gated_delta_invariance import check_decode, check_engine_rollout
    from vexact_models.conformance.kernel_invariance import Result

    result = Result("gated_delta decode")
    check_decode(result, hk, hv, 128, 128)
    check_engine_rollout(result, hk, hv, 128, 128, max_len=700, decode=70)
    assert result.cases == 64 + 1 + 1 and result.mismatches == 0, result.notes
