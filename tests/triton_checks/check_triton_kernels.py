"""Triton kernels vs the CPU reference, on small shapes.

Two ways to run it:
- on CPU under Triton's interpreter (TRITON_INTERPRET=1 VEXACT_BACKEND=triton), which
  tests/test_triton_interpreter.py does in CI: checks kernel *logic* (indexing, masking, paging,
  GQA mapping, RNG bits);
- on a GPU: ``python -m pytest tests/triton_checks/check_triton_kernels.py``.
Results are compared with tolerances (the two backends round differently); bitwise invariance
is proven on the GPU by conformance/kernel_invariance.py.
"""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not (INTERPRET and os.environ.get("VEXACT_BACKEND") == "triton") and not torch.cuda.is_available():
    pytest.skip("needs a GPU, or TRITON_INTERPRET=1 VEXACT_BACKEND=triton", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"

# (the interpreter's tl.dot is patched in conftest.py)

from vexact_models.kernels import (PagedLayout, add_rms_norm, apply_rotary, gather_logprobs,
                                   kv_cache_write, linear, log_softmax, rms_norm, rope_table, silu_and_mul, use_backend)
from vexact_models.kernels.paged_layout import slots_reference  # noqa: E402


def write_pages(k, v, k_cache, v_cache, table, lens: list[int]) -> None:
    """Packed `k`, `v` of sequences of `lens` tokens written into their pages of the caches
    (``[pages, page_size, heads, dim]``) through the block `table`."""
    page_size = k_cache.shape[1]
    slots = torch.cat([slots_reference(table.cpu(), s, torch.arange(n), page_size) for s, n in enumerate(lens)])
    kv_cache_write(k, v, k_cache, v_cache, slots.to(k.device))


def last_tokens(lens: list[int], tokens: int, table, page_size: int):
    """``(rows, layout)``: the packed rows of each sequence's last `tokens` tokens (all of a shorter
    one), and their `PagedLayout` over `table` as a chunk after the rest as context."""
    chunk = [min(tokens, n) for n in lens]
    ends = torch.tensor(lens).cumsum(0).tolist()
    rows = torch.cat([torch.arange(e - c, e) for e, c in zip(ends, chunk)]).to(table.device)
    q_cu = torch.tensor([0] + list(torch.tensor(chunk).cumsum(0)), dtype=torch.int32, device=table.device)
    return rows, PagedLayout(q_cu, torch.tensor(lens, dtype=torch.int32, device=table.device), table, page_size,
                             max(chunk))


def close(a, b, tol):
    a, b = a.double(), b.double()
    err = float((a - b).norm() / b.norm().clamp_min(1e-30))
    assert err < tol, err


def _cpu(x):
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def ref(fn, *args, **kwargs):
    """fn on the reference backend, with tensor arguments moved to CPU; result on DEVICE."""
    with use_backend("reference"):
        out = fn(*[_cpu(a) for a in args], **{k: _cpu(v) for k, v in kwargs.items()})
    return tuple(o.to(DEVICE) for o in out) if isinstance(out, tuple) else out.to(DEVICE)


def rand(*shape, kind="n"):
    return (torch.randn if kind == "n" else torch.rand)(*shape).to(DEVICE)


@pytest.mark.parametrize("m,n,k", [(1, 40, 70), (65, 33, 129), (300, 20, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear(m, n, k, dtype):
    x, w, b = rand(m, k).to(dtype), rand(n, k).to(dtype), rand(n).to(dtype)
    close(linear(x, w, b), ref(linear, x, w, b), 1e-2 if dtype == torch.bfloat16 else 1e-5)
    close(linear(x, w, out_dtype=torch.float32), ref(linear, x, w, out_dtype=torch.float32), 1e-5)


def test_rms_norm_rotary_silu():
    x, w = rand(7, 3, 40), rand(40, kind="u")
    close(rms_norm(x, w, 1e-6), ref(rms_norm, x, w, 1e-6), 1e-5)
    wide = rand(7, 5, 40)[:, 1:4]  # per-head rows of a strided view (q from a fused q/k/v GEMM)
    close(rms_norm(wide, w, 1e-6), ref(rms_norm, wide.contiguous(), w, 1e-6), 1e-5)
    gu = rand(6, 2 * 300)
    close(silu_and_mul(gu[:, :300], gu[:, 300:]), ref(silu_and_mul, gu[:, :300].contiguous(), gu[:, 300:].contiguous()),
          1e-6)
    r = rand(7, 3, 40)
    for got, want in zip(add_rms_norm(x, r, w, 1e-6), ref(add_rms_norm, x, r, w, 1e-6)):
        close(got, want, 1e-5)
    xb, rb = x.bfloat16(), r.bfloat16()
    normed, summed = add_rms_norm(xb, rb, w.bfloat16(), 1e-6)
    # the fused add rounds exactly like torch's bf16 add, and the norm follows
    assert torch.equal(summed, xb + rb)
    assert torch.equal(normed, rms_norm(xb + rb, w.bfloat16(), 1e-6))
    cos, sin = (t.to(DEVICE) for t in rope_table(1.0 / (1e4 ** (torch.arange(0, 20) / 20)), 64))
    pos = torch.randint(0, 64, (7,), device=DEVICE)
    close(apply_rotary(x, pos, cos, sin), ref(apply_rotary, x, pos, cos, sin), 1e-6)
    g, u = rand(5, 1000), rand(5, 1000)
    close(silu_and_mul(g, u), ref(silu_and_mul, g, u), 1e-6)


def test_row_kernel_launch_shapes():
    """The launch shapes `benchmarks/investigations/row_kernels.py` sweeps: `silu_and_mul_triton` is element-wise,
    so every block and warp count gives the default's bits; a norm tile gives the reference's
    values (its bits follow the tile on a GPU: rule 3)."""
    from vexact_models.kernels.rms_norm import rms_norm_triton
    from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

    gu = rand(3, 2 * 700).bfloat16()
    gate, up = gu[:, :700], gu[:, 700:]
    want = silu_and_mul_triton(gate, up)
    for block, warps in ((64, 1), (256, 2), (2048, 8)):
        assert torch.equal(silu_and_mul_triton(gate, up, block, warps), want)
    x, r, w = rand(5, 96), rand(5, 96), rand(96, kind="u")
    for tile in ((1, 1), (2, 4), (4, 8)):
        normed, summed = rms_norm_triton(x, w, 1e-6, r, tile=tile)
        close(normed, ref(rms_norm, x + r, w, 1e-6), 1e-5)
        close(summed, x + r, 1e-6)


def test_row_kernels_benchmark_sweeps():
    """`benchmarks/investigations/row_kernels.py`'s sweeps, with a stand-in timer: every candidate runs and is
    compared with the current launch; the element-wise `silu_and_mul` gives its bits at each."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks" / "investigations"))
    import row_kernels as bench

    timer = lambda fn: (fn(), 2.0)[1]  # noqa: E731
    rows = bench.norm_rows(96, 5, DEVICE, timer, tiles=[(8, 4), (1, 1)])
    assert [r[1] for r in rows] == ["HF ops", "8 rows, 4 warps (now)", "1 rows, 1 warps"] and rows[1][4] == "yes"
    rows = bench.rotary_rows(4, 2, 32, 5, DEVICE, timer, tiles=[(32, 4), (2, 1)])
    assert [r[1] for r in rows] == ["HF ops", "32 rows, 4 warps (now)", "2 rows, 1 warps"] and rows[1][4] == "yes"
    rows = bench.silu_rows(300, 3, DEVICE, timer, launches=[(1024, 4), (64, 1)])
    assert [r[4] for r in rows[1:]] == ["yes", "yes"] and rows[1][3] == "1.00x"


def test_log_softmax_and_gather():
    x = rand(4, 5000) * 3
    t = torch.randint(0, 5000, (4,), device=DEVICE)
    temps = torch.tensor([1.0, 0.5, 2.0, 0.9], device=DEVICE)
    full = log_softmax(x, temps)
    close(full, ref(log_softmax, x, temps), 1e-6)
    lp, lse = gather_logprobs(x, t, temps, return_lse=True)
    assert torch.equal(lp, full[torch.arange(4, device=DEVICE), t])
    close(lse, torch.logsumexp(x.double() / temps.double()[:, None], -1), 1e-6)


def test_log_softmax_over_several_chunks_of_a_row():
    """Rows of three chunks (the last one partial): the float64 values, the gather equal to the
    full row, and a row alone equal to the row in the batch, bit for bit."""
    from vexact_models.kernels.log_softmax import CHUNK_COLUMNS

    vocab = 2 * CHUNK_COLUMNS + 999
    x = rand(3, vocab) * 4
    x[1, -1] = 30.0  # the largest logit in the partial last chunk
    t = torch.tensor([5, vocab - 1, CHUNK_COLUMNS], device=DEVICE)
    temps = torch.tensor([1.0, 0.7, 1.6], device=DEVICE)
    full = log_softmax(x, temps)
    close(full, torch.log_softmax(x.double() / temps.double()[:, None], -1), 1e-5)
    lp = gather_logprobs(x, t, temps)
    assert torch.equal(lp, full[torch.arange(3, device=DEVICE), t])
    assert torch.equal(gather_logprobs(x[1:2], t[1:2], temps[1:2]), lp[1:2])


@pytest.mark.parametrize("k", [2, 3, 21])
def test_gather_of_several_targets_a_row_equals_one_at_a_time(k):
    """``[rows, k]`` targets (a sampled token and its alternatives): each entry bitwise the
    one-target gather of its column, and the full row's entry; the reference's bits too."""
    from vexact_models.kernels.log_softmax import CHUNK_COLUMNS

    vocab = CHUNK_COLUMNS + 777
    x = rand(5, vocab) * 4
    temps = torch.tensor([1.0, 0.5, 2.0, 0.9, 1.3], device=DEVICE)
    t = torch.randint(0, vocab, (5, k), device=DEVICE)
    t[:, -1] = t[:, 0]  # a token twice in a row
    lp = gather_logprobs(x, t, temps)
    assert lp.shape == (5, k)
    for j in range(k):
        assert torch.equal(lp[:, j], gather_logprobs(x, t[:, j].contiguous(), temps))
    assert torch.equal(lp, log_softmax(x, temps).gather(1, t))
    with use_backend("reference"):
        assert torch.equal(gather_logprobs(x.cpu(), t.cpu(), temps.cpu()),
                           torch.stack([gather_logprobs(x.cpu(), t[:, j].cpu(), temps.cpu()) for j in range(k)], 1))


def test_kv_cache_write():
    k, v = rand(5, 2, 8), rand(5, 2, 4)
    kc, vc = torch.zeros(3, 4, 2, 8, device=DEVICE), torch.zeros(3, 4, 2, 4, device=DEVICE)
    slots = torch.tensor([11, -1, 0, 4, 7], device=DEVICE)
    kv_cache_write(k, v, kc, vc, slots)
    kr, vr = torch.zeros(3, 4, 2, 8), torch.zeros(3, 4, 2, 4)
    with use_backend("reference"):
        kv_cache_write(k.cpu(), v.cpu(), kr, vr, slots.cpu())
    assert torch.equal(kc.cpu(), kr) and torch.equal(vc.cpu(), vr)


@pytest.mark.parametrize("top_k", [8, 6])
def test_moe_routing(top_k):
    from vexact_models.kernels.moe_routing import softmax_topk

    logits = rand(40, 128)
    for norm in (True, False):
        w, ids = softmax_topk(logits, top_k, norm)
        w_ref, ids_ref = ref(softmax_topk, logits, top_k, norm)
        assert torch.equal(ids, ids_ref)
        close(w, w_ref, 1e-6)


def test_moe_routing_launch_warps():
    """`softmax_topk_triton` runs `ROUTER_WARPS` unless told (what the models run), picks the same
    experts at any warp count, and names a warp count it cannot launch."""
    from vexact_models.kernels.moe_routing import ROUTER_WARPS, softmax_topk, softmax_topk_triton

    logits = rand(40, 128)
    w, ids = softmax_topk(logits, 8, True)
    for got, want in zip(softmax_topk_triton(logits, 8, True, num_warps=ROUTER_WARPS)[:2], (w, ids)):
        assert torch.equal(got, want)
    w1, ids1, _ = softmax_topk_triton(logits, 8, True, num_warps=1)
    assert torch.equal(ids1, ids)
    close(w1, w, 1e-6)
    with pytest.raises(ValueError, match="num_warps=5 must be 1, 2, 4 or 8"):
        softmax_topk_triton(logits, 8, True, num_warps=5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [40, 60, 300])  # the 16-, 32- and 64-row tiles (`pick_config`)
def test_fused_moe_forward(dtype, tokens):
    from vexact_models.kernels.moe import fused_moe
    from vexact_models.kernels.moe_routing import softmax_topk

    experts, hidden, inter = 8, 64, 96
    x = rand(tokens, hidden).to(dtype)
    gate_up = (rand(experts, 2 * inter, hidden) / 8).to(dtype)
    down = (rand(experts, hidden, inter) / 10).to(dtype)
    logits = rand(tokens, experts)
    logits[:tokens * 6 // 7, 2] += 10  # expert 2 gets most rows, some experts none
    w, ids = softmax_topk(logits, 2, True)
    close(fused_moe(x, gate_up, down, w, ids), ref(fused_moe, x, gate_up, down, w, ids),
          2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_adds_inside_its_combine_kernel_bitwise(dtype):
    """`fused_moe(..., add=a)` (the shared experts' output added in the combine kernel, no
    gradients) is bitwise the routed output plus `a` as torch adds it, for values whose sum rounds
    (large and small magnitudes, opposite signs) and a strided `a`."""
    from vexact_models.kernels.moe import fused_moe
    from vexact_models.kernels.moe_routing import softmax_topk

    experts, hidden, inter, tokens = 8, 64, 96, 37
    x = rand(tokens, hidden).to(dtype)
    gate_up = (rand(experts, 2 * inter, hidden) / 8).to(dtype)
    down = (rand(experts, hidden, inter) / 10).to(dtype)
    w, ids = softmax_topk(rand(tokens, experts), 2, True)
    wide = rand(tokens, 2 * hidden) * torch.logspace(-3, 3, 2 * hidden, device=DEVICE)
    add = wide.to(dtype)[:, ::2]  # every other column: a row stride of 2 * hidden
    plain = fused_moe(x, gate_up, down, w, ids)
    got = fused_moe(x, gate_up, down, w, ids, add=add)
    want = plain + add
    assert torch.equal(got, want)
    assert dtype == torch.float32 or not torch.equal(got.float(), plain.float() + add.float())  # sums did round


@pytest.mark.parametrize("hidden, inter", [(64, 96), (128, 256)])
def test_gate_up_act_and_down_rows_are_the_same_for_every_tile_config(hidden, inter):
    """`gate_up_act` gives silu(gate) * up per expert row, and each pair's gate/up and down rows are
    bitwise the same under the 16- and 32-row decode tiles and the small and large ones (`pick_config`'s
    choices): with the decode tiles' 128-wide K tiles where 128 divides K (the second shape), and
    with the 64-wide fallback where it does not (the first)."""
    from vexact_models.kernels.moe import gate_up_act, moe_align
    from vexact_models.kernels.moe_grouped_gemm import grouped_gemm
    from vexact_models.kernels.moe_config import DECODE, FEW_ROWS, LARGE, SMALL
    from vexact_models.kernels.moe_routing import softmax_topk

    experts, tokens, top_k = 8, 40, 2
    x = rand(tokens, hidden).bfloat16()
    gate_up = (rand(experts, 2 * inter, hidden) / 8).bfloat16()
    down = (rand(experts, hidden, inter) / 10).bfloat16()
    logits = rand(tokens, experts)
    logits[:30, 3] += 10  # expert 3 gets most rows, some experts none
    ids = softmax_topk(logits, top_k, True)[1]
    rows = []
    for cfg in (FEW_ROWS, DECODE, SMALL, LARGE):
        layout = moe_align(ids, experts, cfg.block_m)
        act = gate_up_act(x, gate_up, layout, top_k, cfg)[0]
        y = grouped_gemm(act, down, layout, hidden, inter, down.stride(1), down.stride(2), torch.bfloat16, cfg,
                         down_tiles=True)
        pos = layout.pair_pos.long()
        rows.append((act[pos], y[pos]))
    for act, y in rows[1:]:
        assert torch.equal(act, rows[0][0]) and torch.equal(y, rows[0][1])
    expert = ids.reshape(-1)
    gu = torch.einsum("ph,pnh->pn", x.float().repeat_interleave(top_k, 0), gate_up.float()[expert])
    want = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]
    close(rows[0][0], want, 3e-2)


@pytest.mark.parametrize("gemms", ["triton", "grouped_mm"])
def test_fused_moe_backward(gemms):
    """Both kinds of expert GEMMs (ours; torch's grouped GEMM, its CPU fallback here), an expert
    that no token chose among them (its gradients zero)."""
    from vexact_models.kernels.moe import fused_moe
    from vexact_models.kernels.moe_backward import moe_math, use_moe_backward

    experts, hidden, inter, tokens = 5, 64, 64, 50
    x = rand(tokens, hidden).bfloat16().requires_grad_()
    gate_up = (rand(experts, 2 * inter, hidden) / 8).bfloat16().requires_grad_()
    down = (rand(experts, hidden, inter) / 8).bfloat16().requires_grad_()
    w = rand(tokens, 2, kind="u").requires_grad_()
    ids = torch.randint(0, experts - 1, (tokens, 2), device=DEVICE)
    g = rand(tokens, hidden).bfloat16()
    with use_moe_backward(gemms):
        got = torch.autograd.grad(fused_moe(x, gate_up, down, w, ids), (x, gate_up, down, w), g)
    leaves = [t.detach().double().requires_grad_() for t in (x, gate_up, down, w)]
    want = torch.autograd.grad(moe_math(*leaves, ids), leaves, g.double())
    for a, b in zip(got, want):
        close(a, b, 3e-2)
    assert not got[1][-1].any() and not got[2][-1].any()


@pytest.mark.parametrize("gemms", ["triton", "grouped_mm"])
def test_fused_moe_backward_skips_the_weight_gradients_of_frozen_expert_tensors(gemms, monkeypatch):
    """Frozen expert tensors (LoRA on the experts keeps them so): their weight-gradient GEMMs do not
    run, and x's and the routing weights' gradients are bitwise those of the full backward."""
    from vexact_models.kernels import moe_backward
    from vexact_models.kernels.moe import fused_moe

    experts, hidden, inter, tokens = 4, 64, 64, 30
    x = rand(tokens, hidden).bfloat16().requires_grad_()
    gate_up = (rand(experts, 2 * inter, hidden) / 8).bfloat16()
    down = (rand(experts, hidden, inter) / 8).bfloat16()
    w = rand(tokens, 2, kind="u").requires_grad_()
    ids = torch.randint(0, experts, (tokens, 2), device=DEVICE)
    g = rand(tokens, hidden).bfloat16()
    calls = []
    for name in ("_weight_grad", "_cutlass_weight_grad"):
        original = getattr(moe_backward, name)
        monkeypatch.setattr(moe_backward, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    with moe_backward.use_moe_backward(gemms):
        frozen = torch.autograd.grad(fused_moe(x, gate_up, down, w, ids), (x, w), g)
        assert calls == []
        leaves = (gate_up.clone().requires_grad_(), down.clone().requires_grad_())
        full = torch.autograd.grad(fused_moe(x, *leaves, w, ids), (x, w, *leaves), g)
        assert len(calls) == 2
    assert torch.equal(frozen[0], full[0]) and torch.equal(frozen[1], full[1])


def test_logprob_grad():
    from vexact_models.kernels.logprob_grad import logprob_grad

    x = rand(4, 2500) * 3  # more than one column block, a ragged last one
    t = torch.tensor([0, 2499, 1024, 7], device=DEVICE)
    temps = torch.tensor([1.0, 0.5, 2.0, 0.9], device=DEVICE)
    grad = rand(4)
    lse = torch.logsumexp(x / temps[:, None], -1)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = logprob_grad(x, lse, t, temps, grad, out_dtype=out_dtype)
        assert got.dtype == out_dtype
        close(got, ref(logprob_grad, x, lse, t, temps, grad, out_dtype), 1e-6 if out_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("rows,n", [(7, 32), (300, 128), (300, 1000)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_add_rms_norm_backward(rows, n, dtype):
    """The one-pass backward kernel (blocks of rows spread over the programs, a ragged last block,
    dW from per-program partial sums) against float64 autograd, with and without the residual
    stream's own gradient."""
    x, r = rand(rows, n).to(dtype).requires_grad_(), rand(rows, n).to(dtype).requires_grad_()
    w = (rand(n, kind="u") + 0.5).to(dtype).requires_grad_()
    g_normed, g_summed = rand(rows, n).to(dtype), rand(rows, n).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = torch.autograd.grad(rms_norm(x, w, 1e-6), (x, w), g_normed)
    xd, rd, wd = (t.detach().double().requires_grad_() for t in (x, r, w))

    def norm64(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6) * wd

    want = torch.autograd.grad(norm64(xd), (xd, wd), g_normed.double())
    for a, b in zip(got, want):
        assert a.dtype == dtype
        close(a, b, tol)
    normed, summed = add_rms_norm(x, r, w, 1e-6)
    got = torch.autograd.grad((normed * g_normed).sum() + (summed * g_summed).sum(), (x, r, w))
    s = xd + rd
    want = torch.autograd.grad((norm64(s) * g_normed.double()).sum() + (s * g_summed.double()).sum(), (xd, rd, wd))
    for a, b in zip(got, want):
        close(a, b, tol)


def test_silu_and_mul_backward():
    from vexact_models.kernels.silu_and_mul import silu_and_mul_backward_reference

    g, u, go = rand(5, 1000) * 3, rand(5, 1000), rand(5, 1000)
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = g.to(dtype).requires_grad_(), u.to(dtype).requires_grad_()
        got = torch.autograd.grad(silu_and_mul(gate, up), (gate, up), go.to(dtype))
        want = ref(silu_and_mul_backward_reference, gate.detach().double(), up.detach().double(), go.double())
        for a, b in zip(got, want):
            assert a.dtype == dtype
            close(a, b, 1e-6 if dtype == torch.float32 else 1e-2)
