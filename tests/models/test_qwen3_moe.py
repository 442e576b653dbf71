"""Qwen3-MoE training variant: HF parity (logits, aux loss, grads), checkpoint layouts."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3MoeForCausalLM as HFQwen3MoeForCausalLM

from vexact_models.qwen3_moe import Qwen3MoeForCausalLM, Qwen3MoeForCausalLMInference, tiny_config

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A stock checkpoint: transformers saves experts one tensor each (the hub layout)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    torch.manual_seed(0)
    HFQwen3MoeForCausalLM(tiny_config(initializer_range=0.1)).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pair(checkpoint):
    hf = HFQwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ours = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    return hf, ours


def test_hub_checkpoint_stores_one_tensor_per_expert(checkpoint):
    keys = load_file(checkpoint / "model.safetensors")
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in keys and "model.layers.1.mlp.up_proj.weight" in keys


def test_logits_and_aux_loss_match_stock(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (3, 30))
    with torch.no_grad():
        a, b = hf(ids, output_router_logits=True), ours(ids, output_router_logits=True)
    assert rel(b.logits, a.logits) <= 1e-5
    assert abs(float(a.aux_loss) - float(b.aux_loss)) < 1e-5
    assert len(b.router_logits) == 2  # layers 0 and 2 are sparse, layer 1 dense


def test_loss_and_gradients_match_stock(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 12))
    loss_hf = hf(ids, labels=ids, output_router_logits=True).loss
    loss_ours = ours(ids, labels=ids, output_router_logits=True).loss
    assert abs(float(loss_hf) - float(loss_ours)) < 1e-5
    names = [n for n, _ in hf.named_parameters()]
    g_hf = dict(zip(names, torch.autograd.grad(loss_hf, list(hf.parameters()))))
    g_ours = dict(zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(loss_ours, list(ours.parameters()))))
    assert g_hf.keys() == g_ours.keys()
    for name in names:
        assert rel(g_ours[name], g_hf[name]) < 1e-4, name


def test_fused_layout_checkpoint_loads(pair, tmp_path):
    _, ours = pair
    ours.config.save_pretrained(tmp_path)
    save_file({k: v.contiguous() for k, v in ours.state_dict().items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(tmp_path / "model.safetensors")
    again = Qwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values()))


def test_save_pretrained_is_loadable_by_stock(pair, tmp_path):
    _, ours = pair
    ours.save_pretrained(tmp_path)
    stock = HFQwen3MoeForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert torch.equal(stock.model.layers[2].mlp.experts.down_proj, ours.model.layers[2].mlp.experts.down_proj)


def test_token_logprobs_bitwise_across_packing(pair):
    _, ours = pair
    seqs = [torch.randint(0, 512, (n,)) for n in (9, 1, 21)]
    with torch.no_grad():
        alone = [ours.token_logprobs(s[None])[0] for s in seqs]
        packed = ours.token_logprobs(torch.cat(seqs), cu_seqlens=torch.tensor([0, 9, 10, 31]))
    for got, want in zip(torch.split(packed, [9, 1, 21]), alone):
        assert torch.equal(got, want)


def test_inference_variant_shares_storage(pair):
    _, ours = pair
    inference = Qwen3MoeForCausalLMInference(ours)
    assert {p.data_ptr() for p in inference.parameters()} == {p.data_ptr() for p in ours.parameters()}
