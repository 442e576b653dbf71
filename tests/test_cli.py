import pytest

from vexact_models.cli import main


def test_demo_runs_end_to_end(capsys):
    assert main(["demo", "--device", "cpu", "--pool", "8", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "vexact_models.qwen3.modeling.Qwen3ForCausalLM" in out and "RESULT: PASS" in out
    assert "model.safetensors" in out


def test_demo_takes_another_architecture(capsys):
    """``--arch`` builds that architecture's tiny config: the gated-DeltaNet hybrid rolls out with its
    state cache and matches its recompute."""
    assert main(["demo", "--arch", "qwen3_5", "--device", "cpu", "--pool", "3", "--max-tokens", "5"]) == 0
    out = capsys.readouterr().out
    assert "vexact_models.qwen3_5.modeling.Qwen3_5ForCausalLM" in out and "RESULT: PASS" in out


def test_demo_refuses_bad_arguments(capsys):
    with pytest.raises(SystemExit, match="--pool=0 must be >= 1"):
        main(["demo", "--device", "cpu", "--pool", "0"])
    with pytest.raises(SystemExit):
        main(["demo", "--arch", "gpt2"])
    assert "invalid choice: 'gpt2'" in capsys.readouterr().err


def test_new_architecture_writes_a_package_and_prints_the_next_steps(tmp_path, capsys):
    assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "mistral").iterdir()) == ["__init__.py", "modeling.py"]
    assert (tmp_path / "tests" / "test_mistral.py").is_file()
    assert "MistralConfig has no attention_bias, mlp_bias" in out
    assert "sliding_window" not in out  # the Llama template honours it (layers.layer_window): nothing to flag
    assert '[project.entry-points."vexact_models.architectures"]\nmistral = "mistral"' in out
    # a second run refuses, naming the folder, and changes nothing
    assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path)]) == 2
    assert "mistral already exists; the scaffold never overwrites" in capsys.readouterr().err


def test_new_architecture_dry_run_and_errors(tmp_path, capsys):
    assert main(["new-architecture", "mistral", "--from", "qwen3", "--dest", str(tmp_path), "--dry-run"]) == 0
    assert "Would write (dry run)" in capsys.readouterr().out and not any(tmp_path.iterdir())
    assert main(["new-architecture", "mistral", "--from", "gpt2", "--dest", str(tmp_path)]) == 2
    assert "--from 'gpt2' is not a registered architecture; choose one of" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["new-architecture", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "--config-class" in help_text and "entry point" in help_text and "never overwritten" in help_text
