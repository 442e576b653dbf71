"""``vexact export-text`` (`vexact_models.text_export`): the text model of a published-style
multimodal checkpoint (written by transformers' own multimodal class) becomes a text checkpoint
that stock transformers' text class and, after ``patch()``, the Auto classes (ours) load with no
tensor missing or left over and the multimodal model's logits; bad input is refused before
anything is written, and a failed export leaves nothing."""

import json

import pytest
import torch
import transformers

import vexact_models
from vexact_models import text_export
from vexact_models.cli import main

from .models.model_support import MULTIMODAL_FAMILIES, registered_or_skip, rel, save_multimodal

pytestmark = pytest.mark.compat  # also run on older transformers releases (.ci/run)


@pytest.fixture(params=sorted(MULTIMODAL_FAMILIES))
def multimodal(request, tmp_path):
    """(architecture, the multimodal model, its folder with a tokenizer config and a processor config)."""
    arch = registered_or_skip(request.param)
    folder = tmp_path / "multimodal"
    model = save_multimodal(arch, arch.tiny_config(), folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    (folder / "preprocessor_config.json").write_text(json.dumps({"image_processor_type": "x"}))
    return arch, model, folder


def test_the_export_loads_in_stock_and_in_ours_with_the_multimodal_logits(multimodal, tmp_path):
    arch, model, folder = multimodal
    target = text_export.export_text_model(folder, tmp_path / "text", max_shard_size="20KB", progress=False)
    files = {p.name for p in target.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "tokenizer_config.json"} <= files
    assert "preprocessor_config.json" not in files and "model-00001-of-" in " ".join(sorted(files))
    config = json.loads((target / "config.json").read_text())
    assert config["model_type"] in arch.model_types and config["architectures"] == [arch.hf_class().__name__]
    ids = torch.randint(3, 512, (2, 20))
    stock, info = arch.hf_class().from_pretrained(target, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    with torch.no_grad():
        want = model(input_ids=ids).logits
        assert rel(stock.eval()(ids).logits, want) <= 1e-6
        direct = arch.causal_lm_class.from_pretrained(folder, dtype=torch.float32).eval()(ids).logits
    vexact_models.patch()
    try:
        ours = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        critic = transformers.AutoModelForTokenClassification.from_pretrained(target, num_labels=1)
    finally:
        vexact_models.unpatch()
    assert type(ours) is arch.causal_lm_class and type(critic) is arch.token_classification_class
    assert critic.score.out_features == 1
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, direct)


def test_bad_input_is_refused_before_anything_is_written(multimodal, tmp_path):
    arch, _, folder = multimodal
    text_folder = tmp_path / "plain"
    arch.causal_lm_class(arch.tiny_config()).save_pretrained(text_folder)
    with pytest.raises(ValueError, match=rf"has model_type '{arch.model_types[0]}', not one of the multimodal"):
        text_export.export_text_model(text_folder, tmp_path / "out")
    with pytest.raises(ValueError, match=r"source='.*nowhere' is neither a checkpoint folder nor a hub model id"):
        text_export.export_text_model(tmp_path / "nowhere", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="is not a checkpoint folder"):
        text_export.export_text_model(tmp_path / "empty", tmp_path / "out")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        text_export.export_text_model(folder, tmp_path / "full")
    with pytest.raises(ValueError, match=r"max_shard_size='lots' must be a positive"):
        text_export.export_text_model(folder, tmp_path / "out", max_shard_size="lots")
    assert not (tmp_path / "out").exists() and (tmp_path / "full" / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "full", "multimodal", "plain"]


def test_a_failed_export_leaves_nothing(multimodal, tmp_path, monkeypatch):
    _, _, folder = multimodal
    calls = []

    def fail_on_the_second(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)

    from vexact_models import checkpoint_writer

    real = checkpoint_writer.save_file
    monkeypatch.setattr(checkpoint_writer, "save_file", fail_on_the_second)
    with pytest.raises(OSError, match="disk full"):
        text_export.export_text_model(folder, tmp_path / "out", max_shard_size="20KB", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multimodal"]


def test_the_command(multimodal, tmp_path, capsys):
    _, _, folder = multimodal
    assert main(["export-text", str(folder), str(tmp_path / "out"), "--no-progress", "--max-shard-size", "20000"]) == 0
    assert f"wrote the text model to {tmp_path / 'out'}: config.json" in capsys.readouterr().out
    assert (tmp_path / "out" / "model.safetensors.index.json").is_file()  # 20000 bytes a shard, as --help says
    assert main(["export-text", str(folder), str(tmp_path / "out")]) == 2
    assert "vexact export-text: error: export_text_model: target" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["export-text", "--help"])
    assert exit_.value.code == 0 and "AutoModelForImageTextToText" in capsys.readouterr().out


def test_a_hub_model_id_is_exported_from_the_hub_cache(multimodal, tmp_path, monkeypatch):
    """SOURCE as a hub id: fetched into the hub cache, or found there (offline here, laid out as a
    download leaves it), then exported as the folder is."""
    import shutil

    from huggingface_hub import constants

    _, _, folder = multimodal
    repo = tmp_path / "hub" / "models--org--multimodal"
    shutil.copytree(folder, repo / "snapshots" / ("2" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("2" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    from safetensors.torch import load_file

    from_hub = text_export.export_text_model("org/multimodal", tmp_path / "from_hub", progress=False)
    from_folder = text_export.export_text_model(folder, tmp_path / "from_folder", progress=False)
    a, b = load_file(from_hub / "model.safetensors"), load_file(from_folder / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("name", sorted(MULTIMODAL_FAMILIES))
def test_the_head_is_tied_as_the_multimodal_model_ties_it(name, tmp_path):
    """transformers ties a multimodal model's head by the multimodal config's tie_word_embeddings
    (the model's own config), not text_config's: with the two flags apart, the export takes the
    first, so stock's text class ties (or not) as the multimodal model did, with its logits."""
    arch = registered_or_skip(name)
    config_class, model_class, fields = MULTIMODAL_FAMILIES[name]
    ids = torch.randint(3, 512, (1, 12))
    for tie in (True, False):
        text = arch.tiny_config(tie_word_embeddings=not tie)
        config = getattr(transformers, config_class)(text_config=text.to_dict(), tie_word_embeddings=tie, **fields)
        torch.manual_seed(0)
        model = getattr(transformers, model_class)(config).eval()
        assert (model.lm_head.weight is model.model.language_model.embed_tokens.weight) == tie
        model.save_pretrained(tmp_path / f"mm{tie}")
        target = text_export.export_text_model(tmp_path / f"mm{tie}", tmp_path / f"text{tie}", progress=False)
        assert json.loads((target / "config.json").read_text())["tie_word_embeddings"] == tie
        stock, info = arch.hf_class().from_pretrained(target, output_loading_info=True, dtype=torch.float32)
        assert not info["missing_keys"] and not info["unexpected_keys"]
        with torch.no_grad():
            assert rel(stock.eval()(ids).logits, model(input_ids=ids).logits) <= 1e-6


def test_a_config_that_is_no_json_is_named(tmp_path, capsys):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text("{bad")
    assert main(["export-text", str(tmp_path / "src"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"vexact export-text: error: export_text_model: cannot read '{tmp_path / 'src' / 'config.json'}'" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
