"""The n samples of one prompt prefill it once on the gated-DeltaNet hybrids
(`runtime.scheduler_siblings`): the siblings take the leader's prompt pages and a copy of its
GDN slot state; the prompt runs once up to its share point, and every logprob equals the
training recompute bitwise, and the rollout with prefix sharing off (each sample prefilling)
token for token; with chunked prefill, one step at a time and ahead, and with preemptions."""

import numpy as np
import pytest
import torch

from vexact_models.conformance.models import build_model
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.linear_state_cache import LinearStateCache
from vexact_models.runtime.llm_setup import cache_budget_bytes
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.sequence import Sequence

from .test_linear_state_cache import spec

HYBRIDS = ["qwen3_5", "qwen3_5_moe", "qwen3_next"]
BLOCK, N = 4, 4
LENGTHS = (19, 6)  # share points 16 and 4 (the pages of 4 before the last token)


def count_prompt_tokens(llm) -> dict:
    """Wrap the scheduler's two entry points to count the prompt tokens each step runs and the
    state copies it carries."""
    counts = {"prompt": 0, "copies": 0}
    scheduler = llm.scheduler

    def tally(items):
        for item in items or ():
            seq = item.seq
            start = len(seq.token_ids) if item.in_flight else seq.num_computed_tokens
            counts["prompt"] += max(0, min(start + item.num_new_tokens, seq.num_prompt_tokens) - start)
            counts["copies"] += item.state_from is not None
        return items

    schedule, ahead = scheduler.schedule, scheduler.schedule_ahead
    scheduler.schedule = lambda: (lambda out: (tally(out.scheduled), out)[1])(schedule())
    scheduler.schedule_ahead = lambda: tally(ahead())
    return counts


def completions(outs):
    return [(c.token_ids, c.logprobs) for o in outs for c in o.outputs]


def assert_recompute(model, prompts, outs):
    for prompt, out in zip(prompts, outs):
        for c in out.outputs:
            want = model.token_logprobs(torch.tensor([prompt + c.token_ids]))[0, len(prompt):]
            assert torch.equal(torch.tensor(c.logprobs), want), (len(prompt), c.index)


def test_n_samples_prefill_their_prompt_once_and_equal_training_bitwise(hybrid):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3, n=N)
    shares = [(n - 1) // BLOCK * BLOCK for n in LENGTHS]
    once = sum(s + N * (n - s) for n, s in zip(LENGTHS, shares))
    alone = None
    for engine in (dict(enable_prefix_sharing=False), dict(), dict(async_scheduling=False),
                   dict(max_num_batched_tokens=12)):
        llm = LLM(hybrid, device="cpu", block_size=BLOCK, max_num_seqs=12, kv_cache_bytes=1 << 22,
                  **{"max_num_batched_tokens": 128, **engine})
        counts = count_prompt_tokens(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        if not engine:
            assert counts == {"prompt": once, "copies": (N - 1) * len(LENGTHS)}
            assert llm.block_manager.num_shared_hits == (N - 1) * sum(s // BLOCK for s in shares)
        elif "enable_prefix_sharing" in engine:
            assert counts == {"prompt": N * sum(LENGTHS), "copies": 0}
            alone = completions(outs)
            assert_recompute(hybrid, prompts, outs)
        else:  # with a budget of 12 the second leader waits at its share point while the first's siblings run
            assert counts == {"prompt": once, "copies": (N - 1) * len(LENGTHS)}, engine
        assert completions(outs) == alone, engine


def test_preempted_samples_rebuild_their_state_by_recompute(hybrid):
    """Pages for about three sequences and n = 4: samples are preempted after sharing their
    prompt's pages and state, re-prefill from 0 (alone, or from a leader at the share point
    again), and every logprob is still the recompute's."""
    gen = torch.Generator().manual_seed(8)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (13, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=4, n=N)
    budget = cache_budget_bytes(hybrid, torch.float32, BLOCK, 14, 8)
    llm = LLM(hybrid, device="cpu", block_size=BLOCK, max_num_seqs=8, kv_cache_bytes=budget, max_num_batched_tokens=32)
    counts = count_prompt_tokens(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.num_preemptions > 0 and counts["copies"] > 0, (llm.num_preemptions, counts)
    assert_recompute(hybrid, prompts, outs)


def test_copy_slots_copies_every_tensor_of_the_slot():
    cache = LinearStateCache(spec(), slots=5, device=torch.device("cpu"), dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    tensors = [*cache.conv.values(), *cache.states.values()]
    assert len(tensors) == 4  # conv and delta-rule states of the spec's two GDN layers
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in tensors]
    cache.copy_slots(torch.tensor([1, 1]), torch.tensor([3, 0]))
    for old, new in zip(before, tensors):
        assert torch.equal(new[3], old[1]) and torch.equal(new[0], old[1])
        assert all(torch.equal(new[s], old[s]) for s in range(1, new.shape[0]) if s != 3)


def test_scheduler_holds_siblings_until_the_leader_reaches_the_share_point():
    """A prompt of 11 tokens (share point 8 at pages of 4), n = 3, 10 tokens a step: the leader
    runs 8 tokens (stopping at the share point) while its siblings wait and a later request is
    admitted past them; then the siblings take 2 pages each and a copy of the leader's state, and
    run the last 3 tokens beside the leader."""
    bm = BlockManager(64, BLOCK, enable_prefix_sharing=False)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10, max_model_len=64, eos_token_id=None,
                          share_prompt_state=True)
    params = SamplingParams(max_tokens=4, n=3, ignore_eos=True)
    group = [Sequence(0, i, list(range(2, 13)), params, seed=i) for i in range(3)]
    other = Sequence(1, 0, [5, 6], SamplingParams(max_tokens=4, ignore_eos=True), seed=9)
    for seq in (*group, other):
        scheduler.add(seq)
    steps = []
    for _ in range(2):
        out = scheduler.schedule()
        steps.append([(item.seq.request_id, item.seq.sample_index, item.num_new_tokens,
                       None if item.state_from is None else item.state_from.sample_index) for item in out.scheduled])
        scheduler.postprocess(out.scheduled, [7 if i.samples else None for i in out.scheduled],
                              [0.0 if i.samples else None for i in out.scheduled])
    assert steps[0] == [(0, 0, 8, None), (1, 0, 2, None)]  # stops at 8; the next request passes the siblings
    assert steps[1] == [(0, 0, 3, None), (1, 0, 1, None), (0, 1, 3, 0), (0, 2, 3, 0)]
    assert group[1].block_table[:2] == group[0].block_table[:2] == group[2].block_table[:2]
    assert [bm.ref_count(b) for b in group[0].block_table] == [3, 3, 1]
    with pytest.raises(ValueError, match="share_prompt_state=True needs a BlockManager with enable_prefix_sharing=False"):
        Scheduler(BlockManager(8, BLOCK), 8, 6, 64, None, share_prompt_state=True)
    with pytest.raises(ValueError, match="share_prompt_state=1 must be a bool"):
        Scheduler(bm, 8, 6, 64, None, share_prompt_state=1)


def test_share_prefix_errors_change_nothing():
    bm = BlockManager(16, BLOCK, enable_prefix_sharing=False)
    params = SamplingParams(max_tokens=4, n=2)
    donor, seq = (Sequence(0, i, list(range(2, 12)), params, seed=i) for i in range(2))
    bm.allocate(donor, 8)
    with pytest.raises(ValueError, match="has not computed 8 tokens"):
        bm.share_prefix(seq, donor, 8)
    donor.num_computed_tokens = 8
    with pytest.raises(ValueError, match="num_tokens=6 must be a positive multiple of block_size=4"):
        bm.share_prefix(seq, donor, 6)
    assert seq.block_table == [] and seq.num_computed_tokens == 0 and seq.seq_id not in bm.tables
    assert bm.can_share_prefix(8, 10) and not bm.can_share_prefix(8, 4 * 17)
    bm.share_prefix(seq, donor, 8)
    assert seq.block_table == donor.block_table and seq.num_computed_tokens == 8
    assert bm.tables.table(seq.seq_id) == donor.block_table and bm.num_shared_hits == 2
    with pytest.raises(ValueError, match="must hold no pages and no computed tokens"):
        bm.share_prefix(seq, donor, 8)
    assert np.array_equal(bm.tables.gather(bm.tables.rows([seq]), 2)[0], donor.block_table)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton GDN kernels)")
@pytest.mark.parametrize("name", HYBRIDS)
def test_gpu_n_samples_share_their_prompt_at_chunk_64(name):
    """On the GPU (Triton kernels), bf16, the published chunk of 64, pages of 16: prompts of 100
    and 300 tokens, n = 4, prefill pieces of 48: the prompts run once up to their share points
    (96, 288), and every logprob equals the training recompute and the rollout with prefix
    sharing off, bitwise."""
    arch = get(name)
    model = build_model(arch, arch.tiny_config(linear_chunk_size=None, head_dim=64), torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    lengths = (100, 300)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=2, n=N)
    runs = []
    for share in (False, True):
        llm = LLM(model, block_size=16, max_num_seqs=8, kv_cache_bytes=1 << 26, max_num_batched_tokens=48,
                  enforce_eager=True, enable_prefix_sharing=share)
        counts = count_prompt_tokens(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        shares = [(n - 1) // 16 * 16 for n in lengths] if share else [0, 0]
        assert counts["prompt"] == sum(s + N * (n - s) for n, s in zip(lengths, shares)), counts
        runs.append(completions(outs))
        for prompt, out in zip(prompts, outs):
            for c in out.outputs:
                want = model.token_logprobs(torch.tensor([prompt + c.token_ids], device="cuda"))[0, len(prompt):].cpu()
                assert torch.equal(torch.tensor(c.logprobs), want), (name, len(prompt), c.index)
    assert runs[0] == runs[1]
