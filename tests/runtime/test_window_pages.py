"""Pages behind a sliding window (docs/design.md section 6): the BlockManager releases them as a
sequence advances, prefix sharing keeps its chain across them, and the engine of a model whose
every layer is windowed gives bitwise the results of the same engine keeping every page (and of
the training forward) with fewer pages, also under forced preemption."""

import pytest
import torch

import vexact_models.llama as llama
from vexact_models.kernels.attention_window import window_block_start
from vexact_models.layers import cache_window
from vexact_models.runtime import SamplingParams
from vexact_models.runtime.block_manager import BlockManager, window_pages_bound
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence

from .llm_support import cache_bytes, make_llm, training_logprobs


def _seq(tokens: list[int]) -> Sequence:
    return Sequence(0, 0, tokens, SamplingParams(), 0)


def test_release_behind_window_frees_the_pages_no_later_query_reads():
    bm = BlockManager(40, 16, window=20)
    seq = _seq(list(range(2, 102)))
    bm.allocate(seq, 100)
    seq.num_computed_tokens = 100
    assert bm.release_behind_window(seq) == 4  # window_block_start(100, 20) = 64: pages 0-3
    assert seq.released_blocks == 4 and len(seq.block_table) == 7 and bm.num_free_blocks == 40 - 3
    assert bm.release_behind_window(seq) == 0  # nothing new
    bm.free(seq)  # the released pages are not freed twice
    assert bm.num_free_blocks == 40 and seq.released_blocks == 0 and seq.block_table == []
    assert BlockManager(40, 16).release_behind_window(_seq([1])) == 0  # no window: nothing
    with pytest.raises(ValueError, match="window=0 must be None or an int >= 1"):
        BlockManager(4, 4, window=0)


def test_a_windowed_sequence_longer_than_the_cache_fits_while_its_window_does():
    """`shortfall` with a window asks for `window_pages_bound` pages, not the whole sequence's."""
    assert window_pages_bound(6, 4, 32) == 29  # (6 keys + 63 below them + 32) / 4, rounded up, + 3
    bm = BlockManager(29, 4, window=6)
    assert bm.shortfall(1000, 32) is None and bm.shortfall(20, 32) is None
    assert bm.shortfall(1000, 36) == ("needs 30 KV cache blocks for 1000 positions in chunks of 36 but the cache has "
                                      "only 29 blocks in total (block_size=4, window=6)")
    assert BlockManager(29, 4).shortfall(1000, 32).startswith("needs 250 KV cache blocks for 1000 positions but")


def test_a_prefix_hit_takes_only_the_pages_its_window_reads_and_the_chain_continues():
    """A sequence sharing a cached prefix takes only the pages its next query reads: the entries
    below that query's `window_block_start` enter released, with no page and no reference."""
    bm = BlockManager(64, 4, window=8)
    prompt = list(range(2, 90))
    a, b = _seq(prompt), _seq(prompt)
    bm.allocate(a, 88)
    a.num_computed_tokens = 88
    bm.cache_full_blocks(a, 88)
    bm.allocate(b, 88)  # a's full pages but the last hold its first 84 tokens; its query at 84 reads from 64 on
    assert b.num_computed_tokens == 84 and b.released_blocks == window_block_start(84, 8) // 4 == 16
    assert b.block_table[16:21] == a.block_table[16:21] and len(b.block_table) == 22 and bm.num_shared_hits == 5
    assert [bm.ref_count(block) for block in a.block_table[15:17]] == [1, 2] and bm.num_free_blocks == 64 - 23
    assert bm.release_behind_window(a) == 16 and bm.num_free_blocks == 64 - 7  # b took none of those 16
    assert all(bm.ref_count(block) == 2 for block in a.block_table[16:21])  # b still reads them
    a.token_ids += list(range(300, 312))
    bm.allocate(a, 100)
    bm.cache_full_blocks(a, 100)  # publishing goes on past the released pages (seq.released_key)
    c = _seq(prompt + list(range(300, 312)) + [5])
    bm.allocate(c, 101)
    assert c.num_computed_tokens == 100 and c.released_blocks == 16 and c.block_table[16:25] == a.block_table[16:25]
    for seq in (a, b, c):
        bm.free(seq)  # entries released on arrival are never freed
    assert bm.num_free_blocks == 64


def _drive(sched, seq, max_steps=200) -> int:
    """Steps until `seq`, added alone, finishes (a fake model: every sampled token is 7)."""
    sched.add(seq)
    for step in range(max_steps):
        if not sched.has_unfinished():
            return step
        out = sched.schedule()
        tokens = [7 if item.samples else None for item in out.scheduled]
        sched.postprocess(out.scheduled, tokens, [0.0 if t is not None else None for t in tokens])
    raise AssertionError(f"{seq!r} did not finish in {max_steps} steps")


@pytest.mark.parametrize("sharing", [True, False])
def test_a_conversation_whose_cached_prefix_outgrows_the_cache_goes_on_under_the_window(sharing):
    """Turn 1 fills the cache exactly (`window_pages_bound` pages, all published); turn 2, turn 1
    plus 10 tokens, shares its cached prefix's last page, the only one its window reads, and runs
    alone in the cache as it does with sharing off: a sequence alone in the cache always progresses."""
    pages = window_pages_bound(1, 16, 16)
    bm = BlockManager(pages, 16, enable_prefix_sharing=sharing, window=1)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=4096, eos_token_id=None)
    turn1 = Sequence(0, 0, list(range(1, 101)), SamplingParams(max_tokens=pages * 16 + 1 - 100), 0)
    _drive(sched, turn1)
    assert turn1.num_tokens - 1 == pages * 16 and bm.num_cached_blocks == (pages if sharing else 0)
    turn2 = Sequence(1, 0, turn1.token_ids + [3] * 10, SamplingParams(max_tokens=4), 0)
    assert bm.num_cached_tokens(turn2) == (pages * 16 if sharing else 0)
    _drive(sched, turn2)
    assert turn2.finish_reason == "length" and turn2.num_output_tokens == 4
    assert bm.num_shared_hits == (1 if sharing else 0) and bm.num_free_blocks == pages


def _model(window: int | None):
    torch.manual_seed(0)
    config = llama.tiny_config(initializer_range=0.5)
    config.sliding_window = window  # every layer windowed, as Mistral's (layers.layer_window)
    return llama.LlamaForCausalLM(config).eval()


def _run(llm, prompts, params, release: bool):
    """(results, peak pages in use) with or without releasing the pages behind the window."""
    bm = llm.block_manager
    if not release:
        bm.window = None
    peak = 0
    schedule, schedule_ahead = llm.scheduler.schedule, llm.scheduler.schedule_ahead

    def tracked(pick=schedule):
        nonlocal peak
        out = pick()
        held = [seq.block_table[seq.released_blocks:] for seq in llm.scheduler._running]
        assert bm.num_blocks - bm.num_free_blocks == len({block for table in held for block in table})
        peak = max(peak, bm.num_blocks - bm.num_free_blocks)
        return out

    llm.scheduler.schedule, llm.scheduler.schedule_ahead = tracked, lambda: tracked(schedule_ahead)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        del llm.scheduler.schedule, llm.scheduler.schedule_ahead
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], peak


@pytest.mark.parametrize("engine", [dict(max_num_batched_tokens=64), dict(max_num_batched_tokens=7),
                                    dict(max_num_batched_tokens=64, kv_blocks=40)],
                         ids=["budget64", "budget7", "preempting"])
def test_engine_frees_pages_behind_the_window_bitwise(engine):
    model = _model(window=6)
    assert cache_window(model) == 6 and cache_window(_model(None)) is None
    gemma_like = _model(6)
    gemma_like.model.layers[1].self_attn.sliding_window = None  # a global layer: no page is freed
    assert cache_window(gemma_like) is None
    prompts = [list(range(3, 75)), list(range(100, 190))]
    params = [SamplingParams(temperature=1.0, n=2, max_tokens=40, seed=1, ignore_eos=True),
              SamplingParams(temperature=0.8, max_tokens=30, seed=2, ignore_eos=True)]
    blocks = engine.pop("kv_blocks", 256)
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, blocks), **engine)
    got, peak = _run(llm, prompts, params, release=True)
    assert llm.block_manager.window == 6 and llm.block_manager.num_free_blocks == blocks
    keeping = make_llm(model, kv_cache_bytes=cache_bytes(model, blocks), **engine)
    want, peak_keeping = _run(keeping, prompts, params, release=False)
    assert got == want and peak < peak_keeping
    if blocks == 40:
        assert keeping.num_preemptions > 0
    for prompt, completions in zip(prompts, got):
        for tokens, logprobs in completions:
            temperature = params[prompts.index(prompt)].temperature
            assert torch.equal(torch.tensor(logprobs), training_logprobs(model, prompt, tokens, temperature))


def test_a_sequence_longer_than_the_cache_rolls_out_under_the_window():
    """A 150-token prompt plus 12 tokens would need 41 pages; the cache has 30, which fits its
    window (`window_pages_bound` 29 in chunks of 32): it rolls out bitwise ``token_logprobs``, where
    the same engine without the window refuses it with the error naming what it needs."""
    model = _model(window=6)
    prompt, params = list(range(3, 153)), SamplingParams(temperature=1.0, max_tokens=12, seed=4, ignore_eos=True)
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 30), max_num_batched_tokens=32)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 12
    assert torch.equal(torch.tensor(out.logprobs), training_logprobs(model, prompt, out.token_ids, 1.0))
    plain = _model(window=None)
    refused = make_llm(plain, kv_cache_bytes=cache_bytes(plain, 30), max_num_batched_tokens=32)
    out = refused.generate([prompt], params, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "error" and "needs 41 KV cache blocks for 162 positions" in out.outputs[0].error


def test_the_next_turn_of_a_conversation_that_filled_the_cache_shares_its_window_bitwise():
    """Turn 1 (121 tokens) fills a 30-page cache and leaves its pages published (an engine owning
    its weights keeps them); turn 2, turn 1 plus 8 tokens (129 tokens, more than the cache holds),
    shares the cached pages its window reads and rolls out bitwise the training forward's logprobs."""
    model = _model(window=6)
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 30), max_num_batched_tokens=32, owns_weights=True)
    prompt = list(range(3, 103))
    first = llm.generate([prompt], SamplingParams(max_tokens=21, seed=1, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert llm.block_manager.num_cached_blocks == 30 and llm.block_manager.num_shared_hits == 0
    prompt += first.token_ids + [7] * 8
    out = llm.generate([prompt], SamplingParams(max_tokens=4, seed=1, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 4 and llm.block_manager.num_shared_hits > 0
    assert torch.equal(torch.tensor(out.logprobs), training_logprobs(model, prompt, out.token_ids, 1.0))
