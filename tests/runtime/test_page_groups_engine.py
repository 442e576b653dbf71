"""The engine over tiny Gemma 3, GPT-OSS and OLMo 3 checkpoints (stock transformers'
``save_pretrained``; windowed layers of 8 keys beside a full one, prompts of 30-90 tokens) with the window page group
(docs/design.md section 6, `runtime.page_groups`): tokens and logprobs bitwise those of the same
engine with one page group (every page kept) and of the training recompute, in chunked prefill,
no chunking, preemption, n=2 with prefix sharing (on and off), one step at a time and ahead, and
every step through the CUDA-graph buffers (`llm_support.CalledGraphs` on the CPU; the real graphs
in the `gpu` test); the window group's pages are released mid-sequence, its free list accounts
for every page, and a sequence holds at most `window_pages_bound` of them."""

import pytest
import torch

from vexact_models.registry import architectures
from vexact_models.runtime import LLM, SamplingParams, llm_setup
from vexact_models.runtime.model_runner import ModelRunner
from vexact_models.runtime.page_groups import PageGroups, window_pages_bound

from ..models.model_support import stock_model
from .llm_support import CalledGraphs, cache_bytes

ARCHS = {a.name: a for a in architectures() if a.name in ("gemma3", "gpt_oss", "olmo3")}
if not ARCHS:  # Architecture.min_transformers keeps them out on older releases
    pytest.skip("GPT-OSS, Gemma 3 and OLMo 3 need a newer transformers", allow_module_level=True)

BS = 4
PROMPTS = [list(range(3, 80)), list(range(100, 190)), list(range(200, 230))]
PARAMS = [SamplingParams(temperature=1.0, n=2, max_tokens=12, seed=1, ignore_eos=True),
          SamplingParams(temperature=0.8, max_tokens=10, seed=2, ignore_eos=True),
          SamplingParams(temperature=1.0, max_tokens=12, seed=3, ignore_eos=True, stop_token_ids=[7, 11])]


def save_checkpoint(name: str, path, **dims) -> tuple[str, torch.nn.Module]:
    """(checkpoint folder, the training model loaded from it) of a stock tiny model of `name`."""
    stock_model(ARCHS[name], initializer_range=0.2, **dims).save_pretrained(path)
    return str(path), ARCHS[name].causal_lm_class.from_pretrained(path).eval()


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory):
    return save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def engine(path: str, monkeypatch, groups: bool = True, device: str = "cpu", **kwargs) -> LLM:
    """An engine over `path` with pages of 4; `groups` False: one page group (the windowed layers
    keep every page, as before the window group)."""
    kwargs.setdefault("max_num_seqs", 8)
    kwargs.setdefault("max_num_batched_tokens", 64)
    kwargs.setdefault("kv_cache_bytes", 1 << 22)
    with monkeypatch.context() as patch:
        if not groups:
            patch.setattr(llm_setup, "window_layers", lambda model: None)
        llm = LLM(path, device=device, block_size=BS, **kwargs)
    assert isinstance(llm.block_manager, PageGroups) == groups
    return llm


def graph_shaped(llm: LLM) -> CalledGraphs:
    """`llm`'s steps through `CalledGraphs` (decode buckets up to max_num_seqs, mixed steps up to
    the token budget), as `ModelRunner` makes them on CUDA."""
    runner, config = llm.runner, llm.engine_config
    graphs = CalledGraphs(runner.model, runner.kv_caches, runner.block_size, runner.max_blocks_per_seq,
                          config.max_num_seqs, runner.device, max_tokens=config.max_num_batched_tokens,
                          window_group=runner.window_group)
    runner.graphs = graphs
    llm._remember_graphs(llm.backend)
    return graphs


def run(llm: LLM, chunk: int) -> tuple[list, dict]:
    """(every completion's (tokens, logprobs), what the tracker saw): after each schedule (and
    schedule ahead) the free lists account for exactly the pages the running sequences hold, in
    each group, and no sequence holds more than `window_pages_bound` window pages."""
    bm, sched = llm.block_manager, llm.scheduler
    seen = dict(held=0, held_window=0, released=0)
    schedule, schedule_ahead = sched.schedule, sched.schedule_ahead

    def tracked(pick=schedule):
        out = pick()
        held = {b for s in sched._running for b in s.block_table[s.released_blocks:]}
        assert bm.num_blocks - bm.num_free_blocks == len(held)
        seen["held"] += len(held)
        if isinstance(bm, PageGroups):
            group = bm.window_group
            views = [s.window_pages for s in sched._running]
            held = {b for v in views for b in v.block_table[v.released_blocks:]}
            assert group.num_blocks - group.num_free_blocks == len(held)
            for view in views:
                assert len(view.block_table) == len(view.seq.block_table)
                assert len(view.block_table) - view.released_blocks <= window_pages_bound(group.window, BS, chunk)
                seen["released"] = max(seen["released"], view.released_blocks)
            seen["held_window"] += len(held)
        return out

    sched.schedule, sched.schedule_ahead = tracked, lambda: tracked(schedule_ahead)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    finally:
        del sched.schedule, sched.schedule_ahead
    assert bm.num_free_blocks == bm.num_blocks
    if isinstance(bm, PageGroups):
        assert bm.window_group.num_free_blocks == bm.window_group.num_blocks
    return [[(c.token_ids, c.logprobs) for c in o.outputs] for o in outs], seen


def check_training(training, got) -> None:
    for prompt, params, completions in zip(PROMPTS, PARAMS, got):
        for tokens, logprobs in completions:
            with torch.no_grad():
                want = training.token_logprobs(torch.tensor([prompt + tokens], device=training.device),
                                               temperature=params.temperature)[0, len(prompt):]
            assert torch.equal(torch.tensor(logprobs, device=want.device), want)


SCENARIOS = {
    "chunk 7, one step at a time": dict(max_num_batched_tokens=7, async_scheduling=False),
    "budget 64": dict(),
    "no chunking, sharing off": dict(enable_chunked_prefill=False, max_num_batched_tokens=128, max_model_len=128,
                                     enable_prefix_sharing=False),
    "preempting": dict(kv_cache_bytes=40 * 3 * 1024, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_window_group_rollouts_equal_one_group_and_training_bitwise(checkpoint, monkeypatch, scenario):
    path, training = checkpoint
    kwargs = SCENARIOS[scenario]
    chunk = kwargs.get("max_num_batched_tokens", 64)
    llm = engine(path, monkeypatch, **kwargs)
    got, seen = run(llm, chunk)
    one = engine(path, monkeypatch, groups=False, **kwargs)
    want, seen_one = run(one, chunk)
    assert got == want
    check_training(training, got)
    assert seen["released"] >= 16 and seen["held_window"] < seen_one["held"]  # pages freed mid-sequence
    assert seen["held"] == seen_one["held"]  # the global group holds what one group held
    if scenario == "preempting":
        assert llm.num_preemptions > 0 and one.num_preemptions > 0
    if kwargs.get("enable_prefix_sharing", True):
        assert llm.block_manager.num_shared_hits > 0 and llm.block_manager.window_group.num_shared_hits > 0


def test_window_group_rollouts_through_the_graph_buffers(checkpoint, monkeypatch):
    """Every step padded to its CUDA-graph bucket (decode and mixed) through the static buffers,
    the window group's slots and tables among them; ahead and one step at a time."""
    path, training = checkpoint
    for kwargs in (dict(), dict(async_scheduling=False)):
        llm = engine(path, monkeypatch, max_num_batched_tokens=24, **kwargs)
        graphs = graph_shaped(llm)
        got, seen = run(llm, 24)
        assert graphs.num_mixed > 0 and graphs.mixed_replays > graphs.num_mixed and seen["released"] >= 16
        assert graphs.inputs.window_block_table is not None
        check_training(training, got)


def test_sleep_and_wake_up_keep_the_window_group(checkpoint, monkeypatch):
    """`sleep` frees both groups' caches, `wake_up` allocates them again at their own page counts,
    and the rollout after it is bitwise the one before; a pipeline stage's runner holds its own
    windowed layers' pages in a pool of the window group's size, its full layers' in the global one
    (the rollouts: tests/distributed/test_pipeline_window.py)."""
    path, _ = checkpoint
    llm = engine(path, monkeypatch, max_num_batched_tokens=32)
    group = llm.engine_config.window_group
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=4, ignore_eos=True)
    before = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    llm.sleep(0)
    assert llm.runner.kv_caches == []
    llm.wake_up()
    assert {llm.runner.kv_caches[i][0].shape[0] for i in group.layers} == {group.num_blocks}
    after = llm.generate([PROMPTS[1]], params, use_tqdm=False)[0].outputs[0]
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)
    stage = ModelRunner(llm.model, 8, BS, torch.device("cpu"), torch.float32, layers=range(0, 2), window_group=group)
    sizes = [None if kv is None else kv[0].shape[0] for kv in stage.kv_caches]
    assert sizes == [group.num_blocks if i in group.layers else 8 for i in range(2)] + [None] * (len(sizes) - 2)


def test_a_window_layer_attending_beyond_the_group_window_is_refused(checkpoint, monkeypatch):
    """The paged context names the layer whose pages the window group frees when it attends
    without a window (a model that did not declare its window as the engine read it)."""
    path, _ = checkpoint
    llm = engine(path, monkeypatch)
    layer = llm.engine_config.window_group.layers[0]
    llm.model.causal_lm.model.layers[layer].self_attn.sliding_window = None
    with pytest.raises(ValueError, match=f"layer {layer} keeps its K/V in the window group"):
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (Triton kernels, CUDA graphs)")
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_window_group_rollouts_with_cuda_graphs_equal_one_group_and_training_bitwise(name, tmp_path, monkeypatch):
    """On the GPU in bf16 (head dim 64): the engine's real CUDA graphs (decode and mixed steps),
    ahead and one step at a time, with preemption and n=2 sharing, eager steps too: bitwise the
    one-group engine and the training recompute, window pages freed mid-sequence."""
    path, training = save_checkpoint(name, tmp_path, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                     head_dim=64)
    training = training.to("cuda", torch.bfloat16)
    page = cache_bytes(training, 1)  # the three layers' K/V of a page of 4 positions
    for kwargs in (dict(), dict(async_scheduling=False), dict(kv_cache_bytes=40 * page, max_num_batched_tokens=32),
                   dict(enforce_eager=True, max_num_batched_tokens=16)):
        kwargs = dict(dtype=torch.bfloat16, device="cuda", **kwargs)
        chunk = kwargs.get("max_num_batched_tokens", 64)
        llm = engine(path, monkeypatch, **kwargs)
        assert (llm.runner.graphs is None) == ("enforce_eager" in kwargs)
        got, seen = run(llm, chunk)
        one = engine(path, monkeypatch, groups=False, **kwargs)
        want, _ = run(one, chunk)
        assert got == want and seen["released"] >= 16
        assert "kv_cache_bytes" not in kwargs or llm.num_preemptions > 0
        check_training(training, got)
