import os
import stat
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("argv,words", [
    (["--pool", "0"], "argument --pool: must be >= 1, got 0"),
    (["--arch", "gpt2"], "argument --arch: unknown architecture 'gpt2'; registered: ["),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--checkpoint", "FILE"], "exists and is not an empty folder; the demo writes a new checkpoint there"),
    (["--checkpoint", "FULL"], "exists and is not an empty folder"),
])
def test_demo_refuses_bad_arguments_before_writing_anything(argv, words, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "config.json").write_text("{}")
    argv = [str(tmp_path / a.lower()) if a in ("FILE", "FULL") else a for a in argv]
    with pytest.raises(SystemExit) as info:
        main(["demo", *argv])
    assert info.value.code == 2 and words in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["config.json", "file", "full"]  # nothing written


def test_demo_names_the_transformers_an_architecture_needs(gemma3_too_old, capsys):
    """On a transformers older than an architecture's floor, ``--arch`` says which release it needs
    (it used to be an "invalid choice"), and ``--help`` lists it apart from the registered ones."""
    with pytest.raises(SystemExit) as info:
        main(["demo", "--arch", "gemma3"])
    assert info.value.code == 2
    assert "argument --arch: architecture 'gemma3' needs transformers >= 5.24" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "qwen3_5, qwen3_5_moe" in out and "; gemma3 needs transformers >= 5.24" in out


def test_demo_config_on_cuda_raises_head_dims_or_refuses_what_the_gpu_kernels_do_not_take():
    """On CUDA the tiny configs' head dims are raised to the GPU attention's smallest; an MLA
    config (latent and rope dims) or a head dim derived from a small hidden size (Qwen2's) is
    refused, naming the CPU and published-shape ways out (H200, 2026-12-04: both crashed in the
    attention kernel before)."""
    from vexact_models.cli import demo_config

    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # only configs are built: no GPU needed
    assert demo_config("qwen3_5", cuda)[1].head_dim == 64 and demo_config("qwen3_5", cpu)[1].head_dim == 32
    for arch in ("deepseek_v3", "qwen2"):
        with pytest.raises(ValueError, match=f"--arch {arch} on cuda: its tiny test config's attention dims are below"):
            demo_config(arch, cuda)
        assert demo_config(arch, cpu)[0].name == arch


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_demo_refuses_on_cuda_an_architecture_whose_tiny_attention_the_gpu_kernels_do_not_take(capsys, tmp_path):
    with pytest.raises(SystemExit) as info:
        main(["demo", "--arch", "qwen2", "--device", "cuda", "--checkpoint", str(tmp_path / "ckpt")])
    assert info.value.code == 2 and "--arch qwen2 on cuda: its tiny test config's attention dims" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()


def test_demo_help_explains_and_conformance_keeps_its_name(capsys):
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "recompute every sampled token's logprob" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["conformance", "--pool", "0"])
    assert info.value.code == 2 and capsys.readouterr().err.startswith("usage: vexact conformance")


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
    (tmp_path / "afile").write_text("x")
    for extra in ([], ["--dry-run"]):  # refused either way, and the file is left as it was
        assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path / "afile"), *extra]) == 2
        assert "afile' is a file, not a folder" in capsys.readouterr().err
    assert (tmp_path / "afile").read_text() == "x"
    with pytest.raises(SystemExit) as exit_:
        main(["new-architecture", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "--config-class" in help_text and "entry point" in help_text and "never overwritten" in help_text


def test_demo_refuses_a_backend_it_does_not_take_before_writing_anything(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("VEXACT_BACKEND", "bogus")
    with pytest.raises(SystemExit) as info:
        main(["demo", "--device", "cpu", "--checkpoint", str(tmp_path / "ckpt")])
    assert info.value.code == 2
    assert "vexact demo: error: VEXACT_BACKEND='bogus' is not a backend; choose one of" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_new_architecture_refuses_a_dest_it_cannot_write(tmp_path, capsys, monkeypatch):
    """--dest whose tests/ is a file, or a folder it may not write in: a usage error naming --dest and
    the path, before anything is written (tracebacks before)."""
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "tests").write_text("x")
    (tmp_path / "locked").mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "locked" and real_access(path, mode))
    for dest, words in (("d", f"--dest '{tmp_path / 'd'}': cannot write {tmp_path / 'd' / 'tests' / 'test_mistral.py'}: "
                              f"'{tmp_path / 'd' / 'tests'}' is not a folder"),
                        ("locked", f"no permission to write in '{tmp_path / 'locked'}'")):
        for extra in ([], ["--dry-run"]):
            assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path / dest), *extra]) == 2
            assert words in capsys.readouterr().err
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == ["d", "d/tests", "locked"]


def test_new_architecture_leaves_nothing_when_writing_fails_and_writes_plain_modes(tmp_path, capsys, monkeypatch):
    """A failure while writing (the final rename here) leaves no test, staging folder or --dest
    folders it made; a written package folder has a plain mkdir's mode (0o700 from mkdtemp before)."""
    def fail(self, target):
        raise OSError(18, "Invalid cross-device link")

    with monkeypatch.context() as patch:
        patch.setattr(Path, "rename", fail)
        assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path / "new" / "pkg")]) == 2
    assert "Invalid cross-device link" in capsys.readouterr().err and not any(tmp_path.iterdir())
    previous = os.umask(0o022)
    try:
        assert main(["new-architecture", "mistral", "--from", "llama", "--dest", str(tmp_path / "pkg")]) == 0
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "pkg" / "mistral").stat().st_mode) == 0o755
