"""The benchmark scripts need a GPU to measure; on CPU they must still import, explain
themselves (--help) and refuse cleanly."""

import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["kernels.py", "moe.py", "throughput.py", "decode_profile.py", "training.py"])
def test_benchmark_script_help_and_cpu_refusal(script):
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "usage" in (help_run.stdout + help_run.stderr).lower()
    cpu_run = subprocess.run([sys.executable, script], cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
                             env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert cpu_run.returncode == 2 and "needs a CUDA GPU" in cpu_run.stderr


def test_step_overhead_runs_on_cpu():
    """benchmarks/step_overhead.py measures host time only: it runs (tiny) on CPU."""
    script = "step_overhead.py"
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "--context-len" in help_run.stdout
    run = subprocess.run([sys.executable, script, "--batch", "3,8", "--steps", "3", "--warmup", "1",
                          "--context-len", "20", "--block-size", "4"],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if "schedule" in line).split()
    assert header[:2] == ["batch", "schedule"] and "postprocess" in header
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("3", "8")]
    assert [r[0] for r in rows] == ["3", "8"] and all(len(r) == 9 for r in rows)
    bad = subprocess.run([sys.executable, script, "--batch", "0"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2
