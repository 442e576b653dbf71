"""The benchmark scripts need a GPU to measure; on CPU they must still import, explain
themselves (--help) and refuse cleanly."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["kernels.py", "moe.py", "throughput.py"])
def test_benchmark_script_help_and_cpu_refusal(script):
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "usage" in (help_run.stdout + help_run.stderr).lower()
    cpu_run = subprocess.run([sys.executable, script], cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
                             env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert cpu_run.returncode == 2 and "needs a CUDA GPU" in cpu_run.stderr
