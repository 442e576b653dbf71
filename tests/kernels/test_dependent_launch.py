"""Programmatic dependent launch (`kernels/dependent_launch.py`): the switch, and on a Hopper GPU
that a decode-shaped chain of our kernels captured in a CUDA graph launches with PDL and gives the
bits it gives without."""

import pytest
import torch

from vexact_models.kernels import (add_rms_norm, gather_logprobs, linear, log_softmax, rms_norm, sample_tokens,
                                   set_dependent_launch, silu_and_mul, use_dependent_launch)
from vexact_models.kernels.dependent_launch import ENV_VAR, dependent_launch, dependent_launch_kwargs


def test_cpu_launches_never_use_pdl(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert not dependent_launch("cpu")
    assert dependent_launch_kwargs("cpu") == {"PDL": False}


def test_a_bad_mode_names_the_variable_the_value_and_the_choices(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")
    with pytest.raises(ValueError, match=r"VEXACT_PDL='yes'.*\('auto', 'off'\)"):
        dependent_launch("cpu")
    with pytest.raises(ValueError, match="'on'"):
        set_dependent_launch("on")


def test_the_override_wins_over_the_environment_and_is_restored(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "yes")  # invalid: only read when no override is set
    with use_dependent_launch("off"):
        assert not dependent_launch("cpu")
        with use_dependent_launch("auto"):
            assert not dependent_launch("cpu")  # auto: never on the CPU
    with pytest.raises(ValueError):
        dependent_launch("cpu")


def _launches(monkeypatch):
    """A spy on Triton's `JITFunction.run` (the real one runs): the list it fills with
    ``(kernel name, compiled kernel)`` for every Triton launch."""
    from triton.runtime.jit import JITFunction

    launches, real = [], JITFunction.run

    def run(self, *args, **kwargs):
        kernel = real(self, *args, **kwargs)
        launches.append((self.__name__, kernel))
        return kernel

    monkeypatch.setattr(JITFunction, "run", run)
    return launches


def _chain(x, residual, norm_w, gate_up_w, down_w, head_w, temps, seeds, steps, targets):
    """One decode layer's MLP half and a sampling head: norm, GEMM, SiLU, GEMM, norm, LM head,
    sampling and log-probabilities, each kernel reading the one before."""
    h, summed = add_rms_norm(x, residual, norm_w, 1e-6)
    gate, up = linear(h, gate_up_w).chunk(2, dim=-1)
    y = linear(silu_and_mul(gate, up), down_w)
    logits = linear(rms_norm(y, norm_w, 1e-6), head_w, out_dtype=torch.float32)
    return (summed, y, logits, log_softmax(logits, temps), sample_tokens(logits, temps, seeds, steps),
            gather_logprobs(logits, targets, temps))


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9),
                    reason="programmatic dependent launch needs a Hopper or newer GPU")
@pytest.mark.parametrize("rows", [1, 128])
def test_a_graph_of_decode_kernels_launches_dependently_with_the_same_bits(rows, monkeypatch):
    gen = torch.Generator().manual_seed(rows)
    hidden, inter, vocab = 1024, 3072, 32000
    x, residual = (torch.randn(rows, hidden, generator=gen).bfloat16().cuda() for _ in range(2))
    norm_w = (1 + 0.1 * torch.randn(hidden, generator=gen)).bfloat16().cuda()
    gate_up_w = (torch.randn(2 * inter, hidden, generator=gen) / 32).bfloat16().cuda()
    down_w = (torch.randn(hidden, inter, generator=gen) / 55).bfloat16().cuda()
    head_w = (torch.randn(vocab, hidden, generator=gen) / 32).bfloat16().cuda()
    temps = torch.linspace(0.5, 1.5, rows).cuda()
    seeds = torch.arange(rows).cuda() * 7919
    steps = torch.arange(rows).cuda() + 3
    targets = torch.randint(0, vocab, (rows,), generator=gen).cuda()
    args = (x, residual, norm_w, gate_up_w, down_w, head_w, temps, seeds, steps, targets)

    outputs, launches = {}, _launches(monkeypatch)
    for mode in ("off", "auto"):
        launches.clear()
        with use_dependent_launch(mode):
            eager = _chain(*args)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = _chain(*args)
            for _ in range(3):
                graph.replay()
            torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(eager, captured)), mode
        outputs[mode] = captured
        # every Triton kernel of the chain (quack's GEMMs, where they run, are not Triton's)
        assert {name for name, _ in launches} >= {"_rms_norm_kernel", "_linear_kernel", "_silu_and_mul_kernel",
                                                  "_lse_partial_kernel", "_logprob_kernel", "_sample_kernel",
                                                  "_sample_pick_kernel"}
        dependent = [(name, bool(k.metadata.launch_pdl), "griddepcontrol.wait" in k.asm["ptx"]) for name, k in launches]
        assert all(pdl == waits == (mode == "auto") for _, pdl, waits in dependent), (mode, dependent)
    assert all(torch.equal(a, b) for a, b in zip(outputs["off"], outputs["auto"]))
    assert not outputs["auto"][3].isnan().any()


def _kernel_defs_and_dependent_launches(path):
    """({kernel name: FunctionDef}, [(kernel name, line)] of launches that pass
    `dependent_launch_kwargs`) in one kernels module."""
    import ast

    tree = ast.parse(path.read_text(), str(path))
    defs = {node.name: node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
    def passes_pdl(call):
        return any(isinstance(n, ast.Name) and n.id == "dependent_launch_kwargs"
                   for kw in call.keywords if kw.arg is None for n in ast.walk(kw.value))

    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    # launch_staged(kernel, grid, args, kwargs, ...) takes its keywords as a dict built before
    staged_pdl = any(isinstance(c.func, ast.Name) and c.func.id == "dict" and passes_pdl(c) for c in calls)
    launches = []
    for node in calls:
        if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name) and passes_pdl(node):
            launches.append((node.func.value.id, node.lineno))
        elif (isinstance(node.func, ast.Name) and node.func.id == "launch_staged" and staged_pdl
              and isinstance(node.args[0], ast.Name)):
            launches.append((node.args[0].id, node.lineno))
    return defs, launches


def test_every_dependent_launch_is_of_a_kernel_that_waits_first():
    """Triton's CPU interpreter ignores keyword arguments a kernel does not declare, so a launch
    passing ``PDL`` to a kernel without it fails on the GPU only: each launch that passes
    `dependent_launch_kwargs` must be of a kernel of the same module that takes ``PDL`` and whose
    first statement (after its docstring) is ``wait_for_inputs(PDL)``."""
    import ast
    from pathlib import Path

    kernels_dir = Path(__file__).resolve().parents[2] / "kernels"
    checked, problems = set(), []
    for path in sorted(kernels_dir.glob("*.py")):
        defs, launches = _kernel_defs_and_dependent_launches(path)
        for name, line in launches:
            fn = defs.get(name)
            body = [s for s in (fn.body if fn else []) if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            first = ast.unparse(body[0]) if body else ""
            if fn is None or "PDL" not in [a.arg for a in fn.args.args] or first != "wait_for_inputs(PDL)":
                problems.append(f"{path.name}:{line}: {name} (first statement: {first!r})")
            checked.add(name)
    assert not problems, problems
    assert {"_linear_kernel", "_linear_tma_kernel", "_attention_fwd_kernel", "_rms_norm_kernel",
            "_rotary_cache_write_kernel", "_silu_and_mul_kernel", "_sample_kernel", "_sample_pick_kernel",
            "_lse_partial_kernel", "_logprob_kernel", "_kv_cache_write_kernel", "moe_gate_up_kernel", "_moe_grouped_gemm_kernel",
            "_moe_combine_kernel", "_moe_align_kernel", "_grouped_topk_kernel", "_softmax_topk_kernel",
            "_latent_cache_write_kernel", "_head_linear_kernel"} <= checked
