"""vLLM's ``allowed_token_ids`` and ``logit_bias`` in the engine (`runtime.logit_bias`): every
sampled token is the one the definition picks (the training forward's logits, restricted and
biased, then penalised, then the sampler's Gumbel-max at its seed and index); a request's tokens
do not depend on its batch, the cache or async steps; the reported logprobs stay the unedited
ones training recomputes; bad lists are refused naming the value."""

import pytest
import torch

from vexact_models.registry import get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.logit_bias import LogitEdits
from vexact_models.runtime.sequence import Sequence

from .llm_support import (gen, make_llm, prompts_for, sampled_by_definition, tokens_four_ways, training_logits,
                          training_logprobs)


def _model():
    torch.manual_seed(0)
    return get("qwen3").causal_lm_class(get("qwen3").tiny_config(initializer_range=0.3)).eval()


PARAMS = [dict(allowed_token_ids=[5, 9, 33, 200, 301]), dict(logit_bias={7: 30.0, 8: -100.0, 40: 2.5}),
          dict(allowed_token_ids=[3, 4, 5, 6], logit_bias={4: 1.5}, repetition_penalty=1.5),
          dict(logit_bias={11: 3.0}, top_k=5, presence_penalty=1.0)]


def _params(i: int) -> SamplingParams:
    return SamplingParams(temperature=[1.0, 0.0, 0.9, 1.2][i % 4], max_tokens=12, seed=60 + i, ignore_eos=True,
                          **PARAMS[i % len(PARAMS)])


def _definition_tokens(model, prompt: list[int], tokens: list[int], p: SamplingParams) -> list[int]:
    """At each output position: the training forward's logits, restricted to the allowed tokens and
    biased, then penalised, filtered and sampled as the definition says (`sampled_by_definition`)."""
    x = training_logits(model, prompt, tokens)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(x.shape[1], dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        x = torch.where(keep, x, float("-inf"))
    for token, bias in (p.logit_bias or {}).items():
        x[:, token] = x[:, token] + bias
    return sampled_by_definition(x, prompt, tokens, p)


def test_sampled_tokens_are_the_definitions_and_logprobs_stay_trainings():
    model = _model()
    prompts = prompts_for(8, seed=41)
    params = [_params(i) for i in range(8)]
    got = gen(make_llm(model), prompts, params)
    for prompt, p, out in zip(prompts, params, got):
        c = out.outputs[0]
        assert c.token_ids == _definition_tokens(model, prompt, c.token_ids, p)
        if p.allowed_token_ids is not None:
            assert set(c.token_ids) <= set(p.allowed_token_ids)
        assert 8 not in c.token_ids  # biased to -100
        t = p.temperature if p.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs), training_logprobs(model, prompt, c.token_ids, t))
    greedy = [o.outputs[0].token_ids for o, p in zip(got, params) if p.temperature == 0]
    assert greedy and all(ids == [7] * 12 for ids in greedy)  # +30 on token 7 wins every greedy step


def test_edited_rows_do_not_depend_on_their_batch_the_cache_or_the_steps():
    model = _model()
    prompts = prompts_for(7, seed=42, lo=6, hi=18)
    params = [_params(i) for i in range(7)]
    batch, alone, tight, replayed = tokens_four_ways(lambda **kw: make_llm(model, **kw), prompts, params, 12)
    assert batch == alone == tight == replayed


def test_edits_leave_other_rows_bits_and_add_each_bias_once():
    seqs = [Sequence(0, 0, [1], SamplingParams(logit_bias={2: 0.5, 5: -1.0}), 1),
            Sequence(1, 0, [1], SamplingParams(), 2),
            Sequence(2, 0, [1], SamplingParams(allowed_token_ids=[0, 3], logit_bias={3: 2.0}), 3)]
    logits = torch.randn(3, 6)
    edits = LogitEdits.of(seqs, 6, torch.device("cpu"))
    out = edits.apply(logits)
    assert torch.equal(out[1], logits[1])
    want0 = logits[0].clone()
    want0[2] += 0.5
    want0[5] += -1.0
    assert torch.equal(out[0], want0)
    assert out[2, 0] == logits[2, 0] and out[2, 3] == logits[2, 3] + 2.0 and out[2, [1, 2, 4, 5]].isinf().all()
    assert LogitEdits.of(seqs[1:2], 6, torch.device("cpu")) is None


@pytest.mark.parametrize("field, value, match", [
    ("allowed_token_ids", [], r"allowed_token_ids=\[\] must be None or a non-empty list"),
    ("allowed_token_ids", [3, -1], r"allowed_token_ids\[1\]=-1 must be an int >= 0"),
    ("allowed_token_ids", 5, r"allowed_token_ids=5 must be None or a non-empty list"),
    ("logit_bias", {"3": 1.0}, r"logit_bias key '3' must be a token id"),
    ("logit_bias", {3: float("inf")}, r"logit_bias\[3\]=inf must be a finite number"),
    ("logit_bias", [(3, 1.0)], r"logit_bias=\[\(3, 1.0\)\] must be None or a dict"),
])
def test_bad_lists_are_refused(field, value, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})


def test_token_ids_outside_the_vocabulary_are_refused_before_anything_runs():
    model = _model()
    llm = make_llm(model)
    vocab = model.config.vocab_size
    for params, name in ((SamplingParams(allowed_token_ids=[1, vocab]), "allowed_token_ids"),
                         (SamplingParams(logit_bias={vocab + 5: 1.0}), "logit_bias")):
        bad = vocab if name == "allowed_token_ids" else vocab + 5
        with pytest.raises(ValueError, match=rf"SamplingParams.{name} holds token id {bad}, outside the vocabulary "
                                             rf"\[0, {vocab}\)"):
            gen(llm, [[3, 4], [5]], [SamplingParams(), params])
        assert not llm.scheduler.has_unfinished()
    assert gen(llm, [[3, 4]], SamplingParams(max_tokens=2, seed=1))[0].outputs[0].token_ids
