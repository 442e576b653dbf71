"""``SamplingParams(min_p=...)`` in the engine: every sampled token is at least ``min_p`` times as
probable as the most probable one (under ``softmax(logits / T)`` of the training forward's
logits), where without it some are not; a request's tokens do not depend on its batch, the
cache or the step sizes; the reported logprobs stay the unfiltered ones training recomputes."""

import torch

from vexact_models.registry import get
from vexact_models.runtime import SamplingParams

from .llm_support import cache_bytes, gen, make_llm, prompts_for, training_logprobs


def _model():
    torch.manual_seed(0)
    return get("qwen3").causal_lm_class(get("qwen3").tiny_config(initializer_range=0.3)).eval()


def _ratios(model, prompt, tokens, temperature) -> list[float]:
    """p(token) / max p at each sampled position, from the training forward, in float64."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].double()
    p = torch.softmax(logits / temperature, -1)
    return (p.gather(1, torch.tensor(tokens)[:, None])[:, 0] / p.max(-1).values).tolist()


def test_sampled_tokens_pass_min_p_and_logprobs_stay_trainings():
    model = _model()
    prompts = prompts_for(6, seed=21)
    free = SamplingParams(n=2, temperature=1.5, max_tokens=12, seed=4, ignore_eos=True)
    held = SamplingParams(n=2, temperature=1.5, max_tokens=12, seed=4, ignore_eos=True, min_p=0.2)
    llm = make_llm(model)
    without, with_min_p = gen(llm, prompts, free), gen(llm, prompts, held)
    low = [r for prompt, out in zip(prompts, without) for c in out.outputs
           for r in _ratios(model, prompt, c.token_ids, 1.5)]
    assert min(low) < 0.2  # the test can fail: unfiltered sampling takes tokens min-p would drop
    for prompt, out in zip(prompts, with_min_p):
        for c in out.outputs:
            assert min(_ratios(model, prompt, c.token_ids, 1.5)) >= 0.2 - 1e-6
            assert torch.equal(torch.tensor(c.logprobs), training_logprobs(model, prompt, c.token_ids, 1.5))


def test_min_p_rows_do_not_depend_on_their_batch_or_the_cache():
    model = _model()
    prompts = prompts_for(5, seed=22, lo=8, hi=14)
    params = [SamplingParams(temperature=1.2, max_tokens=10, seed=i, ignore_eos=True, min_p=[0.0, 0.1, 0.3][i % 3],
                             top_k=[-1, 5][i % 2]) for i in range(5)]
    together = gen(make_llm(model), prompts, params)
    alone = [gen(make_llm(model), [p], [sp])[0] for p, sp in zip(prompts, params)]
    tight_llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 12), max_num_batched_tokens=8)
    tight = gen(tight_llm, prompts, params)
    assert tight_llm.num_preemptions > 0
    for a, b, c in zip(together, alone, tight):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs == c.outputs[0].logprobs
