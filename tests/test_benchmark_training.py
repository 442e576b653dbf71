"""The training benchmarks on the CPU: benchmarks/training.py (its kernel groups, a tiny hybrid run
with stock's paths, a refused stock backward as a row, its argument errors) and the GDN layer's
profile in benchmarks/gated_delta.py."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
TINY_ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")


def test_training_profile_groups_kernels(monkeypatch, capsys):
    """`training.py --profile`: kernel names land in the step part they belong to, and the
    per-group table adds each side's kernels up."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import training

    assert training.kernel_group("_attention_fwd_kernel") == "attention forward"
    assert training.kernel_group("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>") == "attention backward"
    assert training.kernel_group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention backward"
    assert training.kernel_group("_linear_tma_kernel") == "GEMM (Triton linear)"
    assert training.kernel_group("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT") == "GEMM (cuBLAS)"
    assert training.kernel_group("void at::native::vectorized_elementwise_kernel<4, ...>") == "copies, casts, elementwise"
    assert training.kernel_group("something_new") == "other"
    training.print_profiles("t", {"hf": {"nvjet_a": 0.002, "flash_fwd": 0.001},
                                  "vexact": {"_linear_kernel": 0.0015, "_attention_fwd_kernel": 0.0005}}, top=1)
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.strip().startswith("total")).split()
    assert total == ["total", "3.00", "2.00"]
    assert "top 1 kernels" in out and "_linear_kernel" in out and "_attention_fwd_kernel" not in out.split("vexact: top")[1]


def test_a_side_out_of_memory_leaves_its_row_without_a_ratio(monkeypatch, capsys):
    """`print_pair_table`: where stock ran out of memory (its rate NaN) the row says OOM and gives
    no ratio (it printed ``nanx``); a row both sides ran keeps it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import training

    nan = float("nan")
    rows = [["hf", None, 4096, 8, True, nan, nan, nan, "OOM"], ["vexact", None, 4096, 8, True, 1.0, 34303.0, 2**30, None],
            ["hf", None, 32768, 1, True, 2.0, 16326.0, 2**31, None], ["vexact", None, 32768, 1, True, 1.8, 17722.0, 2**30, None]]
    training.print_pair_table("t", rows, full_recompute=False)
    lines = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    assert lines[0][4:7] == ["OOM", "34,303", "-"] and lines[1][4:7] == ["16,326", "17,722", "1.09x"]  # ("keep attn")


def test_training_hybrid_tiny_times_the_torch_path_and_reports_fla_absent(monkeypatch, capsys):
    """benchmarks/training.py --tiny on Qwen3.5-MoE with the fla import made unavailable: stock's
    torch delta rule is timed (with our rate over it), fla's rows say it is not installed, and ours
    is also timed forward alone (the pass fla's side would get beside its refused backward)."""
    import sys as sys_

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys_.modules, name, None)  # `import fla` raises ImportError
    import training

    assert training.main(["--tiny", "--configs", "qwen3.5-35b-a3b"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.split("## qwen3.5-35b-a3b tiny (3 layers)")[1].splitlines()[2:] if line.strip()]
    assert [r[0] for r in rows] == ["24"] * 5 + ["40"] * 5, out
    torch_rows = [r for r in rows if "torch" in r]
    assert len(torch_rows) == 2 and all(r[-1].endswith("x") and r[-1] != "-" for r in torch_rows), out
    fla_rows = [line for line in out.splitlines() if "fla kernels)" in line and line.strip()[:2] in ("24", "40")]
    assert len(fla_rows) == 4 and all("not installed (ModuleNotFoundError" in line for line in fla_rows), out
    ours = [r for r in rows if "vexact" in r]
    assert [r[r.index("vexact") + 1] for r in ours] == ["fwd+bwd", "forward"] * 2 and all(r[-1] == "1.00x" for r in ours)


def test_training_run_side_reports_a_refused_backward_as_its_row(monkeypatch):
    """`training.run_side` with `refusable` (stock's fla side): a backward that raises (fla 0.6 on
    Hopper under Triton < 3.7.1) is the row's result, "refused: ...", and the forward-alone pass
    is still timed; without `refusable` (ours, stock's torch path) the error propagates."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import training

    from vexact_models.conformance.models import architecture_of, build_model, make_config

    class Refuse(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("the backward needs Triton >= 3.7.1 on Hopper\nmore")

    def refused_loss(model, ids):
        return Refuse.apply(training.hf_loss(model, ids))

    arch = architecture_of("qwen3.5-35b-a3b")
    model = build_model(arch, make_config(arch), torch.device("cpu"), torch.float32).train()
    args = SimpleNamespace(checkpointing="off", full_recompute=False, tokens=48, seed=0, device=torch.device("cpu"),
                           steps=1, profile=0)
    rows, profiles = training.run_side("HF (fla)", model, refused_loss, [24], args, 1, ("fwd+bwd", "forward"),
                                       refusable=True)
    assert rows[0][:2] == ["HF (fla)", "fwd+bwd"]
    assert rows[0][8] == "refused: RuntimeError: the backward needs Triton >= 3.7.1 on Hopper"
    assert rows[1][1] == "forward" and rows[1][8] == "" and rows[1][6] > 0 and profiles == {}
    with pytest.raises(RuntimeError, match="Triton >= 3.7.1"):
        training.run_side("vexact", model, refused_loss, [24], args, 1, ("fwd+bwd",))


@pytest.mark.parametrize("argv,words", [
    (["--configs", "qwen3-0.6b", "--stock-linear-attention", "torch"],
     "--stock-linear-attention=torch: qwen3-0.6b has no gated-DeltaNet layers"),
    (["--configs", "qwen3.5-35b-a3b", "--stock-linear-attention", "torch,triton"],
     "--stock-linear-attention: expected a comma-separated subset of torch,fla, got 'torch,triton'"),
    (["--configs", "nope:4"], "--configs 'nope': config 'nope': no such file"),
    (["--tiny", "--configs", "qwen3-0.6b,qwen3.5-35b-a3b", "--set", "linear_num_key_heads=2"],
     "Qwen3Config has no field 'linear_num_key_heads'"),  # every config gets every override
])
def test_training_refuses_bad_configs_and_stock_paths(argv, words):
    """training.py names the option and the value before building anything (and before it needs a GPU)."""
    run = subprocess.run([sys.executable, "training.py", *argv], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120, env=TINY_ENV)
    assert run.returncode == 2 and words in run.stderr, run.stderr


def test_gated_delta_profile_rows_rank_the_ops_and_total_them(monkeypatch):
    """`gated_delta.profile_rows` on the CPU (the reference backend's ops by CPU time): per length,
    the ops from the slowest, their shares, and a total row that is their sum."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gated_delta

    rows = gated_delta.profile_rows([24, 40], 2, device="cpu")
    for t in (24, 40):
        mine = [r for r in rows if r[0] == f"2 x {t}"]
        assert mine[-1][1] == "total" and len(mine) > 3, mine
        ms = [float(r[2]) for r in mine[:-1]]
        assert ms == sorted(ms, reverse=True) and all(m > 0 for m in ms)
        assert abs(sum(ms) - float(mine[-1][2])) <= 1e-3 * len(ms) + 1e-3
        assert any("mul" in r[1] or "matmul" in r[1] or "bmm" in r[1] for r in mine), mine


def test_gated_delta_walk_launch_rows_time_each_shape_and_compare_bits(monkeypatch):
    """`gated_delta.walk_launch_rows` on the CPU with stand-in clocks: a row per launch shape, the
    training forward and decode cells from the clocks, the bits compared with the first shape's
    (the reference backend: equal), and the walk's launch shape restored afterwards."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gated_delta
    from vexact_models.kernels import gated_delta_recurrent as walk

    calls, shapes = [], walk.WALK_SHAPES

    def timer(fn, warmup, rep):
        calls.append(walk.walk_shape(1, 1, 128))
        fn()
        return 1.25

    def graph_timer(fns):
        calls.append(walk.walk_shape(1, 1, 128))
        [fn() for fn in fns]
        return 0.0025

    rows = gated_delta.walk_launch_rows([(16, 1), (64, 4)], [8], [2], device="cpu", timer=timer,
                                        graph_timer=graph_timer)
    assert rows == [["16x1", "1.250", "2.5", "yes"], ["64x4", "1.250", "2.5", "yes"]]
    assert calls == [walk.WalkShape(16, 1)] * 2 + [walk.WalkShape(64, 4)] * 2
    with pytest.raises(RuntimeError), gated_delta.walk_launch(4, 2):
        raise RuntimeError
    assert walk.WALK_SHAPES == shapes

    import vexact_models.kernels as kernels
    boundaries, rule = [], kernels.gated_delta_rule

    def recorded(*args):
        boundaries.append(args[-1])
        return rule(*args)

    monkeypatch.setattr(kernels, "gated_delta_rule", recorded)
    rows = gated_delta.walk_launch_rows([(8, 1)], [4], [], device="cpu", timer=timer, graph_timer=graph_timer, seqs=3)
    assert rows == [["8x1", "1.250", "yes"]]
    assert boundaries == [[0, 4, 8, 12]] * 2  # timed, then run for the bits: 3 packed sequences of 4 tokens


@pytest.mark.parametrize("value,words", [("16x1,12x1", "--walk-launches: 12x1 must be a power of two <= 128 (dv)"),
                                         ("16x3", "--walk-launches: 16x3 must be a power of two"),
                                         ("16", "a candidate is COLUMNSxWARPS, e.g. 16x1, got '16'")])
def test_gated_delta_refuses_a_bad_walk_launch(value, words):
    run = subprocess.run([sys.executable, "gated_delta.py", "--walk-launches", value], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and words in run.stderr, run.stderr
