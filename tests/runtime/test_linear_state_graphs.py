"""Graph-shaped gated-DeltaNet steps on the CPU reference kernels (`kernels.gated_delta_step`,
`runtime.linear_state_cache.LinearStepBuffers`, `runtime.cuda_graphs`): plans at a bucket's
capacity in fixed buffers, padding rows and sequences, the warm-up's dry run, and the engine's step
graphs run as calls on their static buffers, all bitwise the training forward. The captures
themselves are CUDA only (`gpu` tests here and in test_linear_state_cache.py)."""

import numpy as np
import pytest
import torch

from vexact_models.kernels.gated_delta_step import dry_run, plan_sizes, plan_step
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStep, LinearStepBuffers

from .llm_support import graph_shaped
from .test_linear_state_cache import sequences, spec, split, training

CPU = torch.device("cpu")


def test_plan_of_a_step():
    """Pool of 4 slots: a decode token, a piece starting mid-sequence, a prefill from 0; at capacity
    64 tokens, 5 sequences (padding entries: no rows, no state read or written)."""
    pool = 4
    plan = plan_step([2, 0, 3], [31, 5, 0], [1, 40, 16], pool, 64, 5)
    assert plan["slot"].tolist() == [2, 0, 3, -1, -1] and plan["context"].tolist() == [31, 5, 0, 0, 0]
    # first row, rows, the state read (position 0: zeros), the state written
    assert plan["segment"].tolist() == [[0, 1, 41, 0, 0], [1, 40, 16, 0, 0], [2, 0, -1, -1, -1], [2, 0, 3, -1, -1]]
    assert {k: (a.dtype, a.shape) for k, a in plan.items()} == plan_sizes(64, 5)
    dry = dry_run(plan, pool)  # reads alike, writes only the padding state, no conv state
    assert (dry["slot"] == -1).all() and np.array_equal(dry["segment"][:3], plan["segment"][:3])
    assert dry["segment"][3].tolist() == [pool, pool, pool, -1, -1]


@pytest.mark.parametrize("seed", range(10))
def test_any_step_fits_its_capacity(seed):
    """Random steps: one entry per sequence, the rows back to back, padding entries without work."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 9))
    counts = rng.integers(1, 200, n) if seed % 2 else rng.integers(1, 3, n)
    starts = rng.integers(0, 300, n)
    slots = rng.permutation(12)[:n]
    plan = plan_step(slots, starts, counts, 12, int(counts.sum()) + 3, n + 2)
    first, rows, src, dst = plan["segment"]
    assert first[:n].tolist() == np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist() and rows[:n].tolist() == counts.tolist()
    assert src[:n].tolist() == np.where(starts == 0, -1, slots).tolist() and dst[:n].tolist() == slots.tolist()
    assert (rows[n:] == 0).all() and (src[n:] == -1).all() and (dst[n:] == -1).all()


def test_plan_errors_name_the_limit_and_write_nothing():
    with pytest.raises(ValueError, match=r"2 sequences of \[3, 2\] tokens do not fit a step of 2 sequences and 4"):
        plan_step([0, 1], [0, 0], [3, 2], 2, 4, 2)
    with pytest.raises(ValueError, match=r"do not fit a step of 1 sequences"):
        plan_step([0, 1], [0, 0], [1, 1], 2, 4, 1)
    cache = LinearStateCache(spec(), slots=2, device=CPU, dtype=torch.float32)
    buffers = LinearStepBuffers(cache, 8, 2, CPU)
    buffers.fill([1], [3], [2], 4, 2)
    before = buffers.buffer.clone()
    with pytest.raises(ValueError, match=r"slots \[1, 1\] must be distinct"):
        buffers.fill([1, 1], [0, 0], [1, 1], 4, 2)
    assert torch.equal(buffers.buffer, before)


def test_graph_shaped_steps_equal_training_bitwise():
    """Three sequences in slots 4, 0, 2 of one cache: prefill pieces of 7 to 40 tokens and decode
    tokens, sequences pausing while others run; every step through fixed buffers at a larger bucket (padding tokens
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


def test_engine_graph_shaped_steps_equal_training(hybrid):
    """Requests past the slots (admissions beside decodes), prompts of 13-45 tokens in pieces of
    24 (pausing mid-prompt while others run), stop tokens
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
