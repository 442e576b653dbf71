from vexact_models.cli import main


def test_demo_runs_end_to_end(capsys):
    assert main(["demo", "--device", "cpu", "--pool", "8", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    assert "vexact_models.qwen3.modeling.Qwen3ForCausalLM" in out and "RESULT: PASS" in out
    assert "model.safetensors" in out
