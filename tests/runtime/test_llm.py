"""The engine front end (runtime/llm.py) end to end on a tiny CPU Qwen3: input validation
(nothing half-done), requests that can never fit, preemption, reproducibility under any
batching/engine settings, rollout logprobs == training logprobs bitwise, greedy == training
argmax, n, stop tokens/EOS, max_model_len."""

import copy
from dataclasses import replace

import pytest
import torch

from vexact_models.runtime import SamplingParams

from .llm_support import cache_bytes, gen, make_llm, prompts_for, result, training_logprobs

# -- 1. validation ---------------------------------------------------------------------------------

VALID = [[5, 6, 7], [8, 9, 10, 11]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=3)


@pytest.fixture(scope="module")
def small_llm(model):
    return make_llm(model, max_model_len=16)


@pytest.fixture(scope="module")
def baseline(small_llm):
    return [result(o) for o in gen(small_llm, VALID, GREEDY)]


@pytest.mark.parametrize("prompts, params, words", [
    ([[5, 6, 512]], GREEDY, ["token id 512", "vocabulary [0, 512)"]),
    ([[5, 6, 10_000]], GREEDY, ["token id 10000", "vocabulary"]),
    ([[5, -1, 6]], GREEDY, ["token id -1", "vocabulary"]),
    ([list(range(2, 18))], GREEDY, ["length 16", "max_model_len=16"]),  # == max_model_len
    ([list(range(2, 30))], GREEDY, ["length 28", "max_model_len=16"]),  # > max_model_len
    ([[]], GREEDY, ["prompt", "empty"]),
    ([[5, 6], [7, 8]], [GREEDY] * 3, ["3 sampling_params", "2 prompts"]),
    ([[5, 6], [7, 8]], [GREEDY], ["1 sampling_params", "2 prompts"]),
    (["hello world"], GREEDY, ["tokenizer"]),
    ([[5, 6], "hello"], GREEDY, ["tokenizer"]),
])
def test_bad_input_raises_and_leaves_nothing_behind(small_llm, baseline, prompts, params, words):
    # valid prompts first: a half-validated call would already have queued them
    with pytest.raises(ValueError) as info:
        gen(small_llm, VALID + prompts if isinstance(params, SamplingParams) else prompts, params)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not small_llm.scheduler.has_unfinished()
    assert small_llm.block_manager.num_free_blocks == small_llm.block_manager.num_blocks
    assert [result(o) for o in gen(small_llm, VALID, GREEDY)] == baseline


@pytest.mark.parametrize("kwargs, words", [
    (dict(max_tokens=0), ["max_tokens=0"]),
    (dict(max_tokens=-3), ["max_tokens=-3"]),
    (dict(top_p=0.0), ["top_p=0.0", "(0, 1]"]),
    (dict(top_p=1.5), ["top_p=1.5", "(0, 1]"]),
    (dict(top_p=-0.2), ["top_p=-0.2"]),
    (dict(temperature=-0.5), ["temperature=-0.5"]),
])
def test_bad_sampling_params_raise_naming_field_and_value(kwargs, words):
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_engine_argument_errors(model):
    with pytest.raises(ValueError, match="max_model_len=2000"):
        make_llm(model, max_model_len=2000)
    with pytest.raises(ValueError, match=r"\(10 bytes\).*kv_cache_bytes"):
        make_llm(model, kv_cache_bytes=10)
    with pytest.raises(ValueError, match="gpu_memory_utilization=1.5"):
        make_llm(model, gpu_memory_utilization=1.5)


def test_single_prompt_forms(small_llm, baseline):
    # a bare list of ids is one prompt
    [out] = gen(small_llm, VALID[0], GREEDY)
    assert result(out) == baseline[0] and out.prompt_token_ids == VALID[0] and out.prompt is None
    assert gen(small_llm, [], GREEDY) == []


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_as_vllm(small_llm, baseline):
    """k keeps the last k prompt tokens (the request's ``prompt_token_ids``), as if only they were
    given; -1 as many as the engine takes; a k above ``max_model_len`` is refused before anything runs."""
    [out] = gen(small_llm, [1, 2] + VALID[1], replace(GREEDY, truncate_prompt_tokens=4))
    assert out.prompt_token_ids == VALID[1] and result(out) == baseline[1]
    [whole] = gen(small_llm, list(range(2, 40)), replace(GREEDY, truncate_prompt_tokens=-1))
    assert whole.prompt_token_ids == list(range(25, 40))  # max_model_len 16: 15 prompt tokens
    with pytest.raises(ValueError, match=r"SamplingParams.truncate_prompt_tokens=17 is above max_model_len=16"):
        gen(small_llm, [VALID[0], VALID[1]], [GREEDY, replace(GREEDY, truncate_prompt_tokens=17)])
    assert not small_llm.scheduler.has_unfinished()


# -- 2. a request that can never fit ----------------------------------------------------------------

def test_request_that_never_fits_errors_while_others_finish(model):
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 4))  # 16 positions in all
    params = SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True, seed=3)
    prompts = [[5, 6, 7], list(range(20, 30)), [8, 9, 10, 11]]
    huge = SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=4)  # 10 + 20 positions
    outs = gen(llm, prompts, [params, huge, params])
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "error", "length"]
    err = outs[1].outputs[0]
    assert err.token_ids == [] and err.logprobs == []
    assert "needs 8 KV cache blocks" in err.error and "only 4 blocks" in err.error
    assert outs[0].outputs[0].error is None and outs[2].outputs[0].error is None
    assert not llm.scheduler.has_unfinished()
    big = make_llm(model)
    want = gen(big, [prompts[0], prompts[2]], params)
    assert [result(outs[0]), result(outs[2])] == [result(o) for o in want]


# -- 3. preemption ----------------------------------------------------------------------------------

def test_preemption_by_recompute_gives_identical_results(model):
    prompts = prompts_for(6, seed=1, lo=5, hi=9)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, max_tokens=12, ignore_eos=True, seed=50 + i)
              for i, (t, k, p) in enumerate([(0.0, -1, 1.0), (1.0, -1, 1.0), (0.7, 20, 1.0), (1.2, -1, 0.8),
                                             (0.9, 10, 0.9), (1.0, -1, 1.0)])]
    small = make_llm(model, kv_cache_bytes=cache_bytes(model, 8), max_num_batched_tokens=16)
    got = gen(small, prompts, params)
    assert small.num_preemptions > 0
    big = make_llm(model)
    want = gen(big, prompts, params)
    assert big.num_preemptions == 0
    for g, w in zip(got, want):
        assert len(g.outputs[0].token_ids) == 12 and g.outputs[0].finish_reason == "length"
        assert result(g) == result(w)
    assert not small.scheduler.has_unfinished()
    assert small.block_manager.num_free_blocks == small.block_manager.num_blocks


# -- 4. reproducibility -----------------------------------------------------------------------------

TARGET_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, seed=7),
    SamplingParams(temperature=1.0, max_tokens=6, seed=8),
    SamplingParams(temperature=0.8, top_k=5, max_tokens=6, seed=9),
    SamplingParams(temperature=1.3, top_p=0.6, max_tokens=6, seed=10),
    SamplingParams(temperature=0.9, top_k=30, top_p=0.8, min_tokens=2, max_tokens=6, seed=11),
]
ENGINES = [
    dict(max_num_seqs=64, max_num_batched_tokens=4096, block_size=4),  # the reference
    dict(max_num_seqs=1, max_num_batched_tokens=8, block_size=4),
    dict(max_num_seqs=4, max_num_batched_tokens=16, block_size=8),
    dict(max_num_seqs=64, max_num_batched_tokens=4096, block_size=16),
    dict(max_num_seqs=3, max_num_batched_tokens=5, block_size=2),
    dict(max_num_seqs=8, max_num_batched_tokens=64, block_size=1, enable_chunked_prefill=False, max_model_len=64),
]


def test_same_prompt_and_seed_give_the_same_result_under_any_batching(model):
    targets = list(zip(prompts_for(len(TARGET_PARAMS), seed=2, lo=9, hi=13), TARGET_PARAMS))
    others = list(zip(prompts_for(10, seed=3, lo=2, hi=14),
                      [SamplingParams(temperature=0.5 + 0.1 * i, top_k=-1 if i % 2 else 8, max_tokens=3 + i % 5,
                                      seed=200 + i) for i in range(10)]))
    reference = None
    for engine in ENGINES:
        llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 512, engine["block_size"]), **engine)
        alone = [result(gen(llm, [p], sp)[0]) for p, sp in targets]
        # targets spread among the others (at the front, middle and back)
        mixed = list(others)
        slots = [0, 3, 6, 9, 12]
        for slot, item in zip(slots, targets):
            mixed.insert(slot, item)
        outs = gen(llm, [p for p, _ in mixed], [sp for _, sp in mixed])
        in_batch = [result(outs[slot]) for slot in slots]
        if reference is None:
            reference = alone
            for [(toks, _, reason)] in reference:
                assert len(toks) == 6 and reason == "length"
        assert alone == reference, engine
        assert in_batch == reference, engine
    # different seeds do change sampled outputs (the test above is not vacuous)
    llm = make_llm(model)
    p, sp = targets[1]
    assert result(gen(llm, [p], replace(sp, seed=sp.seed + 1))[0]) != reference[1]
    # a negative seed (vLLM's int64 range) counts modulo 2**63
    assert result(gen(llm, [p], replace(sp, seed=sp.seed - 2**63))[0]) == reference[1]


# -- 5./6./7. logprobs == training logprobs, greedy == argmax, n ----------------------------------

def test_rollout_logprobs_equal_training_logprobs_bitwise(model):
    prompts = prompts_for(6, seed=4, lo=3, hi=14)
    params = [SamplingParams(temperature=0.0, max_tokens=7),
              SamplingParams(temperature=1.0, max_tokens=7, seed=1),
              SamplingParams(temperature=0.6, top_k=10, max_tokens=7, seed=2, n=4),
              SamplingParams(temperature=1.4, top_p=0.7, max_tokens=7, seed=3),
              SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_tokens=3, max_tokens=7, seed=4, n=4),
              SamplingParams(temperature=2.0, max_tokens=7, n=4, ignore_eos=True)]
    llm = make_llm(model, max_num_batched_tokens=12, max_num_seqs=5)
    outs = gen(llm, prompts, params)
    samples, temps = [], []
    for prompt, sp, out in zip(prompts, params, outs):
        assert len(out.outputs) == sp.n
        for c in out.outputs:
            assert len(c.token_ids) == len(c.logprobs) >= 1
            want = training_logprobs(model, prompt, c.token_ids, sp.temperature)
            assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), want), (out.request_id, c.index)
            samples.append((prompt, c))
            temps.append(sp.temperature if sp.temperature > 0 else 1.0)
    # packed, all samples in one training batch with per-sequence temperatures
    seqs = [p + c.token_ids for p, c in samples]
    cu = torch.tensor([0] + torch.tensor([len(s) for s in seqs]).cumsum(0).tolist(), dtype=torch.int32)
    with torch.no_grad():
        flat = model.token_logprobs(torch.tensor([t for s in seqs for t in s]), cu_seqlens=cu,
                                    temperature=torch.tensor(temps))
    for (p, c), start, stop in zip(samples, cu[:-1].tolist(), cu[1:].tolist()):
        assert torch.equal(flat[start + len(p):stop], torch.tensor(c.logprobs, dtype=torch.float32))


def test_bf16_rollout_logprobs_equal_training_logprobs(model):
    m = copy.deepcopy(model).to(torch.bfloat16)
    llm = make_llm(m, kv_cache_bytes=cache_bytes(m, 64), max_num_batched_tokens=8)
    prompt = [5, 17, 33, 9, 250, 11]
    sp = SamplingParams(temperature=0.8, max_tokens=4, seed=5, n=2)
    [out] = gen(llm, [prompt], sp)
    for c in out.outputs:
        want = training_logprobs(m, prompt, c.token_ids, 0.8)
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), want)


def test_greedy_picks_the_training_argmax(model):
    prompts = prompts_for(4, seed=5, lo=2, hi=10)
    llm = make_llm(model, max_num_batched_tokens=8)
    outs = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    distinct = set()
    for prompt, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert len(tokens) == 8
        with torch.no_grad():
            logits = model(torch.tensor([prompt + tokens])).logits[0]
        for i, token in enumerate(tokens):
            row = logits[len(prompt) - 1 + i]
            assert token == int(row.argmax()), (prompt, i)
        want = torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)[torch.arange(8), torch.tensor(tokens)]
        assert torch.allclose(torch.tensor(out.outputs[0].logprobs, dtype=torch.float64), want, atol=1e-5)
        distinct.update(tokens)
    assert len(distinct) > 4  # the model does not just repeat one token


def test_top_k_one_and_tiny_top_p_reduce_to_greedy(model):
    """Filtering reaches the engine's sampling: one candidate left means the argmax, and at
    T = 1 the reported logprobs are greedy's (both are the unfiltered T = 1 distribution)."""
    prompts = prompts_for(3, seed=8)
    llm = make_llm(model)
    greedy = [result(o) for o in gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))]
    for params in (SamplingParams(temperature=1.0, top_k=1, max_tokens=6, ignore_eos=True, seed=1),
                   SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=6, ignore_eos=True, seed=2)):
        assert [result(o) for o in gen(llm, prompts, params)] == greedy
    hot = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1)
    assert [result(o) for o in gen(llm, prompts, hot)] != greedy


def test_n_gives_indexed_distinct_completions(model):
    llm = make_llm(model)
    prompt = [5, 6, 7, 8, 9]
    [out] = gen(llm, [prompt], SamplingParams(temperature=1.0, n=4, max_tokens=6, seed=12, ignore_eos=True))
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # reproducible, and each sample is its own stream: n=4 again gives the same 4 completions
    [again] = gen(llm, [prompt], SamplingParams(temperature=1.0, n=4, max_tokens=6, seed=12, ignore_eos=True))
    assert result(again) == result(out)
    # greedy n=4: all identical
    [greedy] = gen(llm, [prompt], SamplingParams(temperature=0.0, n=4, max_tokens=6, ignore_eos=True))
    assert len({tuple(c.token_ids) for c in greedy.outputs}) == 1 and len(greedy.outputs) == 4


def test_requests_without_seed_are_reproducible_per_engine_seed(model):
    prompts = prompts_for(3, seed=6)
    sp = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)
    a = [result(o) for o in gen(make_llm(model, seed=1), prompts, sp)]
    b = [result(o) for o in gen(make_llm(model, seed=1), prompts, sp)]
    c = [result(o) for o in gen(make_llm(model, seed=2), prompts, sp)]
    assert a == b and a != c


# -- 10. stop tokens and EOS ------------------------------------------------------------------------

def first_new_token_step(model, min_step: int = 2):
    """A prompt and its greedy output where step k >= min_step emits a token not seen before."""
    llm = make_llm(model)
    for prompt in prompts_for(20, seed=7, lo=3, hi=8):
        [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
        tokens = out.outputs[0].token_ids
        for k in range(min_step, 8):
            if tokens[k] not in tokens[:k] and tokens[k] != 1:
                return prompt, tokens, k
    raise AssertionError("no suitable prompt")


def test_stop_token_stops_greedy_output_there(model):
    prompt, tokens, k = first_new_token_step(model)
    llm = make_llm(model)
    stop = tokens[k]
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop]))
    c = out.outputs[0]
    assert c.token_ids == tokens[:k + 1] and c.finish_reason == "stop"
    # min_tokens beyond k: the stop token is banned at step k, so greedy takes another token there
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop],
                                              min_tokens=k + 1))
    c = out.outputs[0]
    assert c.token_ids[:k] == tokens[:k] and c.token_ids[k] != stop
    assert c.finish_reason in ("length", "stop") and (c.finish_reason == "length") == (stop not in c.token_ids)


def test_model_eos_stops_unless_ignored(model):
    prompt, tokens, k = first_new_token_step(model)
    m = copy.deepcopy(model)
    m.generation_config.eos_token_id = tokens[k]  # where HF generation reads EOS; the engine does too
    llm = make_llm(m)
    assert llm.eos_token_ids == [tokens[k]]
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"
    # several EOS ids: the later ones stop too
    m.generation_config.eos_token_id = [3, tokens[k]]
    llm = make_llm(m)
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"


def test_max_model_len_caps_the_output(model):
    llm = make_llm(model, max_model_len=10)
    [out] = gen(llm, [[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


# -- 11. update_weights and shared storage --------------------------------------------------------



def test_default_page_size_holds_whole_key_blocks_where_decode_reads_them_by_tma():
    """`LLM`'s default page size: 64 positions for GQA caches of head dim 64 or 128 (decode
    launches of few programs read whole key blocks by TMA from such pages on Hopper) and for
    latent MLA caches; 16 for other head dims (MLA's expanded 192-wide keys, tiny test models)."""
    from vexact_models.deepseek_v3.latent_attention import KVCacheSpec
    from vexact_models.runtime.llm_args import default_block_size

    assert default_block_size((36, 8, 128, 128)) == 64 and default_block_size((2, 4, 64, 64)) == 64
    assert default_block_size((27, 16, 192, 128)) == 16 and default_block_size((2, 2, 16, 16)) == 16
    assert default_block_size(KVCacheSpec(27, 1, 576, 512, value_in_key=True)) == 64
