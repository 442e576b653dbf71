import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64."""
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm().clamp_min(1e-300))


@pytest.fixture
def clean_attention_backward(monkeypatch):
    """No attention backward choice from the environment or an override, before and after."""
    from vexact_models.kernels.attention_backward_choice import ENV_VAR, set_attention_backward

    monkeypatch.delenv(ENV_VAR, raising=False)
    set_attention_backward(None)
    yield
    set_attention_backward(None)
