"""vLLM's ``SamplingParams(logprobs=k)`` and ``prompt_logprobs=k`` (`runtime.top_logprobs`): per
sampled position, and per prompt position, a dict of the position's own token and the k most
probable ones. Sampling is untouched (the same tokens as without them), the sampled token's
entry is the float the engine reports without them, and every entry is the training forward's
``token_logprobs`` of that token at that position, bitwise, under preemption, chunked prefill,
prefix sharing, ``n > 1`` and async steps."""

import numpy as np
import pytest
import torch

from vexact_models.registry import architectures, get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime import top_logprobs
from vexact_models.runtime.sampling_params import MAX_LOGPROBS
from vexact_models.runtime.sequence import Sequence
from vexact_models.runtime.top_logprobs import Logprob, completion_logprobs

from .llm_support import cache_bytes, gen, graph_shaped, make_llm, prompts_for, word_tokenizer

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


def test_more_alternatives_than_the_vocabulary_return_the_whole_vocabulary():
    model = _model("qwen3", vocab_size=12)
    [out] = gen(make_llm(model), [[3, 4, 5]], SamplingParams(max_tokens=3, seed=1, logprobs=20, prompt_logprobs=20))
    assert all(len(e) == 12 for e in out.outputs[0].logprobs + out.prompt_logprobs[1:])
    assert all(sorted(e[t].rank for t in e) == list(range(1, 13)) for e in out.prompt_logprobs[1:])


def test_decoded_tokens_come_from_the_engines_tokenizer():
    llm = make_llm(_model("qwen3"), tokenizer=word_tokenizer())
    [out] = gen(llm, ["w3 w4 w5"], SamplingParams(max_tokens=3, seed=1, logprobs=2))
    for entry in out.outputs[0].logprobs:
        assert all(v.decoded_token == f"w{t}" for t, v in entry.items())
    stored = (np.array([[5, 5, 5], [7, 7, 9]]), np.array([[0.0] * 3, [-1.0, -1.0, -2.0]], np.float32),
              np.array([3, 1]), 1, 2)  # row 1 of a step's arrays, k = 2
    seq = type("Seq", (), {"num_output_tokens": 1, "top_logprobs": {0: stored}})()
    assert completion_logprobs(seq) == [{7: Logprob(-1.0, 1), 9: Logprob(-2.0, 2)}]  # a token in both: once


def test_position_dicts_are_built_when_read_and_read_as_a_list():
    """`PositionLogprobs`: nothing is built by ``generate``; a position read is built once (then
    the same dict), each distinct token decoded once; it compares, slices, adds, copies and pickles
    as the plain list of dicts."""
    import copy
    import pickle

    tokenizer = word_tokenizer()
    calls = []
    decode = tokenizer.batch_decode
    tokenizer.batch_decode = lambda ids, **kw: calls.extend(ids) or decode(ids, **kw)
    llm = make_llm(_model("qwen3"), tokenizer=tokenizer)
    [out] = gen(llm, ["w3 w4 w5"], SamplingParams(max_tokens=6, seed=1, logprobs=4, prompt_logprobs=2))
    lps = out.outputs[0].logprobs
    assert not calls and all(e is None for e in lps._built)  # nothing built yet
    third = lps[2]
    assert lps[2] is third and sum(e is not None for e in lps._built) == 1 and len(calls) == len(third)
    plain = [dict(e) for e in lps]
    assert len(calls) == len({t for e in plain for t in e})  # each distinct token decoded once
    assert lps == plain and plain == lps and lps[1:3] == plain[1:3] and lps[-1] == plain[-1]
    assert lps + [None] == plain + [None] and [None] + lps == [None] + plain
    assert type(copy.deepcopy(lps)) is list and copy.deepcopy(lps) == plain
    assert pickle.loads(pickle.dumps(lps)) == plain and repr(lps) == repr(plain)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == 3 and out.prompt_logprobs != lps


@pytest.mark.parametrize("value, words", [(-1, ["logprobs=-1", "minimum 0"]),
                                          (True, ["logprobs=True", "int"]), (2.0, ["logprobs=2.0", "int"])])
def test_bad_logprobs_are_refused_naming_the_value_and_the_limit(value, words):
    with pytest.raises(ValueError) as err:
        SamplingParams(logprobs=value)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_more_alternatives_than_max_logprobs_need_an_engine_built_for_them():
    """vLLM's ``max_logprobs`` engine argument (default 20): a request asking for more is refused
    before anything runs, naming the request and the argument; an engine built with
    ``max_logprobs=40`` returns 40 alternatives, each the training forward's logprob; the limit
    is a top-k chunk's 2,048 columns."""
    model = _model("qwen3")
    prompt = prompts_for(1, seed=4)[0]
    llm = make_llm(model)
    assert llm.max_logprobs == MAX_LOGPROBS == 20
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=rf"SamplingParams.{name}=21 \(request 1\) is above the engine's "
                                             r"max_logprobs=20; build it with LLM\(..., max_logprobs=21\)"):
            gen(llm, [prompt, prompt], [SamplingParams(max_tokens=2), SamplingParams(max_tokens=2, **{name: 21})])
        assert not llm.scheduler.has_unfinished()
    wide = make_llm(model, max_logprobs=40)
    [out] = gen(wide, [prompt], SamplingParams(temperature=0.9, max_tokens=3, seed=2, logprobs=40, prompt_logprobs=40))
    c = out.outputs[0]
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert len(entry) in (40, 41) and sorted(v.rank for t, v in entry.items() if v.rank <= 40) == list(range(1, 41))
        for alt in list(entry)[:: 7] + [token]:
            assert entry[alt].logprob == _training_entry(model, prompt + c.token_ids[:i], alt, 0.9), (i, alt)
    assert all(len(e) in (40, 41) for e in out.prompt_logprobs[1:])
    for bad in (-1, 2049, 1.5):
        with pytest.raises(ValueError, match=rf"LLM: max_logprobs={bad}"):
            make_llm(model, max_logprobs=bad)
    assert make_llm(model, max_logprobs=2048).max_logprobs == 2048


@pytest.mark.parametrize("name", ARCHS)
def test_prompt_logprobs_are_the_training_forwards_and_sampling_is_unchanged(name, monkeypatch):
    """Every prompt token after the first: its entry is ``token_logprobs`` of the prompt at the
    request's temperature, each alternative the training forward's too; chunked prefill (8-token
    steps, their positions' logits 3 rows at a time), n = 2 (the second sample shares the first's
    prompt pages or state); the samples are those of the same requests without prompt logprobs."""
    monkeypatch.setattr(top_logprobs, "PROMPT_ROWS_AT_ONCE", 3)
    overrides = {"final_logit_softcapping": 3.0} if name == "gemma3" else {}
    model = _model(name, **overrides)
    prompts = prompts_for(3, seed=5, lo=9, hi=20)
    plain = SamplingParams(n=2, temperature=0.7, max_tokens=4, seed=3, ignore_eos=True)
    asked = SamplingParams(n=2, temperature=0.7, max_tokens=4, seed=3, ignore_eos=True, prompt_logprobs=2)
    llm = make_llm(model, max_num_batched_tokens=8)
    want, got = gen(llm, prompts, plain), gen(llm, prompts, asked)
    for prompt, w, g in zip(prompts, want, got):
        assert w.prompt_logprobs is None and [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        assert [c.logprobs for c in g.outputs] == [c.logprobs for c in w.outputs]
        assert g.prompt_logprobs[0] is None and len(g.prompt_logprobs) == len(prompt)
        with torch.no_grad():
            ref = model.token_logprobs(torch.tensor([prompt]), temperature=0.7)[0]
        assert torch.equal(torch.tensor([e[t].logprob for e, t in zip(g.prompt_logprobs[1:], prompt[1:])]), ref[1:])
        for i in (1, len(prompt) // 2, len(prompt) - 1):
            entry = g.prompt_logprobs[i]
            assert next(iter(entry)) == prompt[i] and 2 <= len(entry) <= 3
            for alt, lp in entry.items():
                assert lp.logprob == _training_entry(model, prompt[:i], alt, 0.7), (i, alt)


def test_prompt_positions_logits_are_made_a_few_rows_at_a_time(monkeypatch):
    """`launch_prompt_alternatives` runs the head on `PROMPT_ROWS_AT_ONCE` rows at a time (a long
    prompt chunk never holds all its positions' logits) and gives the bits of one head over all."""
    model = _model("qwen3")
    seq = Sequence(0, 0, list(range(3, 11)), SamplingParams(prompt_logprobs=4), 1)
    prompt = top_logprobs.PromptRows(np.arange(7), np.array(seq.token_ids[1:]), np.full(7, 1.0, np.float32),
                                     [(seq, i) for i in range(1, 8)])
    hidden = torch.randn(7, model.config.hidden_size)
    sizes = []

    def head(rows):
        sizes.append(len(rows))
        assert not torch.is_grad_enabled()  # the model's weights require grad: no graph is built
        return model.final_logits(rows)

    top_logprobs.launch_prompt_alternatives(hidden, prompt, model.final_logits).record()
    whole = top_logprobs.prompt_logprobs_of(seq)
    monkeypatch.setattr(top_logprobs, "PROMPT_ROWS_AT_ONCE", 3)
    top_logprobs.launch_prompt_alternatives(hidden, prompt, head).record()
    assert sizes == [3, 3, 1] and top_logprobs.prompt_logprobs_of(seq) == whole and len(whole) == 8


def test_a_scored_prompt_computes_every_position_beside_published_pages():
    """The prompt's pages are published by an earlier call (an engine owning its weights) and by
    a request sharing its prefix: the scoring sample takes none of them (it would have no logits
    for their positions), the others still share, and a preemption by recompute keeps the scores."""
    model = _model("qwen3")
    base = prompts_for(2, seed=6, lo=13, hi=18)
    prompts = base + [p + [7, 8, 9] for p in base]
    llm = make_llm(model, owns_weights=True)
    first = gen(llm, prompts, SamplingParams(n=2, max_tokens=3, seed=1))
    hits = llm.block_manager.num_shared_hits
    scored = gen(llm, prompts, SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=0))
    assert llm.block_manager.num_shared_hits > hits  # the second samples took the published pages
    tight_llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 14), max_num_batched_tokens=8)
    tight = gen(tight_llm, prompts, SamplingParams(n=2, max_tokens=3, seed=1, prompt_logprobs=0))
    assert tight_llm.num_preemptions > 0
    for prompt, f, s, t in zip(prompts, first, scored, tight):
        with torch.no_grad():
            ref = model.token_logprobs(torch.tensor([prompt]))[0, 1:]
        assert torch.equal(torch.tensor([e[tok].logprob for e, tok in zip(s.prompt_logprobs[1:], prompt[1:])]), ref)
        assert all(len(e) == 1 for e in s.prompt_logprobs[1:])
        assert s.prompt_logprobs == t.prompt_logprobs and s.outputs[0].token_ids == f.outputs[0].token_ids


def test_a_request_that_never_fits_errors_without_scores_beside_scored_ones():
    model = _model("qwen3")
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 4))  # 16 positions in all
    prompts = [[5, 6, 7], list(range(20, 30))]
    params = [SamplingParams(max_tokens=5, seed=3, prompt_logprobs=1, logprobs=1),
              SamplingParams(max_tokens=20, seed=4, prompt_logprobs=1, logprobs=1)]  # 10 + 20 positions
    ok, huge = gen(llm, prompts, params)
    assert huge.outputs[0].finish_reason == "error" and huge.prompt_logprobs is None
    assert huge.outputs[0].logprobs == [] and "KV cache blocks" in huge.outputs[0].error
    assert ok.outputs[0].finish_reason == "length" and len(ok.prompt_logprobs) == 3


def test_prompt_logprobs_decode_their_tokens_and_are_refused_out_of_range():
    llm = make_llm(_model("qwen3"), tokenizer=word_tokenizer())
    [out] = gen(llm, ["w3 w4 w5 w6"], SamplingParams(max_tokens=2, seed=1, prompt_logprobs=1))
    assert [list(e)[0] for e in out.prompt_logprobs[1:]] == [4, 5, 6]
    assert all(v.decoded_token == f"w{t}" for e in out.prompt_logprobs[1:] for t, v in e.items())
    with pytest.raises(ValueError, match="prompt_logprobs=-1 is below the minimum 0"):
        SamplingParams(prompt_logprobs=-1)


def test_steps_scoring_prompts_run_eagerly_beside_graph_shaped_steps():
    """An engine whose steps run through the step graphs' buffers (`CalledGraphs`, as on CUDA):
    the steps holding scored prompt positions run eagerly (their extra logits rows are not a
    captured shape), the others replay, and every output is the eager engine's."""
    model = _model("qwen3")
    prompts = prompts_for(5, seed=8, lo=6, hi=20)
    params = [SamplingParams(temperature=0.9, max_tokens=6, seed=i, ignore_eos=True,
                             prompt_logprobs=1 if i % 2 else None, logprobs=2 if i == 2 else None) for i in range(5)]
    want = gen(make_llm(model, max_num_batched_tokens=16), prompts, params)
    llm = make_llm(model, max_num_batched_tokens=16)
    graphs, replayed, steps = graph_shaped(llm), [], []
    run, execute, scoring = graphs.run, llm.runner.execute, llm.runner.execute_scoring
    graphs.run = lambda inputs, *args, **kwargs: replayed.append(1) or run(inputs, *args, **kwargs)
    llm.runner.execute = lambda scheduled: steps.append(False) or execute(scheduled)
    llm.runner.execute_scoring = lambda scheduled, rows: steps.append(True) or scoring(scheduled, rows)
    got = gen(llm, prompts, params)
    assert replayed and sum(steps) and len(replayed) + sum(steps) == len(steps)  # each step: replayed or eager
    for w, g in zip(want, got):
        assert g.prompt_logprobs == w.prompt_logprobs
        assert [(c.token_ids, c.logprobs) for c in g.outputs] == [(c.token_ids, c.logprobs) for c in w.outputs]
    assert got[1].prompt_logprobs is not None and got[0].prompt_logprobs is None
