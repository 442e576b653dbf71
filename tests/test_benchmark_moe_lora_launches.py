"""benchmarks/moe_lora_launches.py (`moe.py --lora`'s launch table): its rows on the CPU (Triton's
interpreter, a stand-in clock that runs every timed function)."""

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

ROWS_ON_CPU = """
import moe_lora_launches
from vexact_models.kernels import expert_lora
expert_lora.REGROUP_PAIRS_PER_EXPERT = 4  # 3 tokens: B in place; 40 tokens: B copied
calls = []
def clock(fns):
    calls.append(len(fns))
    [f() for f in fns]
    return 0.002
rows = moe_lora_launches.launch_rows(4, [3, 40], device="cpu", graph_timer=clock, shape=(64, 8, 48, 2))
for row in rows:
    print("|".join(str(c) for c in row))
print("calls", *calls)
"""


def test_launch_rows_time_each_launch_and_compare_the_b_operands_in_the_interpreter():
    """Per token count and expert tensor: the base GEMM, B's two copies, both shrinks, the four
    expands (of the partials and of u, each with both B operands: their rows bitwise equal), the
    launcher; "picked" marks the rollout's operand at that many pairs an expert; one function
    timed per adapter copy (one on CPU)."""
    env = dict(os.environ, TRITON_INTERPRET="1", VEXACT_BACKEND="triton", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", ROWS_ON_CPU], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = [line.split("|") for line in lines[:-1]]
    expands = [f"expand {of}, {b}" for of in ("of partials (training)", "of u (rollout)")
               for b in ("B in PEFT layout", "B copied (copy apart)")]
    launches = ["base GEMM (peer)", "B copy by expert", "B copy, torch's of the permuted view",
                "shrink, partials (training)", "shrink, u summed (rollout)", *expands,
                "the rollout's launcher (shrink, expand, copy if picked)"]
    assert [r[:4] for r in rows] == [[t, per, tensor, launch] for t, per in (("3", "0.8"), ("40", "10.0"))
                                     for tensor in ("gate/up", "down") for launch in launches]
    assert all(r[4] == "2.0" for r in rows)
    for r in rows:
        expand = r[3].startswith("expand")
        assert r[5] == ("yes" if expand else ""), r
        copied_picked = r[0] == "40"
        rollout = "of u" in r[3]
        assert r[6] == ("yes" if expand and rollout and ("copied" in r[3]) == copied_picked else ""), r
    assert lines[-1] == "calls " + " ".join(["1"] * len(rows))
