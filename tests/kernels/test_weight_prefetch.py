"""The decode GEMMs' weight prefetch (`kernels/weight_prefetch.py`): when launches take it, and on
a Hopper GPU that GEMMs captured in a CUDA graph with it give the bits they give without."""

import pytest
import torch

from vexact_models.kernels import (linear, set_weight_prefetch, use_dependent_launch, use_linear_backend,
                                   use_weight_prefetch)
from vexact_models.kernels.weight_prefetch import ENV_VAR, PREFETCH_MAX_ROWS, rows_prefetchable, weight_prefetch


def test_rows_prefetchable_needs_contiguous_16_byte_rows():
    weight = torch.zeros(64, 128, dtype=torch.bfloat16)
    assert rows_prefetchable(weight)
    assert not rows_prefetchable(weight.t())  # a column of the storage per row
    assert not rows_prefetchable(torch.zeros(64, 12, dtype=torch.bfloat16))  # 24-byte rows
    assert not rows_prefetchable(torch.zeros(64 * 128 + 4, dtype=torch.bfloat16)[4:].view(64, 128))  # 8-byte offset
    assert rows_prefetchable(torch.zeros(64, 256, dtype=torch.bfloat16)[:, :128])  # 256-byte rows, 512 apart


def test_cpu_launches_never_prefetch(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not weight_prefetch(torch.zeros(64, 128, dtype=torch.bfloat16), 8)


def test_a_bad_mode_names_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "on")
    with pytest.raises(ValueError, match=r"VEXACT_WEIGHT_PREFETCH='on'.*\('auto', 'off'\)"):
        weight_prefetch(torch.zeros(64, 128, dtype=torch.bfloat16), 8)
    with pytest.raises(ValueError, match="'yes'"):
        set_weight_prefetch("yes")
    with use_weight_prefetch("off"):  # the override wins over the bad variable
        assert not weight_prefetch(torch.zeros(64, 128, dtype=torch.bfloat16), 8)


def _gemm_launches(monkeypatch):
    """[(kernel name, compiled kernel)] of every Triton launch, filled by a spy on `JITFunction.run`
    (the real one runs)."""
    from triton.runtime.jit import JITFunction

    launches, real = [], JITFunction.run

    def run(self, *args, **kwargs):
        kernel = real(self, *args, **kwargs)
        launches.append((self.__name__, kernel))
        return kernel

    monkeypatch.setattr(JITFunction, "run", run)
    return launches


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="the bulk L2 prefetch and dependent launches need a Hopper or newer GPU")
@pytest.mark.parametrize("rows", [1, 128, 256, PREFETCH_MAX_ROWS + 64])
def test_graphed_gemms_prefetch_their_weights_with_the_same_bits(rows, monkeypatch):
    """qkv- and gate_up-shaped weights (pointer and TMA tiles at 256 rows), captured after a norm-like
    kernel so that the GEMMs launch dependently; the prefetch runs in `auto` up to
    `PREFETCH_MAX_ROWS` rows and never in `off`."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 1024, generator=gen).bfloat16().cuda()
    weights = [(torch.randn(n, 1024, generator=gen) / 32).bfloat16().cuda() for n in (4096, 6144, 1024)]
    weights[1] = torch.cat([weights[1], weights[1][:, :64]], dim=1)[:, :1024]  # rows 2,176 bytes apart

    def chain():
        h = x * 2  # a kernel before the first GEMM
        outs = [linear(h, w) for w in weights[:2]]
        return outs + [linear(outs[0][:, :1024].contiguous(), weights[2])]

    outputs, launches = {}, _gemm_launches(monkeypatch)
    with use_dependent_launch("auto"), use_linear_backend("triton"):
        for mode in ("off", "auto"):
            launches.clear()
            with use_weight_prefetch(mode):
                eager = chain()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured = chain()
                graph.replay()
                torch.cuda.synchronize()
            assert all(torch.equal(a, b) for a, b in zip(eager, captured)), mode
            outputs[mode] = captured
            gemms = [k for name, k in launches if name.startswith("_linear")]
            prefetching = ["cp.async.bulk.prefetch.L2" in k.asm["ptx"] for k in gemms]
            assert len(gemms) == 6 and all(p == (mode == "auto" and rows <= PREFETCH_MAX_ROWS) for p in prefetching)
    assert all(torch.equal(a, b) for a, b in zip(outputs["off"], outputs["auto"]))
