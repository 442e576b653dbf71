"""Graph-shaped gated-DeltaNet steps on the CPU reference kernels (`kernels.gated_delta_step`,
`runtime.linear_state_cache.LinearStepBuffers`, `runtime.cuda_graphs`): plans at a bucket's
capacity in fixed buffers, padding rows and sequences, the warm-up's dry run, and the engine's step
graphs run as calls on their static buffers, all bitwise the training forward. The captures
themselves are CUDA only (`gpu` tests here and in test_linear_state_cache.py)."""

import numpy as np
import pytest
import torch

from vexact_models.conformance.models import build_model
from vexact_models.kernels.gated_delta_step import dry_run, plan_sizes, plan_step, scratch_states
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStep, LinearStepBuffers

from .llm_support import CalledGraphs
from .test_linear_state_cache import sequences, spec, split, training

CPU = torch.device("cpu")


def test_plan_of_a_step_across_chunks():
    """Chunk 16, pool of 4 slots: a decode token completing its chunk, a piece starting mid-chunk
    that crosses two boundaries, a prefill from 0 ending on a boundary; at capacity 64 tokens, 5
    sequences (padding entries: no rows, runs of length 0, copies to the padding state)."""
    c, pool = 16, 4
    plan = plan_step([2, 0, 3], [31, 5, 0], [1, 40, 16], c, pool, 64, 5)
    assert plan["slot"].tolist() == [2, 0, 3, -1, -1] and plan["context"].tolist() == [31, 5, 0, 0, 0]
    # the decode token: row 15 of slot 2's chunk, from its state; no row of T kept (complete)
    assert plan["decode"].tolist() == [[32, 0, 0, 0, 0], [15, -1, -1, -1, -1], [0, 0, 0, 0, 0], [2, -1, -1, -1, -1],
                                       [-1, -1, -1, -1, -1]]
    # rows0: chunk 0 of the others from their slot's rows, from its pool state (position 0: zeros);
    # the decode's entry has no rows wanted; no chunk 0 stays incomplete, so no row of T is kept
    assert plan["rows0"].tolist() == [[32, 0, 48, 0, 0], [15, 16, 16, 0, 0], [15, 5, 0, 0, 0], [0, 1, 41, 0, 0],
                                      [2, -1, -1, -1, -1], [-1, -1, -1, -1, -1]]
    # fold0: every chunk 0 that completes, the decode's (from slot 2's state into it) too
    assert plan["fold0"].tolist() == [[32, 0, 48, 0, 0], [16, 16, 16, 0, 0], [2, -1, -1, -1, -1], [2, 0, 3, 0, 0]]
    # sequence 1 (lead 5, 40 tokens): chunk 1 from its step row 1 + 11 = 12, chunk 2 (13 rows) from 28
    assert plan["rows1"].tolist() == [[0, 12, 0, 0, 0], [0, 16, 0, 0, 0], [0, 0, 0, 0, 0], [0, 12, 0, 0, 0],
                                      [-1, 0, -1, -1, -1], [-1, -1, -1, -1, -1]]
    assert plan["fold1"].tolist() == [[0, 12, 0, 0, 0], [0, 16, 0, 0, 0], [-1, 0, -1, -1, -1], [0, 0, 0, 0, 0]]
    # chunk 2 stays incomplete (13 rows): its rows of T go to slot 0's
    assert plan["rows2"][:, :1].tolist() == [[28], [13], [0], [28], [0], [0]] and (plan["rows2"][4:, 1:] == -1).all()
    assert plan["copy"][:, :1].tolist() == [[0], [0]] and (plan["copy"][1, 1:] == pool).all()
    trash = pool * c
    store, keep = plan["store"], plan["keep"]
    assert store[0] == 2 * c + 15 and store[1:12].tolist() == list(range(5, 16)) and (store[12:41] == trash).all()
    assert store[41:57].tolist() == list(range(3 * c, 4 * c)) and (store[57:] == trash).all()
    assert (keep[:28] == trash).all() and keep[28:41].tolist() == list(range(13)) and (keep[41:] == trash).all()
    assert {k: (a.dtype, a.shape) for k, a in plan.items()} == plan_sizes(64, 5, c)
    dry = dry_run(plan, c, pool)  # reads alike, writes only the padding row and state, keeps no row of T
    assert (dry["slot"] == -1).all() and (dry["fold0"][3] == pool).all() and (dry["store"] == trash).all()
    assert (dry["keep"] == trash).all() and (dry["copy"][1] == pool).all()
    assert (dry["decode"][4] == -1).all()
    assert np.array_equal(dry["decode"][:4], plan["decode"][:4]) and np.array_equal(dry["fold1"], plan["fold1"])
    for name in ("rows0", "rows1", "rows2"):
        assert np.array_equal(dry[name][:5], plan[name][:5]) and (dry[name][5] == -1).all()


@pytest.mark.parametrize("seed", range(20))
def test_any_step_fits_its_capacity(seed):
    """Random steps fill at most the capacity's entries, however their tokens split into chunks."""
    rng = np.random.default_rng(seed)
    c = int(rng.choice([16, 64]))
    n = int(rng.integers(1, 9))
    counts = rng.integers(1, 4 * c, n) if seed % 2 else rng.integers(1, 3, n)
    starts = rng.integers(0, 5 * c, n)
    tokens = int(counts.sum())
    plan = plan_step(rng.permutation(12)[:n], starts, counts, c, 12, tokens, n)
    total = starts % c + counts
    assert (plan["rows2"][1] > 0).sum() == np.maximum(-(-total // c) - 2, 0).sum() <= scratch_states(tokens, c)
    assert (plan["copy"][1] < 12).sum() == (total // c >= 2).sum()
    assert plan["fold1"][1].sum() // c == np.maximum(total // c - 1, 0).sum() <= scratch_states(tokens, c)


def test_plan_errors_name_the_limit_and_write_nothing():
    with pytest.raises(ValueError, match=r"2 sequences of \[3, 2\] tokens do not fit a step of 2 sequences and 4"):
        plan_step([0, 1], [0, 0], [3, 2], 16, 2, 4, 2)
    with pytest.raises(ValueError, match=r"do not fit a step of 1 sequences"):
        plan_step([0, 1], [0, 0], [1, 1], 16, 2, 4, 1)
    cache = LinearStateCache(spec(), slots=2, device=CPU, dtype=torch.float32)
    buffers = LinearStepBuffers(cache, 8, 2, CPU)
    buffers.fill([1], [3], [2], 4, 2)
    before = buffers.buffer.clone()
    with pytest.raises(ValueError, match=r"slots \[1, 1\] must be distinct"):
        buffers.fill([1, 1], [0, 0], [1, 1], 4, 2)
    assert torch.equal(buffers.buffer, before)


def test_graph_shaped_steps_equal_training_bitwise():
    """Three sequences in slots 4, 0, 2 of one cache: prefill pieces on and off chunk boundaries,
    one of 40 tokens (three chunks, the scratch's folds) and decode tokens, sequences pausing
    mid-chunk while others run; every step through fixed buffers at a larger bucket (padding tokens
    hold NaN, padding sequences), its dry run first (as a capture's warm-up): bitwise the training
    forward, conv and delta rule."""
    lengths = [73, 40, 21]
    pieces = [[7, 9, 40, 1, 1, 15], [16, 16, 1, 0, 1, 6], [20, 0, 0, 1]]
    slots = [4, 0, 2]
    x, weight, g, beta = sequences(lengths)
    want_conv, want = training(x, weight, g, beta, lengths)
    cache = LinearStateCache(spec(), slots=5, device=CPU, dtype=torch.float32)
    buffers = LinearStepBuffers(cache, 64, 4, CPU)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    done = [0, 0, 0]
    got_conv, got = torch.zeros_like(want_conv), torch.zeros_like(want)
    for step in range(6):
        order = [s for s in range(3) if step < len(pieces[s]) and pieces[s][step]][::-1 if step % 2 else 1]
        counts = [pieces[s][step] for s in order]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(order, counts)])
        t, max_q = len(rows), max(counts)
        bucket_tokens, bucket_seqs, bucket_q = t + 5, len(order) + 1, 1 << (max_q - 1).bit_length()
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts), [t]]), dtype=torch.int32)  # + an empty sequence
        buffers.fill([slots[s] for s in order], [done[s] for s in order], counts, bucket_tokens, bucket_seqs)
        plan = LinearStep.from_arrays(cache, buffers.views(bucket_tokens, bucket_seqs), cu, bucket_q)
        xs = torch.cat([x[rows], torch.full((5, x.shape[1]), float("nan"))])
        gs, bs = (torch.cat([a[rows], torch.full((5, a.shape[1]), float("nan"))]) for a in (g, beta))
        for stage in (buffers.dry_run, buffers.restage):
            stage()
            for layer in (0, 2):
                conv = plan.conv(layer, xs, weight, None, "silu")
                out = plan.delta_rule(layer, *split(conv), gs, bs)
        got_conv[rows], got[rows] = conv[:t], out[:t]
        for s, m in zip(order, counts):
            done[s] += m
    assert done == lengths
    assert torch.equal(got_conv, want_conv) and torch.equal(got, want)


def graph_shaped(llm: LLM) -> CalledGraphs:
    """Give `llm`'s runner `CalledGraphs` of its decode and mixed steps (as `ModelRunner` makes on CUDA)."""
    runner = llm.runner
    graphs = CalledGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_blocks_per_seq,
                          llm.engine_config.max_num_seqs, CPU, max_tokens=llm.engine_config.max_num_batched_tokens,
                          linear_states=runner.linear_states)
    runner.graphs = graphs
    llm._remember_graphs(llm.backend)  # (else generate recaptures: the runner's own, none on the CPU)
    return graphs


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def hybrid(request):
    arch = get(request.param)
    return build_model(arch, arch.tiny_config(), CPU, torch.float32)


def test_engine_graph_shaped_steps_equal_training(hybrid):
    """Requests past the slots (admissions beside decodes), prompts of 13-45 tokens in pieces of
    24 (chunk 16: crossing boundaries mid-piece, pausing mid-chunk while others run), stop tokens
    and lengths ending sequences at different steps, a preemption by recompute, one step at a time
    and ahead: every step through the step graphs' buffers (decode and mixed buckets), the
    rollout's logprobs token_logprobs' bitwise (the eager steps': test_linear_state_cache.py)."""
    from vexact_models.runtime.llm_setup import cache_budget_bytes

    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (13, 45, 30)]
    params = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True, seed=5 + i, stop_token_ids=[7, 11])
              for i, m in enumerate((12, 5, 9))]
    engines = [dict(kv_cache_bytes=cache_budget_bytes(hybrid, torch.float32, 4, 16, 2))]
    if hybrid.config.model_type == "qwen3_5_text":  # (the layers' step code is one for the three)
        engines.append(dict(async_scheduling=False))
    for engine in engines:
        llm = LLM(hybrid, device="cpu", block_size=4, max_num_seqs=2, max_num_batched_tokens=24,
                  **{"kv_cache_bytes": 1 << 22, **engine})
        graphs = graph_shaped(llm)
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert graphs.num_mixed > 0 and graphs.mixed_replays > graphs.num_mixed
        assert "kv_cache_bytes" not in engine or llm.num_preemptions > 0
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            want = hybrid.token_logprobs(torch.tensor([prompt + tokens]))[0, len(prompt):]
            assert torch.equal(torch.tensor(out.outputs[0].logprobs), want)
