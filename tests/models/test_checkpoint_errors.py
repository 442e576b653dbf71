"""A hub-layout MoE checkpoint (one tensor per expert, ``mlp.experts.<e>.gate_proj.weight``...,
which transformers fuses into ``mlp.experts.gate_up_proj`` at load time) with a missing,
mis-shaped or surplus expert tensor: the error names that tensor. transformers' own error names
only the fused target and points at its log."""

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from vexact_models.patches.checkpoints import expert_tensor_shapes
from vexact_models.registry import architectures, get

#: the architectures whose hub checkpoints transformers converts (one tensor per expert)
ARCHS = sorted(arch.name for arch in architectures()
               if arch.checkpoint_conversions and expert_tensor_shapes(arch.tiny_config()) is not None)


@pytest.fixture(scope="module", params=ARCHS)
def hub_checkpoint(request, tmp_path_factory):
    """A stock transformers model saved with stock ``save_pretrained``: the per-expert layout."""
    arch = get(request.param)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp(request.param)
    arch.hf_class()(arch.tiny_config()).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    experts = sorted(k for k in tensors if ".mlp.experts.1." in k)
    assert experts, "stock save_pretrained no longer writes one tensor per expert"
    return arch, folder, tensors, experts[0]


def rewrite(folder, out, tensors):
    """The same checkpoint with `tensors` as its weights."""
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_intact_hub_checkpoint_loads_into_fused_experts(hub_checkpoint):
    arch, folder, tensors, _ = hub_checkpoint
    model = arch.causal_lm_class.from_pretrained(folder)
    layer = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    fused = model.model.layers[layer].mlp.experts.gate_up_proj
    gate = tensors[f"model.layers.{layer}.mlp.experts.3.gate_proj.weight"]
    assert torch.equal(fused[3, :gate.shape[0]], gate)


def test_missing_expert_tensor_is_named(hub_checkpoint, tmp_path):
    arch, folder, tensors, name = hub_checkpoint
    broken = dict(tensors)
    del broken[name]
    with pytest.raises(ValueError) as info:
        arch.causal_lm_class.from_pretrained(rewrite(folder, tmp_path / "ckpt", broken))
    assert f"missing tensor(s) ['{name}']" in str(info.value), str(info.value)


def test_misshaped_expert_tensor_is_named_with_both_shapes(hub_checkpoint, tmp_path):
    arch, folder, tensors, name = hub_checkpoint
    broken = dict(tensors)
    want = tuple(broken[name].shape)
    broken[name] = torch.zeros(want[0] - 1, want[1])
    with pytest.raises(ValueError) as info:
        arch.causal_lm_class.from_pretrained(rewrite(folder, tmp_path / "ckpt", broken))
    assert f"{name} has shape {(want[0] - 1, want[1])} but the model expects {want}" in str(info.value), str(info.value)


def test_surplus_expert_is_named(hub_checkpoint, tmp_path):
    arch, folder, tensors, name = hub_checkpoint
    experts, _ = expert_tensor_shapes(arch.tiny_config())
    extra = name.replace(".experts.1.", f".experts.{experts}.")
    broken = dict(tensors, **{extra: tensors[name].clone()})
    with pytest.raises(ValueError) as info:
        arch.causal_lm_class.from_pretrained(rewrite(folder, tmp_path / "ckpt", broken))
    assert f"{extra} is for expert {experts}, but the config has {experts} experts" in str(info.value)


def test_stock_transformers_names_only_the_fused_tensor(hub_checkpoint, tmp_path):
    """Why the check exists (if transformers starts naming the tensor, this says so)."""
    arch, folder, tensors, name = hub_checkpoint
    broken = dict(tensors)
    del broken[name]
    transformers.logging.set_verbosity_error()
    try:
        with pytest.raises(Exception) as info:
            arch.hf_class().from_pretrained(rewrite(folder, tmp_path / "ckpt", broken))
    finally:
        transformers.logging.set_verbosity_warning()
    assert name not in str(info.value)
