"""The engine front end (runtime/llm.py) end to end on a tiny CPU Qwen3.

Checks input validation (nothing half-done), errors for requests that can never fit,
preemption, reproducibility under any batching/engine settings, rollout logprobs ==
training logprobs bitwise, greedy == training argmax, n, stop tokens/EOS, update_weights,
sleep/wake_up, text prompts through a checkpoint folder with a tokenizer, and the progress bar.

The model uses ``initializer_range=0.5``: with the default 0.02 the tiny random model's logits
are almost flat, greedy just repeats the last prompt token and sampled tokens are decided by the
noise alone, which would make the token-level assertions here nearly vacuous.
"""

import copy
import random
from dataclasses import replace

import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block

BS = 4


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


def cache_bytes(model, blocks: int, block_size: int = BS) -> int:
    return blocks * kv_bytes_per_block(model.kv_cache_spec(), block_size, next(model.parameters()).dtype)


def make_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("block_size", BS)
    kwargs.setdefault("kv_cache_bytes", cache_bytes(model, 256, kwargs["block_size"]))
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("max_num_seqs", 16)
    kwargs.setdefault("device", "cpu")  # CPU tests, even on a machine with a GPU
    return LLM(model, **kwargs)


def gen(llm, prompts, params, **kwargs):
    return llm.generate(prompts, params, use_tqdm=False, **kwargs)


def result(out) -> list[tuple[list[int], list[float], str]]:
    """(token ids, logprobs, finish reason) of every completion of one RequestOutput."""
    return [(c.token_ids, c.logprobs, c.finish_reason) for c in out.outputs]


def prompts_for(n: int, seed: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, 512) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def training_logprobs(model, prompt, tokens, temperature) -> torch.Tensor:
    with torch.no_grad():
        lp = model.token_logprobs(torch.tensor([prompt + tokens]), temperature=temperature if temperature > 0 else 1.0)
    return lp[0, len(prompt):]


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
    assert getattr(m, "generation_config", None) is None  # so the engine reads config.eos_token_id
    m.config.eos_token_id = tokens[k]
    llm = make_llm(m)
    assert llm.eos_token_ids == [tokens[k]]
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out.outputs[0].token_ids == tokens and out.outputs[0].finish_reason == "length"
    # several EOS ids: the later ones stop too
    m.config.eos_token_id = [3, tokens[k]]
    llm = make_llm(m)
    [out] = gen(llm, [prompt], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"


def test_max_model_len_caps_the_output(model):
    llm = make_llm(model, max_model_len=10)
    [out] = gen(llm, [[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 3 and out.outputs[0].finish_reason == "length"


# -- 11. update_weights and shared storage --------------------------------------------------------

PROMPTS_W = [[5, 6, 7, 8], [40, 41, 42]]
PARAMS_W = SamplingParams(temperature=0.9, max_tokens=5, seed=21, ignore_eos=True)


def run_w(llm):
    return [result(o) for o in gen(llm, PROMPTS_W, PARAMS_W)]


def test_engine_shares_parameter_storage_with_the_training_model(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    ours = dict(m.named_parameters())
    engine = dict(llm.model.causal_lm.named_parameters())
    assert ours.keys() == engine.keys()
    assert all(ours[n].data_ptr() == engine[n].data_ptr() for n in ours)
    before = run_w(llm)
    with torch.no_grad():
        m.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    after = run_w(llm)
    assert after != before
    assert after == run_w(make_llm(copy.deepcopy(m)))


def test_update_weights_copies_new_values(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    before = run_w(llm)
    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    want = run_w(make_llm(target))
    assert want != before
    # the trainer's natural call: its whole state_dict (a tied model lists lm_head.weight too)
    llm.update_weights(target.state_dict())
    assert run_w(llm) == want
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), target.parameters()))
    # an iterable of (name, tensor) pairs works too
    llm.update_weights(list(model.named_parameters()))
    assert run_w(llm) == before


@pytest.mark.parametrize("bad, words", [
    (("model.layers.0.mlp.gate.weight", torch.zeros(3)), ["model.layers.0.mlp.gate.weight", "unknown"]),
    (("model.norm.weight", torch.zeros(65)), ["model.norm.weight", "(65,)", "(64,)"]),
])
def test_update_weights_rejects_bad_names_and_shapes_and_writes_nothing(model, bad, words):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    snapshot = {n: p.detach().clone() for n, p in m.named_parameters()}
    name = "model.layers.1.self_attn.q_proj.weight"
    good = (name, torch.zeros_like(snapshot[name]))
    with pytest.raises(ValueError) as info:
        llm.update_weights(dict([good, bad]))
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert all(torch.equal(p, snapshot[n]) for n, p in m.named_parameters())


# -- 12. sleep / wake_up ----------------------------------------------------------------------------

def test_sleep_frees_the_cache_and_wake_up_restores_it(model):
    llm = make_llm(model)
    before = run_w(llm)
    num_layers = model.config.num_hidden_layers
    assert len(llm.runner.kv_caches) == num_layers
    shapes = [(k.shape, v.shape) for k, v in llm.runner.kv_caches]
    llm.sleep()
    assert llm.runner.kv_caches == []
    llm.sleep()  # idempotent
    # generating while asleep is a clear error and leaves nothing queued
    with pytest.raises(RuntimeError, match="wake_up"):
        gen(llm, PROMPTS_W, PARAMS_W)
    assert not llm.scheduler.has_unfinished()
    llm.wake_up()
    assert [(k.shape, v.shape) for k, v in llm.runner.kv_caches] == shapes
    llm.wake_up()  # no-op when awake
    assert run_w(llm) == before
    # the re-allocated cache is uninitialised memory: whatever it holds (even NaN) must not leak
    for k, v in llm.runner.kv_caches:
        k.fill_(float("nan")), v.fill_(float("nan"))
    assert run_w(llm) == before


def test_a_failing_step_does_not_wedge_the_engine(model, monkeypatch):
    llm = make_llm(model)
    before = run_w(llm)
    calls = []
    real = llm.runner.execute

    def flaky(scheduled):
        calls.append(len(scheduled))
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real(scheduled)

    monkeypatch.setattr(llm.runner, "execute", flaky)
    with pytest.raises(RuntimeError, match="injected failure"):
        run_w(llm)
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert run_w(llm) == before


# -- 13. text prompts through a checkpoint folder --------------------------------------------------

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tiny_qwen3")
    vocab = {f"w{i}": i for i in range(512)}
    vocab["[UNK]"] = 512  # outside the model's vocabulary (512): an unknown word is a bad token id
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    torch.manual_seed(1)
    hf = transformers.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()
    hf.save_pretrained(path)
    return path, hf


def test_llm_loads_a_checkpoint_folder_with_its_tokenizer(checkpoint):
    path, hf = checkpoint
    llm = LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_num_batched_tokens=32)
    assert type(llm.model.causal_lm) is qwen3.Qwen3ForCausalLM and llm.tokenizer is not None
    assert llm.dtype == torch.float32 and llm.eos_token_ids == [1]
    ours = llm.model.causal_lm.state_dict()
    assert all(torch.equal(t, ours[n]) for n, t in hf.state_dict().items())
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    [out] = gen(llm, ["w1 w2 w3"], sp)
    assert out.prompt == "w1 w2 w3" and out.prompt_token_ids == [1, 2, 3]
    c = out.outputs[0]
    assert len(c.token_ids) == 5
    assert c.text == llm.tokenizer.decode(c.token_ids) == " ".join(f"w{t}" for t in c.token_ids)
    # the same as token-id prompts over the same weights (and text and ids mix in one call)
    twin = make_llm(qwen3.Qwen3ForCausalLM.from_pretrained(str(path)).eval())
    [want] = gen(twin, [[1, 2, 3]], sp)
    assert (c.token_ids, c.logprobs) == (want.outputs[0].token_ids, want.outputs[0].logprobs)
    mixed = gen(llm, [[1, 2, 3], "w1 w2 w3"], sp)
    assert result(mixed[0]) == result(mixed[1]) == result(out)
    assert mixed[0].prompt is None and mixed[0].outputs[0].text == c.text


def test_checkpoint_generation_config_eos_list_is_used(checkpoint, tmp_path):
    """generation_config.json's EOS list (Qwen3: [<|im_end|>, <|endoftext|>]) stops generation."""
    import json
    import shutil

    path, _ = checkpoint
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    [out] = gen(LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20), ["w7 w8 w9 w10"], sp)
    tokens = out.outputs[0].token_ids
    k = next(k for k in range(1, 8) if tokens[k] not in tokens[:k] and tokens[k] != 1)
    folder = tmp_path / "ckpt"
    shutil.copytree(path, folder)
    gen_cfg = json.loads((folder / "generation_config.json").read_text())
    gen_cfg["eos_token_id"] = [1, tokens[k]]
    (folder / "generation_config.json").write_text(json.dumps(gen_cfg))
    llm = LLM(str(folder), device="cpu", block_size=BS, kv_cache_bytes=1 << 20)
    assert llm.eos_token_ids == [1, tokens[k]]
    [out] = gen(llm, ["w7 w8 w9 w10"], SamplingParams(temperature=0.0, max_tokens=8))
    assert out.outputs[0].token_ids == tokens[:k + 1] and out.outputs[0].finish_reason == "stop"
    [out] = gen(llm, ["w7 w8 w9 w10"], sp)
    assert out.outputs[0].token_ids == tokens


@pytest.mark.parametrize("text, words", [
    ("", ["empty"]),
    ("w1 nonsense w2", ["token id 512", "vocabulary"]),
    (" ".join(["w5"] * 40), ["length 40", "max_model_len=32"]),
])
def test_bad_text_prompts_raise_and_leave_nothing_behind(checkpoint, text, words):
    path, _ = checkpoint
    llm = LLM(str(path), device="cpu", block_size=BS, kv_cache_bytes=1 << 20, max_model_len=32)
    sp = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError) as info:
        gen(llm, ["w1 w2 w3", text], sp)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert not llm.scheduler.has_unfinished()
    [out] = gen(llm, ["w1 w2 w3"], sp)
    assert len(out.outputs[0].token_ids) == 3


# -- 14. progress bar ------------------------------------------------------------------------------

def test_progress_bar(model, capsys):
    llm = make_llm(model)
    prompts = [[5, 6], [7, 8, 9], [10]]
    sp = SamplingParams(temperature=0.0, max_tokens=2)
    capsys.readouterr()
    quiet = llm.generate(prompts, sp, use_tqdm=False)
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""
    loud = llm.generate(prompts, sp, use_tqdm=True)
    captured = capsys.readouterr()
    assert "generate" in captured.err and "3/3" in captured.err
    assert [result(o) for o in loud] == [result(o) for o in quiet]
