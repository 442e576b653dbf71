"""Qwen3-MoE-specific checks: the hub layout (one tensor per expert), the auxiliary loss and the
router logits against stock. What every architecture must do is tests/models/test_architectures.py."""

import pytest
import torch
from safetensors.torch import load_file
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from vexact_models.qwen3_moe import Qwen3MoeForCausalLM, tiny_config

from .model_support import rel

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stock checkpoint: transformers saves experts one tensor each (the hub layout)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    HFQwen3MoeForCausalLM(tiny_config(initializer_range=0.1)).save_pretrained(path)
    return path


def test_hub_checkpoint_stores_one_tensor_per_expert(checkpoint):
    keys = load_file(checkpoint / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys


def test_aux_loss_and_router_logits_match_stock(checkpoint):
    hf = HFQwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (3, 30))
    with torch.no_grad():
        a, b = hf(ids, output_router_logits=True), ours(ids, output_router_logits=True)
    assert rel(b.logits, a.logits) <= 1e-5
    assert abs(float(a.aux_loss) - float(b.aux_loss)) < 1e-5
    assert len(b.router_logits) == 2  # layers 0 and 2 are sparse, layer 1 dense
    for mine, stock in zip(b.router_logits, a.router_logits):
        assert rel(mine, stock) <= 1e-5
