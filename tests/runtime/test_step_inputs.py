"""A step's model inputs: build_step_inputs against a plain per-token reference, the one-copy
staging (Layout, to_device, HostCopy), the step graphs' input buffers (GraphInputs) and buckets, and the runner."""

import numpy as np
import pytest
import torch

from vexact_models.runtime.block_manager import BlockManager
from vexact_models.runtime.cuda_graphs import step_bucket, token_bucket
from vexact_models.runtime.graph_inputs import GraphInputs
from vexact_models.runtime.model_runner import ModelRunner
from vexact_models.runtime.sampling_params import SamplingParams
from vexact_models.runtime.scheduler import ScheduledSeq
from vexact_models.runtime.sequence import Sequence
from vexact_models.runtime.staging import HostCopy, Layout, to_device
from vexact_models.runtime.step_inputs import ATTENTION_ORDER, attention_order, build_step_inputs

from .workload_support import make_scheduler, random_workload, run_steps


def reference_inputs(scheduled, bs):
    """The inputs token by token, as the runner used to build them."""
    ids, positions, slots, cu, seq_lens, rows = [], [], [], [0], [], []
    width = max(len(item.seq.block_table) for item in scheduled)
    tables = []
    for item in scheduled:
        seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
        ids += seq.token_ids[start:start + n]
        positions += range(start, start + n)
        slots += [seq.block_table[p // bs] * bs + p % bs for p in range(start, start + n)]
        cu.append(cu[-1] + n)
        seq_lens.append(start + n)
        tables.append(seq.block_table + [0] * (width - len(seq.block_table)))
        if item.samples:
            rows.append(cu[-1] - 1)
    # attention programs take the sequences by decreasing new tokens x keys, ties in scheduled order
    work = [item.num_new_tokens * n for item, n in zip(scheduled, seq_lens)]
    order = sorted(range(len(scheduled)), key=lambda s: (-work[s], s))
    return dict(ids=ids, positions=positions, slots=slots, logits_rows=rows, cu_seqlens=cu, seq_lens=seq_lens,
                block_table=tables, seq_order=order, max_seqlen_q=max(item.num_new_tokens for item in scheduled))


DTYPES = dict(ids=np.int64, positions=np.int64, slots=np.int64, logits_rows=np.int64, cu_seqlens=np.int32,
              seq_lens=np.int32, block_table=np.int32, seq_order=np.int32)


@pytest.mark.parametrize("seed", range(30))
def test_inputs_equal_the_per_token_reference(seed):
    config, requests = random_workload(seed)
    sched, _ = make_scheduler(config, requests)
    bs = config["block_size"]
    for out in run_steps(sched):
        if not out.scheduled:
            continue
        expected = reference_inputs(out.scheduled, bs)
        for tables in (sched.block_manager.tables, None):  # the mirror, and the lists
            inputs = build_step_inputs(out.scheduled, bs, tables)
            assert inputs.max_seqlen_q == expected["max_seqlen_q"]
            for name, dtype in DTYPES.items():
                array = getattr(inputs, name)
                assert array.dtype == dtype and array.tolist() == expected[name], name
        decode = all(item.num_new_tokens == 1 and item.samples for item in out.scheduled)
        assert inputs.decode_only == decode


def test_attention_order_takes_the_most_work_first_and_arrival_keeps_the_schedule():
    new_tokens = np.array([1, 1, 1, 1, 8, 1])
    seq_lens = np.array([30, 90, 30, 200, 20, 90])
    order = attention_order(new_tokens, seq_lens)
    assert order.dtype == np.int32 and order.tolist() == [3, 4, 1, 5, 0, 2]  # 200, 160, 90, 90, 30, 30
    with ATTENTION_ORDER.use("arrival"):
        assert attention_order(new_tokens, seq_lens).tolist() == list(range(6))
    assert attention_order(np.zeros(0, np.int64), np.zeros(0, np.int32)).tolist() == []
    with pytest.raises(ValueError, match="'fastest' is not an attention program order"):
        ATTENTION_ORDER.set("fastest")


def test_a_chunk_past_its_pages_is_refused():
    bm = BlockManager(4, 4)
    seq = Sequence(0, 0, list(range(10, 19)), SamplingParams(), 0)
    bm.allocate(seq, 4)  # one page: positions [0, 4)
    for tables in (bm.tables, None):
        build_step_inputs([ScheduledSeq(seq, 4, False)], 4, tables)
        with pytest.raises(IndexError, match="runs to position 5, past its 1 blocks of 4"):
            build_step_inputs([ScheduledSeq(seq, 6, False)], 4, tables)


def test_layout_and_to_device_round_trip():
    arrays = [np.arange(3, dtype=np.int64), np.array([1.5, -2.0], np.float32), np.arange(6, dtype=np.int32).reshape(2, 3),
              np.zeros(0, np.int64), np.array([0.25], np.float64)]
    layout = Layout([(a.dtype, a.shape) for a in arrays])
    assert all(offset % 16 == 0 for offset in layout.offsets) and layout.nbytes % 16 == 0
    out = to_device(arrays, torch.device("cpu"))
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1  # one buffer: one copy on a GPU
    for array, tensor in zip(arrays, out):
        assert tensor.numpy().dtype == array.dtype and tensor.shape == array.shape
        assert np.array_equal(tensor.numpy(), array)


def step_inputs(decode: bool):
    """A decode step's inputs (every sequence one token, all sample), or a mixed one's (a
    prompt chunk of several tokens beside other sequences)."""
    for seed in range(40):
        config, requests = random_workload(seed)
        sched, _ = make_scheduler(config, requests)
        for out in run_steps(sched):
            items = out.scheduled
            if not items:
                continue
            inputs = build_step_inputs(items, config["block_size"], sched.block_manager.tables)
            if decode and inputs.decode_only and len(items) > 1:
                return inputs, config
            if not decode and len(items) > 1 and inputs.max_seqlen_q > 1 and not all(i.samples for i in items):
                return inputs, config
    raise AssertionError("no such step")


def test_graph_inputs_fill_a_decode_step_then_padding():
    inputs, config = step_inputs(decode=True)
    n = len(inputs.ids)
    b = n + 2
    buffers = GraphInputs(b + 1, b + 1, -(-config["max_model_len"] // config["block_size"]), torch.device("cpu"))
    assert len({t.untyped_storage().data_ptr() for t in (buffers.ids, buffers.block_table)}) == 1
    buffers.fill(inputs, b, b)
    assert buffers.ids[:b].tolist() == inputs.ids.tolist() + [0, 0]
    assert buffers.positions[:b].tolist() == inputs.positions.tolist() + [0, 0]
    assert buffers.slots[:b].tolist() == inputs.slots.tolist() + [-1, -1]
    assert buffers.logits_rows[:b].tolist() == list(range(n)) + [0, 0]
    assert buffers.cu_seqlens[:b + 1].tolist() == list(range(n + 1)) + [n, n]
    assert buffers.seq_lens[:b].tolist() == inputs.seq_lens.tolist() + [0, 0]
    assert sorted(inputs.seq_order.tolist()) == list(range(n))
    assert buffers.seq_order[:b].tolist() == inputs.seq_order.tolist() + [n, n + 1]  # empty padding: last
    width = inputs.block_table.shape[1]
    assert buffers.block_table[:n, :width].tolist() == inputs.block_table.tolist()
    assert buffers.ids.dtype == torch.int64 and buffers.cu_seqlens.dtype == torch.int32
    with pytest.raises(ValueError, match="does not fit"):
        buffers.fill(inputs, n - 1, n - 1)


def test_graph_inputs_fill_a_mixed_step_then_padding():
    """Tokens past the step belong to no sequence (cu_seqlens ends at T), padding sequences are
    empty, and only the R sampling rows are real logits rows."""
    inputs, config = step_inputs(decode=False)
    t, s, r = len(inputs.ids), len(inputs.seq_lens), len(inputs.logits_rows)
    assert r < s < t
    tokens, seqs = t + 3, s + 1
    buffers = GraphInputs(tokens, seqs, -(-config["max_model_len"] // config["block_size"]), torch.device("cpu"))
    buffers.fill(inputs, tokens, seqs)
    assert buffers.ids.tolist() == inputs.ids.tolist() + [0] * 3
    assert buffers.positions.tolist() == inputs.positions.tolist() + [0] * 3
    assert buffers.slots.tolist() == inputs.slots.tolist() + [-1] * 3
    assert buffers.logits_rows.tolist() == inputs.logits_rows.tolist() + [0] * (seqs - r)
    assert buffers.cu_seqlens.tolist() == inputs.cu_seqlens.tolist() + [t]
    assert buffers.seq_lens.tolist() == inputs.seq_lens.tolist() + [0]
    assert buffers.seq_order.tolist() == inputs.seq_order.tolist() + [s]
    before = buffers.buffer.clone()
    for bad in ((t - 1, seqs), (tokens, s - 1), (tokens + 1, seqs), (tokens, seqs + 1)):
        with pytest.raises(ValueError, match="does not fit"):
            buffers.fill(inputs, *bad)
    assert torch.equal(buffers.buffer, before)  # nothing half-written
    with pytest.raises(ValueError, match="max_tokens=3 is below max_batch=4"):
        GraphInputs(3, 4, 2, torch.device("cpu"))


def test_token_bucket_pads_at_most_a_quarter_past_512():
    assert [token_bucket(n, 8192) for n in (1, 3, 17, 500, 512, 513, 640, 641, 1025, 1100, 5000, 8192)] == \
        [1, 4, 24, 512, 512, 640, 640, 768, 1280, 1280, 5120, 8192]
    assert token_bucket(700, 700) == 700 and token_bucket(600, 1000) == 640
    for n in range(513, 9000, 37):
        assert n <= token_bucket(n, 10 ** 6) <= 1.25 * n
    for bad in (0, 9):
        with pytest.raises(ValueError, match=f"tokens={bad} must be in"):
            token_bucket(bad, 8)


def test_step_bucket_of_decode_mixed_and_eager_steps():
    decode, _ = step_inputs(decode=True)
    mixed, _ = step_inputs(decode=False)
    n, t, s, q = len(decode.ids), len(mixed.ids), len(mixed.seq_lens), mixed.max_seqlen_q
    assert step_bucket(decode, [1, 2, 4, 8, 16], 64) == (token_bucket(n, 16),) * 2 + (1,)
    assert step_bucket(decode, [1, 2, 4, 8, 16], 0) == (token_bucket(n, 16),) * 2 + (1,)  # decode needs no tokens cap
    assert step_bucket(decode, [1], 64) is None  # more sequences than the largest batch bucket
    batch = next(b for b in (1, 2, 4, 8, 16) if b >= s)
    tokens = max(token_bucket(t, 1024), batch)
    assert step_bucket(mixed, [1, 2, 4, 8, 16], 1024) == (tokens, batch, min(1 << (q - 1).bit_length(), tokens))
    assert step_bucket(mixed, [1, 2, 4, 8, 16], t) == (t, batch, min(1 << (q - 1).bit_length(), t))
    assert step_bucket(mixed, [1, 2, 4, 8, 16], t - 1) is None  # past the tokens cap: eager
    assert step_bucket(mixed, [1, 2, 4, 8, 16], 0) is None  # mixed graphs off


class RecordingModel:
    def __init__(self):
        self.calls = []

    def kv_cache_spec(self):
        return 1, 1, 2, 2

    def __call__(self, ids, positions, context, rows):
        layout = context.layout
        self.calls.append([t.clone() for t in (ids, positions, context.slot_mapping, rows, layout.cu_seqlens_q,
                                                layout.seq_lens, layout.block_table, layout.seq_order)]
                          + [layout.max_seqlen_q])
        return torch.zeros(rows.shape[0], 8)


def test_runner_passes_the_same_inputs_with_or_without_the_mirror():
    config, requests = random_workload(5)
    sched, _ = make_scheduler(config, requests)
    models = [RecordingModel(), RecordingModel()]
    runners = [ModelRunner(m, 4, config["block_size"], torch.device("cpu"), torch.float32,
                           max_model_len=config["max_model_len"]) for m in models]
    runners[0].block_tables = sched.block_manager.tables
    for out in run_steps(sched):
        if out.scheduled:
            for runner in runners:
                runner.execute(out.scheduled)
    assert len(models[0].calls) == len(models[1].calls) > 0
    for a, b in zip(models[0].calls, models[1].calls):
        assert a[-1] == b[-1]
        for x, y in zip(a[:-1], b[:-1]):
            assert x.dtype == y.dtype and torch.equal(x, y)
    # the attention programs' order reaches the kernels' layout: longest context first
    orders = [call[7] for call in models[0].calls]
    for call, order in zip(models[0].calls, orders):
        work = (call[4][1:] - call[4][:-1]) * call[5]
        assert order.dtype == torch.int32 and torch.equal(work[order.long()], work.sort(descending=True).values)
    assert any(not torch.equal(order, torch.arange(len(order), dtype=torch.int32)) for order in orders)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned copies)")])])
def test_host_copy_brings_tensors_of_any_dtype_and_shape_back(device):
    """`HostCopy`: the tensors' values on the host once `result` returns; on CUDA in fresh pinned
    memory (the copies ran without a sync), on CPU the tensors themselves."""
    tensors = [torch.arange(6, device=device).view(2, 3), torch.tensor([0.5, -1.25], device=device),
               torch.tensor([True, False], device=device)]
    copy = HostCopy(tensors)
    got = copy.result()
    assert [t.device.type for t in got] == ["cpu"] * 3
    assert all(torch.equal(g, t.cpu()) and g.dtype == t.dtype for g, t in zip(got, tensors))
    assert all(g.is_pinned() for g in got) if device == "cuda" else all(g is t for g, t in zip(got, tensors))
    assert HostCopy([]).result() == []
