"""`kernels.linear_silu_and_mul`: the gated MLP's activation from its fused [gate; up] weight,
bitwise `linear` then `silu_and_mul`, with SwiGLU in quack's GEMM epilogue where a rollout's
decode step can take it (`kernels/linear_silu_and_mul_quack.py`).

On CPU: the op is the composition (values, gradients, errors), the model's MLP takes it only
where nothing else is added to the fused GEMM's output, the launch choice, and that Triton still
compiles `silu_and_mul` to the PTX sequence the epilogue repeats (sm_90, offline). On a Hopper GPU
with quack: the fused launch's outputs equal the two ops' bitwise, and a captured MLP runs it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vexact_models.kernels import linear, linear_silu_and_mul, silu_and_mul, use_linear_backend
from vexact_models.kernels import linear_quack as lq
from vexact_models.kernels import linear_silu_and_mul_quack as lsq
from vexact_models.layers import GatedMLP, fuse_linears

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _two_ops(x, w):
    gate, up = linear(x, w).split(w.shape[0] // 2, dim=-1)
    return silu_and_mul(gate, up)


def test_is_linear_then_silu_and_mul_with_their_gradients():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=gen, requires_grad=True)
    w = torch.randn(24, 16, generator=gen, requires_grad=True)
    out = linear_silu_and_mul(x, w)
    assert out.shape == (3, 5, 12)
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = _two_ops(x2, w2)
    assert torch.equal(out, want)
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)


def test_bad_shapes_name_the_argument_and_the_limit():
    with pytest.raises(ValueError, match=r"weight shape \(7, 4\) must be \[2I, K\]"):
        linear_silu_and_mul(torch.randn(2, 4), torch.randn(7, 4))
    with pytest.raises(ValueError, match="x has 5 features but weight expects 4"):
        linear_silu_and_mul(torch.randn(2, 5), torch.randn(8, 4))


def test_a_swapped_config_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="swaps A and B"):
        lsq.linear_silu_and_mul_quack(torch.randn(2, 8), torch.randn(16, 8), lq.QuackConfig(64, 32, True, swap_ab=True))


def test_unavailable_reasons_name_the_first_missing_requirement(monkeypatch):
    x, w = torch.zeros(4, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    assert "bf16 only" in lsq.unavailable_reason(x.half(), w.half())
    assert "multiple of 8 rows" in lsq.unavailable_reason(x, w[:56])
    monkeypatch.setattr(lsq, "_epilogue", lambda: "ModuleNotFoundError: No module named 'quack'")
    assert "epilogue module cannot be imported or built" in lsq.unavailable_reason(x, w)
    monkeypatch.setattr(lsq, "_epilogue", lambda: object())  # importable: linear_quack's checks speak next
    reason = lsq.unavailable_reason(x, w)
    assert "pip install quack-kernels" in reason or "devices x=cpu" in reason, reason


def test_choose_takes_the_gemms_own_config_unless_it_swaps(monkeypatch):
    """The fused launch runs with the config `linear_quack` gives the gate/up GEMM, and not where
    that config swaps A and B (quack has no gated swap-AB epilogue) or the epilogue cannot run."""
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(lsq, "epilogue_unavailable_reason", lambda x2d, weight: None)
    for config in (lq.QuackConfig(64, 96, True, 2, 1), lq.SM90_DEFAULT):
        monkeypatch.setattr(lq, "choose", lambda *args, c=config: c)
        assert lsq.choose(x, w) == config
    monkeypatch.setattr(lq, "choose", lambda *args: lq.QuackConfig(64, 16, True, swap_ab=True))
    assert lsq.choose(x, w) is None
    monkeypatch.setattr(lq, "choose", lambda *args: None)
    assert lsq.choose(x, w) is None
    monkeypatch.setattr(lq, "choose", lambda *args: lq.SM90_DEFAULT)
    monkeypatch.setattr(lsq, "epilogue_unavailable_reason", lambda x2d, weight: "no quack")
    assert lsq.choose(x, w) is None


def _mlp(bias=False):
    torch.manual_seed(0)
    mlp = GatedMLP(16, 24, bias=bias)
    assert fuse_linears([mlp.gate_proj, mlp.up_proj])
    return mlp


def test_the_mlp_takes_the_fused_op_only_where_nothing_is_added_to_the_gemm(monkeypatch):
    """No gradient, fused, bias-free, no adapters: the MLP hands the fused weight to
    `linear_silu_and_mul`; with a gradient, a bias or unfused weights it runs the two ops. The
    outputs are the same numbers either way."""
    import vexact_models.layers as layers

    calls = []
    real = layers.linear_silu_and_mul
    monkeypatch.setattr(layers, "linear_silu_and_mul", lambda x, w: calls.append(tuple(w.shape)) or real(x, w))
    mlp = _mlp()
    x = torch.randn(5, 16)
    with torch.no_grad():
        fused_out = mlp(x)
    assert calls == [(48, 16)]
    with_grad = mlp(x)
    assert calls == [(48, 16)] and torch.equal(with_grad, fused_out)
    biased = _mlp(bias=True)
    with torch.no_grad():
        biased(x)
    unfused = GatedMLP(16, 24)
    with torch.no_grad():
        unfused(x)
    assert calls == [(48, 16)]


def test_the_mlp_keeps_peft_adapters_on_the_two_op_path(monkeypatch):
    peft = pytest.importorskip("peft")
    import vexact_models.layers as layers

    calls = []
    monkeypatch.setattr(layers, "linear_silu_and_mul", lambda x, w: calls.append(1))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = _mlp()

        def forward(self, x):
            return self.mlp(x)

    model = peft.get_peft_model(Wrapper(), peft.LoraConfig(r=2, target_modules=["gate_proj"], init_lora_weights=False))
    with torch.no_grad():
        model(torch.randn(3, 16))
    assert calls == []


def test_an_epilogue_quack_cannot_build_is_unavailable_and_the_two_ops_run(monkeypatch):
    """quack fingerprints an epilogue's source and every global it reaches, and takes a function for
    a library's (not walked into) only when its file lies under ``site-packages``. Installed on a
    plain ``PYTHONPATH`` (``pip install --target``), quack and cutlass-dsl look like user code to it,
    and building our epilogue raises TypeError on a ContextVar inside cutlass (quack 0.6.5,
    cutlass-dsl 4.8.1; first seen on the H200). Such an install is unavailable, with the reason
    named, and the MLP runs the two ops; a direct call says why it cannot run before it allocates.
    Runs with the real quack (the test extra installs it; on CPU it imports and builds epilogues)."""
    identity = pytest.importorskip("quack.gemm_runtime.identity")
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(64, 64, dtype=torch.bfloat16)
    lsq._epilogue.cache_clear()
    monkeypatch.setattr(lq, "choose", lambda *args: lq.SM90_DEFAULT)  # as in a capture on a Hopper GPU
    try:
        assert not isinstance(lsq._epilogue(), str)  # from site-packages the module builds
        assert lsq.epilogue_unavailable_reason(x, w) is None and lsq.choose(x, w) == lq.SM90_DEFAULT
        lsq._epilogue.cache_clear()
        # what quack's check answers for every file of a --target install
        monkeypatch.setattr(identity, "_is_extern_function", lambda fn: False)
        reason = lsq.epilogue_unavailable_reason(x, w)
        assert reason.startswith("quack's epilogue module cannot be imported or built: TypeError"), reason
        assert "ContextVar" in reason and lsq.choose(x, w) is None
        with pytest.raises(RuntimeError, match="epilogue module cannot be imported or built: TypeError"):
            lsq.linear_silu_and_mul_quack(x, w, lq.SM90_DEFAULT)
    finally:
        lsq._epilogue.cache_clear()


def test_triton_still_compiles_silu_and_mul_to_the_sequence_the_epilogue_repeats(monkeypatch):
    """The epilogue's bits rest on issuing `silu_and_mul`'s own instructions. Compiled for sm_90 on
    the CPU, the Triton kernel's fp32 arithmetic between its bf16 loads and its store is exactly
    `SILU_MUL_PTX`'s, in its order: a Triton that lowers ``exp`` or ``/`` otherwise fails here.
    One difference is allowed: Triton 3.9 folds the negation of ``exp(-x)`` into the constant
    (``x * -log2(e)`` in one ``mul``) where 3.6 subtracts x from 0 and multiplies by log2(e). The two
    round alike for every x: a negation is exact and round-to-nearest is symmetric in sign, and the
    one input they tell apart, x = +0 (-0 against +0), gives ``ex2`` 1 either way."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("VEXACT_BACKEND", "triton")
    from sm90_compile import compile_only

    from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

    gate, up = torch.randn(2, 64).bfloat16(), torch.randn(2, 64).bfloat16()
    with compile_only() as kernels:
        silu_and_mul_triton(gate, up, block=64, num_warps=2)
    ptx = kernels[-1].asm["ptx"]
    float_ops = r"(sub|mul|ex2\.approx|add|div\.full|div\.rn|rcp\.approx|rcp\.rn|neg|fma\.rn)(\.ftz)?\.f32"
    got = [m.group(0) for m in re.finditer(float_ops, ptx)]
    one_element = ["sub.f32", "mul.f32", "ex2.approx.f32", "add.f32", "div.full.f32", "mul.f32"]
    if got == one_element[1:]:  # the negation folded into the constant (Triton 3.9)
        assert re.search(r"mul\.f32\s+%r\d+, %r\d+, 0fBFB8AA3B;", ptx), ptx
    else:
        assert got == one_element, got  # 64 columns on 64 threads: one element a thread
        assert "0f3FB8AA3B" in ptx
    assert "cvt.rn.bf16.f32" in ptx
    epilogue = [m.group(0) for m in re.finditer(float_ops, lsq.SILU_MUL_PTX)]
    assert epilogue == one_element
    assert lsq.SILU_MUL_PTX.count("cvt.rn.bf16.f32") == 3  # gate, up, then the product


_QUACK_MISSING = lq.device_unavailable_reason()
needs_quack = pytest.mark.skipif(_QUACK_MISSING is not None, reason=f"quack: {_QUACK_MISSING}")


@pytest.mark.parametrize("k,inter", [(1024, 3072), (4096, 12288), (2048, 1408)])
@pytest.mark.parametrize("config", [c for c in lq.table_configs() if not c.swap_ab], ids=str)
@pytest.mark.gpu
@needs_quack
def test_fused_launch_equals_the_two_ops_bitwise(k, inter, config):
    from vexact_models.kernels.linear import linear_triton
    from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

    gen = torch.Generator(device="cuda").manual_seed(k + inter)
    x = (torch.randn(1000, k, device="cuda", generator=gen) * 2).bfloat16()
    w = (torch.randn(2 * inter, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    gate, up = linear_triton(x, w, None, torch.bfloat16).split(inter, dim=1)
    want = silu_and_mul_triton(gate, up)
    for m in (1, 7, 65, 128, 129, 256, 1000):
        got = lsq.linear_silu_and_mul_quack(x[:m], w, config)
        assert torch.equal(got.view(torch.int16), want[:m].view(torch.int16)), m


@pytest.mark.gpu
@needs_quack
def test_a_captured_mlp_runs_the_fused_launch_and_eager_calls_do_not(monkeypatch):
    """Inside a CUDA-graph capture (a rollout's decode step) at 128 rows the MLP's gate/up and
    SwiGLU are one quack launch; eagerly, and with ``VEXACT_LINEAR=triton``, the two ops run. All
    three give the same bits."""
    calls = []
    real = lsq.linear_silu_and_mul_quack
    monkeypatch.setattr(lsq, "linear_silu_and_mul_quack", lambda *args: calls.append(args[2]) or real(*args))
    torch.manual_seed(0)
    mlp = GatedMLP(1024, 3072).cuda().bfloat16()
    assert fuse_linears([mlp.gate_proj, mlp.up_proj])
    x = torch.randn(128, 1024, device="cuda").bfloat16()

    def captured(mode):
        with use_linear_backend(mode), torch.no_grad():
            mlp(x)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = mlp(x)
            graph.replay()
            return out.clone()

    with torch.no_grad():
        eager = mlp(x)
    assert calls == []
    fused = captured("auto")
    assert calls and all(not c.swap_ab for c in calls)
    calls.clear()
    assert torch.equal(captured("triton"), fused) and calls == []
    assert torch.equal(eager, fused)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
