"""Faults an RL stack runs into: engine calls from two threads at once (`runtime.engine_lock`:
one waits its turn, neither's outputs change) and non-finite logits (a NaN weight: an error
naming the requests, with no sync of its own; the engine serves the next call as before).
Real threads and real weights; results compared bitwise with lone calls."""

import threading

import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.registry import get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.sampler import Sampler, flag_nonfinite_rows, nonfinite_rows
from vexact_models.runtime.sequence import Sequence

from .llm_support import gen, make_llm, prompts_for, result

PARAMS = [SamplingParams(temperature=1.0, max_tokens=10, seed=5, ignore_eos=True),
          SamplingParams(temperature=0.7, top_p=0.9, max_tokens=7, seed=6, n=2, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)]


def fresh_model():
    """A tiny Qwen3 of the tests' own (update_weights writes into the model's storage)."""
    torch.manual_seed(1)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


def calls():
    """Two calls' prompts and parameters (explicit seeds: outputs independent of call order)."""
    return (prompts_for(3, seed=21), PARAMS), (prompts_for(2, seed=22), PARAMS[:2])


class _WatchedLock:
    """The engine lock's inner lock, noting when a caller finds it taken (so the test knows the
    second thread is waiting, not merely started)."""

    def __init__(self, lock) -> None:
        self.lock, self.contended = lock, threading.Event()

    def __enter__(self):
        if self.lock.locked():
            self.contended.set()
        return self.lock.__enter__()

    def __exit__(self, *exc):
        return self.lock.__exit__(*exc)


def _run_during_first_step(llm, second):
    """Run `second()` on another thread once the first call's first step is done, and make that
    call go on only when `second` waits for the engine. Returns (steps' threads, the thread, its
    result holder)."""
    watched = _WatchedLock(llm._engine_lock._lock)
    llm._engine_lock._lock = watched
    complete, steps, box = llm._complete, [], {}
    thread = threading.Thread(target=lambda: box.setdefault("out", second()), name="second")

    def logged(launched, bar):
        steps.append(threading.current_thread().name)
        complete(launched, bar)
        if not thread.is_alive() and "out" not in box:
            thread.start()
            assert watched.contended.wait(30), "the second call never reached the engine lock"

    llm._complete = logged
    return steps, thread, box


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_concurrent_generate_waits_its_turn_and_both_outputs_are_the_lone_ones(async_scheduling):
    model = fresh_model()
    (pa, sa), (pb, sb) = calls()
    lone = make_llm(model, async_scheduling=async_scheduling)
    want_a = [result(o) for o in gen(lone, pa, sa)]
    want_b = [result(o) for o in gen(lone, pb, sb)]
    llm = make_llm(model, async_scheduling=async_scheduling)
    steps, thread, box = _run_during_first_step(llm, lambda: gen(llm, pb, sb))
    got_a = [result(o) for o in gen(llm, pa, sa)]
    thread.join(60)
    assert not thread.is_alive()
    got_b = [result(o) for o in box["out"]]
    assert got_a == want_a and got_b == want_b  # bitwise: token ids and float logprobs compared exactly
    first = steps.index("second")
    assert set(steps[:first]) == {"MainThread"} and set(steps[first:]) == {"second"}  # no interleaved step
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_update_weights_and_sleep_from_another_thread_wait_for_a_running_generate():
    model = fresh_model()
    (pa, sa), _ = calls()
    llm = make_llm(model, owns_weights=True)
    want = [result(o) for o in gen(llm, pa, sa)]
    name = "model.layers.0.mlp.down_proj.weight"
    changed = {name: dict(model.named_parameters())[name].detach() * 2}

    def second():
        llm.update_weights(changed)  # waits for generate: its steps all see the old weights
        llm.sleep(1)
        return "done"

    steps, thread, box = _run_during_first_step(llm, second)
    got = [result(o) for o in gen(llm, pa, sa)]
    thread.join(60)
    assert box["out"] == "done" and got == want
    with pytest.raises(RuntimeError, match="asleep"):
        gen(llm, pa, sa)
    llm.wake_up()
    assert [result(o) for o in gen(llm, pa, sa)] != want  # the update did land, after generate


def test_an_engine_call_from_inside_a_call_on_the_same_thread_is_refused_not_deadlocked():
    model = fresh_model()
    (pa, sa), _ = calls()
    llm = make_llm(model)
    want = [result(o) for o in gen(llm, pa, sa)]

    def weights():  # an iterator update_weights consumes, calling back into the engine
        yield from ()
        gen(llm, pa, sa)

    with pytest.raises(RuntimeError, match=r"LLM\.generate: called from inside LLM\.update_weights on the same thread"):
        llm.update_weights(weights())
    assert llm._engine_lock.holder is None
    assert [result(o) for o in gen(llm, pa, sa)] == want  # the lock was given back


def _poison(model, name: str, where=(0, 0)) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """`name`'s weight with one NaN at `where`, and the good one to restore (by checkpoint
    name: the tiny config ties lm_head to the embedding)."""
    good = model.state_dict()[name].detach().clone()
    bad = good.clone()
    bad[where] = float("nan")
    return {name: bad}, {name: good}


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("weight", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_nonfinite_logits_raise_naming_the_requests_and_the_engine_stays_usable(async_scheduling, weight):
    model = fresh_model()
    (pa, sa), _ = calls()
    llm = make_llm(model, async_scheduling=async_scheduling)
    want = [result(o) for o in gen(llm, pa, sa)]  # requests 0-2
    bad, good = _poison(model, weight)
    llm.update_weights(bad)
    # a NaN in a decoder weight spreads to every logit; one in an lm_head row reaches one column
    with pytest.raises(RuntimeError, match=r"LLM\.generate: the logits of request 3 \(sample 0, after 0 output "
                                           r"tokens\), .*request 4 \(sample 1.* hold NaN or inf") as info:
        gen(llm, pa, sa)  # requests 3-5
    assert "request 5 (sample 0" in str(info.value) and "request 2 " not in str(info.value)
    assert not llm.scheduler.has_unfinished()  # the failed call's requests are gone, their pages free
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert all(torch.isfinite(kv).all() for pair in llm.runner.kv_caches for kv in pair)  # no NaN K/V left
    llm.update_weights(good)
    assert [result(o) for o in gen(llm, pa, sa)] == want  # as a lone call with the good weights


def test_nonfinite_kv_is_zeroed_in_a_latent_cache_too():
    """DeepSeek's latent cache: V is a view of K's first dims, and the rotary part after them
    must be zeroed as well."""
    arch = get("deepseek_v3")
    torch.manual_seed(0)
    model = arch.causal_lm_class(arch.tiny_config(initializer_range=0.3)).eval()
    (pa, sa), _ = calls()
    llm = make_llm(model)
    assert llm.model.kv_cache_spec().value_in_key
    want = [result(o) for o in gen(llm, pa, sa)]
    bad, good = _poison(model, "model.layers.0.input_layernorm.weight", where=(0,))
    llm.update_weights(bad)
    with pytest.raises(RuntimeError, match=r"the logits of request 3 \(sample 0.* hold NaN or inf"):
        gen(llm, pa, sa)
    assert all(torch.isfinite(kv).all() for pair in llm.runner.kv_caches for kv in pair)
    llm.update_weights(good)
    assert [result(o) for o in gen(llm, pa, sa)] == want


def test_nonfinite_logits_are_flagged_per_row_on_the_logprobs_the_step_copies_anyway():
    torch.manual_seed(0)
    logits = torch.randn(4, 300)
    want = Sampler(None).launch(logits, _seqs(4)).result()
    logits[1, 0] = float("nan")  # the first column: where a running max may skip it
    logits[2, 17] = float("inf")
    logits[3, 299] = float("-inf")  # an infinity of either sign is a fault of the forward
    tokens, logprobs = Sampler(None).launch(logits, _seqs(4)).result()
    assert tokens[0] == want[0][0] and logprobs[0] == want[1][0]  # a finite row keeps its bits
    assert nonfinite_rows(logprobs) == [1, 2, 3]
    assert nonfinite_rows([None, -0.5, None, float("nan")]) == [3]  # None: a row that sampled nothing
    assert nonfinite_rows([None, -0.5, -2.25]) == []
    flagged = flag_nonfinite_rows(logits, torch.full((4,), -1.5))
    assert flagged[0] == -1.5 and flagged[1:].isnan().all()


def _seqs(n: int) -> list[Sequence]:
    params = SamplingParams(temperature=1.0, max_tokens=4, seed=3)
    return [Sequence(i, 0, [1, 2], params, seed=i) for i in range(n)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("weight", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"])
def test_nonfinite_logits_under_cuda_graphs(weight):
    """The same under decode and mixed-step CUDA graphs (the sampler, which flags the rows, runs
    after the replay) and the Triton kernels, where the logprob kernel's max may skip a NaN."""
    torch.manual_seed(0)
    dims = dict(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config(**dims)).to("cuda", torch.bfloat16).eval()
    (pa, sa), _ = calls()
    llm = make_llm(model, device="cuda", block_size=16, kv_cache_bytes=1 << 24)
    assert llm.runner.graphs is not None
    want = [result(o) for o in gen(llm, pa, sa)]
    bad, good = _poison(model, weight, where=(5, 3))
    llm.update_weights(bad)
    with pytest.raises(RuntimeError, match=r"the logits of request 3 \(sample 0.* hold NaN or inf"):
        gen(llm, pa, sa)
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert all(torch.isfinite(kv).all() for pair in llm.runner.kv_caches for kv in pair)
    llm.update_weights(good)
    assert [result(o) for o in gen(llm, pa, sa)] == want
