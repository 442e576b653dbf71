"""Prefix sharing of full KV pages, the engine end to end: fewer pages, results bitwise identical
to unshared runs and to the training forward, also under chunked prefill and forced preemption
(the BlockManager and scheduler side: test_prefix_sharing.py)."""

import random

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


def cache_bytes(model, blocks: int) -> int:
    return blocks * kv_bytes_per_block(model.kv_cache_spec(), BS, next(model.parameters()).dtype)


def make_llm(model, **kwargs) -> LLM:
    kwargs.setdefault("kv_cache_bytes", cache_bytes(model, 256))
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("max_num_seqs", 16)
    return LLM(model, device="cpu", block_size=BS, **kwargs)


def run(llm, prompts, params):
    """Results, the peak number of pages in use over the run's steps, and the most pages that
    sharing saved in one step (pages listed by the running block tables minus pages in use)."""
    peak = saved = 0
    sched = llm.scheduler
    schedule, schedule_ahead = sched.schedule, sched.schedule_ahead

    def tracked(pick=schedule):
        nonlocal peak, saved
        out = pick()
        bm = llm.block_manager
        in_use = bm.num_blocks - bm.num_free_blocks
        tables = [seq.block_table for seq in llm.scheduler._running]
        distinct = {block for table in tables for block in table}
        assert in_use == len(distinct)  # pages in use are exactly the running sequences' pages
        assert all(bm.ref_count(block) == sum(t.count(block) for t in tables) for block in distinct)
        peak = max(peak, in_use)
        saved = max(saved, sum(len(t) for t in tables) - in_use)
        return out

    sched.schedule, sched.schedule_ahead = tracked, lambda: tracked(schedule_ahead)  # steps decided ahead too
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del sched.schedule, sched.schedule_ahead
    return [[(c.token_ids, c.logprobs, c.finish_reason) for c in o.outputs] for o in outs], peak, saved


def check_training(model, prompts, params, results):
    for prompt, sp, completions in zip(prompts, params, results):
        temperature = sp.temperature if sp.temperature > 0 else 1.0
        for tokens, logprobs, _ in completions:
            with torch.no_grad():
                want = model.token_logprobs(torch.tensor([prompt + tokens]), temperature=temperature)[0, len(prompt):]
            assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), want)


N_PROMPTS = [list(range(40, 53)), [7, 300, 12, 9, 41, 41, 2, 150, 77, 8, 6, 500, 33, 21, 90, 4, 3]]  # 13, 17 tokens
N_PARAMS = [SamplingParams(temperature=1.0, n=4, max_tokens=6, seed=3, ignore_eos=True),
            SamplingParams(temperature=0.7, top_k=20, n=4, max_tokens=6, seed=4, ignore_eos=True)]


@pytest.mark.parametrize("engine", [
    dict(max_num_batched_tokens=64),
    dict(max_num_batched_tokens=4),
    dict(max_num_batched_tokens=64, enable_chunked_prefill=False, max_model_len=64),
    dict(max_num_batched_tokens=4, max_num_seqs=3),
    dict(max_num_batched_tokens=5),  # chunks end mid-page
], ids=["budget64", "budget4", "no-chunking", "budget4-3seqs", "budget5"])
def test_n_samples_share_prompt_pages_with_identical_results(model, engine):
    shared = make_llm(model, **engine)
    got, peak, saved = run(shared, N_PROMPTS, N_PARAMS)
    unshared = make_llm(model, enable_prefix_sharing=False, **engine)
    want, peak_unshared, saved_unshared = run(unshared, N_PROMPTS, N_PARAMS)
    assert got == want
    # samples 1..3 each share all 3 (13 tokens), resp. 4 (17 tokens), full prompt pages but the
    # one holding the last prompt token
    assert shared.block_manager.num_shared_hits == 3 * 3 + 3 * 4
    assert unshared.block_manager.num_shared_hits == 0 and saved_unshared == 0
    assert saved >= 8  # pages listed by several running tables at one step
    if engine["max_num_batched_tokens"] == 64:
        assert peak < peak_unshared
        if engine.get("enable_chunked_prefill", True):
            # everything is admitted in step 0 either way: the peak drops by all shared pages
            assert (peak, peak_unshared) == (23, 44)
    assert all(len(c) == 4 and len({tuple(t) for t, _, _ in c}) > 1 for c in got)
    check_training(model, N_PROMPTS, N_PARAMS, got)
    assert shared.block_manager.num_free_blocks == shared.block_manager.num_blocks


@pytest.mark.parametrize("budget", [4, 5, 64])
def test_sharing_under_forced_preemption(model, budget):
    prompts = N_PROMPTS + [list(range(100, 112))]
    params = N_PARAMS + [SamplingParams(temperature=1.2, n=3, max_tokens=8, seed=5, ignore_eos=True)]
    small = make_llm(model, kv_cache_bytes=cache_bytes(model, 8), max_num_batched_tokens=budget)
    got, _, _ = run(small, prompts, params)
    assert small.num_preemptions > 0 and small.block_manager.num_shared_hits > 0
    reference = make_llm(model, enable_prefix_sharing=False)
    want, _, _ = run(reference, prompts, params)
    assert reference.num_preemptions == 0
    assert got == want
    unshared_small = make_llm(model, kv_cache_bytes=cache_bytes(model, 8), max_num_batched_tokens=budget,
                              enable_prefix_sharing=False)
    assert run(unshared_small, prompts, params)[0] == want
    check_training(model, prompts, params, got)


@pytest.mark.parametrize("budget", [4, 5, 64])
def test_requests_with_a_common_prefix_share_pages(model, budget):
    rng = random.Random(0)
    common = [rng.randrange(2, 512) for _ in range(22)]
    prompts = [common + [rng.randrange(2, 512) for _ in range(k)] for k in (1, 3, 6)] + [common[:9]]
    params = [SamplingParams(temperature=0.9, max_tokens=5, seed=10 + i, ignore_eos=True) for i in range(4)]
    shared = make_llm(model, max_num_batched_tokens=budget)
    got, peak, saved = run(shared, prompts, params)
    unshared = make_llm(model, max_num_batched_tokens=budget, enable_prefix_sharing=False)
    want, peak_unshared, _ = run(unshared, prompts, params)
    assert got == want
    # prompts 1, 2 share the 5 full common pages of prompt 0, prompt 3 its first 2
    assert shared.block_manager.num_shared_hits >= 2 * 5 + 2
    assert saved >= 5
    if budget == 64:
        assert peak < peak_unshared
    check_training(model, prompts, params, got)


def test_cached_pages_do_not_outlive_a_generate_call(model):
    import copy

    m = copy.deepcopy(model)
    llm = make_llm(m)
    prompt, sp = N_PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4)
    first = run(llm, [prompt], [sp])[0]
    hits = llm.block_manager.num_shared_hits
    assert llm.block_manager.num_cached_blocks > 0
    with torch.no_grad():  # in place, through the storage the engine shares
        m.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    second = run(llm, [prompt], [sp])[0]
    assert llm.block_manager.num_shared_hits == hits  # nothing stale was shared
    assert second != first
    assert second == run(make_llm(copy.deepcopy(m)), [prompt], [sp])[0]


def test_an_engine_owning_its_weights_shares_pages_across_calls(model, tmp_path):
    """``LLM(folder)`` owns its weights: a conversation's next turn (a prompt extending an earlier
    call's prompt and output) takes the pages that call published, with a fresh engine's results
    and the training forward's logprobs; after `update_weights`, `sleep`/`wake_up`, nothing
    computed before is shared."""
    import copy

    model.save_pretrained(tmp_path)
    sp = SamplingParams(temperature=0.9, max_tokens=8, seed=5, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", block_size=BS, kv_cache_bytes=cache_bytes(model, 256),
              max_num_batched_tokens=64)
    first, _, _ = run(llm, [N_PROMPTS[0]], [sp])
    turn = N_PROMPTS[0] + first[0][0][0] + [17, 18, 19, 20, 21]
    hits = llm.block_manager.num_shared_hits
    second, _, _ = run(llm, [turn], [sp])
    assert llm.block_manager.num_shared_hits >= hits + (len(N_PROMPTS[0]) + 8) // BS - 1
    fresh = LLM(str(tmp_path), device="cpu", block_size=BS, kv_cache_bytes=cache_bytes(model, 256))
    assert second == run(fresh, [turn], [sp])[0]
    check_training(model, [turn], [sp], second)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    llm.update_weights(changed.state_dict())
    hits = llm.block_manager.num_shared_hits
    third, _, _ = run(llm, [turn], [sp])
    assert llm.block_manager.num_shared_hits == hits and third != second
    check_training(changed, [turn], [sp], third)
    llm.sleep(1)
    llm.wake_up()
    hits = llm.block_manager.num_shared_hits
    assert run(llm, [turn], [sp])[0] == third and llm.block_manager.num_shared_hits == hits


def test_an_adapter_change_starts_afresh_in_an_engine_owning_its_weights(model):
    """``LLM(peft_model, owns_weights=True)``: disabling the adapters between calls changes what
    the pages hold, so the next call shares none of them."""
    import copy

    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft_model = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                                 init_lora_weights=False))
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = make_llm(peft_model, owns_weights=True)
    with_adapters, _, _ = run(llm, [N_PROMPTS[1]], [sp])
    hits = llm.block_manager.num_shared_hits
    assert run(llm, [N_PROMPTS[1]], [sp])[0] == with_adapters and llm.block_manager.num_shared_hits > hits
    hits = llm.block_manager.num_shared_hits
    with peft_model.disable_adapter():
        without, _, _ = run(llm, [N_PROMPTS[1]], [sp])
    assert llm.block_manager.num_shared_hits == hits and without != with_adapters
    check_training(model, [N_PROMPTS[1]], [sp], without)


def test_reset_prefix_cache_forgets_the_pages_of_earlier_calls(model, tmp_path):
    """vLLM's ``LLM.reset_prefix_cache()``: weights written in place into an engine that owns them
    (which it cannot see) give stale pages to the next call unless it is called; after it the
    next call prefills afresh, with the new weights' results."""
    import copy

    model.save_pretrained(tmp_path)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(tmp_path), device="cpu", block_size=BS, kv_cache_bytes=cache_bytes(model, 256))
    first, _, _ = run(llm, [N_PROMPTS[1]], [sp])
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
        llm.model.causal_lm.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
    hits = llm.block_manager.num_shared_hits
    stale, _, _ = run(llm, [N_PROMPTS[1]], [sp])
    assert llm.block_manager.num_shared_hits > hits  # the unseen change: the old pages were taken
    assert llm.reset_prefix_cache() is True
    hits = llm.block_manager.num_shared_hits
    fresh, _, _ = run(llm, [N_PROMPTS[1]], [sp])
    assert llm.block_manager.num_shared_hits == hits and fresh != first and fresh != stale
    assert fresh == run(make_llm(changed), [N_PROMPTS[1]], [sp])[0]
