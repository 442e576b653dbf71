"""examples/grpo.py (a GRPO loop on the public API) and its library, vexact_models.rl."""

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vexact_models.rl import (RolloutBatch, clipped_policy_loss, entropy_rows, group_advantages, k3_kl,
                              mismatch_stats, repeat_last_token_reward)
from vexact_models.runtime.outputs import CompletionOutput, RequestOutput

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpo.py"


def test_grpo_example_cpu_defaults(tmp_path):
    """The CPU defaults (plus --compare-stock): exit 0; every step's training logprobs equal the
    rollout's bitwise; the reward rises from about 0.13 to about 0.96 over the 40 steps (means of
    the first and last 5 steps); stock transformers on the same weights differs; a PNG is written."""
    run = subprocess.run([sys.executable, str(EXAMPLE), "--compare-stock", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "RESULT: PASS" in run.stdout
    metrics = json.loads((tmp_path / "grpo_metrics.json").read_text())
    steps = metrics["steps"]
    assert len(steps) == 40
    for r in steps:
        assert r["max_abs_delta"] == 0.0 and r["mismatched_tokens"] == 0 and r["k3_kl"] == 0.0, r
        assert r["tokens"] == 16 * 8 * 2
    summary = metrics["summary"]
    assert summary["reward_first"] < 0.3, summary
    assert summary["reward_last"] > 0.7 and summary["reward_last"] > summary["reward_first"] + 0.4, summary
    # the stock model differs from the rollout on most tokens (by float rounding: fp32 on CPU)
    assert 0 < summary["stock_max_abs_delta"] < 1e-3, summary
    assert summary["stock_mismatched_tokens"] > summary["tokens"] // 4, summary
    assert any(r["stock_k3_kl"] > 0 for r in steps)
    assert (tmp_path / "grpo.png").stat().st_size > 10_000
    for key in ("mean_rollout_s", "mean_train_s", "mean_update_s"):
        assert summary[key] > 0


def test_grpo_example_help_and_bad_flags():
    help_run = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True, text=True, timeout=120)
    assert help_run.returncode == 0 and "--compare-stock" in help_run.stdout and "--device" in help_run.stdout
    bad = subprocess.run([sys.executable, str(EXAMPLE), "--group", "1"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--group=1 must be >= 2" in bad.stderr


def _parse_args(script: str):
    """The `parse_args` of examples/<script>.py (loaded as a module: no subprocess, nothing run)."""
    spec = importlib.util.spec_from_file_location(f"example_{script}", EXAMPLE.parent / f"{script}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.parse_args


@pytest.mark.parametrize("script", ["grpo", "trl_grpo"])
@pytest.mark.parametrize("argv,words", [
    (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
    (["--lr", "-1"], "argument --lr: must be a finite number >= 0, got -1"),
    (["--config", "nosuch"], "argument --config: config 'nosuch': no such file, and not one of the bundled configs"),
    (["--model", "/no/such/checkpoint"], "argument --model: '/no/such/checkpoint': no such folder"),
    (["--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["--task-vocab", "2"], "--task-vocab=2 must be >= 3"),
    (["--layers", "0"], "argument --layers: must be >= 1, got 0"),
])
def test_examples_refuse_bad_flags_naming_flag_value_and_limit(script, argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        _parse_args(script)(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def test_trl_example_takes_qwen3_configs_only_for_its_random_checkpoint(capsys):
    with pytest.raises(SystemExit) as info:
        _parse_args("trl_grpo")(["--config", "moonlight-16b-a3b"])
    assert info.value.code == 2 and "the random checkpoint is a Qwen3 one" in capsys.readouterr().err
    assert _parse_args("trl_grpo")(["--config", "qwen3-8b", "--layers", "2"]).config == "qwen3-8b"


@pytest.mark.parametrize("argv,words", [
    (["--micro-batch", "-3"], "argument --micro-batch: must be >= 0, got -3"),
    (["--temperature", "0"], "argument --temperature: must be a finite number > 0, got 0"),
])
def test_grpo_refuses_its_own_bad_flags(argv, words, capsys):
    with pytest.raises(SystemExit) as info:
        _parse_args("grpo")(argv)
    assert info.value.code == 2 and words in capsys.readouterr().err


def _outputs():
    c = [CompletionOutput(0, [5, 6], [-0.5, -1.25], "length"), CompletionOutput(1, [7], [-2.0], "stop")]
    return [RequestOutput(0, None, [1, 2, 3], c), RequestOutput(1, None, [4], [CompletionOutput(0, [8, 9], [-0.1, -0.2],
                                                                                           "length")])]


def test_rollout_batch_packs_outputs():
    b = RolloutBatch.from_outputs(_outputs(), pad_token_id=0)
    assert b.input_ids.tolist() == [[1, 2, 3, 5, 6], [1, 2, 3, 7, 0], [4, 8, 9, 0, 0]]
    assert b.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]]
    assert b.completion_mask.tolist() == [[0, 0, 0, 1, 1], [0, 0, 0, 1, 0], [0, 1, 1, 0, 0]]
    assert b.rollout_logprobs[0, 3:].tolist() == [-0.5, -1.25] and b.rollout_logprobs[2, 1:3].tolist() == [
        pytest.approx(-0.1), pytest.approx(-0.2)]
    assert b.prompt_index.tolist() == [0, 0, 1]
    assert list(b.pairs()) == [([1, 2, 3], [5, 6]), ([1, 2, 3], [7]), ([4], [8, 9])]
    assert [len(m) for m in b.micro_batches(2)] == [2, 1]
    empty = [RequestOutput(0, None, [1], [CompletionOutput(0, [], [], "stop")])]
    with pytest.raises(ValueError, match="request 0 has a completion with no tokens"):
        RolloutBatch.from_outputs(empty)
    with pytest.raises(ValueError, match="size=0"):
        next(b.micro_batches(0))


def test_group_advantages():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5]), 3)
    std = torch.tensor([1.0, 0.0, 0.0]).std()
    assert torch.allclose(adv[:3], torch.tensor([2 / 3, -1 / 3, -1 / 3]) / (std + 1e-4))
    assert torch.equal(adv[3:], torch.zeros(3))  # a group with one reward value teaches nothing
    assert torch.allclose(group_advantages(torch.tensor([1.0, 0.0]), 2, scale=False), torch.tensor([0.5, -0.5]))
    with pytest.raises(ValueError, match="group_size=4"):
        group_advantages(torch.zeros(6), 4)


def test_clipped_policy_loss_gradient_and_clipping():
    mask = torch.tensor([[1, 1, 0]])
    old = torch.tensor([[-1.0, -2.0, 0.0]])
    adv = torch.tensor([2.0])
    lp = old.clone().requires_grad_(True)
    loss = clipped_policy_loss(lp, old, adv, mask)
    loss.backward()
    # at ratio 1: loss = -mean(A), gradient -A / tokens on masked tokens, none on padding
    assert loss.item() == pytest.approx(-2.0)
    assert lp.grad.tolist() == [[-1.0, -1.0, 0.0]]
    # far above 1 + clip with a positive advantage: clipped, no gradient
    lp2 = (old + torch.tensor([[1.0, 0.0, 0.0]])).requires_grad_(True)
    clipped_policy_loss(lp2, old, adv, mask).backward()
    assert lp2.grad[0, 0].item() == 0.0 and lp2.grad[0, 1].item() == pytest.approx(-1.0)
    # num_tokens: micro-batch losses add up to the batch loss
    assert clipped_policy_loss(old, old, adv, mask, num_tokens=4).item() == pytest.approx(-1.0)
    with pytest.raises(ValueError, match="one shape"):
        clipped_policy_loss(old, old[:, :2], adv, mask)


def test_mismatch_stats_and_k3():
    mask = torch.tensor([[1, 1, 0]])
    a = torch.tensor([[-1.0, -2.0, 5.0]])
    same = mismatch_stats(a, a.clone(), mask)
    assert same == {"max_abs_delta": 0.0, "mean_abs_delta": 0.0, "k3_kl": 0.0, "mismatched_tokens": 0, "tokens": 2}
    b = a + torch.tensor([[0.0, 1e-3, 100.0]])  # the unmasked entry does not count
    diff = mismatch_stats(b, a, mask)
    assert diff["mismatched_tokens"] == 1 and diff["max_abs_delta"] == pytest.approx(1e-3, rel=1e-3)
    assert diff["k3_kl"] == pytest.approx((math.expm1(1e-3) - 1e-3) / 2, rel=1e-2) and diff["k3_kl"] > 0
    assert k3_kl(a, a, torch.zeros_like(mask)) == 0.0
    # -0.0 and 0.0 are equal numbers but different bits: counted as a mismatch
    assert mismatch_stats(torch.tensor([[-0.0]]), torch.tensor([[0.0]]), torch.tensor([[1]]))["mismatched_tokens"] == 1


def test_entropy_rows_and_reward():
    hidden, weight = torch.randn(5, 8), torch.randn(11, 8)
    p = torch.softmax(hidden @ weight.T / 0.7, -1)
    assert torch.allclose(entropy_rows(hidden, weight, 0.7), -(p * p.log()).sum(-1), atol=1e-5)
    assert repeat_last_token_reward([3, 4], [4, 4, 1, 4]) == 0.75
    assert repeat_last_token_reward([3], []) == 0.0
