import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.conformance.models import build_model
from vexact_models.registry import get


@pytest.fixture(scope="module")
def model():
    """A tiny Qwen3 with ``initializer_range=0.5``: with the default 0.02 its logits are almost
    flat, greedy just repeats the last prompt token and sampled tokens are decided by the noise
    alone, which would make token-level assertions nearly vacuous."""
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def hybrid(request):
    """Each gated-DeltaNet hybrid (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) at its tiny config, fp32, CPU."""
    arch = get(request.param)
    return build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
