"""Async scheduling: `Scheduler.schedule_ahead` (a decode step decided before the tokens of the
step in flight are known), its inputs, the sampler's RNG counters one token ahead, and the
engine loop that launches it (`runtime.llm_steps`): the same tokens, logprobs and finish
reasons as one step at a time, in every engine setting."""

import numpy as np
import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.sampler import Sampler
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence, SequenceStatus
from vexact_models.runtime.step_inputs import build_step_inputs

from .llm_support import cache_bytes, gen, make_llm, prompts_for, result, training_logprobs

EOS = 2


def scheduler(num_blocks=64, block_size=4, max_num_seqs=4, budget=64, max_model_len=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(bm, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                     max_model_len=max_model_len, eos_token_id=EOS)


def add(sched, prompt_len=3, **params):
    seq = Sequence(len(sched._running) + sched.num_waiting, 0, [9] * prompt_len, SamplingParams(**params), seed=0)
    sched.add(seq)
    return seq


def finish(sched, scheduled, token=5):
    return sched.postprocess(scheduled, [token if i.samples else None for i in scheduled],
                             [0.0 if i.samples else None for i in scheduled])


# -- the scheduler -------------------------------------------------------------------------------

def test_schedule_ahead_runs_the_tokens_in_flight_and_takes_their_pages():
    sched = scheduler()
    a, b = add(sched, prompt_len=3), add(sched, prompt_len=4)
    step = sched.schedule().scheduled  # both prompts, both sample
    ahead = sched.schedule_ahead()
    assert [i.seq for i in ahead] == [a, b] and all(i.num_new_tokens == 1 and i.samples and i.in_flight for i in ahead)
    # b's token in flight is position 4, the first of a second page; a's (3) still fits its page
    assert (len(a.block_table), len(b.block_table)) == (1, 2)
    assert sched.schedule_ahead() is None  # two steps in flight already
    with pytest.raises(RuntimeError, match="before postprocess"):
        sched.schedule()
    finish(sched, step, token=7)
    assert (a.token_ids[-1], a.num_computed_tokens) == (7, 3)
    finish(sched, ahead, token=8)
    assert a.token_ids[-2:] == [7, 8] and a.num_computed_tokens == 4 and b.num_computed_tokens == 5
    assert sched.schedule().scheduled  # nothing in flight: the ordinary path again


def test_postprocess_takes_the_steps_in_order_and_leaves_no_half_applied_step():
    sched = scheduler()
    seq = add(sched)
    step = sched.schedule().scheduled
    ahead = sched.schedule_ahead()
    with pytest.raises(RuntimeError, match="in the order they were scheduled"):
        finish(sched, ahead)
    assert seq.num_computed_tokens == 0 and seq.num_output_tokens == 0
    finish(sched, step)
    finish(sched, ahead)
    assert seq.num_output_tokens == 2


def test_a_sequence_that_stops_in_flight_has_its_ahead_row_dropped():
    sched = scheduler()
    a, b = add(sched), add(sched)
    step = sched.schedule().scheduled
    ahead = sched.schedule_ahead()
    assert sched.postprocess(step, [EOS, 5], [0.0, 0.0]) == [a]  # a stops: its pages are freed
    assert a.block_table == [] and a.status is SequenceStatus.FINISHED
    assert sched.postprocess(ahead, [6, 7], [-1.0, -2.0]) == []
    assert a.output_token_ids == [EOS] and b.output_token_ids == [5, 7] and b.output_logprobs == [0.0, -2.0]
    assert sched.block_manager.num_free_blocks == sched.block_manager.num_blocks - len(b.block_table)


def test_schedule_ahead_leaves_out_sequences_that_reach_a_length_limit():
    sched = scheduler(max_model_len=6)
    short = add(sched, max_tokens=1)  # done with the token in flight
    capped = add(sched, prompt_len=5)  # max_model_len: 5 + 1
    going = add(sched, max_tokens=3)
    step = sched.schedule().scheduled
    ahead = sched.schedule_ahead()
    assert [i.seq for i in ahead] == [going]
    assert set(finish(sched, step)) == {short, capped}
    finish(sched, ahead)
    assert going.num_output_tokens == 2


def test_schedule_ahead_declines_what_only_the_ordinary_path_decides():
    assert scheduler().schedule_ahead() is None  # nothing in flight

    sched = scheduler(budget=4)
    add(sched, prompt_len=8)  # two chunks of 4: the first samples nothing
    sched.schedule()
    assert sched.schedule_ahead() is None

    sched = scheduler()
    add(sched), add(sched)
    first = sched.schedule().scheduled
    sched._in_flight[0] = (first[1:], False)  # as if the token budget had left the first one out
    assert sched.schedule_ahead() is None

    sched = scheduler(num_blocks=3)
    add(sched, prompt_len=4), add(sched, prompt_len=4), add(sched, prompt_len=4)  # every page taken
    sched.schedule()
    assert sched.schedule_ahead() is None  # position 4 needs a page: a preemption decides who gets it

    sched = scheduler()
    add(sched)
    sched.schedule()
    add(sched, prompt_len=80)  # past max_model_len: finished with "error", reported by schedule()
    assert sched.schedule_ahead() is None


def test_schedule_ahead_admits_into_the_slots_free_now():
    sched = scheduler(max_num_seqs=3)
    a, b = add(sched), add(sched)
    step = sched.schedule().scheduled
    c = add(sched, prompt_len=5)  # arrives while a step is in flight, with a slot free
    ahead = sched.schedule_ahead()
    assert [(i.seq, i.num_new_tokens, i.in_flight) for i in ahead] == [(a, 1, True), (b, 1, True), (c, 5, False)]
    assert c.status is SequenceStatus.RUNNING and ahead[2].samples
    finish(sched, step)
    finish(sched, ahead)
    assert c.num_output_tokens == 1 and a.num_output_tokens == 2

    sched = scheduler(max_num_seqs=2)
    a, b = add(sched), add(sched, max_tokens=1)
    c = add(sched)  # waits: b's slot frees with the token in flight, which only postprocess makes known
    sched.schedule()
    assert [i.seq for i in sched.schedule_ahead()] == [a] and sched.num_waiting == 1


def test_steps_ahead_publish_their_full_pages_for_sharing():
    sched = scheduler(block_size=4)
    seq = add(sched, prompt_len=3, max_tokens=8)
    step = sched.schedule().scheduled
    ahead = sched.schedule_ahead()  # runs position 3: the page's last
    finish(sched, step)
    bm = sched.block_manager
    assert bm.num_cached_blocks == 0
    finish(sched, ahead)
    assert bm.num_cached_blocks == 1  # tokens 0..3 known and their K/V written
    assert seq.num_computed_tokens == 4


# -- inputs and sampling -------------------------------------------------------------------------

def test_ahead_inputs_are_the_ordinary_decode_inputs_but_the_ids():
    sched = scheduler()
    seqs = [add(sched, prompt_len=n) for n in (3, 4, 6)]
    step = sched.schedule().scheduled
    ahead = build_step_inputs(sched.schedule_ahead(), 4, sched.block_manager.tables)
    finish(sched, step, token=11)
    ordinary = build_step_inputs([type(step[0])(s, 1, True) for s in seqs], 4, sched.block_manager.tables)
    assert ordinary.ids.tolist() == [11, 11, 11] and ahead.ids.tolist() == [0, 0, 0]
    for name in ("positions", "slots", "logits_rows", "cu_seqlens", "seq_lens", "block_table"):
        assert np.array_equal(getattr(ahead, name), getattr(ordinary, name)), name
    assert ahead.max_seqlen_q == ordinary.max_seqlen_q == 1 and ahead.decode_only


@pytest.mark.parametrize("params", [dict(temperature=1.0, seed=3), dict(temperature=0.7, top_k=5, seed=4),
                                    dict(temperature=1.0, min_tokens=3, stop_token_ids=[1, 3], seed=5)])
def test_sampling_ahead_counts_the_token_in_flight(params):
    """The RNG counter and min_tokens bans of a step ahead are those of the same step run after
    its token in flight is appended."""
    logits = torch.randn(1, 16, generator=torch.Generator().manual_seed(0)) * 3
    for outputs in range(4):
        seq = Sequence(0, 0, [9, 9], SamplingParams(**params), seed=params["seed"])
        seq.token_ids += [4] * outputs
        ahead = Sampler(EOS).launch(logits, [seq], ahead=1).result()
        seq.token_ids.append(4)  # the token in flight arrives
        assert Sampler(EOS)(logits, [seq]) == ahead
        if params.get("min_tokens") and outputs + 1 < 3:  # still banned one token ahead
            banned = logits.clone()
            banned[0, [1, 3, EOS]] = float("inf")
            assert Sampler(EOS).launch(banned, [seq]).result()[0][0] not in (1, 3, EOS)


# -- the engine ----------------------------------------------------------------------------------

PARAMS = [SamplingParams(temperature=1.0, max_tokens=14, seed=1),  # may stop at EOS
          SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, stop_token_ids=[7, 11, 13], seed=2),
          # every odd token from 5 stops it: it stops soon after min_tokens whatever the seed's stream, so the
          # workload always has a sequence that stops in a step (and runs in the step ahead, its row dropped)
          SamplingParams(temperature=1.2, top_k=20, max_tokens=11, min_tokens=6, stop_token_ids=list(range(5, 512, 2)),
                         seed=3),
          SamplingParams(temperature=1.0, n=3, max_tokens=10, seed=4, ignore_eos=True)]


def run_both(model, prompts, params, **engine):
    """(results, steps scheduled ahead, shared pages, admissions in steps ahead) with async
    scheduling on, then off."""
    out = []
    for on in (True, False):
        llm = make_llm(model, async_scheduling=on, **engine)
        picked, ahead = llm.scheduler.schedule_ahead, []
        llm.scheduler.schedule_ahead = lambda: ahead.append(picked()) or ahead[-1]
        results = [result(o) for o in gen(llm, prompts, params)]
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
        steps = [a for a in ahead if a is not None]
        admitted = sum(not item.in_flight for step in steps for item in step)
        out.append((results, len(steps), llm.block_manager.num_shared_hits, admitted))
    return out


ENGINES = {"default": {}, "3 seqs": dict(max_num_seqs=3), "budget 5": dict(max_num_batched_tokens=5),
           "3 seqs, budget 5": dict(max_num_seqs=3, max_num_batched_tokens=5),
           "preemption": dict(kv_cache_bytes=None, max_num_seqs=8), "no sharing": dict(enable_prefix_sharing=False)}


@pytest.mark.parametrize("engine", ENGINES, ids=list(ENGINES))
def test_async_scheduling_gives_the_same_rollouts(model, engine):
    settings = dict(ENGINES[engine])
    if engine == "preemption":
        settings["kv_cache_bytes"] = cache_bytes(model, 12)
    prompts = prompts_for(len(PARAMS), seed=11)
    (on, ahead_on, shared_on, admitted), (off, ahead_off, shared_off, _) = run_both(model, prompts, PARAMS, **settings)
    assert on == off
    if engine != "preemption":
        # with preemption the page pressure arrives a step apart (async frees a stopped sequence's pages
        # one step later, docs/design.md), so which cached pages are revived may differ: the tokens may not
        assert shared_on == shared_off
    assert ahead_on > 0 and ahead_off == 0  # the integration ran (and only when on)
    if engine.startswith("3 seqs"):
        assert admitted > 0  # waiting sequences joined steps scheduled ahead
    reasons = {reason for completions in on for _, _, reason in completions}
    assert reasons == {"stop", "length"}  # stopped sequences ran a dropped row ahead
    for prompt, sp, completions in zip(prompts, PARAMS, on):  # and training agrees, bitwise
        for tokens, logprobs, _ in completions:
            assert torch.equal(training_logprobs(model, prompt, tokens, sp.temperature), torch.tensor(logprobs))


def test_pages_filled_by_steps_ahead_are_shared_with_a_later_prompt(model):
    """One sequence at a time: b waits while a decodes ahead; b's prompt is a's prompt and first
    outputs, whose pages a filled in steps scheduled ahead (published at their postprocess)."""
    a_prompt = prompts_for(1, seed=5, lo=6, hi=6)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    a_out = result(gen(make_llm(model), [a_prompt], greedy)[0])[0][0]
    prompts = [a_prompt, a_prompt + a_out[:10]]  # 16 tokens: 3 full pages of a's
    (on, ahead, shared_on, _), (off, _, shared_off, _) = run_both(model, prompts, greedy, max_num_seqs=1)
    assert on == off and ahead > 0
    assert shared_on == shared_off == 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (decode CUDA graphs)")
def test_async_scheduling_with_cuda_graphs_gives_the_same_rollouts():
    """On CUDA the steps ahead replay decode graphs (their ids copied in on the device) or run
    eagerly with admissions; rollouts equal one step at a time and the training recompute, bitwise."""
    torch.manual_seed(0)
    config = qwen3.tiny_config(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64)  # a head dim the Triton attention takes
    model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts, params = prompts_for(2 * len(PARAMS), seed=7), PARAMS * 2
    runs = []
    for on in (True, False):
        llm = LLM(model, block_size=16, max_num_seqs=4, kv_cache_bytes=1 << 24, async_scheduling=on)
        picked, ahead = llm.scheduler.schedule_ahead, []
        llm.scheduler.schedule_ahead = lambda: ahead.append(picked()) or ahead[-1]
        runs.append([result(o) for o in gen(llm, prompts, params)])
        assert llm.runner.graphs is not None
        steps = [a for a in ahead if a is not None]
        assert (len(steps) > 0 and any(not i.in_flight for step in steps for i in step)) == on
    assert runs[0] == runs[1]
    for prompt, sp, completions in zip(prompts, params, runs[0]):
        for tokens, logprobs, _ in completions:
            with torch.no_grad():
                lp = model.token_logprobs(torch.tensor([prompt + tokens], device="cuda"),
                                          temperature=sp.temperature if sp.temperature > 0 else 1.0)
            assert torch.equal(lp[0, len(prompt):].cpu(), torch.tensor(logprobs))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (a busy stream)")
def test_launching_a_sample_does_not_wait_for_the_device():
    """Bans (min_tokens), min-p/top-k/top-p rows, allowed tokens and biases, the penalties (new
    sequences' slots filled, the sampled tokens counted) and the results' copy all reach the
    device without a sync: with the stream busy, `Sampler.launch` returns while the stream still
    runs."""
    def seqs():  # new sequences each time: new rows, new penalty slots
        return [Sequence(i, 0, [9, 9], SamplingParams(temperature=1.0, top_p=0.9, top_k=8, min_p=0.01, min_tokens=4,
                                                      stop_token_ids=[3], seed=i, repetition_penalty=1.3,
                                                      presence_penalty=0.5 * (i % 2), logit_bias={5: 1.0},
                                                      allowed_token_ids=list(range(40)) if i % 2 else None),
                         seed=i) for i in range(4)]

    logits = torch.randn(4, 64, device="cuda")
    sampler = Sampler(EOS)
    want = sampler.launch(logits, seqs()).result()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of spinning on the current stream
    sampled = sampler.launch(logits, seqs())
    assert not torch.cuda.current_stream().query()  # the host did not wait for the sleep
    assert sampled.result() == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch's sync debug mode)")
def test_a_generate_with_async_scheduling_never_waits_for_the_device_unasked():
    """Under torch's sync debug mode a whole `generate` (graphs, admissions ahead, min-p/top-p rows,
    min_tokens bans, allowed tokens and biases, the penalties' slots and counts) runs no
    synchronizing op: its only waits are the results' events."""
    torch.manual_seed(0)
    config = qwen3.tiny_config(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=64)
    model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    llm = LLM(model, block_size=16, max_num_seqs=4, kv_cache_bytes=1 << 24)
    prompts = prompts_for(12, seed=2)
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, min_tokens=4, max_tokens=16, seed=2,
                            repetition_penalty=1.2, frequency_penalty=0.3, logit_bias={7: 2.0},
                            allowed_token_ids=list(range(1, 300)))
    want = [result(o) for o in gen(llm, prompts, params)]
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [result(o) for o in gen(llm, prompts, params)]
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert got == want


def test_steps_ahead_of_a_sequence_sampling_from_its_last_token_wait_to_sample():
    """A grammar (structured outputs) or a bad word of several tokens needs the token in flight
    on the host before the next mask or bans: the step ahead is scheduled all the same, and
    `last_token_samplers_running` tells the engine to sample it once the step in flight is
    postprocessed; once the sequence has finished, it reads False. A one-token bad word needs
    no history."""
    from vexact_models.runtime.bad_words import BadWords

    for bad_words, waits in ((BadWords([(3, 4)]), True), (BadWords([(3,)]), False)):
        sched = scheduler()
        add(sched)
        b = Sequence(1, 0, [9] * 3, SamplingParams(max_tokens=2), seed=0)
        b.bad_words = bad_words  # (set before it is added, as the engine does)
        sched.add(b)
        step = sched.schedule().scheduled
        ahead = sched.schedule_ahead()
        assert [item.seq for item in ahead] == [item.seq for item in step]
        assert sched.last_token_samplers_running() is waits
        finish(sched, step)
        finish(sched, ahead)  # b reaches max_tokens
        assert b.is_finished and not sched.last_token_samplers_running()
    sched = scheduler()
    c = Sequence(0, 0, [9] * 3, SamplingParams(), seed=0)
    c.grammar = object()  # (any grammar state)
    sched.add(c)
    assert not sched.last_token_samplers_running()  # waiting, not running
    sched.schedule()
    assert c.samples_from_its_last_token and sched.schedule_ahead() and sched.last_token_samplers_running()
