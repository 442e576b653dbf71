"""The FSDP2 scripts (docs/design.md section 8) run on CPU: the accelerate FSDP2 example on 2 processes (gloo) and
benchmarks/fsdp_sync.py in its tiny CPU mode (world size 1)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", PYTHONWARNINGS="ignore")


def test_accelerate_fsdp2_example_on_two_cpu_processes():
    """accelerate's own FSDP2 prepare path (per-layer fully_shard, activation checkpointing
    wrappers, bf16 mixed precision), rollout == sharded recompute at every step. With warnings
    shown: torch's for a sharded module that returns a view (tests/models/test_module_outputs.py)
    and for the collective name it deprecated must not appear."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(ROOT / "examples" / "accelerate_fsdp2.py"), "--arch", "qwen3_moe", "--dtype", "bfloat16",
           "--activation-checkpointing", "--steps", "2"]
    run = subprocess.run(cmd, env=dict(ENV, PYTHONWARNINGS="default"), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    for warning in ("returned a view tensor", "all_gather_into_tensor` is deprecated"):
        assert warning not in run.stderr, run.stderr[-6000:]
    steps = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all("on 2 ranks, 0 mismatches" in s for s in steps), run.stdout
    assert "qwen3_moe (FSDPQwen3MoeForCausalLM, 2 ranks): 48 tokens, 0 mismatches over 2 steps" in run.stdout


def test_accelerate_fsdp2_example_help_and_bad_flags():
    script = str(ROOT / "examples" / "accelerate_fsdp2.py")
    help_run = subprocess.run([sys.executable, script, "--help"], env=ENV, capture_output=True, text=True, timeout=60)
    assert help_run.returncode == 0 and "--activation-checkpointing" in help_run.stdout
    bad = subprocess.run([sys.executable, script, "--steps", "0"], env=ENV, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--steps must be >= 1" in bad.stderr
    # without torchrun (one process): usage and exit 2, before any model is built
    alone = subprocess.run([sys.executable, script], env={k: v for k, v in ENV.items() if not k.endswith("_SIZE")},
                           capture_output=True, text=True, timeout=60)
    assert alone.returncode == 2 and "needs 2 or more processes" in alone.stderr and "world size unset" in alone.stderr
    assert "Traceback" not in alone.stderr, alone.stderr
    one = subprocess.run([sys.executable, script], env=dict(ENV, WORLD_SIZE="1"), capture_output=True, text=True,
                         timeout=60)
    assert one.returncode == 2 and "got world size 1" in one.stderr, one.stderr


def test_fsdp_sync_benchmark_tiny_on_cpu():
    run = subprocess.run([sys.executable, "fsdp_sync.py", "--tiny"], cwd=ROOT / "benchmarks", env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    out = run.stdout
    for title in ("rollout -> sharded recompute", "weights into the engine", "peak memory", "sleep/wake cycles"):
        assert title in out, out
    row = next(line.split() for line in out.splitlines() if line.strip().startswith("tiny") and "tok/s" not in line)
    assert row[:2] == ["tiny", "2"] and int(row[2].replace(",", "")) >= 300 and row[3] == "0", row
    assert out.rstrip().endswith("OK")


def test_fsdp_sync_benchmark_refuses_without_a_gpu():
    run = subprocess.run([sys.executable, "fsdp_sync.py"], cwd=ROOT / "benchmarks", env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "needs a CUDA GPU" in run.stderr
