"""CUDA graphs of steps with prompt chunks (`runtime.cuda_graphs`): replayed, captured on first
use, capped, and bitwise the eager steps and the training recompute. CUDA only; the host side
(buffers, buckets) is tested on CPU in test_step_inputs.py."""

import pytest
import torch

import vexact_models.qwen3 as qwen3
import vexact_models.qwen3_moe as qwen3_moe
from vexact_models.runtime import LLM, SamplingParams

from .llm_support import gen, prompts_for, result

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")]

# sampled and greedy rows; several lengths, so sequences finish and free slots at different steps
PARAMS = [SamplingParams(temperature=0.8, max_tokens=9, seed=3, ignore_eos=True),
          SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.9, max_tokens=13, seed=4, ignore_eos=True)]


def tiny_model(arch: str):
    """A head dim the Triton attention takes (64), bf16 on the GPU."""
    torch.manual_seed(0)
    dims = dict(initializer_range=0.5, hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    module = dict(qwen3=(qwen3, "Qwen3ForCausalLM"), qwen3_moe=(qwen3_moe, "Qwen3MoeForCausalLM"))[arch]
    return getattr(module[0], module[1])(module[0].tiny_config(**dims)).to("cuda", torch.bfloat16).eval()


def workload():
    """More requests than slots (admissions beside decodes), and prompts longer than the token
    budget (non-final chunks, whose rows do not sample)."""
    prompts = prompts_for(9, seed=11, lo=3, hi=30) + prompts_for(2, seed=12, lo=70, hi=90)
    return prompts, [PARAMS[i % len(PARAMS)] for i in range(len(prompts))]


def run(model, **engine):
    llm = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24, **engine)
    prompts, params = workload()
    return [result(o) for o in gen(llm, prompts, params)], llm


def test_fewer_graph_sizes_pad_steps_to_the_next_with_the_eager_bits():
    """``cuda_graph_sizes=[2]`` with 4 slots: graphs of 2 and 4 sequences only (decode steps of 3
    padded to 4, of 1 to 2; mixed steps the same), every result the eager engine's."""
    model = tiny_model("qwen3")
    want, _ = run(model, enforce_eager=True)
    got, llm = run(model, cuda_graph_sizes=[2])
    assert got == want and llm.runner.graphs.buckets == [2, 4]
    assert {seqs for _, seqs, _ in llm.runner.graphs.graphs} <= {2, 4}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_steps_with_prompt_chunks_replay_graphs_with_the_eager_bits(arch):
    model = tiny_model(arch)
    want, eager = run(model, enforce_eager=True)
    assert eager.runner.graphs is None
    got, llm = run(model)
    graphs = llm.runner.graphs
    assert graphs.num_mixed > 0 and graphs.mixed_replays > graphs.num_mixed  # captured once, replayed again
    assert any(max_q > 1 for _, _, max_q in graphs.graphs)
    assert got == want
    decode_only, off = run(model, cuda_graph_max_tokens=0)
    assert off.runner.graphs.num_mixed == off.runner.graphs.mixed_replays == 0
    assert decode_only == want
    captured, replays = graphs.num_mixed, graphs.mixed_replays
    again = [result(o) for o in gen(llm, *workload())]  # the same steps: their buckets are captured now
    assert again == want and graphs.num_mixed == captured and graphs.mixed_replays == 2 * replays
    prompts, params = workload()
    for prompt, sp, completions in zip(prompts, params, want):
        for tokens, logprobs, _ in completions:
            with torch.no_grad():
                lp = model.token_logprobs(torch.tensor([prompt + tokens], device="cuda"),
                                          temperature=sp.temperature if sp.temperature > 0 else 1.0)
            assert torch.equal(lp[0, len(prompt):].cpu(), torch.tensor(logprobs))


def test_mixed_buckets_past_the_cap_and_the_limit_run_eagerly(monkeypatch):
    """Steps of more tokens than ``cuda_graph_max_tokens``, and new buckets once `MAX_MIXED_GRAPHS`
    are captured, run eagerly, with the same results; the graphs count them (``eager_steps``)."""
    import vexact_models.runtime.cuda_graphs as cuda_graphs

    model = tiny_model("qwen3")
    want, _ = run(model, enforce_eager=True)
    got, capped = run(model, cuda_graph_max_tokens=16)
    assert got == want
    assert capped.runner.graphs.num_mixed > 0 and all(b[0] <= 16 for b in capped.runner.graphs.graphs)
    assert capped.runner.graphs.eager_steps > 0  # (counted: the prompts' steps past 16 tokens)
    _, uncapped = run(model)
    monkeypatch.setattr(cuda_graphs, "MAX_MIXED_GRAPHS", 1)
    got, limited = run(model)
    assert got == want and limited.runner.graphs.num_mixed == 1 and limited.runner.graphs.mixed_replays >= 1
    assert limited.runner.graphs.eager_steps > uncapped.runner.graphs.eager_steps  # (new buckets past the cap)


def test_next_turns_share_the_last_calls_pages_under_graphs_and_async_steps():
    """An engine owning its weights keeps the pages a call published (`LLM._keep_prefix_cache`):
    the next turns (each prompt extended by its output and new tokens), under CUDA graphs and
    async scheduling, take them and give the bits of an engine that starts afresh."""
    model = tiny_model("qwen3")
    prompts, params = workload()
    owned = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24,
                owns_weights=True)
    first = gen(owned, prompts, params)
    turns = [p + o.outputs[0].token_ids + [5, 6, 7] for p, o in zip(prompts, first)]
    hits = owned.block_manager.num_shared_hits
    got = [result(o) for o in gen(owned, turns, params)]
    assert owned.block_manager.num_shared_hits > hits
    fresh = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    gen(fresh, prompts, params)
    hits = fresh.block_manager.num_shared_hits
    assert got == [result(o) for o in gen(fresh, turns, params)] and fresh.block_manager.num_shared_hits == hits


@pytest.mark.parametrize("k", [3, 64])
def test_alternatives_under_graphs_and_async_steps_are_the_training_forwards(k):
    """``SamplingParams(logprobs=k)`` (`runtime.top_logprobs`) with CUDA graphs and async steps:
    the alternatives are read from each replay's logits before the next step's replay writes them,
    the dicts equal the eager engine's, and every entry is the training forward's logprob of
    its token at its position (the Triton gather of several targets a row); k = 64 above the
    default ``max_logprobs``, on engines built for it."""
    from dataclasses import replace

    model = tiny_model("qwen3")
    prompts, params = workload()
    params = [replace(p, logprobs=k) for p in params]
    engine = dict(block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24,
                  max_logprobs=max(k, 20))
    eager = gen(LLM(model, enforce_eager=True, async_scheduling=False, **engine), prompts, params)
    llm = LLM(model, **engine)
    got = gen(llm, prompts, params)
    assert llm.runner.graphs.mixed_replays > 0
    assert [[(c.token_ids, c.logprobs) for c in o.outputs] for o in got] == \
        [[(c.token_ids, c.logprobs) for c in o.outputs] for o in eager]
    for prompt, sp, out in zip(prompts, params, got):
        c = out.outputs[0]
        t = sp.temperature if sp.temperature > 0 else 1.0
        for i, entry in enumerate(c.logprobs[:4]):
            alts = list(entry)
            rows = torch.tensor([prompt + c.token_ids[:i] + [a] for a in alts], device="cuda")
            with torch.no_grad():
                lp = model.token_logprobs(rows, temperature=t)[:, -1].cpu()
            assert torch.equal(lp, torch.tensor([entry[a].logprob for a in alts]))


def test_min_p_penalties_and_prompt_scores_under_graphs_and_async_steps_are_the_eager_engines():
    """min-p (`kernels.sampling.filter_thresholds` on CUDA), allowed tokens and logit biases
    (`runtime.logit_bias`), repetition/frequency/presence penalties (the device counts, added to
    by steps launched ahead of the host: `runtime.penalties`)
    and prompt scores (`prompt_logprobs`, steps run eagerly) under CUDA graphs and async steps give
    the eager synchronous engine's tokens, and the logprobs stay the training forward's."""
    from dataclasses import replace

    model = tiny_model("qwen3")
    prompts, params = workload()
    options = [dict(min_p=0.05), dict(repetition_penalty=1.5, presence_penalty=0.5), dict(frequency_penalty=1.0),
               dict(allowed_token_ids=list(range(2, 200)), logit_bias={9: 1.5})]
    sampling = [replace(p, **options[i % 4]) for i, p in enumerate(params)]
    scoring = [replace(p, prompt_logprobs=2, repetition_penalty=1.3) for p in params]
    eager = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24,
                enforce_eager=True, async_scheduling=False)
    llm = LLM(model, block_size=16, max_num_seqs=4, max_num_batched_tokens=48, kv_cache_bytes=1 << 24)
    for batch in (sampling, scoring):
        want, got = gen(eager, prompts, batch), gen(llm, prompts, batch)
        assert [result(o) for o in got] == [result(o) for o in want]
        assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in want]
        for prompt, sp, out in zip(prompts, batch, got):
            tokens, logprobs, _ = result(out)[0]
            with torch.no_grad():
                lp = model.token_logprobs(torch.tensor([prompt + tokens], device="cuda"),
                                          temperature=sp.temperature if sp.temperature > 0 else 1.0)[0].cpu()
            assert torch.equal(lp[len(prompt):], torch.tensor(logprobs))
            if sp.prompt_logprobs is not None:
                assert torch.equal(lp[1:len(prompt)],
                                   torch.tensor([e[t].logprob for e, t in zip(out.prompt_logprobs[1:], prompt[1:])]))
    assert llm.runner.graphs.mixed_replays > 0
    plain = gen(llm, prompts, params)
    assert sum(result(a)[0][0] != result(b)[0][0] for a, b in zip(plain, gen(llm, prompts, sampling))) >= 3
