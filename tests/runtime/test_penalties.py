"""vLLM's ``repetition_penalty``, ``frequency_penalty`` and ``presence_penalty`` in the engine
(`runtime.penalties`): every sampled token is the one the definition picks (the training forward's
logits, penalised from the sequence's own prompt and earlier outputs, then the sampler's Gumbel-max
at its seed and index); a request's tokens do not depend on its batch, the cache, preemption, the
step sizes or async steps; the reported logprobs stay the unpenalised ones training recomputes;
the device counts' slots are filled, freed and grown as the module says."""

from dataclasses import replace

import pytest
import torch

from vexact_models.registry import get
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.penalties import PenaltyCounts
from vexact_models.runtime.sequence import Sequence, SequenceStatus

from .llm_support import (cache_bytes, gen, graph_shaped, make_llm, prompts_for, sampled_by_definition, training_logits,
                          training_logprobs)

PENALTIES = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.5), dict(presence_penalty=2.0),
             dict(repetition_penalty=0.7, frequency_penalty=-0.5, presence_penalty=0.4)]


def _model(name: str = "qwen3"):
    torch.manual_seed(0)
    return get(name).causal_lm_class(get(name).tiny_config(initializer_range=0.3)).eval()


def _params(i: int, **extra) -> SamplingParams:
    """Sampled and greedy rows, each with penalties, some filtering too."""
    base = dict(temperature=[1.0, 0.0, 0.8, 1.3][i % 4], max_tokens=14, seed=40 + i, ignore_eos=True,
                top_k=[-1, -1, 6, -1][i % 4])
    return SamplingParams(**base, **PENALTIES[i % len(PENALTIES)], **extra)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5"])
def test_sampled_tokens_are_the_definitions_and_logprobs_stay_trainings(name):
    model = _model(name)
    prompts = prompts_for(8, seed=31)
    params = [_params(i) for i in range(8)]
    llm = make_llm(model)
    plain = gen(llm, prompts, [replace(p, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0)
                               for p in params])
    got = gen(llm, prompts, params)
    changed = 0
    for prompt, sp, out, base in zip(prompts, params, got, plain):
        c = out.outputs[0]
        assert c.token_ids == sampled_by_definition(training_logits(model, prompt, c.token_ids), prompt, c.token_ids, sp)
        t = sp.temperature if sp.temperature > 0 else 1.0
        assert torch.equal(torch.tensor(c.logprobs), training_logprobs(model, prompt, c.token_ids, t))
        changed += c.token_ids != base.outputs[0].token_ids
    assert changed >= 3  # the penalties steer sampling (the test can fail)


def test_a_strong_repetition_penalty_stops_greedy_repeats():
    model = _model()
    prompts = prompts_for(6, seed=32)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm = make_llm(model)
    repeats = [len(o.outputs[0].token_ids) - len(set(o.outputs[0].token_ids)) for o in gen(llm, prompts, greedy)]
    assert sum(repeats) > 10  # a tiny random model loops without it
    held = gen(llm, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, repetition_penalty=50.0))
    for prompt, out in zip(prompts, held):
        ids = out.outputs[0].token_ids
        assert len(set(ids)) == len(ids) and not set(ids) & set(prompt)


def test_penalised_rows_do_not_depend_on_their_batch_the_cache_or_the_steps():
    model = _model()
    prompts = prompts_for(7, seed=33, lo=6, hi=20)
    params = [_params(i, n=1 + i % 2) for i in range(7)]
    want = [[c.token_ids for c in o.outputs] for o in gen(make_llm(model), prompts, params)]
    alone = [[c.token_ids for c in gen(make_llm(model), [p], [sp])[0].outputs] for p, sp in zip(prompts, params)]
    tight_llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 14), max_num_batched_tokens=8, max_num_seqs=5)
    tight = [[c.token_ids for c in o.outputs] for o in gen(tight_llm, prompts, params)]
    assert tight_llm.num_preemptions > 0
    sync = make_llm(model)
    sync.async_scheduling = False
    in_sync = [[c.token_ids for c in o.outputs] for o in gen(sync, prompts, params)]
    graphed = make_llm(model)
    graphs = graph_shaped(graphed)
    replayed = [[c.token_ids for c in o.outputs] for o in gen(graphed, prompts, params)]
    assert graphs.mixed_replays > 0 and any(max_q == 1 for _, _, max_q in graphs.graphs)  # decode graphs too
    assert want == alone == tight == in_sync == replayed


def test_mixed_batches_keep_the_other_rows_bits_and_calls_reuse_the_slots():
    """Rows without penalties beside penalised ones sample what they sample alone; a second call
    reuses the slots of the first's finished sequences, and a call without penalties frees them."""
    model = _model()
    prompts = prompts_for(6, seed=34)
    params = [_params(i) if i % 2 else SamplingParams(temperature=1.0, max_tokens=10, seed=i) for i in range(6)]
    llm = make_llm(model)
    mixed = gen(llm, prompts, params)
    for i in range(0, 6, 2):
        assert mixed[i].outputs[0].token_ids == gen(make_llm(model), [prompts[i]], params[i])[0].outputs[0].token_ids
    slots = llm.sampler.penalty_counts.num_slots
    again = gen(llm, prompts, params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in mixed]
    assert llm.sampler.penalty_counts.num_slots == slots
    gen(llm, prompts[:1], SamplingParams(max_tokens=2, seed=1))
    assert llm.sampler.penalty_counts is None
    gen(llm, prompts, params)
    llm.sleep(0)
    assert llm.sampler.penalty_counts is None


def _seq(prompt: list[int], outputs: list[int] = (), **params) -> Sequence:
    seq = Sequence(0, 0, prompt, SamplingParams(**params), 1)
    for tok in outputs:
        seq.append_token(tok, 0.0)
    return seq


def test_penalty_counts_fill_reuse_and_grow_slots():
    counts = PenaltyCounts(10, torch.device("cpu"))
    seqs = [_seq([1, 2, 2], [3, 3, 4], repetition_penalty=1.2), _seq([5], presence_penalty=1.0)]
    assert counts.slots_of(seqs) == [0, 1] and counts.num_slots == 8
    assert counts.counts[0].tolist() == [0, 0, 0, 2, 1, 0, 0, 0, 0, 0] and not counts.counts[1].any()
    assert counts.in_prompt[0].nonzero().flatten().tolist() == [1, 2] and counts.in_prompt[1, 5]
    assert counts.slots_of(seqs[::-1]) == [1, 0]  # kept
    many = [_seq([i], frequency_penalty=0.5) for i in range(7)]
    assert counts.slots_of(many) == [2, 3, 4, 5, 6, 7, 8] and counts.num_slots == 16  # grown, rows kept
    assert counts.counts[0, 3] == 2 and counts.in_prompt[1, 5]
    seqs[0].status = SequenceStatus.FINISHED
    for seq in many:
        seq.status = SequenceStatus.FINISHED
    later = [_seq([9], [9], repetition_penalty=2.0) for _ in range(15)]
    slots = counts.slots_of(later)
    assert counts.num_slots == 16 and 1 not in slots and 0 in slots  # finished sequences' slots, cleared
    row = slots.index(0)
    assert counts.counts[0].tolist() == [0] * 9 + [1] and counts.in_prompt[0].nonzero().flatten().tolist() == [9]
    rows = counts.rows([later[row], _seq([4])])
    assert rows.slots.tolist() == [0, -1] and rows.counted.tolist() == [0] and rows.using.tolist() == [0]
    rows.count(torch.tensor([7, 8]))
    assert counts.counts[0, 7] == 1 and counts.counts[:, 8].sum() == 0
    assert counts.rows([_seq([4])]) is None


@pytest.mark.parametrize("field, value, match", [
    ("repetition_penalty", 0.0, r"repetition_penalty=0.0 must be > 0"),
    ("repetition_penalty", float("nan"), "must be a finite number"),
    ("frequency_penalty", 2.5, r"frequency_penalty=2.5 is outside \[-2, 2\]"),
    ("presence_penalty", -3, r"presence_penalty=-3.0 is outside \[-2, 2\]"),
    ("presence_penalty", "1", "must be a float"),
])
def test_bad_penalties_are_refused(field, value, match):
    with pytest.raises(ValueError, match=f"SamplingParams.{field}"):
        SamplingParams(**{field: value})
    with pytest.raises(ValueError, match=match):
        SamplingParams(**{field: value})
