"""The KV cache fills its allocator segments (`model_runner.segment_bytes`), so that a
freed cache returns its memory to the device even when a tensor made while the engine was awake
still lives (on the H200, 2026-11-25, without it a second engine's budget came out negative at
Llama-3.1-8B)."""

import gc

import pytest
import torch

import vexact_models.qwen3 as qwen3
from vexact_models.runtime import LLM
from vexact_models.runtime import model_runner
from vexact_models.runtime.model_runner import CUDA_OWN_SEGMENT, CUDA_SEGMENT_UNIT, segment_bytes

from .llm_support import cache_bytes, make_llm


def test_large_cache_tensors_are_allocated_to_whole_segments():
    unit, own = CUDA_SEGMENT_UNIT, CUDA_OWN_SEGMENT
    assert segment_bytes(own - 2) == own - 2  # shares a 20 MiB segment: nothing to fill
    assert segment_bytes(own) == own and segment_bytes(own + 1) == own + unit
    assert segment_bytes(17_850_000_000) == -(-17_850_000_000 // unit) * unit
    for nbytes in (own, own + 4_608, 24 * 2**20 + 2**18, 10**11 + 7):
        assert segment_bytes(nbytes) % unit == 0 and 0 <= segment_bytes(nbytes) - nbytes < unit


def test_a_cpu_cache_is_not_padded(model):
    llm = make_llm(model, kv_cache_bytes=cache_bytes(model, 37))
    k, v = llm.runner.kv_caches[0]
    assert llm.runner.num_blocks == 37 and k.shape[0] == v.shape[0] == 37
    assert k.untyped_storage().nbytes() == k.numel() * k.element_size()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value_in_key", [False, True])
def test_cpu_kv_pairs_are_zeros_of_their_own(dtype, value_in_key):
    """On the CPU the caches are numpy's calloc'd zeros viewed as `dtype` (`_cache_zeros`): zeros of
    the shape and dtype, contiguous, each layer's K and V their own memory (V a view of K's first
    dims only with `value_in_key`), a write landing where it is indexed."""
    shape = (5, 4, 2)
    pairs = [model_runner.kv_pair(shape, 8, 6, value_in_key, torch.device("cpu"), dtype) for _ in range(2)]
    for k, v in pairs:
        assert k.shape == (*shape, 8) and v.shape == (*shape, 6) and k.dtype == v.dtype == dtype
        assert k.is_contiguous() and not k.any() and not v.any()
        assert k.untyped_storage().nbytes() == k.numel() * k.element_size()
    (k0, v0), (k1, v1) = pairs
    k0[3, 1, 0, 2] = 2.5
    v0[4, 0, 1, 5] = -1.0
    assert k0.sum().item() == (2.5 - 1.0 if value_in_key else 2.5) and not k1.any() and not v1.any()
    assert (v0.data_ptr() == k0.data_ptr()) == value_in_key


def _cache_segments_kept(model, blocks: int) -> int:
    """Segments of a freed engine's KV cache still held after ``empty_cache``, where tensors of
    1.25 MiB made while the engine was awake still live."""
    llm = LLM(model, device="cuda", block_size=4, max_num_seqs=4, enforce_eager=True,
              kv_cache_bytes=cache_bytes(model, blocks))
    llm.generate([[5, 6, 7]], None, use_tqdm=False)
    assert llm.runner.num_blocks == blocks
    cache_ptrs = [t.data_ptr() for pair in llm.runner.kv_caches for t in pair]
    meanwhile = [torch.empty(5 * 2**18, dtype=torch.uint8, device="cuda") for _ in range(4 * len(cache_ptrs))]
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    kept = [seg for seg in torch.cuda.memory_snapshot()
            if any(seg["address"] <= p < seg["address"] + seg["total_size"] for p in cache_ptrs)]
    del meanwhile
    torch.cuda.empty_cache()
    return len(kept)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_freed_cache_returns_its_segments_though_tensors_made_meanwhile_live(monkeypatch):
    """A cache tensor of ~24.25 MiB would leave a 1.75 MiB tail in its 26 MiB segment; tensors of
    1.25 MiB made while the engine is awake land in such tails and keep the segments after the
    engine is gone (checked here with `segment_bytes` turned off). Holding its tail, the cache
    returns all its segments to the device."""
    torch.manual_seed(0)  # a head dim the Triton attention takes (64)
    config = qwen3.tiny_config(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    gpu_model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    spec = gpu_model.kv_cache_spec()
    page = 4 * spec[1] * spec[2] * 2  # bytes of one K page of one layer
    blocks = (24 * 2**20 + 2**18) // page
    assert CUDA_SEGMENT_UNIT - blocks * page % CUDA_SEGMENT_UNIT >= 5 * 2**18  # unpadded: a 1.25 MiB tail fits
    torch.cuda.empty_cache()
    assert _cache_segments_kept(gpu_model, blocks) == 0
    monkeypatch.setattr(model_runner, "segment_bytes", lambda nbytes: nbytes)
    assert _cache_segments_kept(gpu_model, blocks) > 0  # the failure the padding prevents
