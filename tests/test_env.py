"""``vexact env``: what a bug report needs, as a subprocess and through `vexact_models.cli.main`."""

import importlib.metadata as metadata
import json
import os
import platform
import subprocess
import sys

import pytest
import torch
import transformers

from vexact_models import env_report
from vexact_models.cli import main
from vexact_models.switches import declared_switches


def _installed(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


def test_vexact_env_as_a_command_prints_versions_device_backend_and_switches():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VEXACT_")}
    env.update(VEXACT_PDL="off", VEXACT_LINEAR="cublas")
    out = subprocess.run([sys.executable, "-m", "vexact_models.cli", "env"], env=env, capture_output=True, text=True,
                         check=True, timeout=300).stdout
    lines = out.splitlines()
    assert f"- python: {platform.python_version()}" in lines
    for name in ("torch", "triton", "transformers", "peft", "accelerate", "trl", "verl", "quack-kernels", "flash-attn-4",
                 "nvidia-cudnn-frontend"):
        assert f"- {name}: {_installed(name)}" in lines
    # the distributions' versions: PyPI's CUDA wheels of torch leave the local tag (+cu132) out of theirs
    assert f"- torch: {torch.__version__.split('+')[0]}" in {line.split('+')[0] for line in lines}
    assert f"- transformers: {transformers.__version__}" in lines
    if not torch.cuda.is_available():
        assert any(line.startswith("- device: cpu") for line in lines)
        assert "- kernel backend on cpu: reference" in lines
    switch_lines = [line.split() for line in lines if line.startswith("    VEXACT_")]
    assert [words[0] for words in switch_lines] == [s.env_var for s in declared_switches()[0]]
    assert "    VEXACT_PDL" in out and any(w[:3] == ["VEXACT_PDL", "=", "off"] and "(set;" in w for w in switch_lines)
    assert any(w[:4] == ["VEXACT_LINEAR", "=", "'cublas'", "(invalid)"] for w in switch_lines)  # reported, not raised
    assert any(w[:3] == ["VEXACT_ATTENTION_FORWARD", "=", "triton"] and "(unset;" in w for w in switch_lines)
    assert "modes auto|cudnn|fa4|flash|triton;" in out


def test_vexact_env_json_through_main(capsys, monkeypatch):
    monkeypatch.setenv("VEXACT_BACKEND", "reference")
    monkeypatch.delenv("VEXACT_ATTENTION_ORDER", raising=False)
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["versions"]["torch"] == _installed("torch") and report["versions"]["python"] == platform.python_version()
    assert report["versions"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert report["backend"] == {"device": "cuda" if torch.cuda.is_available() else "cpu", "backend": "reference"}
    assert report["device"]["type"] == ("cuda" if torch.cuda.is_available() else "cpu")
    rows = {row["name"]: row for row in report["switches"]}
    assert set(rows) == {s.env_var for s in declared_switches()[0]}
    assert rows["VEXACT_BACKEND"] | {"module": None} == {
        "name": "VEXACT_BACKEND", "value": "reference", "environment": "reference", "default": "auto",
        "modes": ["reference", "triton", "fast", "auto"], "chooses": "backend", "module": None}
    assert rows["VEXACT_ATTENTION_ORDER"]["environment"] is None and rows["VEXACT_ATTENTION_ORDER"]["value"] == "longest"
    assert report["switch_modules_not_imported"] == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_vexact_env_names_each_cuda_device_and_its_capability(capsys):
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    major, minor = torch.cuda.get_device_capability(0)
    assert f"- device cuda:0: {torch.cuda.get_device_name(0)} (sm_{major}{minor})" in out
    assert "- kernel backend on cuda: triton" in out


def test_a_bad_backend_is_reported_and_help_explains(capsys, monkeypatch):
    monkeypatch.setenv("VEXACT_BACKEND", "cublas")
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "kernel backend on" in out and "none: VEXACT_BACKEND='cublas' is not a backend" in out
    with pytest.raises(SystemExit) as exit_:
        main(["env", "--help"])
    assert exit_.value.code == 0
    help_text = capsys.readouterr().out
    assert "bug report" in help_text and "--json" in help_text and "not installed" in help_text


def test_requirement_names_put_the_core_first_and_leave_tooling_out():
    requirements = ['torch>=2.11', 'numpy>=1.24', 'pytest>=8; extra == "test"', 'triton==3.6.0; extra == "test"',
                    'triton>=3.6; extra == "gpu"', 'quack_kernels>=0.6.5; extra == "quack"',
                    'matplotlib>=3.7; extra == "examples"', 'trl>=1.16; extra == "examples"', 'trl>=1.16; extra == "trl"',
                    'flash-attn-4>=4.0.0b36; extra == "fa4"']
    assert env_report.requirement_names(requirements) == ["torch", "triton", "transformers", "peft", "numpy",
                                                          "quack-kernels", "nvidia-cutlass-dsl", "trl", "flash-attn-4"]
    found = env_report.versions(['vexact-no-such-package>=1; extra == "x"'])
    assert found["vexact-no-such-package"] == "not installed" and found["torch"] == metadata.version("torch")
