"""The conformance suite over every registered architecture (tiny configs, reference backend).

A new architecture that registers itself is picked up here with no edit.
"""

import pytest
import torch

from vexact_models.conformance.cli import build_model, main, make_config
from vexact_models.conformance.suite import run_conformance
from vexact_models.registry import architectures, get


@pytest.mark.parametrize("arch", architectures(), ids=lambda a: a.name)
def test_rollout_logprobs_equal_training_logprobs_bitwise(arch):
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=64, max_tokens=20, prompt_len=40)
    names = " | ".join(s.name for s in report.scenarios)
    assert "preemptions" in names, "the preemption scenario must actually preempt"
    assert report.tokens > 5000
    assert report.mismatches == 0, [(s.name, s.mismatches, s.max_abs_diff) for s in report.scenarios]
    assert report.reproducibility_checked > 100 and report.reproducibility_mismatches == 0
    assert report.hf_parity is not None and report.hf_parity.vs_hf <= 1e-5 and report.ok


def test_suite_detects_a_batch_dependent_kernel(monkeypatch):
    """Swap the reference GEMM for BLAS (rows change with M): the suite must report mismatches."""
    import importlib

    linear_module = importlib.import_module("vexact_models.kernels.linear")  # the module, not the function

    def blas_linear(x2d, weight, bias, out_dtype):
        out = x2d.float() @ weight.float().T
        return (out if bias is None else out + bias.float()).to(out_dtype)

    monkeypatch.setattr(linear_module, "linear_reference", blas_linear)
    arch = get("qwen3")
    config = arch.tiny_config(hidden_size=256, intermediate_size=512, num_attention_heads=4, head_dim=64)
    model = build_model(arch, config, torch.device("cpu"), torch.float32)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=16, max_tokens=8, check_parity=False)
    assert report.mismatches > 0


def test_cli_prints_table(capsys):
    assert main(["--pool", "8", "--max-tokens", "4", "--prompt-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "logprobs checked" in out and "RESULT: PASS" in out


def test_cli_rejects_bad_arguments():
    with pytest.raises(SystemExit):
        main(["--pool", "0"])
    with pytest.raises(ValueError, match="no such file, and not one of the bundled configs"):
        make_config(architectures()[0], "nope", None, None)


def test_published_configs_load():
    arch = [a for a in architectures() if a.name == "qwen3"][0]
    for name in arch.published_configs:
        cfg = make_config(arch, name.removesuffix(".json"), 2, 4096)
        assert cfg.num_hidden_layers == 2 and cfg.max_position_embeddings == 4096 and cfg.head_dim == 128


def test_low_precision_parity_is_judged_against_hf_own_error():
    from vexact_models.conformance.suite import hf_parity

    arch = [a for a in architectures() if a.name == "qwen3"][0]
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.bfloat16)
    parity = hf_parity(arch, model, torch.device("cpu"))
    assert parity.ours_vs_fp32 is not None and parity.hf_vs_fp32 > 0
    assert parity.ok(), str(parity)


def test_build_model_goes_through_patch_and_restores_the_auto_classes():
    import vexact_models

    arch = get("qwen3")
    assert not vexact_models.is_patched()
    model = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    assert type(model) is arch.causal_lm_class and not vexact_models.is_patched()


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe"])
def test_cli_checks_rollouts_with_lora_adapters(name, capsys):
    assert main(["--arch", name, "--lora", "4", "--pool", "8", "--max-tokens", "6", "--prompt-len", "8"]) == 0
    out = capsys.readouterr().out
    assert "RESULT: PASS" in out
    with pytest.raises(SystemExit):
        main(["--lora", "-1"])
