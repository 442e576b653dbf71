"""The kernel invariance CLI's shape selection and dispatch (the checks themselves need a GPU:
docs/design.md section 7)."""

import pytest

import torch

from vexact_models.conformance import attention_invariance, kernel_invariance
from vexact_models.conformance.attention_invariance import (ATTENTION_SHAPES, LATENT_SHAPES, attention_shape_names,
                                                            selected_shapes)
from vexact_models.conformance.kernel_invariance import main


def test_shape_names_list_every_attention_and_latent_shape_in_order():
    assert attention_shape_names() == [s[0] for s in ATTENTION_SHAPES] + [s[0] for s in LATENT_SHAPES]
    assert "moonlight MLA" in attention_shape_names() and "deepseek-v3 latent MLA" in attention_shape_names()


def test_selected_shapes_default_to_all_and_read_a_comma_list():
    assert selected_shapes(None) == set(attention_shape_names())
    assert selected_shapes("qwen3-8b, moonlight MLA") == {"qwen3-8b", "moonlight MLA"}


@pytest.mark.parametrize("text", ["qwen3-9b", "qwen3-8b,nope", " , "])
def test_unknown_shapes_are_refused_with_the_known_ones(text):
    with pytest.raises(ValueError) as e:
        selected_shapes(text)
    assert "--shapes" in str(e.value) and "qwen3-0.6b" in str(e.value) and "deepseek-v3 MLA" in str(e.value)


def test_cli_refuses_an_unknown_shape_before_touching_the_gpu(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--only", "attention", "--shapes", "qwen3-9b"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'qwen3-9b'" in err and "qwen3-30b-a3b" in err


@pytest.fixture
def recorded_checks(monkeypatch):
    """main() on the CPU with every attention and latent check replaced by a recorder of its shape
    (the CUDA calls around them made harmless): which checks a command line runs, and on what."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "no GPU")
    for module, name in ((attention_invariance, "check_attention"), (attention_invariance, "check_attention_configs"),
                         (kernel_invariance, "check_latent_attention"), (kernel_invariance, "check_attention_configs"),
                         (kernel_invariance, "check_head_linear"), (kernel_invariance, "check_latent_cache_write")):
        monkeypatch.setattr(module, name, lambda result, heads, *args, _name=name, **kwargs:
                            calls.append((_name, heads, args[0])))
    return calls


def test_cli_checks_only_the_named_attention_shapes(recorded_checks, capsys):
    assert main(["--only", "attention", "--quick", "--shapes", "qwen3-8b,gqa-d64"]) == 0
    assert recorded_checks == [("check_attention", 32, 8), ("check_attention_configs", 32, 8),
                               ("check_attention", 8, 2), ("check_attention_configs", 8, 2)]
    out = capsys.readouterr().out
    assert "attention qwen3-8b: 0 mismatches so far" in out and "qwen3-0.6b" not in out


def test_cli_checks_only_the_named_latent_shapes(recorded_checks):
    assert main(["--only", "latent", "--quick", "--shapes", "deepseek-v3 latent MLA,qwen3-8b"]) == 0
    assert {name for name, _, _ in recorded_checks} == {"check_latent_attention", "check_attention_configs",
                                                      "check_head_linear", "check_latent_cache_write"}
    assert {heads for _, heads, _ in recorded_checks} == {128}  # DeepSeek-V3's heads only


def test_cli_without_shapes_checks_every_attention_shape(recorded_checks):
    assert main(["--only", "attention", "--quick"]) == 0
    assert [c[1:] for c in recorded_checks if c[0] == "check_attention"] == [(s[1], s[2]) for s in ATTENTION_SHAPES]


def test_windowed_shapes_pass_their_window_and_sinks_and_fa4_leaves_them_out(recorded_checks, monkeypatch, capsys):
    from vexact_models.kernels import use_attention_forward

    seen = []
    monkeypatch.setattr(attention_invariance, "check_attention", lambda result, hq, hkv, *args, **kwargs:
                        seen.append((hq, kwargs["window"], kwargs["sinks"])))
    names = "gpt-oss sliding 128 sinks,gpt-oss full sinks,mistral-7b sliding 4096,qwen3-8b"
    assert main(["--only", "attention", "--quick", "--shapes", names]) == 0
    assert seen == [(32, None, False), (64, 128, True), (64, None, True), (32, 4096, False)]
    seen.clear()
    with use_attention_forward("fa4"):
        assert main(["--only", "attention", "--quick", "--shapes", names]) == 0
    assert seen == [(32, None, False)]
    assert "gpt-oss full sinks: left out (the fa4 forward takes no window or sinks)" in capsys.readouterr().out


def test_cli_checks_every_third_linear_shape_when_quick(recorded_checks, monkeypatch):
    from vexact_models.conformance import linear_invariance

    calls = []
    monkeypatch.setattr(linear_invariance, "check_linear", lambda result, k, n, ms, dtype: calls.append((k, n, max(ms))))
    monkeypatch.setattr(linear_invariance, "check_linear_configs", lambda result, k, n: calls.append((k, n, "configs")))
    assert main(["--only", "linear", "--quick"]) == 0
    assert calls == [(k, n, 1024) for _, _, k, n in linear_invariance.LINEAR_SHAPES[::3]] + \
        [(1024, 3072, "configs"), (4096, 1024, "configs")]
    assert not recorded_checks  # no attention check


def test_cli_checks_every_lora_group_at_rank_16_when_quick(recorded_checks, monkeypatch):
    from vexact_models.conformance import lora_invariance

    calls = []
    monkeypatch.setattr(lora_invariance, "check_lora_group",
                        lambda result, k, sizes, rank, dtype, ms, what: calls.append((k, sizes, rank, dtype, max(ms))))
    assert main(["--only", "lora", "--quick"]) == 0
    assert calls == [(k, sizes, 16, dtype, 1024) for _, _, k, sizes in lora_invariance.LORA_GROUPS
                     for dtype in (torch.float32, torch.bfloat16)]
    assert not recorded_checks  # no attention check


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_lora_group_check_finds_no_mismatch_on_the_gpu():
    from vexact_models.conformance.invariance_result import Result
    from vexact_models.conformance.lora_invariance import check_lora_group

    result = Result("lora_add")
    check_lora_group(result, 1024, (2048, 1024, 1024), 16, torch.float32, [1, 3, 64, 300], "q/k/v")
    assert result.cases > 0 and result.mismatches == 0, result.notes
