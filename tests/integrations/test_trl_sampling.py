"""TRL's sampling options through `VexactGRPOTrainer`: ``min_p``, the penalties, the filters and
logit edits, and stop strings in ``generation_kwargs`` reach the engine as TRL passes them to vLLM,
and TRL's mismatch metrics stay exactly 0 / 1."""

import pytest
import torch

pytest.importorskip("trl")
pytest.importorskip("datasets")

from .trl_support import DIFF_MAX, IS_MAX, IS_MIN, grpo_trainer  # noqa: E402


@pytest.fixture(scope="module")
def example(trl_grpo_example):
    """examples/trl_grpo.py as a module (tests/integrations/conftest.py)."""
    return trl_grpo_example


def test_min_p_reaches_the_engine_and_the_metrics_stay_exact(example, tmp_path):
    """``GRPOConfig(min_p=...)``, as TRL passes it to vLLM: every rollout samples with it, and
    TRL's metrics stay at 0 / 1 (the logprobs are the unfiltered ones)."""
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo={"min_p": 0.1, "temperature": 1.3})
    gen = trainer.vllm_generation
    assert gen.sampling["min_p"] == 0.1
    seen = []
    generate = gen.llm.generate
    gen.llm.generate = lambda prompts, params, **kw: seen.append(params) or generate(prompts, params, **kw)
    trainer.train()
    assert seen and all(p.min_p == 0.1 and p.temperature == 1.3 for p in seen)
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs


def test_penalties_reach_the_engine_and_the_metrics_stay_exact(example, tmp_path):
    """``GRPOConfig(repetition_penalty=...)``, and the other penalties, the filters, a logit bias and
    a bad word in ``generation_kwargs``, as TRL passes them to vLLM: every rollout samples with them, and TRL's
    metrics stay at 0 / 1 (the logprobs are the unfiltered, unpenalised ones its training forward
    computes); ``generation_kwargs={"temperature": ...}`` is refused (training would recompute at
    another temperature)."""
    kwargs = {"presence_penalty": 0.5, "frequency_penalty": 0.25, "top_k": 0, "min_p": 0.05, "logit_bias": {3: 0.5},
              "bad_words": ["t3"], "skip_special_tokens": False,
              "spaces_between_special_tokens": False}  # (the last: text only, dropped)
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo={"repetition_penalty": 1.3, "generation_kwargs": kwargs})
    gen = trainer.vllm_generation
    seen = []
    generate = gen.llm.generate
    tokens = []

    def generate_seen(prompts, params, **kw):
        seen.append(params)
        outs = generate(prompts, params, **kw)
        tokens.extend(t for out in outs for t in out.outputs[0].token_ids)
        return outs

    gen.llm.generate = generate_seen
    trainer.train()
    assert seen and all((p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.3, 0.5, 0.25)
                        and (p.top_k, p.min_p, p.skip_special_tokens, p.logit_bias) == (-1, 0.05, False, {3: 0.5})
                        and p.bad_words == ["t3"] for p in seen)
    assert tokens and 3 not in tokens  # "t3" is token 3: banned, its bias notwithstanding
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    with pytest.raises(ValueError, match=r"generation_kwargs \['temperature'\]"):
        grpo_trainer(example, "qwen3", tmp_path, grpo={"generation_kwargs": {"temperature": 0.5}})


def test_ignore_eos_from_generation_kwargs_runs_every_completion_to_its_length(example, tmp_path):
    """``generation_kwargs={"ignore_eos": True}``, as vLLM reads it (TRL passes no stop ids, and vLLM
    leaves the model's EOS ids out of them then): no completion ends at EOS."""
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo={"generation_kwargs": {"ignore_eos": True}})
    gen = trainer.vllm_generation
    assert gen.sampling["stop_token_ids"] == [] and gen.sampling["ignore_eos"] is True
    torch.manual_seed(1)
    _, completion_ids, _, _ = gen.generate([[3, 4, 5], [9, 2, 2, 7, 11], [6]] * 8)
    eos = trainer.processing_class.eos_token_id
    assert any(eos in ids[:-1] for ids in completion_ids)  # EOS was drawn, and the completion went on
    assert all(len(ids) == 5 for ids in completion_ids)


def test_stop_strings_from_generation_kwargs_cut_the_completions(example, tmp_path):
    """``GRPOConfig(generation_kwargs={"stop": [...]})``, as TRL passes it to vLLM: the engine gets
    the trainer's tokenizer, each completion ends at the token whose text completes the string
    (or at the length limit without one), and TRL's metrics stay at 0 / 1."""
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo={"generation_kwargs": {"stop": ["t1"]}})
    gen = trainer.vllm_generation
    assert gen.llm.tokenizer is trainer.processing_class
    _, completion_ids, _, _ = gen.generate([[3, 4, 5], [9, 2, 2, 7, 11], [6]] * 4)
    words = [[trainer.processing_class.decode([t]) for t in ids] for ids in completion_ids]
    assert any(len(w) < 5 for w in words)  # some stopped early
    for w in words:  # cut at the stop string's token, at EOS, or at max_completion_length
        assert not any("t1" in x for x in w[:-1]) and ("t1" in w[-1] or w[-1] == "<eos>" or len(w) == 5), w
    assert any("t1" in w[-1] for w in words)
    trainer.train()
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs


def test_structured_outputs_regex_constrains_the_completions(example, tmp_path):
    """``GRPOConfig(vllm_structured_outputs_regex=...)``, as TRL passes it to vLLM: every completion
    token is one the regex allows (xgrammar over the trainer's tokenizer; the toy tokenizer's tokens
    are the words ``t<i>``), and TRL's metrics stay at 0 / 1 (the logprobs are the unmasked ones its
    training forward computes). ``generation_kwargs["structured_outputs"]`` reaches the engine too;
    the config's regex wins over it, as in TRL."""
    pytest.importorskip("xgrammar")
    kwargs = {"structured_outputs": {"choice": ["t5t6"]}}
    trainer = grpo_trainer(example, "qwen3", tmp_path, grpo={"vllm_structured_outputs_regex": "(t1[0-9]*)+",
                                                             "generation_kwargs": kwargs})
    gen = trainer.vllm_generation
    assert gen.sampling["structured_outputs"] == {"regex": "(t1[0-9]*)+"}
    seen = []
    generate = gen.llm.generate
    gen.llm.generate = lambda prompts, params, **kw: seen.append(outs := generate(prompts, params, **kw)) or outs
    trainer.train()
    words = [trainer.processing_class.decode([t]) for outs in seen for out in outs for t in out.outputs[0].token_ids]
    assert len(words) > 20 and all(w == "<eos>" or (w.startswith("t1") and w[1:].isdigit()) for w in words), words
    logs = [h for h in trainer.state.log_history if DIFF_MAX in h]
    assert len(logs) == 2 and all(h[DIFF_MAX] == 0.0 and h[IS_MIN] == h[IS_MAX] == 1.0 for h in logs), logs
    chosen = grpo_trainer(example, "qwen3", tmp_path, grpo={"generation_kwargs": kwargs}).vllm_generation
    _, completion_ids, _, _ = chosen.generate([[3, 4, 5], [6]])
    assert all(ids[:2] == [5, 6] for ids in completion_ids), completion_ids
