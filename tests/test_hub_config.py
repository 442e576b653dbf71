"""`vexact_models.hub_config`: where a checkpoint comes from (its config, its quantization method,
a hub id's folder) and which file holds each of its tensors."""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

from vexact_models import hub_config

pytestmark = pytest.mark.compat


def test_stored_tensors_from_an_index_or_a_single_file_and_the_reader(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    save_file({"a": torch.arange(3.0), "b": torch.ones(2)}, single / "model.safetensors")
    files = hub_config.stored_tensors(single, "test")
    assert files == {"a": single / "model.safetensors", "b": single / "model.safetensors"}
    assert torch.equal(hub_config.TensorReader(files).get("a"), torch.arange(3.0))
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": torch.zeros(1)}, sharded / "one.safetensors")
    save_file({"b": torch.full((2,), 7.0)}, sharded / "two.safetensors")
    (sharded / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"a": "one.safetensors", "b": "two.safetensors"}}))
    reader = hub_config.TensorReader(hub_config.stored_tensors(str(sharded), "test"))
    assert torch.equal(reader.get("b"), torch.full((2,), 7.0)) and torch.equal(reader.get("a"), torch.zeros(1))
    with pytest.raises(ValueError, match=r"who: source '.*empty' holds no safetensors checkpoint"):
        (tmp_path / "empty").mkdir()
        hub_config.stored_tensors(tmp_path / "empty", "who")


def test_quant_method_and_the_config_a_load_reads(tmp_path):
    assert hub_config.quant_method({"quantization_config": {"quant_method": "fp8"}}) == "fp8"
    assert hub_config.quant_method({"model_type": "qwen3"}) is None
    assert hub_config.quant_method(transformers.Qwen3Config()) is None
    config = transformers.Qwen3Config(num_hidden_layers=1)
    config.save_pretrained(tmp_path)
    assert hub_config.checkpoint_config(tmp_path, {})["num_hidden_layers"] == 1  # the stored dict
    assert hub_config.checkpoint_config(tmp_path, {"config": config}) is config  # a config passed wins
    assert hub_config.dequantize_requested({"dequantize": True})
    assert not hub_config.dequantize_requested(None)
