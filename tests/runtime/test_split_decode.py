"""A decode step as two halves (`runtime.split_decode`): the halves' contexts, and logits bitwise
those of one forward, on the CPU (one stream). The two-stream graphs are checked on a GPU in
test_cuda_graphs.py."""

import numpy as np
import pytest
import torch

import vexact_models.deepseek_v3 as deepseek_v3
import vexact_models.qwen3 as qwen3
from vexact_models.causal_lm import InferenceModel
from vexact_models.kernels import PagedLayout
from vexact_models.layers import PagedContext
from vexact_models.runtime.model_runner import ModelRunner
from vexact_models.runtime.split_decode import split_context, split_decode_forward
from vexact_models.runtime.step_inputs import attention_order

BLOCK = 4


def _model(arch: str):
    torch.manual_seed(0)
    if arch == "qwen3":
        lm = qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.3))
    else:
        lm = deepseek_v3.DeepseekV3ForCausalLM(deepseek_v3.tiny_config(initializer_range=0.3))
    return lm.float().eval()


def _decode_step(runner: ModelRunner, real: int, bucket: int, seed: int):
    """A decode step of `real` sequences padded to `bucket` as the graphs pad it: random cached
    contexts (the cache is filled with random values), each sequence on its own pages."""
    rng = np.random.default_rng(seed)
    lens = np.zeros(bucket, np.int32)
    lens[:real] = rng.integers(1, 6 * BLOCK, real)
    pages = -(-int(lens.max()) // BLOCK)
    table = np.zeros((bucket, pages), np.int32)
    table[:real] = rng.permutation(runner.num_blocks)[:real * pages].reshape(real, pages)
    positions = np.zeros(bucket, np.int64)
    positions[:real] = lens[:real] - 1
    slots = np.full(bucket, -1, np.int64)
    slots[:real] = table[np.arange(real), positions[:real] // BLOCK] * BLOCK + positions[:real] % BLOCK
    cu = np.minimum(np.arange(bucket + 1), real).astype(np.int32)
    order = np.concatenate([attention_order(np.ones(real, np.int64), lens[:real].astype(np.int64)),
                            np.arange(real, bucket)]).astype(np.int32)
    ids = np.zeros(bucket, np.int64)
    ids[:real] = rng.integers(2, 500, real)
    as_tensor = torch.from_numpy
    layout = PagedLayout(as_tensor(cu), as_tensor(lens), as_tensor(table), BLOCK, 1, as_tensor(order))
    rows = np.zeros(bucket, np.int64)
    rows[:real] = np.arange(real)
    return as_tensor(ids), as_tensor(positions), PagedContext(layout, as_tensor(slots), runner.kv_caches), as_tensor(rows)


def _runner(model) -> ModelRunner:
    runner = ModelRunner(model, num_blocks=512, block_size=BLOCK, device=torch.device("cpu"), dtype=torch.float32,
                         max_model_len=64)
    gen = torch.Generator().manual_seed(1)
    for k, v in runner.kv_caches:
        k.copy_(torch.randn(k.shape, generator=gen))
        if v.data_ptr() != k.data_ptr():
            v.copy_(torch.randn(v.shape, generator=gen))
    return runner


@pytest.mark.parametrize("arch", ["qwen3", "deepseek_v3"])
@pytest.mark.parametrize("real,bucket", [(64, 64), (50, 64), (20, 64), (7, 8)])
def test_two_halves_give_the_logits_of_one_forward_bitwise(arch, real, bucket):
    model = InferenceModel(_model(arch))
    runner = _runner(model)
    ids, positions, context, rows = _decode_step(runner, real, bucket, seed=real)
    snapshot = [k.clone() for k, _ in runner.kv_caches]
    want = model(ids, positions, context, rows)
    written = [k.clone() for k, _ in runner.kv_caches]
    for k, old in zip(runner.kv_caches, snapshot):
        k[0].copy_(old)  # the split step writes the same new keys again
    got = split_decode_forward(model, ids, positions, context, rows, side_stream=None, mode="free")
    assert torch.equal(got[:real], want[:real])
    assert all(torch.equal(k, w) for (k, _), w in zip(runner.kv_caches, written))
    assert any(not torch.equal(w, old) for w, old in zip(written, snapshot))  # the step did write keys


def test_split_context_numbers_each_half_from_zero():
    cu = torch.tensor([0, 1, 2, 2, 2, 2, 2], dtype=torch.int32)  # 2 real sequences in a bucket of 6
    lens = torch.tensor([5, 9, 0, 0, 0, 0], dtype=torch.int32)
    table = torch.arange(12, dtype=torch.int32).view(6, 2)
    order = torch.tensor([1, 0, 2, 3, 4, 5], dtype=torch.int32)
    slots = torch.tensor([4, 35, -1, -1, -1, -1])
    first, second = split_context(PagedContext(PagedLayout(cu, lens, table, 8, 1, order), slots, []), 3)
    assert first.layout.cu_seqlens_q.tolist() == [0, 1, 2, 2]
    assert second.layout.cu_seqlens_q.tolist() == [0, 0, 0, 0]  # padding only: no query rows
    assert first.layout.seq_order.tolist() == [1, 0, 2] and second.layout.seq_order.tolist() == [0, 1, 2]
    assert torch.equal(second.layout.block_table, table[3:]) and second.slot_mapping.tolist() == [-1, -1, -1]
    assert torch.equal(second.layout.seq_lens, lens[3:])
    order = torch.tensor([4, 0, 5, 2, 1, 3], dtype=torch.int32)
    cu = torch.arange(7, dtype=torch.int32)
    first, second = split_context(PagedContext(PagedLayout(cu, lens, table, 8, 1, order), slots, []), 3)
    assert first.layout.seq_order.tolist() == [0, 2, 1] and second.layout.seq_order.tolist() == [1, 2, 0]
    assert second.layout.cu_seqlens_q.tolist() == [0, 1, 2, 3]
