"""Prompt states kept for later requests on the gated-DeltaNet hybrids
(`runtime.scheduler_prefix_states`, ``LLM(prefix_states=N)``): a conversation's next turn takes
the kept pages and a copy of the kept state of its last turn's prompt and prefills only the rest,
and every token and logprob equals prefilling everything (prefix sharing off) and the training
recompute, bitwise; with chunked prefill, one step at a time and ahead, n > 1, kept states given
back for pages or slots, and their errors."""

import numpy as np
import pytest
import torch

from vexact_models.conformance.models import build_model
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.linear_state_cache import LinearStateCache, snapshot_slot
from vexact_models.runtime.llm_setup import cache_budget_bytes
from vexact_models.runtime.page_groups import PageGroups
from vexact_models.runtime.scheduler import Scheduler
from vexact_models.runtime.scheduler_prefix_states import REPLY_STRIDE

from .test_linear_state_cache import spec
from .test_prompt_state_sharing import HYBRIDS, assert_recompute, completions, count_prompt_tokens

BLOCK = 4


def _engine(model, **kwargs) -> LLM:
    kwargs = {"max_num_batched_tokens": 128, "kv_cache_bytes": 1 << 22, **kwargs}
    return LLM(model, device="cpu", block_size=BLOCK, max_num_seqs=8, owns_weights=True, **kwargs)


def _turns(llm, first: list[list[int]], params, turns: int = 3) -> tuple[list, list[list[int]], list[int]]:
    """Each conversation's turns (the prompt: the conversation so far plus 5 new tokens); the
    outputs and prompts of every turn, and the prompt tokens each turn computed."""
    counts = count_prompt_tokens(llm)
    outs, prompts, computed, gen = [], [], [], torch.Generator().manual_seed(11)
    conversations = [list(p) for p in first]
    for _ in range(turns):
        before = counts["prompt"]
        out = llm.generate(conversations, params, use_tqdm=False)
        outs.append(out)
        prompts.append([list(c) for c in conversations])
        computed.append(counts["prompt"] - before)
        conversations = [c + o.outputs[0].token_ids + torch.randint(2, 500, (5,), generator=gen).tolist()
                         for c, o in zip(conversations, out)]
    return outs, prompts, computed


def kept_depth(prompt: int, max_tokens: int, block: int = BLOCK) -> int:
    """Tokens of a conversation's last turn (`prompt` tokens, `max_tokens` sampled, ``ignore_eos``)
    that its next turn takes: its reply's last state (each ``reply_stride`` tokens past the share
    point, up to its last computed position), else its prompt's share point."""
    stride = -(-REPLY_STRIDE // block) * block
    share = (prompt - 1) // block * block
    return max(share, (prompt + max_tokens - 2) // stride * stride)


@pytest.mark.parametrize("engine, lengths, max_tokens", [
    (dict(), (19, 23, 6), 6), (dict(async_scheduling=False), (19, 23, 6), 6), (dict(max_num_batched_tokens=12), (19, 23, 6), 6),
    (dict(), (58, 61, 50), 14), (dict(async_scheduling=False), (58, 61, 50), 14)])
def test_a_conversations_next_turn_prefills_only_what_it_adds_and_equals_prefilling_all(hybrid, engine, lengths, max_tokens):
    """Three turns of three conversations; a turn takes its last turn's prompt state, or where the
    reply reached 64 tokens (a stride), the state the reply kept there (from steps scheduled ahead,
    and one at a time)."""
    gen = torch.Generator().manual_seed(7)
    first = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in lengths]
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=3)
    turns = 3
    want, prompts, alone = _turns(_engine(hybrid, enable_prefix_sharing=False), first, params, turns)
    llm = _engine(hybrid, prefix_states=4, **engine)
    got, _, computed = _turns(llm, first, params, turns)
    for turn in range(turns):
        assert completions(got[turn]) == completions(want[turn])
        assert_recompute(hybrid, prompts[turn], got[turn])
    assert computed[0] == alone[0] == sum(len(p) for p in prompts[0])
    for turn in range(1, turns):  # each prompt begins with the last turn's
        kept = [kept_depth(len(p), max_tokens) for p in prompts[turn - 1]]
        assert computed[turn] == sum(len(p) - k for p, k in zip(prompts[turn], kept)) < alone[turn]
    assert llm.scheduler.num_kept_states == 4  # (every slot: the oldest given back)
    taken = sum(kept_depth(len(p), max_tokens) for t in range(turns - 1) for p in prompts[t])
    assert llm.scheduler.num_prefix_state_tokens == taken


def test_kept_states_give_their_slots_and_pages_back_and_the_results_stay(hybrid):
    """One kept state for three conversations (each turn replaces the others'), and a cache so
    small that kept states must give their pages back for the running ones: the same tokens."""
    gen = torch.Generator().manual_seed(5)
    first = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (21, 14, 9)]
    params = SamplingParams(temperature=1.0, max_tokens=7, ignore_eos=True, seed=1)
    want, prompts, _ = _turns(_engine(hybrid, enable_prefix_sharing=False), first, params)
    tight = cache_budget_bytes(hybrid, torch.float32, BLOCK, 24, 8, state_snapshots=3)
    for engine in (dict(prefix_states=1), dict(prefix_states=3, kv_cache_bytes=tight)):
        llm = _engine(hybrid, **engine)
        got, _, _ = _turns(llm, first, params)
        assert [completions(o) for o in got] == [completions(o) for o in want]
        assert llm.scheduler.num_kept_states <= engine["prefix_states"]
    assert llm.num_preemptions > 0  # (the small cache: kept states gave their pages back first)


def test_replies_kept_under_preemption_give_every_page_back(hybrid):
    """Replies that keep states (64 tokens a stride) in a cache so small that sequences are
    preempted and re-prefill: the same tokens as prefilling everything, and once the kept states
    go (`reset_prefix_cache`) every page is free again (no reference lost or left)."""
    gen = torch.Generator().manual_seed(4)
    first = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (58, 61, 50)]
    params = SamplingParams(temperature=1.0, max_tokens=14, ignore_eos=True, seed=6)
    want, _, _ = _turns(_engine(hybrid, enable_prefix_sharing=False), first, params, 2)
    tight = cache_budget_bytes(hybrid, torch.float32, BLOCK, 48, 8, state_snapshots=3)
    llm = _engine(hybrid, prefix_states=3, kv_cache_bytes=tight)
    got, _, _ = _turns(llm, first, params, 2)
    assert [completions(o) for o in got] == [completions(o) for o in want] and llm.num_preemptions > 0
    llm.reset_prefix_cache()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


def test_the_n_samples_of_a_turn_share_its_kept_state(hybrid):
    gen = torch.Generator().manual_seed(9)
    first = [torch.randint(2, 500, (17,), generator=gen).tolist()]
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2, n=3)
    want = _engine(hybrid, enable_prefix_sharing=False).generate(first, params, use_tqdm=False)
    llm = _engine(hybrid, prefix_states=2)
    llm.generate(first, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)  # keeps the prompt's state
    counts = count_prompt_tokens(llm)
    got = llm.generate(first, params, use_tqdm=False)
    assert completions(got) == completions(want)
    assert counts["prompt"] == 3 * (17 - 16)  # every sample took the kept 16 tokens


def test_online_turns_take_their_kept_states(hybrid):
    """A server's turns come as online requests (`LLM.add_request` / `step`): the next turn of a
    conversation takes the state its last turn kept, and equals ``generate`` without kept states."""
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(2, 500, (22,), generator=gen).tolist()
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=4)
    plain = _engine(hybrid, enable_prefix_sharing=False)
    llm = _engine(hybrid, prefix_states=2)
    counts = count_prompt_tokens(llm)
    for turn in range(3):
        llm.add_request(f"turn{turn}", prompt, params)
        outputs = []
        while llm.has_unfinished_requests():
            outputs += llm.step()
        [want] = plain.generate([prompt], params, use_tqdm=False)
        assert completions(outputs[-1:]) == completions([want])
        computed = counts["prompt"]
        prompt = prompt + want.outputs[0].token_ids + [7, 8, 9]
    assert computed == 22 + (22 + 6 + 3 - 20) + (31 + 6 + 3 - 28)


def test_vexact_serve_passes_prefix_states_to_the_engine(tmp_path):
    """``vexact serve --prefix-states N`` reaches ``LLM`` (whose refusal for a model without
    gated-DeltaNet layers it prints), and a negative N is refused by the option itself."""
    import subprocess
    import sys

    from .llm_support import save_chat_checkpoint

    folder = save_chat_checkpoint(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    run = [sys.executable, "-m", "vexact_models.cli", "serve", str(folder), "--device", "cpu", "--prefix-states"]
    done = subprocess.run(run + ["2"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "prefix_states=2 keeps gated-DeltaNet states" in done.stderr
    done = subprocess.run(run + ["-1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "argument --prefix-states: must be >= 0, got -1" in done.stderr


def test_a_prompt_to_score_takes_no_kept_state(hybrid):
    """``prompt_logprobs`` scores every prompt position, so such a request computes them all."""
    prompt = list(range(3, 22))
    llm = _engine(hybrid, prefix_states=2)
    llm.generate([prompt], SamplingParams(max_tokens=1), use_tqdm=False)
    counts = count_prompt_tokens(llm)
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, seed=5)
    got = llm.generate([prompt + [5, 6]], params, use_tqdm=False)[0]
    want = _engine(hybrid, enable_prefix_sharing=False).generate([prompt + [5, 6]], params, use_tqdm=False)[0]
    assert counts["prompt"] == 21 and got.prompt_logprobs == want.prompt_logprobs
    assert completions([got]) == completions([want])


def test_kept_states_go_with_the_weights_and_the_cache(hybrid):
    llm = _engine(hybrid, prefix_states=2)
    llm.generate([list(range(3, 22))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert llm.scheduler.num_kept_states == 1
    free = llm.block_manager.num_free_blocks
    llm.reset_prefix_cache()
    assert llm.scheduler.num_kept_states == 0 and llm.block_manager.num_free_blocks == free + 4
    llm.generate([list(range(3, 22))], SamplingParams(max_tokens=2), use_tqdm=False)
    llm.update_weights({})
    counts = count_prompt_tokens(llm)
    llm.generate([list(range(3, 22))], SamplingParams(max_tokens=2), use_tqdm=False)
    assert counts["prompt"] == 19  # (new weights: nothing kept is taken)


def test_prefix_states_errors_name_the_argument(hybrid):
    with pytest.raises(ValueError, match="prefix_states=-1"):
        _engine(hybrid, prefix_states=-1)
    with pytest.raises(ValueError, match="enable_prefix_sharing=False turns off"):
        _engine(hybrid, prefix_states=2, enable_prefix_sharing=False)
    dense = build_model(get("qwen3"), get("qwen3").tiny_config(), torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="prefix_states=2 keeps gated-DeltaNet states, and this Qwen3ForCausalLM"):
        _engine(dense, prefix_states=2)
    with pytest.raises(ValueError, match="needs a BlockManager with enable_prefix_sharing=False"):
        Scheduler(BlockManager(8, BLOCK), 2, 16, 64, None, prefix_states=1)
    with pytest.raises(ValueError, match="without a window page group"):
        Scheduler(PageGroups(8, BLOCK, 8, 16, enable_prefix_sharing=False), 2, 16, 64, None, prefix_states=1)


def test_state_copies_address_the_kept_slots_after_the_padding_state():
    cache = LinearStateCache(spec(), slots=3, device=torch.device("cpu"), dtype=torch.float32, snapshots=2)
    layer = spec().layers[0]
    assert cache.states[layer].shape[0] == 6 and cache.conv[layer].shape[0] == 6 and snapshot_slot(3, 1) == 5
    cache.states[layer][1] = 7.0
    cache.conv[layer][1] = 3.0
    cache.copy_slots(torch.tensor([1]), torch.tensor([snapshot_slot(3, 0)]))
    cache.copy_slots(torch.tensor([snapshot_slot(3, 0)]), torch.tensor([2]))
    assert torch.equal(cache.states[layer][2], cache.states[layer][1]) and float(cache.conv[layer][4].max()) == 3.0
    assert spec().cache_bytes(3, torch.float32, 2) == sum(t.numel() * 4 for pools in (cache.conv, cache.states)
                                                          for t in pools.values())
    assert np.array_equal(spec().cache_bytes(3, torch.float32), spec().cache_bytes(3, torch.float32, 0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton GDN kernels, CUDA graphs)")
@pytest.mark.parametrize("name", HYBRIDS)
def test_gpu_turns_take_their_kept_states_under_cuda_graphs(name):
    """On the GPU (Triton kernels, bf16, pages of 16), with decode and mixed-step CUDA graphs and
    async steps: three turns of four conversations of 100-300 tokens; each turn past the first
    prefills only what follows its last turn's share point or its reply's kept state, and every
    logprob equals the rollout with prefix sharing off and the training recompute, bitwise."""
    arch = get(name)
    model = build_model(arch, arch.tiny_config(linear_chunk_size=None, head_dim=64), torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    first = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (100, 300, 161, 17)]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=2)
    runs = []
    for states in (0, 4):
        llm = LLM(model, block_size=16, max_num_seqs=8, kv_cache_bytes=1 << 26, max_num_batched_tokens=96,
                  owns_weights=True, enable_prefix_sharing=bool(states), prefix_states=states)
        outs, prompts, computed = _turns(llm, first, params)
        runs.append([completions(o) for o in outs])
        if states:
            for turn in (1, 2):
                kept = [kept_depth(len(p), 40, 16) for p in prompts[turn - 1]]
                assert computed[turn] == sum(len(p) - k for p, k in zip(prompts[turn], kept)), computed
        for turn in range(3):
            for prompt, out in zip(prompts[turn], outs[turn]):
                tokens = torch.tensor([prompt + out.outputs[0].token_ids], device="cuda")
                want = model.token_logprobs(tokens)[0, len(prompt):].cpu()
                assert torch.equal(torch.tensor(out.outputs[0].logprobs), want), (name, turn, len(prompt))
    assert runs[0] == runs[1]


def test_pages_held_by_reference_go_back_when_the_last_holder_lets_go():
    """`BlockManager.hold` / `release` / `share_pages` (a kept state's pages, a later sequence's)."""
    from vexact_models.runtime.sequence import Sequence

    bm = BlockManager(6, BLOCK, enable_prefix_sharing=False)
    owner, taker = (Sequence(i, 0, list(range(10 + 2 * i)), SamplingParams(), 0) for i in range(2))
    bm.allocate(owner, 8)
    pages = owner.block_table[:2]
    bm.hold(pages)
    bm.free(owner)
    assert bm.num_free_blocks == 4 and [bm.ref_count(p) for p in pages] == [1, 1]
    bm.share_pages(taker, pages)
    assert taker.num_computed_tokens == 8 and bm.tables.table(taker.seq_id) == pages
    bm.release(pages)
    assert bm.num_free_blocks == 4 and [bm.ref_count(p) for p in pages] == [1, 1]
    bm.free(taker)
    assert bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="must all be held"):
        bm.hold(pages)
    with pytest.raises(RuntimeError, match="are not all held"):
        bm.release(pages)
    with pytest.raises(ValueError, match="non-empty list of held pages"):
        bm.share_pages(Sequence(2, 0, list(range(12)), SamplingParams(), 0), pages)
