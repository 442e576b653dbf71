"""The switch between our attention forward and FlashAttention-4 (`attention_forward_choice`),
and FA4's availability checks, on CPU. FA4 itself runs on a Hopper GPU: test_attention_fa4.py."""

import math

import pytest
import torch

from vexact_models.kernels import (UnsupportedError, attention, attention_forward_mode, attention_packed,
                                   set_attention_forward, use_attention_forward)
from vexact_models.kernels import attention_fa4 as fa4
from vexact_models.kernels.attention import attention_forward_triton, packed_layout
from vexact_models.kernels.attention_forward_choice import ENV_VAR, choose_attention_forward


@pytest.fixture(autouse=True)
def clean_switch(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    set_attention_forward(None)
    yield
    set_attention_forward(None)


def _qkv(t=10, hq=4, hkv=2, d=16, dv=16, dtype=torch.bfloat16):
    return torch.randn(t, hq, d).to(dtype), torch.randn(t, hkv, d).to(dtype), torch.randn(t, hkv, dv).to(dtype)


def test_the_default_is_ours_and_the_environment_or_override_chooses(monkeypatch):
    q, k, v = _qkv()
    assert attention_forward_mode() == "triton" and choose_attention_forward(q, k, v) == "triton"
    monkeypatch.setenv(ENV_VAR, "fa4")
    assert attention_forward_mode() == "fa4"
    with use_attention_forward("triton"):
        assert attention_forward_mode() == "triton"
    monkeypatch.setenv(ENV_VAR, "flash")
    with pytest.raises(ValueError, match=rf"{ENV_VAR}='flash' is not an attention forward; choose one of \('triton', 'fa4'\)"):
        attention_forward_mode()


def test_a_forced_fa4_that_cannot_run_raises_before_any_kernel_runs():
    q, k, v = _qkv()
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    with use_attention_forward("fa4"):
        with pytest.raises(UnsupportedError, match=f"{ENV_VAR}/use_attention_forward is 'fa4' but FA4 cannot run"):
            choose_attention_forward(q, k, v)
        with pytest.raises(UnsupportedError, match="FA4 cannot run"):
            attention_forward_triton(q, k, v, packed_layout(cu, 6), 0.25, packed=True)


def test_the_switch_applies_to_the_triton_backend_only():
    """On CPU the reference backend runs for training and rollout alike, whatever the switch."""
    q, k, v = _qkv(dtype=torch.float32)
    cu = torch.tensor([0, 6, 10], dtype=torch.int32)
    want = attention_packed(q, k, v, cu, 6)
    paged = attention(q, k, v, packed_layout(cu, 6))
    with use_attention_forward("fa4"):
        assert torch.equal(attention_packed(q, k, v, cu, 6), want)
        assert torch.equal(attention(q, k, v, packed_layout(cu, 6)), paged)


def test_fa4_unavailable_reasons_name_the_first_failing_requirement(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(fa4, "_fa4_interface", lambda: "ModuleNotFoundError: No module named 'flash_attn'")
    assert fa4.fa4_unavailable_reason(q, k, v).startswith("flash_attn.cute (pip install flash-attn-4) cannot be imported")
    monkeypatch.setattr(fa4, "_fa4_interface", lambda: object())  # stands for an importable package
    assert "FA4 needs all of one of" in fa4.fa4_unavailable_reason(*_qkv(dtype=torch.float32))
    assert "head dims 12/16" in fa4.fa4_unavailable_reason(*_qkv(d=12))
    assert "head dims 16/264" in fa4.fa4_unavailable_reason(*_qkv(dv=264))
    assert "devices q=cpu" in fa4.fa4_unavailable_reason(q, k, v)


def test_fa4_lse_is_ours_in_log2_units_token_major():
    lse = torch.randn(3, 5)  # FA4: [heads, tokens], natural log
    ours = fa4._lse_ours(lse)
    assert ours.shape == (5, 3) and ours.is_contiguous()
    assert torch.equal(ours, lse.t() * math.log2(math.e))
