"""The switch that picks the packed attention backward (cuDNN, FlashAttention-2, Triton), on CPU.
The kernels themselves run on a GPU: tests/triton_checks/check_attention_backward_*.py."""

import pytest
import torch

from vexact_models.kernels import UnsupportedError
from vexact_models.kernels import attention_backward_choice as choice
from vexact_models.kernels.attention_backward_choice import (ENV_VAR, backward_mode, choose_attention_backward,
                                                             set_attention_backward, use_attention_backward)


def _qkv(t=10, hq=4, hkv=2, d=16, dtype=torch.bfloat16):
    return torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, d).to(dtype)


pytestmark = pytest.mark.usefixtures("clean_attention_backward")


def test_switch_reads_environment_and_override(monkeypatch):
    assert backward_mode() == "auto"
    for mode in ("cudnn", "flash", "triton", "auto"):
        monkeypatch.setenv(ENV_VAR, mode)
        assert backward_mode() == mode
    with use_attention_backward("triton"):  # the override wins over the environment
        assert backward_mode() == "triton"
        with use_attention_backward("cudnn"):
            assert backward_mode() == "cudnn"
        assert backward_mode() == "triton"
    assert backward_mode() == "auto"


def test_switch_bad_values_raise_naming_it(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='fast'.*'auto', 'cudnn', 'fa4', 'flash', 'triton'"):
        backward_mode()
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=ENV_VAR):
        choose_attention_backward(q, k, v)
    monkeypatch.delenv(ENV_VAR)
    with use_attention_backward("triton"):
        with pytest.raises(ValueError, match="attention backward='Flash'"):
            set_attention_backward("Flash")
        assert backward_mode() == "triton"  # the bad value changed nothing


def test_choice_per_mode_on_cpu():
    q, k, v = _qkv()
    assert choose_attention_backward(q, k, v) == "triton"  # auto: neither cuDNN nor FA2 runs on CPU
    with use_attention_backward("triton"):
        assert choose_attention_backward(q, k, v) == "triton"
    with use_attention_backward("flash"), pytest.raises(UnsupportedError, match="'flash'.*CUDA"):
        choose_attention_backward(q, k, v)
    with use_attention_backward("cudnn"), pytest.raises(UnsupportedError, match="'cudnn' but the cudnn backward"):
        choose_attention_backward(q, k, v)
    with use_attention_backward("fa4"), pytest.raises(UnsupportedError, match="'fa4' but the fa4 backward"):
        choose_attention_backward(q, k, v)


def test_auto_prefers_cudnn_then_fa4_then_flash(monkeypatch):
    """The order under auto, with each candidate's availability stubbed (the availability checks
    themselves are tested in test_attention_backward_{cudnn,flash}.py)."""
    q, k, v = _qkv()
    monkeypatch.setattr(choice, "cudnn_backward_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(choice, "fa4_unavailable_reason", lambda *a: None)
    monkeypatch.setattr(choice, "flash_backward_unavailable_reason", lambda *a: None)
    assert choose_attention_backward(q, k, v) == "cudnn"
    with use_attention_backward("flash"):
        assert choose_attention_backward(q, k, v) == "flash"
    monkeypatch.setattr(choice, "cudnn_backward_unavailable_reason", lambda *a: "no cuDNN")
    assert choose_attention_backward(q, k, v) == "fa4"
    monkeypatch.setattr(choice, "fa4_unavailable_reason", lambda *a: "no FA4")
    assert choose_attention_backward(q, k, v) == "flash"
    with use_attention_backward("cudnn"), pytest.raises(UnsupportedError, match="no cuDNN"):
        choose_attention_backward(q, k, v)
    monkeypatch.setattr(choice, "flash_backward_unavailable_reason", lambda *a: "no FA2")
    assert choose_attention_backward(q, k, v) == "triton"
