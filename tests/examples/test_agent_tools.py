"""examples/agent_tools.py: an agent loop with tool calls through `vexact serve`'s OpenAI API, its
turns recomputed bitwise by the training forward."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("xgrammar")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "agent_tools.py"


def test_agent_example_cpu_defaults(tmp_path):
    """Two episodes: each calls the tool with integer arguments, every served logprob equals the
    training forward's recompute, and (the template re-rendering the call) turn 2's prompt does
    not continue turn 1's tokens, which the example reports."""
    run = subprocess.run([sys.executable, str(EXAMPLE), "--episodes", "2", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "RESULT: PASS" in run.stdout
    metrics = json.loads((tmp_path / "agent_metrics.json").read_text())
    assert metrics["episodes"] == metrics["called"] == 2 and metrics["mismatches"] == 0 and metrics["tokens"] > 100
    for call in metrics["calls"]:
        name, arguments = call.split("(", 1)
        assert name == "add" and all(isinstance(v, int) for v in json.loads(arguments[:-1]).values())
    assert metrics["continues"] == [False, False]


def test_a_call_cut_short_ends_its_episode(tmp_path):
    """A reply whose call JSON does not close within --max-tokens ends the episode after its first
    turn, whose tokens are still recomputed (the run passes); here with any whitespace allowed."""
    run = subprocess.run([sys.executable, str(EXAMPLE), "--episodes", "1", "--max-tokens", "6", "--any-whitespace",
                          "--out", str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "no call within --max-tokens 6" in run.stdout and "RESULT: PASS" in run.stdout
    metrics = json.loads((tmp_path / "agent_metrics.json").read_text())
    assert (metrics["called"], metrics["calls"], metrics["tokens"], metrics["mismatches"]) == (0, [None], 6, 0)


def test_recompute_counts_a_changed_bit(tmp_path):
    """The example's check fails on a served logprob one ulp off."""
    import math

    import torch
    from transformers import AutoModelForCausalLM

    import vexact_models

    spec = importlib.util.spec_from_file_location("agent_tools", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    folder = module.write_checkpoint(tmp_path, seed=0)
    vexact_models.patch()
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    finally:
        vexact_models.unpatch()
    prompt, reply = [5, 6, 7], [8, 9]
    with torch.no_grad():
        exact = model.token_logprobs(torch.tensor([prompt + reply]), temperature=1.0)[0, 3:].tolist()
    assert module.recompute(model, [(prompt, reply, exact)], 1.0, "cpu") == (2, 0)
    off = [exact[0], math.nextafter(exact[1], 0.0)]
    assert module.recompute(model, [(prompt, reply, off)], 1.0, "cpu") == (2, 1)
