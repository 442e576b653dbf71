"""The engine side of weight sync and colocation (single process, CPU): update_weights from a
stream without materialising it, sleep levels 0/1/2 and wake_up tags, and 100 sleep/wake
cycles leaving the process's live tensor memory flat."""

import copy
import gc

import pytest
import torch

import vexact_models.qwen3 as qwen3
import vexact_models.qwen3_moe as qwen3_moe
from vexact_models.layers import _fused_weight
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block

PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
PARAMS = SamplingParams(temperature=0.9, max_tokens=5, seed=21, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


def make_llm(model, **kwargs):
    block = 4
    return LLM(model, device="cpu", block_size=block, max_num_seqs=8, max_num_batched_tokens=32,
               kv_cache_bytes=32 * kv_bytes_per_block(model.kv_cache_spec(), block, torch.float32), **kwargs)


def rollout(llm):
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def perturbed(model, scale=0.05):
    target = copy.deepcopy(model)
    with torch.no_grad():
        for p in target.parameters():
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return target


# -- update_weights from an iterator ---------------------------------------------------------------

def test_update_weights_consumes_a_stream_one_pair_at_a_time(model):
    """Each pair is copied before the next is pulled: the stream is never materialised."""
    m = copy.deepcopy(model)
    llm = make_llm(m, owns_weights=True)
    target = perturbed(model)
    engine = dict(m.named_parameters())
    pulled = []

    def stream():
        for name, tensor in target.named_parameters():
            if pulled:  # the previous pair has already been written
                prev = pulled[-1]
                assert torch.equal(engine[prev], dict(target.named_parameters())[prev])
            pulled.append(name)
            yield name, tensor.detach().clone()

    assert llm.update_weights(stream()) == len(engine)
    assert pulled == list(engine)
    assert rollout(llm) == rollout(make_llm(target))


def test_update_weights_stream_stops_at_a_bad_pair_having_written_the_ones_before(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)
    target = perturbed(model)
    names = [n for n, _ in target.named_parameters()]
    pairs = [(n, p.detach()) for n, p in target.named_parameters()]
    bad_at = 3
    pairs.insert(bad_at, ("model.layers.0.mlp.up_proj.weight", torch.zeros(7, 7)))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight has shape \(7, 7\)"):
        llm.update_weights(iter(pairs))
    engine = dict(m.named_parameters())
    source = dict(target.named_parameters())
    assert all(torch.equal(engine[n], source[n]) for n in names[:bad_at])
    assert not any(torch.equal(engine[n], source[n]) for n in names[bad_at:])


@pytest.mark.parametrize("bad, words", [
    ([("lm_head.weight", "not a tensor")], ["lm_head.weight", "str"]),
    ([("model.norm.weight",)], ["(name, tensor) pairs"]),
    ([("model.norm.weight", torch.zeros(64, dtype=torch.long))], ["model.norm.weight", "torch.int64"]),
])
def test_update_weights_rejects_malformed_pairs(model, bad, words):
    llm = make_llm(copy.deepcopy(model))
    with pytest.raises(ValueError) as info:
        llm.update_weights(iter(bad))
    assert all(w in str(info.value) for w in words), str(info.value)


def test_moe_experts_update_in_the_fused_layout():
    torch.manual_seed(0)
    m = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny_config(initializer_range=0.5)).eval()
    llm = make_llm(m)
    target = perturbed(m)
    experts = {n: p for n, p in target.named_parameters() if ".experts." in n}
    assert experts and all(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in experts)
    cfg = m.config
    assert experts["model.layers.0.mlp.experts.gate_up_proj"].shape == (
        cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)
    llm.update_weights((n, p.detach()) for n, p in target.named_parameters())
    assert rollout(llm) == rollout(make_llm(target))


# -- sleep levels ---------------------------------------------------------------------------------

def _fused_groups_intact(m) -> bool:
    groups = [g for mod in m.modules() if callable(getattr(mod, "projection_groups", None))
              for g in mod.projection_groups()]
    return bool(groups) and all(_fused_weight([lin.weight for lin in g]) is not None for g in groups)


def test_sleep_level_1_offloads_owned_weights_and_wake_up_restores_them_exactly(model):
    m = copy.deepcopy(model)
    llm = make_llm(m, owns_weights=True)
    before = rollout(llm)
    snapshot = {n: p.detach().clone() for n, p in m.named_parameters()}
    llm.sleep(level=1)
    assert all(p.numel() == 0 for p in m.parameters()) and llm.runner.kv_caches == []
    with pytest.raises(RuntimeError, match="asleep.*wake_up"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    with pytest.raises(RuntimeError, match="wake_up"):
        llm.update_weights({})
    llm.wake_up()
    assert all(torch.equal(p, snapshot[n]) for n, p in m.named_parameters())
    assert _fused_groups_intact(m)  # the q/k/v and gate/up buffers came back whole
    assert rollout(llm) == before


def test_sleep_level_2_discards_weights_until_update_weights_writes_them_all(model):
    m = copy.deepcopy(model)
    llm = make_llm(m, owns_weights=True)
    before = rollout(llm)
    llm.sleep(level=2)
    with pytest.raises(RuntimeError, match="weights are asleep"):
        llm.wake_up(tags=["kv_cache"])
    llm.wake_up(tags=["weights"])  # vLLM's order: weights, load them, then the KV cache
    llm.update_weights({"model.norm.weight": model.model.norm.weight})
    llm.wake_up(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match="not written yet"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.update_weights(model.state_dict())
    assert _fused_groups_intact(m)
    assert rollout(llm) == before


def test_sleep_level_2_after_level_1_drops_the_host_copy(model):
    llm = make_llm(copy.deepcopy(model), owns_weights=True)
    llm.sleep(level=1)
    llm.sleep(level=2)
    llm.wake_up()
    with pytest.raises(RuntimeError, match="not written yet"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def test_sleep_never_releases_weights_shared_with_a_trainer(model):
    m = copy.deepcopy(model)
    llm = make_llm(m)  # an instance: shared by default
    assert llm.owns_weights is False
    before = rollout(llm)
    ptrs = [p.data_ptr() for p in m.parameters()]
    llm.sleep(level=2)
    assert [p.data_ptr() for p in m.parameters()] == ptrs and llm.runner.kv_caches == []
    llm.wake_up()
    assert rollout(llm) == before


def test_engine_loaded_from_a_folder_owns_its_weights(model, tmp_path):
    model.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    before = rollout(llm)
    assert llm.owns_weights is True
    llm.sleep()  # vLLM's default level 1
    assert all(p.numel() == 0 for p in llm.model.causal_lm.parameters())
    llm.wake_up()
    assert rollout(llm) == before


@pytest.mark.parametrize("call, words", [
    (lambda llm: llm.sleep(level=3), ["level=3", "0, 1 or 2"]),
    (lambda llm: llm.sleep(level=True), ["level=True"]),
    (lambda llm: llm.wake_up(tags=["weights", "kv"]), ["'kv'", "kv_cache"]),
])
def test_sleep_and_wake_up_reject_bad_arguments(model, call, words):
    llm = make_llm(copy.deepcopy(model), owns_weights=True)
    with pytest.raises(ValueError) as info:
        call(llm)
    assert all(w in str(info.value) for w in words)
    assert llm.runner.kv_caches and llm._released is None  # nothing changed


def test_owns_weights_must_be_a_bool(model):
    with pytest.raises(ValueError, match="owns_weights='yes'"):
        make_llm(copy.deepcopy(model), owns_weights="yes")


# -- 100 cycles -----------------------------------------------------------------------------------

def live_tensor_bytes() -> tuple[int, int]:
    """(bytes, count) of the distinct storages of every tensor Python can reach."""
    gc.collect()
    seen = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type != "meta":
            storage = obj.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()), len(seen)


def test_100_sleep_wake_cycles_leave_live_memory_flat(model):
    """Live tensor memory (every storage Python can reach) after waking is the same after 1, 50
    and 100 cycles; asleep, level 1 holds the weights' host copy and level 2 nothing of them.
    (The GPU check of allocated/reserved CUDA memory is benchmarks/fsdp_sync.py --sleep-cycles.)"""
    m = copy.deepcopy(model)
    llm = make_llm(m, owns_weights=True)
    before = rollout(llm)
    weights = sum(p.numel() * p.element_size() for p in m.parameters())
    kv = sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in llm.runner.kv_caches)
    awake0 = live_tensor_bytes()
    awake, asleep = [], {}
    for cycle in range(100):
        level = 1 + cycle % 2
        llm.sleep(level=level)
        if cycle >= 98:  # a scan costs ~0.5 s in a pytest process: a few points only
            asleep[level] = live_tensor_bytes()[0]
        llm.wake_up()
        if level == 2:
            llm.update_weights((n, p.detach()) for n, p in model.named_parameters())
        if cycle in (0, 49, 99):
            awake.append(live_tensor_bytes())
        if cycle % 25 == 0:
            assert rollout(llm) == before
    assert awake == [awake0] * 3, (awake, awake0)
    assert asleep[1] == awake0[0] - kv  # the weights moved to host memory, the KV cache is gone
    assert asleep[2] == awake0[0] - kv - weights
    assert rollout(llm) == before
