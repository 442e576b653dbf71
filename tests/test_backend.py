import pytest
import torch

from vexact_models.kernels import (BACKENDS, UnsupportedError, attention_packed, current_backend, linear, rms_norm,
                                   set_backend, use_backend)
from vexact_models.kernels.backend import select


def test_default_follows_device():
    assert current_backend(torch.device("cpu")) == "reference"
    assert current_backend(torch.device("cuda")) == "triton"


def test_set_and_use_backend_override_and_restore():
    set_backend("triton")
    try:
        assert current_backend(torch.device("cpu")) == "triton"
        with use_backend("reference"):
            assert current_backend(torch.device("cuda")) == "reference"
        assert current_backend(torch.device("cpu")) == "triton"
    finally:
        set_backend(None)
    assert current_backend(torch.device("cpu")) == "reference"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("VEXACT_BACKEND", "triton")
    assert current_backend(torch.device("cpu")) == "triton"
    monkeypatch.setenv("VEXACT_BACKEND", "auto")
    assert current_backend(torch.device("cpu")) == "reference"
    monkeypatch.setenv("VEXACT_BACKEND", "bogus")
    with pytest.raises(ValueError, match="VEXACT_BACKEND='bogus' is not a backend"):
        current_backend(torch.device("cpu"))


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend='cublas' is not a backend"):
        set_backend("cublas")
    assert set(BACKENDS) == {"reference", "triton", "fast"}


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with use_backend("triton"), pytest.raises(UnsupportedError, match="linear: backend 'triton' needs a CUDA tensor"):
        linear(torch.randn(2, 8), torch.randn(3, 8))


def test_fast_path_needs_cuda():
    with use_backend("fast"), pytest.raises(UnsupportedError, match="rms_norm: backend 'fast' needs a CUDA tensor"):
        rms_norm(torch.randn(2, 8), torch.ones(8), 1e-6)


def test_unsupported_dtype_and_head_dim_named(monkeypatch):
    with pytest.raises(UnsupportedError, match="does not support dtype torch.int32"):
        select("linear", torch.zeros(2, dtype=torch.int32))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with use_backend("triton"), pytest.raises(UnsupportedError, match="does not support head_dim=48"):
        q = torch.randn(4, 2, 48)
        attention_packed(q, q, q, torch.tensor([0, 4], dtype=torch.int32), 4)
    with use_backend("triton"), pytest.raises(UnsupportedError, match="'triton' does not support dtype torch.float64"):
        select("linear", torch.zeros(2, dtype=torch.float64))
