"""The rollout-loop benchmark scripts run end to end on CPU (``--tiny``): transformers'
`generate_batch` calls, multi-turn calls keeping their pages, and agent-loop clients against the
OpenAI server; each checks its rollouts against the recompute. (Their --help and CPU refusal:
`test_benchmark_scripts.py`.)"""

import os
import subprocess
import sys
from pathlib import Path

import pytest


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_generate_batch_runs_tiny_on_cpu():
    """benchmarks/generate_batch.py --tiny: our model's generate_batch (a new engine a call, and a kept
    one) beside stock's on the stock class, every call a row; the kept engine's tokens the same,
    every sample recomputed with 0 mismatches."""
    run = subprocess.run([sys.executable, "generate_batch.py", "--tiny"], cwd=BENCHMARKS, capture_output=True,
                         text=True, timeout=600, env=dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore"))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split() and line.split()[0] in ("1", "2")]
    assert len(rows) == 2 and all(len(r) == 9 and r[-1].endswith("x") for r in rows)
    assert "0 mismatches" in run.stdout and "the same as a new engine a call" in run.stdout
    assert run.stdout.rstrip().endswith("OK")


@pytest.mark.parametrize("config", [[], ["--config", "qwen3.5-35b-a3b"], ["--config", "qwen3.5-35b-a3b", "--system-len", "40"]])
def test_multi_turn_runs_tiny_on_cpu(config):
    """benchmarks/multi_turn.py --tiny: the engine keeping its pages across calls shares the earlier
    turns' pages (none in turn 1, more each turn after; a gated-DeltaNet hybrid through its kept
    states: with the system prompt, turn 1's replies reach 64 tokens and keep their states there,
    which turn 2's prompts take and turn 3's too, their share point being 64 as well), the engine
    starting afresh shares none but a system prompt (its 40 tokens hold 2 pages of 16, taken by 2
    of the 3 conversations each turn), their outputs are bitwise equal and equal the recompute; the
    first-use table counts no compile or capture on the CPU."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "multi_turn.py", "--tiny", *config], cwd=BENCHMARKS, capture_output=True,
                         text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    rows = [line.split() for line in run.stdout.splitlines() if line.split()[:1] in (["1"], ["2"], ["3"])]
    rows, first_use = rows[:3], rows[3:]
    assert [r[0] for r in rows] == ["1", "2", "3"] and all(r[-1].endswith("x") for r in rows), run.stdout
    # the CPU's reference kernels compile nothing, and no CUDA graph is captured off CUDA
    assert first_use == [[t, "0", "0", "0", "(0.00", "s)", "0", "(0.00", "s)"] for t in "123"], run.stdout
    kept, afresh = [int(r[2]) for r in rows], [int(r[3]) for r in rows]
    if "--system-len" in config:
        assert kept == [2 * 32, 3 * 64, 3 * 64] and afresh == [2 * 32] * 3, run.stdout
    else:
        assert kept[0] == 0 and 0 < kept[1] < kept[2] and afresh == [0, 0, 0], run.stdout
    assert "bitwise equal" in run.stdout and ", 0 mismatches" in run.stdout and run.stdout.rstrip().endswith("OK")


def test_multi_turn_refuses_bad_options_as_usage_errors():
    refused = _usage("multi_turn.py", "--tiny", "--turns", "0")
    assert refused.returncode == 2 and "--turns" in refused.stderr
    refused = _usage("multi_turn.py", "--tiny", "--system-len", "-1")
    assert refused.returncode == 2 and "argument --system-len: must be >= 0, got -1" in refused.stderr


def test_serve_runs_tiny_on_cpu():
    """benchmarks/serve.py --tiny: agent-loop clients over HTTP, in process and through whole calls get the
    same tokens and logprobs every turn, which the recompute finds equal; a bad option is a usage
    error."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    run = subprocess.run([sys.executable, "serve.py", "--tiny"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert "online (HTTP)" in run.stdout and "per-call generate" in run.stdout and "x tok/s" in run.stdout
    assert "in process" in run.stdout and "all modes: True" in run.stdout and " 60 tokens, 0 mismatches" in run.stdout, run.stdout
    refused = _usage("serve.py", "--tiny", "--min-tokens", "9", "--max-tokens", "4")
    assert refused.returncode == 2 and "--min-tokens" in refused.stderr


def _usage(script: str, *argv: str) -> subprocess.CompletedProcess:
    """`script` run with `argv` that its parser refuses (before any work)."""
    return subprocess.run([sys.executable, script, *argv], cwd=BENCHMARKS, capture_output=True, text=True, timeout=300)
