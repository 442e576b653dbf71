"""Every Triton launch states whether the compiler may contract a product and a sum into one FMA
(``enable_fp_fusion``, docs/design.md section 4) rather than leaving it to Triton's default.

The bits on the GPU depend on that choice, and the default is moving: Triton 3.6 contracts, Triton
3.9 still does but warns that 3.10 will not. The kernels were checked on the H200 under 3.6's
default (contraction on) or with it turned off where a CPU reference rounds every product; the
launches now say which, so a newer Triton compiles the same arithmetic."""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vexact_models.kernels._triton import HAS_TRITON

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
_NOT_LAUNCHES = {"candidates"}  # dict lookups called like launches (attention_backward_choice)


def _launches(path: Path) -> list[tuple[int, str, bool]]:
    """``(line, kernel, states fp fusion)`` for every ``kernel[grid](...)`` call in `path`."""
    tree = ast.parse(path.read_text(), str(path))
    return [(node.lineno, ast.unparse(node.func.value), any(k.arg == "enable_fp_fusion" for k in node.keywords))
            for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
            and not (isinstance(node.func.value, ast.Name) and node.func.value.id in _NOT_LAUNCHES)]


def test_every_launch_in_kernels_states_enable_fp_fusion():
    launches = {f"{path.relative_to(KERNELS)}:{line}: {name}": stated
                for path in sorted(KERNELS.rglob("*.py")) for line, name, stated in _launches(path)}
    assert len(launches) >= 60, sorted(launches)  # every module's launches were found
    assert [where for where, stated in launches.items() if not stated] == []


def test_every_launch_in_the_benchmarks_states_enable_fp_fusion():
    """The benchmarks' own kernels too: Triton 3.9 warns at a launch that leaves contraction to
    its default, which 3.10 turns off."""
    launches = {f"{path.relative_to(BENCHMARKS)}:{line}: {name}": stated
                for path in sorted(BENCHMARKS.rglob("*.py")) for line, name, stated in _launches(path)}
    assert "investigations/decode_read_floor.py" in " ".join(launches), sorted(launches)
    assert [where for where, stated in launches.items() if not stated] == []


def test_the_check_finds_a_launch_that_leaves_it_to_triton(tmp_path):
    source = tmp_path / "launch.py"
    source.write_text("def go(x):\n    _k[(1,)](x, BLOCK=4, num_warps=1)\n    _j[(1,)](x, enable_fp_fusion=False)\n")
    assert _launches(source) == [(2, "_k", False), (3, "_j", True)]


_COMPILE = """
import json, sys
import torch, triton, triton.language as tl
sys.path.insert(0, sys.argv[1])
from sm90_compile import compile_only
from vexact_models.kernels.rms_norm import rms_norm_triton

@triton.jit
def multiply_add(a, b, c, out):
    tl.store(out, tl.load(a) * tl.load(b) + tl.load(c))  # one FMA where the compiler may contract

with compile_only() as kernels:
    rms_norm_triton(torch.randn(4, 1024).bfloat16(), torch.ones(1024).bfloat16(), 1e-6)
    multiply_add[(1,)](*[torch.ones(1) for _ in range(4)])
print(json.dumps([[k.metadata.enable_fp_fusion, k.asm["ptx"].count("fma.rn.f32"), k.asm["ptx"]] for k in kernels]))
"""


@pytest.mark.skipif(not HAS_TRITON, reason="compiles a Triton kernel for sm_90")
def test_a_launch_keeps_its_contraction_when_tritons_default_turns_it_off(tmp_path):
    """Compiled for sm_90 on the CPU with Triton's default set to no contraction (3.10's), the
    norm's launch still compiles with it on (its FMAs), as it was checked on the GPU, while a
    launch that leaves it to the default loses its FMA. (A process per default: a kernel's
    in-memory cache does not know the default; a file, since Triton reads a kernel's source.)"""
    script = tmp_path / "compile.py"
    script.write_text(_COMPILE)
    compiled = {}
    for default in ("1", "0"):
        env = dict(os.environ, TRITON_DEFAULT_FP_FUSION=default, VEXACT_BACKEND="triton")
        run = subprocess.run([sys.executable, str(script), str(BENCHMARKS)], env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        compiled[default] = json.loads(run.stdout)
    (norm_on, unstated_on), (norm_off, unstated_off) = compiled["1"], compiled["0"]
    assert norm_on[0] and norm_off[0] and norm_on[2] == norm_off[2] and norm_off[1] > 0
    assert (unstated_on[:2], unstated_off[:2]) == ([True, 1], [False, 0])
