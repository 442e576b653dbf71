"""`LLM`'s online requests (`runtime.llm_online`): requests added while others run, stepped one
engine step at a time, aborted. A request's tokens and logprobs are bitwise those ``generate``
gives it alone (and the training forward's), whatever ran beside it, under preemption, chunked
prefill, ``n > 1`` and steps launched ahead; each `RequestOutputKind` returns what it says."""

import math
from dataclasses import replace

import pytest
import torch

from vexact_models.registry import architectures, get
from vexact_models.runtime import LLM, RequestOutputKind, SamplingParams
from vexact_models.runtime.llm_setup import cache_bytes_per_block, linear_state_bytes

from .llm_support import cache_bytes, gen, make_llm, prompts_for, training_logprobs, word_tokenizer

ARCHS = ["qwen3", "qwen3_5", "gemma3"]
KINDS = [RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA]


def _model(name: str):
    if name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{name} is not registered on this transformers")
    torch.manual_seed(0)
    return get(name).causal_lm_class(get(name).tiny_config()).eval()


def drive(llm, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]], aborts: dict[int, list[str]] = None):
    """Step `llm`, adding the requests of ``arrivals[k]`` (and aborting ``aborts[k]``) before step
    k; returns every output by request id, in the order they came."""
    aborts = aborts or {}
    seen: dict[str, list] = {}
    step = 0
    while llm.has_unfinished_requests() or any(k >= step for k in arrivals):
        for request_id, prompt, params in arrivals.get(step, []):
            llm.add_request(request_id, prompt, params)
        if aborts.get(step):
            llm.abort_request(aborts[step])
        for output in llm.step():
            seen.setdefault(output.request_id, []).append(output)
        step += 1
    return seen


def _requests(count: int, seed: int, kinds=KINDS):
    prompts = prompts_for(count, seed=seed, lo=3, hi=18)
    params = [SamplingParams(n=1 + i % 2, temperature=0.0 if i % 3 == 2 else 0.9, max_tokens=6 + 3 * i, seed=100 + i,
                             ignore_eos=True, output_kind=kinds[i % len(kinds)]) for i in range(count)]
    return prompts, params


def _joined(outputs) -> list[tuple[list[int], list[float], str]]:
    """(tokens, logprobs, finish reason) of each sample, from a request's DELTA outputs."""
    samples: dict[int, list] = {}
    for output in outputs:
        for c in output.outputs:
            entry = samples.setdefault(c.index, [[], [], None])
            entry[0] += c.token_ids
            entry[1] += list(c.logprobs)
            entry[2] = c.finish_reason
    return [tuple(samples[i]) for i in sorted(samples)]


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("async_scheduling", [True, False])
def test_staggered_requests_equal_generate_alone(name, async_scheduling):
    """Requests arriving at different steps, into a cache small enough to preempt, with prompts
    chunked over steps: each one's samples equal ``generate``'s of it alone, bitwise."""
    model = _model(name)
    prompts, params = _requests(8, seed=3)
    states = linear_state_bytes(model, torch.float32, 16)  # the gated-DeltaNet models' (max_num_seqs 16)
    llm = make_llm(model, kv_cache_bytes=14 * cache_bytes_per_block(model, torch.float32, 4) + states, max_num_batched_tokens=16,
                   async_scheduling=async_scheduling)
    alone = [gen(llm, [p], q)[0] for p, q in zip(prompts, params)]
    free = llm.block_manager.num_free_blocks
    seen = drive(llm, {2 * i: [(f"r{i}", p, q)] for i, (p, q) in enumerate(zip(prompts, params))})
    assert llm.num_preemptions > 0
    for i, (want, q) in enumerate(zip(alone, params)):
        outputs = seen[f"r{i}"]
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        if q.output_kind is RequestOutputKind.FINAL_ONLY:
            assert len(outputs) == 1
        if q.output_kind is RequestOutputKind.DELTA:
            got = _joined(outputs)
        else:
            got = [(c.token_ids, c.logprobs, c.finish_reason) for c in outputs[-1].outputs]
        assert got == [(c.token_ids, c.logprobs, c.finish_reason) for c in want.outputs]
        if q.output_kind is RequestOutputKind.CUMULATIVE:  # each output holds everything so far
            lengths = [len(o.outputs[0].token_ids) for o in outputs]
            assert lengths == sorted(lengths) and outputs[-1].outputs[0].cumulative_logprob == \
                math.fsum(want.outputs[0].logprobs)
    assert not llm.scheduler.has_unfinished() and llm._launched is None
    assert llm.block_manager.num_free_blocks == free


def test_online_logprobs_are_the_training_forwards():
    model = _model("qwen3")
    llm = make_llm(model)
    prompts, params = _requests(4, seed=5, kinds=[RequestOutputKind.FINAL_ONLY])
    seen = drive(llm, {i: [(f"r{i}", p, q)] for i, (p, q) in enumerate(zip(prompts, params))})
    for i, (prompt, q) in enumerate(zip(prompts, params)):
        for c in seen[f"r{i}"][-1].outputs:
            want = training_logprobs(model, prompt, c.token_ids, q.temperature)
            assert torch.equal(torch.tensor(c.logprobs), want)


def test_abort_frees_pages_and_leaves_the_others_unchanged():
    model = _model("qwen3")
    prompts, params = _requests(4, seed=7, kinds=[RequestOutputKind.DELTA])
    params = [replace(q, max_tokens=30) for q in params]
    llm = make_llm(model, max_num_seqs=2)
    alone = [gen(llm, [p], q)[0] for p, q in zip(prompts, params)]
    free = llm.block_manager.num_free_blocks
    arrivals = {0: [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]}
    seen = drive(llm, arrivals, aborts={3: ["r0", "r3", "unknown"]})  # r0 runs, r3 waits (max_num_seqs)
    assert seen["r0"] and not seen["r0"][-1].finished and "r3" not in seen
    for i in (1, 2):
        assert _joined(seen[f"r{i}"]) == [(c.token_ids, c.logprobs, c.finish_reason) for c in alone[i].outputs]
    assert not llm.has_unfinished_requests() and llm._launched is None
    assert llm.block_manager.num_free_blocks == free
    llm.add_request("r0", prompts[0], params[0])  # an aborted id may be used again
    assert _joined(drive(llm, {})["r0"]) == [(c.token_ids, c.logprobs, c.finish_reason) for c in alone[0].outputs]


def test_abort_returns_what_the_request_generated_so_far():
    """Aborted mid-run, a request's last output holds its tokens so far (a prefix of what it would
    have generated, the same logprobs), its samples ending "abort"; an aborted DELTA request's last
    output holds only the tokens not returned yet."""
    model = _model("qwen3")
    llm = make_llm(model)
    prompt = prompts_for(1, seed=4)[0]
    for kind in (RequestOutputKind.FINAL_ONLY, RequestOutputKind.DELTA):
        params = SamplingParams(n=2, temperature=0.9, seed=6, max_tokens=20, ignore_eos=True, output_kind=kind)
        want = gen(llm, [prompt], params)[0]
        llm.add_request("a", prompt, params)
        seen = [o for _ in range(6) for o in llm.step()]
        (last,) = llm.abort_request(["a", "a", "unknown"])
        assert last.finished and not llm.has_unfinished_requests() and llm.step() == []
        outputs = seen + [last] if kind is RequestOutputKind.DELTA else [last]
        for (tokens, logprobs, reason), full in zip(_joined(outputs), want.outputs):
            assert reason == "abort" and 0 < len(tokens) < 20
            assert tokens == full.token_ids[:len(tokens)] and logprobs == full.logprobs[:len(tokens)]
    assert llm.abort_request("a") == []


def test_delta_text_adds_up_to_the_text_with_stop_strings():
    model = _model("qwen3")
    llm = make_llm(model, tokenizer=word_tokenizer())
    prompt = prompts_for(1, seed=2)[0]
    free = gen(llm, [prompt], SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = " ".join(free.text.split()[5:7])  # two words in the middle: the text stops before them
    for include in (False, True):
        params = SamplingParams(temperature=0.9, seed=4, max_tokens=12, ignore_eos=True, stop=[stop],
                                include_stop_str_in_output=include, output_kind=RequestOutputKind.DELTA)
        want = gen(llm, [prompt], params)[0].outputs[0]
        outputs = drive(llm, {0: [("s", prompt, params)]})["s"]
        assert len(outputs) > 2 and want.finish_reason == "stop"
        assert "".join(o.outputs[0].text for o in outputs) == want.text
        assert outputs[-1].outputs[0].stop_reason == stop
        cumulative = drive(llm, {0: [("c", prompt, replace(params, output_kind=RequestOutputKind.CUMULATIVE))]})["c"]
        texts = [o.outputs[0].text for o in cumulative]  # as vLLM's: it only grows (a forming stop held back)
        assert texts[-1] == want.text and all(later.startswith(text) for text, later in zip(texts, texts[1:]))


def test_a_request_that_never_fits_finishes_with_its_error():
    model = _model("qwen3")
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 4))
    llm.add_request("big", list(range(2, 40)), SamplingParams(max_tokens=4))
    (output,) = llm.step()
    assert output.finished and output.outputs[0].finish_reason == "error" and "request" in output.outputs[0].error
    assert not llm.has_unfinished_requests()


def test_prompt_logprobs_come_with_the_first_delta():
    model = _model("qwen3")
    llm = make_llm(model)
    prompt = prompts_for(1, seed=9)[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2, output_kind=RequestOutputKind.DELTA)
    want = gen(llm, [prompt], params)[0]
    outputs = drive(llm, {0: [("p", prompt, params)]})["p"]
    assert list(outputs[0].prompt_logprobs) == list(want.prompt_logprobs)
    assert all(o.prompt_logprobs is None for o in outputs[1:])


def test_bad_requests_and_calls_while_requests_run_are_refused():
    model = _model("qwen3")
    llm = make_llm(model)
    for bad, match in [(dict(request_id=""), "request_id"), (dict(request_id=3), "request_id"),
                       (dict(prompt=[]), "empty"), (dict(params="greedy"), "SamplingParams"),
                       (dict(params=SamplingParams(logprobs=40)), "max_logprobs")]:
        kwargs = {"request_id": "a", "prompt": [5, 6], "params": SamplingParams(), **bad}
        with pytest.raises(ValueError, match=match):
            llm.add_request(**kwargs)
    assert not llm.has_unfinished_requests() and not llm.scheduler.has_unfinished()
    llm.add_request("a", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    with pytest.raises(ValueError, match="already an unfinished request"):
        llm.add_request("a", [5, 6], SamplingParams())
    for call in (lambda: gen(llm, [[5, 6]], SamplingParams()), lambda: llm.update_weights({}),
                 lambda: llm.sleep(), lambda: llm.wake_up(), lambda: llm.reset_prefix_cache()):
        with pytest.raises(RuntimeError, match="add_request are unfinished"):
            call()
    assert llm.get_num_unfinished_requests() == 1
    assert drive(llm, {})["a"][-1].finished and llm.step() == []


def test_a_failed_step_drops_every_request_and_the_engine_serves_on():
    model = _model("qwen3")
    llm = make_llm(model)
    prompts, params = _requests(3, seed=11, kinds=[RequestOutputKind.FINAL_ONLY])
    want = [gen(llm, [p], q)[0] for p, q in zip(prompts, params)]
    weight = model.lm_head.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[7, 0] = float("nan")
    for i, (p, q) in enumerate(zip(prompts, params)):
        llm.add_request(f"r{i}", p, q)
    with pytest.raises(RuntimeError, match="NaN or inf"):
        while llm.has_unfinished_requests():
            llm.step()
    assert not llm.has_unfinished_requests() and not llm.scheduler.has_unfinished()
    with torch.no_grad():
        weight.copy_(saved)
    seen = drive(llm, {0: [(f"r{i}", p, q) for i, (p, q) in enumerate(zip(prompts, params))]})
    assert [seen[f"r{i}"][-1].outputs for i in range(3)] == [w.outputs for w in want]


def test_output_kind_is_checked():
    assert SamplingParams(output_kind=1).output_kind is RequestOutputKind.DELTA
    for bad in (3, True, "DELTA"):
        with pytest.raises(ValueError, match="output_kind"):
            SamplingParams(output_kind=bad)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (decode CUDA graphs)")
@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_online_requests_under_cuda_graphs_equal_generate_and_training(name):
    """bf16 on the GPU, decode and mixed steps replaying CUDA graphs, steps launched ahead:
    staggered online requests equal ``generate``'s of each alone and the training recompute."""
    if name not in {arch.name for arch in architectures()}:
        pytest.skip(f"{name} is not registered on this transformers")
    torch.manual_seed(0)
    overrides = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)  # Triton's head dims
    model = get(name).causal_lm_class(get(name).tiny_config(initializer_range=0.5, **overrides)).to(
        "cuda", torch.bfloat16).eval()
    prompts, params = _requests(12, seed=13)
    llm = LLM(model, block_size=16, max_num_seqs=8, kv_cache_bytes=1 << 24)
    assert llm.runner.graphs is not None
    alone = [gen(llm, [p], q)[0] for p, q in zip(prompts, params)]
    seen = drive(llm, {i: [(f"r{i}", p, q)] for i, (p, q) in enumerate(zip(prompts, params))})
    for i, (prompt, want, q) in enumerate(zip(prompts, alone, params)):
        outputs = seen[f"r{i}"]
        got = _joined(outputs) if q.output_kind is RequestOutputKind.DELTA else [
            (c.token_ids, c.logprobs, c.finish_reason) for c in outputs[-1].outputs]
        assert got == [(c.token_ids, c.logprobs, c.finish_reason) for c in want.outputs]
        for tokens, logprobs, _ in got:
            assert torch.equal(training_logprobs(model, prompt, tokens, q.temperature), torch.tensor(logprobs))
