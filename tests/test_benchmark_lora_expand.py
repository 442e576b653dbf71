"""benchmarks/lora_expand.py: its rows on the CPU (Triton's interpreter, a stand-in clock) and its
usage errors."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

ROWS_ON_CPU = """
import lora_expand
from vexact_models.kernels.lora_expand import ExpandTile
rows = lora_expand.tile_rows([("tiny", "q/k/v", 1100, (64, 32, 32)), ("tiny", "o", 600, (48,))], [5, 40], 4,
                             [ExpandTile(16, 32, 4), ExpandTile(32, 128, 4), ExpandTile(64, 16, 2),
                              ExpandTile(32, 32, 4)], device="cpu",
                             graph_timer=lambda fns: ([f() for f in fns], 0.004)[1])
for row in rows:
    print("|".join(str(c) for c in row))
"""


def test_tile_rows_time_every_tile_and_compare_bits_in_the_interpreter():
    """Per group and row count: the default tile first, then each other tile once (the default
    given again is not repeated), every tile's bits equal to the default's (reading the partials
    and reading u summed first), the clock's columns, and the engine's own tile marked."""
    env = dict(os.environ, TRITON_INTERPRET="1", VEXACT_BACKEND="triton", CUDA_VISIBLE_DEVICES="")
    run = subprocess.run([sys.executable, "-c", ROWS_ON_CPU], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=600, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split("|") for line in run.stdout.splitlines()]
    assert [(r[1], r[2], r[3]) for r in rows] == [(g, m, t) for g in ("q/k/v", "o") for m in ("5", "40")
                                                 for t in ("32x128x4", "16x32x4", "64x16x2", "32x32x4")]
    # at 5 and 40 rows the engine takes 32-column tiles (`expand_tile`: too few programs for wider)
    assert all(r[4:] == ["4.0", "1.00x", "yes", "4.0", "4.0", "4.0", "4.0", "yes" if r[3] == "32x32x4" else ""]
               for r in rows), rows


@pytest.mark.parametrize("argv,words", [
    (["--tiles", "32x128"], "a candidate is BLOCK_MxBLOCK_NxWARPS, e.g. 32x128x4, got '32x128'"),
    (["--tiles", "8x128x4"], "--tiles: 8x128x4 must be powers of two with BLOCK_M, BLOCK_N >= 16"),
    (["--tiles", "32x96x4"], "--tiles: 32x96x4 must be powers of two"),
    (["--groups", "70b"], "--groups '70b': no group's model contains it"),
])
def test_lora_expand_refuses_bad_tiles_and_groups(argv, words):
    run = subprocess.run([sys.executable, "lora_expand.py", *argv], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and words in run.stderr, run.stderr
