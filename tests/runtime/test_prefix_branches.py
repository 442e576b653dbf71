"""Prompts that begin alike share their common prefix within one call on the gated-DeltaNet
hybrids (`runtime.scheduler_prefix_states`, branch points): the first prompt stops its prefill
where the prefix it shares with a waiting prompt ends and keeps the state there, the waiting
prompts wait for it and take it; a system prompt, one prompt sent as several requests, n > 1 on
top, online arrivals, an abort and preemptions, and every token and logprob equals prefilling
everything (prefix sharing off) and the training recompute, bitwise."""

import pytest
import torch

from vexact_models.conformance.models import build_model
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.llm_setup import cache_budget_bytes

from .test_prefix_states import BLOCK
from .test_prefix_states import _engine as _kept_engine
from .test_prompt_state_sharing import HYBRIDS, assert_recompute, completions, count_prompt_tokens


def _engine(model, **kwargs) -> LLM:
    return _kept_engine(model, **{"prefix_states": 4, **kwargs})


def _plain(model, prompts, params):
    return _engine(model, enable_prefix_sharing=False, prefix_states=0).generate(prompts, params, use_tqdm=False)


def _tokens(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda n: torch.randint(2, 500, (n,), generator=gen).tolist()


def _system_prompt_batch():
    """A and B share 20 tokens (5 pages), C shares their first 12, D shares nothing."""
    r = _tokens(1)
    common = r(20)
    return [common + r(5), common + r(3), common[:12] + r(9), r(14)]


@pytest.mark.parametrize("engine", [dict(), dict(async_scheduling=False), dict(max_num_batched_tokens=12)])
def test_prompts_that_begin_alike_compute_their_common_prefix_once(hybrid, engine):
    prompts = _system_prompt_batch()
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=3)
    llm = _engine(hybrid, **engine)
    counts = count_prompt_tokens(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert completions(got) == completions(_plain(hybrid, prompts, params))
    assert_recompute(hybrid, prompts, got)
    a, b, c, d = map(len, prompts)
    assert counts == {"prompt": a + (b - 20) + (c - 12) + d, "copies": 2}  # B took 20 tokens, C 12
    assert llm.scheduler.num_prefix_state_tokens == 32
    _assert_nothing_left(llm)


def _assert_nothing_left(llm) -> None:
    """No waiting prompt's keys counted, no running prompt's noted, once the requests are done."""
    scheduler = llm.scheduler
    assert not (scheduler._interest or scheduler._noted or scheduler._computing or scheduler._prompt_keys)


def test_one_prompt_sent_as_several_requests_is_computed_once(hybrid):
    """TRL's GRPO sends each prompt as ``num_generations`` requests of n = 1."""
    prompt = _tokens(2)(23)
    params = [SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=s) for s in range(6)]
    llm = _engine(hybrid)
    counts = count_prompt_tokens(llm)
    got = llm.generate([prompt] * 6, params, use_tqdm=False)
    assert completions(got) == completions(_plain(hybrid, [prompt] * 6, params))
    assert_recompute(hybrid, [prompt] * 6, got)
    assert counts["prompt"] == 23 + 5 * (23 - 20)


def test_the_samples_of_a_prompt_that_took_a_common_prefix_still_share_their_prompt(hybrid):
    """n = 3 on two prompts sharing 12 tokens: B takes them from A's kept state, B's other samples
    take B's whole shared prompt from B (`scheduler_siblings`), not the shorter kept state."""
    r = _tokens(3)
    common = r(12)
    prompts = [common + r(9), common + r(10)]
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True, seed=5, n=3)
    llm = _engine(hybrid)
    counts = count_prompt_tokens(llm)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert completions(got) == completions(_plain(hybrid, prompts, params))
    assert_recompute(hybrid, prompts, got)
    shares = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]  # 20 each
    assert counts["prompt"] == 21 + 2 * (21 - shares[0]) + (22 - 12) + 2 * (22 - shares[1])


def test_a_prompt_arriving_while_its_prefix_is_computed_waits_for_it(hybrid):
    """Online: B comes while A's long prompt is still being prefilled (12 tokens a step); A stops
    where their common prefix ends, and B takes it."""
    r = _tokens(4)
    common = r(24)
    a, b = common + r(15), common + r(6)
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=7)
    llm = _engine(hybrid, max_num_batched_tokens=12)
    counts = count_prompt_tokens(llm)
    llm.add_request("a", a, params)
    outputs = llm.step()
    llm.add_request("b", b, params)
    while llm.has_unfinished_requests():
        outputs += llm.step()
    got = sorted((o for o in outputs if o.finished), key=lambda o: o.request_id)
    assert completions(got) == completions(_plain(hybrid, [a, b], params))
    assert counts["prompt"] == len(a) + len(b) - 24


@pytest.mark.parametrize("kept", [2, 4])
def test_later_conversations_behind_a_system_prompt_take_its_state(hybrid, kept):
    """Conversations that come one call at a time (an engine that owns its weights): X keeps its
    share point's state, Y stops where the system prompt (20 tokens) it shares with that kept
    state ends and keeps the state there too, Z takes it, Z's next turn takes Z's state, and W
    takes the system prompt's again: with two slots too, as the state a conversation took goes
    back first when it keeps a deeper one, unless it is where prompts' common prefix ends. Each
    equals prefilling everything."""
    r = _tokens(8)
    system = r(20)
    x, y, z, w = (system + r(n) for n in (9, 6, 11, 5))
    params = SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, seed=2)
    plain = _engine(hybrid, enable_prefix_sharing=False, prefix_states=0)
    llm = _engine(hybrid, prefix_states=kept)
    counts = count_prompt_tokens(llm)

    def turn(prompt: list[int]) -> list[int]:
        [got] = llm.generate([prompt], params, use_tqdm=False)
        assert completions([got]) == completions(plain.generate([prompt], params, use_tqdm=False))
        return got.outputs[0].token_ids

    turn(x), turn(y)
    turn(z + turn(z) + [7, 8, 9])  # (Z's next turn)
    turn(w)
    taken = 20 + (len(z) - 1) // BLOCK * BLOCK + 20
    assert counts["prompt"] == len(x) + len(y) + len(z) + len(z) + 5 + 3 + len(w) - taken
    assert llm.scheduler.num_kept_states == kept


def test_the_waiting_prompts_go_on_when_the_first_is_aborted_or_preempted(hybrid):
    prompts = _system_prompt_batch()
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=9)
    want = _plain(hybrid, prompts, params)
    llm = _engine(hybrid, max_num_batched_tokens=8)
    for i, prompt in enumerate(prompts):
        llm.add_request(str(i), prompt, params)
    llm.step()  # A computes its first 8 tokens; B and C wait for 12
    llm.abort_request("0")
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    got = sorted((o for o in outputs if o.finished), key=lambda o: o.request_id)
    assert [o.request_id for o in got] == ["1", "2", "3"] and completions(got) == completions(want[1:])
    _assert_nothing_left(llm)
    tight = cache_budget_bytes(hybrid, torch.float32, BLOCK, 20, 8, state_snapshots=4)
    llm = _engine(hybrid, kv_cache_bytes=tight, max_num_batched_tokens=16)
    got = llm.generate(prompts * 2, params, use_tqdm=False)
    assert completions(got) == completions(want * 2) and llm.num_preemptions > 0
    _assert_nothing_left(llm)


def _system_prompt_runs(model, system: int, tails: tuple[int, ...], block: int, kept: int = 4, **engine) -> None:
    """Prompts behind one system prompt of `system` tokens, the first two sent once more, over
    `kept` (>= 3) kept states: the system prompt runs once and each repeated prompt once up to its
    share point (a state no waiting prompt shares never displaces one that some do), and every
    logprob equals prefix sharing off and the recompute, bitwise."""
    r, device = _tokens(6), next(model.parameters()).device
    common = r(system)
    prompts = [common + r(n) for n in tails]
    prompts += prompts[:2]
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seed=s) for s in range(len(prompts))]
    runs = []
    for states in (0, kept):
        llm = LLM(model, block_size=block, max_num_seqs=8, enable_prefix_sharing=bool(states), prefix_states=states,
                  **({"device": device} if device.type == "cpu" else {}), **engine)
        counts = count_prompt_tokens(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs.append(completions(outs))
        if states:
            repeated = sum((len(p) - 1) // block * block for p in prompts[:2])
            assert counts["prompt"] == sum(map(len, prompts)) - (len(tails) - 1) * system - repeated, counts
        for prompt, out in zip(prompts, outs):
            tokens = torch.tensor([prompt + out.outputs[0].token_ids], device=device)
            want = model.token_logprobs(tokens)[0, len(prompt):].cpu()
            assert torch.equal(torch.tensor(out.outputs[0].logprobs), want), (len(prompt))
    assert runs[0] == runs[1]


@pytest.mark.parametrize("kept", [3, 8])
def test_a_system_prompt_is_computed_once_over_few_kept_states(hybrid, kept):
    _system_prompt_runs(hybrid, 20, (7, 9, 1, 15, 3, 6), BLOCK, kept, max_num_batched_tokens=10, kv_cache_bytes=1 << 22)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton GDN kernels, CUDA graphs)")
@pytest.mark.parametrize("name", HYBRIDS)
def test_gpu_a_system_prompt_is_computed_once_under_cuda_graphs(name):
    """On the GPU (Triton kernels, bf16, pages of 16, decode and mixed-step CUDA graphs, async
    steps): `_system_prompt_runs` with a system prompt of 208 tokens and six prompts behind it."""
    arch = get(name)
    model = build_model(arch, arch.tiny_config(linear_chunk_size=None, head_dim=64), torch.device("cuda"), torch.bfloat16)
    _system_prompt_runs(model, 208, (40, 90, 7, 150, 33, 61), 16, max_num_batched_tokens=96, kv_cache_bytes=1 << 26)
