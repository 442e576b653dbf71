"""vLLM's ``SamplingParams(logprobs=k)`` (`runtime.top_logprobs`): per sampled position a dict of
the sampled token and the k most probable ones. Sampling is untouched (the same tokens as without
it), the sampled token's entry is the float the engine reports without it, and every entry is
the training forward's ``token_logprobs`` of that token at that position, bitwise, under
preemption, chunked prefill, prefix sharing, ``n > 1`` and async steps."""

import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

from vexact_models.registry import architectures, get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.sampling_params import MAX_LOGPROBS
from vexact_models.runtime.top_logprobs import Logprob, completion_logprobs

from .llm_support import cache_bytes, gen, make_llm, prompts_for

ARCHS = ["qwen3", "qwen3_5", "gemma3"]


def _model(name: str, **overrides):
    if name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{name} is not registered on this transformers")
    torch.manual_seed(0)
    return get(name).causal_lm_class(get(name).tiny_config(**overrides)).eval()


def _training_entry(model, prefix: list[int], token: int, temperature: float) -> float:
    """``token_logprobs`` of `token` right after `prefix` (the training forward)."""
    with torch.no_grad():
        return float(model.token_logprobs(torch.tensor([prefix + [token]]), temperature=temperature)[0, -1])


@pytest.mark.parametrize("name", ARCHS)
def test_alternatives_are_the_training_forwards_logprobs_and_sampling_is_unchanged(name):
    overrides = {"final_logit_softcapping": 3.0} if name == "gemma3" else {}
    model = _model(name, **overrides)
    prompts = prompts_for(3, seed=1)
    plain = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3, ignore_eos=True)
    asked = SamplingParams(n=2, temperature=0.8, max_tokens=6, seed=3, ignore_eos=True, logprobs=4)
    llm = make_llm(model)
    want, got = gen(llm, prompts, plain), gen(llm, prompts, asked)
    for prompt, w, g in zip(prompts, want, got):
        for wc, gc in zip(w.outputs, g.outputs):
            assert gc.token_ids == wc.token_ids and gc.cumulative_logprob == wc.cumulative_logprob
            assert len(gc.logprobs) == len(gc.token_ids)
            for i, (token, entry) in enumerate(zip(gc.token_ids, gc.logprobs)):
                assert next(iter(entry)) == token and entry[token].logprob == wc.logprobs[i]  # the same float
                assert 4 <= len(entry) <= 5
                prefix = prompt + gc.token_ids[:i]
                for alt, lp in entry.items():
                    assert lp.logprob == _training_entry(model, prefix, alt, 0.8), (i, alt)


def test_alternatives_are_the_most_probable_tokens_with_their_ranks():
    model = _model("qwen3")
    prompt = prompts_for(1, seed=2)[0]
    [out] = gen(make_llm(model), [prompt], SamplingParams(temperature=1.0, max_tokens=5, seed=7, logprobs=3))
    c = out.outputs[0]
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        with torch.no_grad():
            row = model(torch.tensor([prompt + c.token_ids[:i]])).logits[0, -1]
        order = torch.argsort(row, descending=True).tolist()
        alternatives = [t for t in entry if t != token or entry[t].rank <= 3]
        assert sorted(alternatives, key=lambda t: entry[t].rank) == order[:len(alternatives)]
        assert [entry[t].rank for t in order[:3]] == [1, 2, 3]
        assert entry[token].rank == 1 + int((row > row[token]).sum())
        assert all(isinstance(v, Logprob) and v.decoded_token is None for v in entry.values())


def test_logprobs_zero_is_the_sampled_token_alone_and_requests_mix():
    """``logprobs=0``: the dict holds the sampled token only; requests with and without it run
    in the same steps, each getting its own shape."""
    model = _model("qwen3")
    prompts = prompts_for(4, seed=3)
    params = [SamplingParams(max_tokens=4, seed=i, logprobs=[None, 0, 2, None][i]) for i in range(4)]
    outs = gen(make_llm(model), prompts, params)
    alone = [gen(make_llm(model), [p], SamplingParams(max_tokens=4, seed=i))[0] for i, p in enumerate(prompts)]
    for i, (out, ref) in enumerate(zip(outs, alone)):
        c, r = out.outputs[0], ref.outputs[0]
        assert c.token_ids == r.token_ids
        if params[i].logprobs is None:
            assert c.logprobs == r.logprobs
        else:
            assert [e[t].logprob for e, t in zip(c.logprobs, c.token_ids)] == r.logprobs
            assert all(len(e) in (params[i].logprobs + 1, params[i].logprobs) and next(iter(e)) == t
                       for e, t in zip(c.logprobs, c.token_ids))
    assert all(len(e) == 1 for e in outs[1].outputs[0].logprobs)


def test_alternatives_survive_preemption_chunked_prefill_and_prefix_sharing():
    """A cache of a few pages (preemption by recompute), 8-token steps (chunked prefill), shared
    prompts, async steps: the same dicts as a roomy engine's."""
    model = _model("qwen3")
    base = prompts_for(3, seed=4, lo=9, hi=14)
    prompts = base + [p + [5, 6] for p in base]  # shared prefixes
    params = SamplingParams(n=2, temperature=0.9, max_tokens=10, seed=11, ignore_eos=True, logprobs=3)
    roomy = gen(make_llm(model, async_scheduling=False), prompts, params)
    tight_llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 14), max_num_batched_tokens=8)
    tight = gen(tight_llm, prompts, params)
    assert tight_llm.num_preemptions > 0 and tight_llm.block_manager.num_shared_hits > 0
    for r, t in zip(roomy, tight):
        assert [(c.token_ids, c.logprobs) for c in r.outputs] == [(c.token_ids, c.logprobs) for c in t.outputs]


def test_decoded_tokens_come_from_the_engines_tokenizer():
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(512)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    llm = make_llm(_model("qwen3"), tokenizer=tokenizer)
    [out] = gen(llm, ["w3 w4 w5"], SamplingParams(max_tokens=3, seed=1, logprobs=2))
    for entry in out.outputs[0].logprobs:
        assert all(v.decoded_token == f"w{t}" for t, v in entry.items())
    seq = type("Seq", (), {"num_output_tokens": 1, "top_logprobs": {0: ([7, 7, 9], [-1.0, -1.0, -2.0], 1)}})()
    assert completion_logprobs(seq) == [{7: Logprob(-1.0, 1), 9: Logprob(-2.0, 2)}]  # a token in both: once


@pytest.mark.parametrize("value, words", [(-1, ["logprobs=-1", "minimum 0"]),
                                          (MAX_LOGPROBS + 1, [f"logprobs={MAX_LOGPROBS + 1}", f"maximum {MAX_LOGPROBS}"]),
                                          (True, ["logprobs=True", "int"]), (2.0, ["logprobs=2.0", "int"])])
def test_bad_logprobs_are_refused_naming_the_value_and_the_limit(value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(logprobs=value)
    assert all(w in str(err.value) for w in words), str(err.value)
