"""The gated-DeltaNet state cache of the rollout engine (`runtime.linear_state_cache`): its steps
equal the training forward bitwise in prefill pieces of any length and decode, in any slots and batch; the
engine counts it in the memory budget and holds KV pages only for attention layers (a pipeline
stage: the states of its own GDN layers only). The graph-shaped steps (fixed buffers, padded plans)
are tests/runtime/test_linear_state_graphs.py.

The conformance suite (tests/conformance/test_conformance.py) runs every engine scenario on the
three hybrids' tiny configs; the engine test here is a quick check of prefill pieces and decode,
with a preemption."""

import numpy as np
import pytest
import torch

from vexact_models.conformance.models import build_model
from vexact_models.kernels import causal_conv1d, gated_delta_rule
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStateSpec, LinearStep, linear_state_spec
from vexact_models.runtime.llm_setup import cache_budget_bytes, cache_bytes_per_block, linear_state_bytes
from vexact_models.runtime.model_runner import check_linear_state_support

HK, HV, DK, DV, K = 1, 2, 16, 16, 4


def spec() -> LinearStateSpec:
    return LinearStateSpec((0, 2), (HK, HV), (DK, DV), 2 * HK * DK + HV * DV, K)


def sequences(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    x = torch.randn(t, spec().conv_channels, generator=gen)
    weight = torch.randn(spec().conv_channels, K, generator=gen) * 0.5
    g = -torch.rand(t, HV, generator=gen) * 0.6 - 0.01
    beta = torch.rand(t, HV, generator=gen) * 0.9 + 0.05
    return x, weight, g, beta


def training(x, weight, g, beta, lengths):
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    conv = causal_conv1d(x, weight, None, cu, max(lengths), "silu")
    q, k, v = split(conv)
    out, _ = gated_delta_rule(q, k, v, g, beta, cu.tolist())
    return conv, out


def split(conv):
    q, k, v = conv.split([HK * DK, HK * DK, HV * DV], dim=-1)
    t = conv.shape[0]
    return q.reshape(t, HK, DK), k.reshape(t, HK, DK), v.reshape(t, HV, DV)


def test_steps_equal_training_bitwise_in_pieces():
    """Three sequences in slots 4, 0, 2 of one cache, prefill pieces of several lengths and decode
    tokens, in a varying order; both GDN layers of the spec."""
    lengths = [53, 40, 21]
    pieces = [[7, 9, 16, 1, 1, 19], [16, 16, 1, 1, 1, 5], [20, 1]]
    slots = [4, 0, 2]
    x, weight, g, beta = sequences(lengths)
    want_conv, want = training(x, weight, g, beta, lengths)
    cache = LinearStateCache(spec(), slots=5, device=torch.device("cpu"), dtype=torch.float32)
    for t in (*cache.conv.values(), *cache.states.values()):
        t.fill_(float("nan"))  # stale contents are never read: a sequence at position 0 starts from zeros
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    done = [0, 0, 0]
    got_conv, got = torch.zeros_like(want_conv), torch.zeros_like(want)
    for step in range(max(len(p) for p in pieces)):
        order = [s for s in range(3) if step < len(pieces[s])][::-1 if step % 2 else 1]
        counts = [pieces[s][step] for s in order]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(order, counts)])
        cu = torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32)
        plan = LinearStep(cache, np.array([slots[s] for s in order]), np.array([done[s] for s in order]),
                          np.array(counts), cu, max(counts))
        for layer in (0, 2):
            conv = plan.conv(layer, x[rows], weight, None, "silu")
            out = plan.delta_rule(layer, *split(conv), g[rows], beta[rows])
        got_conv[rows], got[rows] = conv, out
        for s, m in zip(order, counts):
            done[s] += m
    assert done == lengths
    assert torch.equal(got_conv, want_conv) and torch.equal(got, want)


def test_step_rejects_bad_slots():
    cache = LinearStateCache(spec(), slots=2, device=torch.device("cpu"), dtype=torch.float32)
    cu = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"plan_step: slots \[0, 2\] must lie in \[0, 2\)"):
        LinearStep(cache, np.array([0, 2]), np.array([0, 0]), np.array([1, 1]), cu, 1)
    with pytest.raises(ValueError, match=r"slots \[1, 1\] must be distinct"):
        LinearStep(cache, np.array([1, 1]), np.array([0, 0]), np.array([1, 1]), cu, 1)
    with pytest.raises(ValueError, match="slots=0 must be >= 1"):
        LinearStateCache(spec(), slots=0, device=torch.device("cpu"), dtype=torch.float32)


def test_cache_bytes_count_every_tensor():
    """Per slot its conv state and fp32 state; per layer one padding state."""
    for slots in (1, 3):
        cache = LinearStateCache(spec(), slots=slots, device=torch.device("cpu"), dtype=torch.bfloat16)
        tensors = [*cache.conv.values(), *cache.states.values()]
        assert sum(t.numel() * t.element_size() for t in tensors) == spec().cache_bytes(slots, torch.bfloat16)
    assert spec().part_bytes(torch.bfloat16) == (3 * spec().conv_channels * 2, HV * DK * DV * 4)
    assert spec().bytes_per_slot(torch.bfloat16) == 2 * (3 * spec().conv_channels * 2 + HV * DK * DV * 4)
    assert spec().cache_bytes(3, torch.bfloat16) == 3 * spec().bytes_per_slot(torch.bfloat16) + 2 * HV * DK * DV * 4


@pytest.fixture(scope="module")
def qwen3_5():
    arch = get("qwen3_5")
    return build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)


def test_spec_of_the_model_and_the_budget(qwen3_5):
    found = linear_state_spec(qwen3_5)
    assert found == LinearStateSpec((0, 2), (2, 4), (16, 16), 2 * 32 + 64, 4)
    assert linear_state_spec(torch.nn.Linear(2, 2)) is None
    per_block = cache_bytes_per_block(qwen3_5, torch.float32, 4)
    assert per_block == 4 * 2 * 32 * 2 * 4  # one attention layer: 4 positions x 2 KV heads x (32 + 32) x fp32
    budget = cache_budget_bytes(qwen3_5, torch.float32, 4, 40, 6)
    assert budget == 40 * per_block + found.cache_bytes(6, torch.float32) == 40 * per_block + \
        linear_state_bytes(qwen3_5, torch.float32, 6)
    llm = LLM(qwen3_5, device="cpu", block_size=4, max_num_seqs=6, kv_cache_bytes=budget + per_block - 1)
    assert llm.engine_config.num_blocks == 40  # the states' bytes come off the pages
    assert llm.runner.kv_caches[0] is None and llm.runner.kv_caches[2] is None and llm.runner.kv_caches[1] is not None
    assert llm.runner.linear_states.slots == 6 and not llm.block_manager.enable_prefix_sharing
    assert llm.scheduler.share_prompt_state  # the n samples of a prompt share it (test_prompt_state_sharing.py)
    with pytest.raises(ValueError, match=r"after the gated-DeltaNet states of 6 sequences.*lower max_num_seqs"):
        LLM(qwen3_5, device="cpu", block_size=4, max_num_seqs=6, kv_cache_bytes=budget - 40 * per_block)


def test_the_hybrids_miss_no_engine_feature(qwen3_5):
    for name in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):
        arch = get(name)
        assert arch.rollout_feature_missing("cuda_graphs") is None  # captured (runtime.cuda_graphs)
        assert arch.rollout_feature_missing("pipeline_parallel") is None  # stages hold their own layers' states
    assert get("qwen3").rollout_feature_missing("cuda_graphs") is None
    with pytest.raises(ValueError, match=r"feature='lora' is not one of \('cuda_graphs', 'pipeline_parallel'\)"):
        get("qwen3").rollout_feature_missing("lora")


def test_a_cache_without_state_slots_is_refused():
    check_linear_state_support(None, 0)  # no GDN layers: nothing to refuse
    check_linear_state_support(spec(), 4)
    with pytest.raises(ValueError, match="state_slots=0 must be >= 1"):
        check_linear_state_support(spec(), 0)


def test_a_stage_holds_the_states_of_its_own_layers(qwen3_5):
    """`linear_state_spec` of a pipeline stage's layers: its GDN layers only (None without any);
    the stage's runner allocates those and KV pages for its attention layers."""
    from vexact_models.runtime.model_runner import ModelRunner
    from vexact_models.runtime.pipeline import PipelineStage, StageModel

    assert linear_state_spec(qwen3_5, range(1, 3)).layers == (2,) and linear_state_spec(qwen3_5, range(1, 2)) is None
    model = get("qwen3_5").inference_class(qwen3_5)
    runner = ModelRunner(StageModel(model, PipelineStage(1, 2, range(1, 3), 3)), 8, 4, torch.device("cpu"),
                         torch.float32, max_model_len=32, layers=range(1, 3), carry_width=64, state_slots=3)
    assert list(runner.linear_states.conv) == [2] and runner.linear_states.slots == 3
    assert [i for i, kv in enumerate(runner.kv_caches) if kv is not None] == [1]


def test_engine_equals_training_in_prefill_pieces_and_decode(qwen3_5):
    """Prompts of 13 and 45 tokens in prefill pieces of 24, decode steps, a preemption by recompute
    (pages for one sequence only), one step at a time and ahead: the rollout's logprobs are
    token_logprobs' bitwise."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (13, 45)]
    params = SamplingParams(temperature=1.0, max_tokens=9, ignore_eos=True, seed=5)
    per_block = cache_bytes_per_block(qwen3_5, torch.float32, 4)
    for engine in (dict(async_scheduling=False), dict(kv_cache_bytes=cache_budget_bytes(qwen3_5, torch.float32, 4, 16, 4))):
        llm = LLM(qwen3_5, device="cpu", block_size=4, max_num_seqs=4, max_num_batched_tokens=24,
                  **{"kv_cache_bytes": 512 * per_block + linear_state_bytes(qwen3_5, torch.float32, 4), **engine})
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert "kv_cache_bytes" not in engine or llm.num_preemptions > 0
        for prompt, out in zip(prompts, outs):
            tokens = out.outputs[0].token_ids
            want = qwen3_5.token_logprobs(torch.tensor([prompt + tokens]))[0, len(prompt):]
            assert torch.equal(torch.tensor(out.outputs[0].logprobs), want)


def test_sleep_and_wake_up_reallocate_the_states(qwen3_5):
    """sleep() releases the GDN states with the KV cache, wake_up() brings both back; the same
    requests then give the same tokens and logprobs (and update_weights of the same weights)."""
    llm = LLM(qwen3_5, device="cpu", block_size=4, max_num_seqs=4, kv_cache_bytes=1 << 22, max_num_batched_tokens=16)
    prompts = [[5, 9, 11, 3] * 5, [7] * 18]
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=2)
    first = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.sleep(0)
    assert llm.runner.linear_states is None and not llm.runner.kv_caches
    llm.wake_up()
    llm.update_weights(qwen3_5.state_dict())
    again = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.runner.linear_states is not None and again == first


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton GDN kernels)")
@pytest.mark.parametrize("name", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_gpu_engine_equals_training(name):
    """On the GPU (Triton kernels), bf16: prompts of 100 and 300 tokens in prefill pieces of 48 and
    decode, eager and with CUDA graphs of the decode and mixed steps (the same tokens and logprobs;
    both token_logprobs' bitwise)."""
    arch = get(name)
    # head_dim 64: the Triton attention takes 64, 128, 192 and 256 (the tiny configs have 32)
    model = build_model(arch, arch.tiny_config(linear_chunk_size=None, head_dim=64), torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (100, 300)]
    params = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=1)
    results = []
    for eager in (True, False):
        llm = LLM(model, block_size=16, max_num_seqs=4, kv_cache_bytes=1 << 24, max_num_batched_tokens=48,
                  enforce_eager=eager)
        assert (llm.runner.graphs is None) == eager
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert eager or llm.runner.graphs.mixed_replays > 0
        results.append([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs])
    assert results[0] == results[1]
    for prompt, (tokens, logprobs) in zip(prompts, results[0]):
        want = model.token_logprobs(torch.tensor([prompt + tokens], device="cuda"))[0, len(prompt):].cpu()
        assert torch.equal(torch.tensor(logprobs), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA graphs)")
def test_gpu_graphs_are_captured_again_over_new_states_after_sleep():
    """sleep(1) frees the states and the graphs, wake_up() captures them again over the new state
    cache (its addresses): the same requests give the same tokens and logprobs; a mixed bucket past
    `MAX_MIXED_GRAPHS` runs eagerly with the same results."""
    import vexact_models.runtime.cuda_graphs as cuda_graphs

    arch = get("qwen3_5")
    model = build_model(arch, arch.tiny_config(linear_chunk_size=None, head_dim=64), torch.device("cuda"), torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (70, 9, 130)]
    params = SamplingParams(temperature=1.0, max_tokens=70, ignore_eos=True, seed=2)
    llm = LLM(model, block_size=16, max_num_seqs=2, kv_cache_bytes=1 << 24, max_num_batched_tokens=40)
    first = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    states = llm.runner.linear_states
    llm.sleep(1)
    llm.wake_up()
    assert llm.runner.linear_states is not states and llm.runner.graphs.linear_states is llm.runner.linear_states
    again = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params, use_tqdm=False)]
    assert again == first
    cuda_graphs.MAX_MIXED_GRAPHS, limit = 1, cuda_graphs.MAX_MIXED_GRAPHS
    try:
        capped = LLM(model, block_size=16, max_num_seqs=2, kv_cache_bytes=1 << 24, max_num_batched_tokens=40)
        outs = capped.generate(prompts, params, use_tqdm=False)
    finally:
        cuda_graphs.MAX_MIXED_GRAPHS = limit
    assert [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs] == first
    assert capped.runner.graphs.num_mixed == 1
