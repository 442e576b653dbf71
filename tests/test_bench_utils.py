"""benchmarks/bench_utils.py, the helpers the benchmark scripts share: the stock peer model, the
case filter, prompt layouts, the workload's decode floor, the graph timer that skips a launch that
cannot run, the bitwise row-count check, the wall-clock timer, the device of a ``--tiny`` run
and the profiler's time per kernel. On CPU."""

from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def test_stock_twin_is_the_hf_class_on_our_weights_device_and_dtype(monkeypatch):
    """`bench_utils.stock_twin` (training.py's and throughput.py's peer): the stock transformers
    class holding our weights, built where our model lives and in its dtype, never initialised on the CPU and moved (our
    model on the meta device here: a twin built on the CPU could not take its weights)."""
    import torch

    from vexact_models.conformance.models import architecture_of, build_model, make_config

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    arch = architecture_of("qwen3-0.6b")
    config = make_config(arch, "qwen3-0.6b", 1, 64, {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                                     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256})
    ours = build_model(arch, config, torch.device("cpu"), torch.bfloat16)
    twin = bench_utils.stock_twin(arch, ours)
    assert type(twin) is arch.hf_class()
    theirs = twin.state_dict()
    assert all(torch.equal(theirs[name], value) for name, value in ours.state_dict().items() if name in theirs)
    assert all(p.dtype == torch.bfloat16 for p in twin.parameters())
    meta = build_model(arch, config, torch.device("meta"), torch.bfloat16)
    built_on = []
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: built_on.append(self.weight.device.type))
    assert all(p.is_meta for p in bench_utils.stock_twin(arch, meta).parameters())
    assert built_on and set(built_on) == {"meta"}


def test_stock_twin_of_a_moe_model_runs_stocks_default_experts(monkeypatch):
    """The peer's experts run what stock picks for a config of its own (transformers' grouped_mm),
    not the ``eager`` loop our configs name for parity checks."""
    from vexact_models.conformance.models import build_model
    from vexact_models.registry import get

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    arch = get("qwen3_moe")
    ours = build_model(arch, arch.tiny_config(), torch.device("cpu"), torch.float32)
    assert ours.config._experts_implementation == "eager"
    assert bench_utils.stock_twin(arch, ours).config._experts_implementation == "grouped_mm"


def test_case_selected_keeps_cases_naming_any_substring_and_every_case_without_one(monkeypatch):
    """`bench_utils.case_selected`: the `--cases` filter the prefill and config benchmarks share."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    assert bench_utils.case_selected("8b training 16 x 1,024", None)
    assert bench_utils.case_selected("8b training 16 x 1,024", "")
    assert bench_utils.case_selected("8b training 16 x 1,024", "prompt,8b training")
    assert not bench_utils.case_selected("8b prompt step", "training,30b")


def test_prompt_layout_and_causal_pairs(monkeypatch):
    """`bench_utils.prompt_layout`: paged prompts after context over shuffled pages (slots for every
    page), or the packed training layout, which needs every key to be a query;
    `bench_utils.causal_pairs`: the query-key pairs a causal launch computes."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    layout, slots = bench_utils.prompt_layout([3, 100], [70, 100], 64, torch.Generator().manual_seed(0), device="cpu")
    assert layout.cu_seqlens_q.tolist() == [0, 3, 103] and layout.seq_lens.tolist() == [70, 100]
    assert layout.page_size == 64 and layout.max_seqlen_q == 100 and slots == 4 * 64
    assert sorted(layout.block_table.flatten().tolist()) == [0, 1, 2, 3]
    packed, rows = bench_utils.prompt_layout([5, 7], [5, 7], 64, packed=True, device="cpu")
    assert packed.cu_seqlens_q.tolist() == [0, 5, 12] and packed.page_size == 1 and rows == 12
    with pytest.raises(ValueError, match="packed=True needs q_lens == seq_lens"):
        bench_utils.prompt_layout([3], [70], 64, packed=True, device="cpu")
    assert bench_utils.causal_pairs([1, 3], [4, 3]) == 4 + (1 + 2 + 3)


def test_workload_decode_roofline_counts_each_decode_step_once(monkeypatch):
    """`bench_utils.workload_decode_roofline` (throughput.py's floor per KV cache mode): a
    request's ``output - 1`` decode steps each read the weights and its cache up to the new
    token, at most `max_seqs` requests run at a time, and routed experts count only as many as
    the step's batch reaches."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    from vexact_models.conformance.models import build_model, make_config
    from vexact_models.experts import FusedExperts
    from vexact_models.registry import get
    from vexact_models.runtime.model_runner import kv_bytes_per_block

    assert bench_utils.expected_routed(8, 2, 1) == 2.0 and bench_utils.expected_routed(8, 8, 3) == 8.0
    assert 7.9 < bench_utils.expected_routed(8, 2, 40) < 8.0
    for arch_name in ("qwen3", "qwen3_moe"):
        model = build_model(get(arch_name), make_config(get(arch_name)), torch.device("cpu"), torch.float32)
        weights = bench_utils.decode_bytes(model, 0, 0)
        per_token = kv_bytes_per_block(model.kv_cache_spec(), 1, torch.float32)
        experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
        expert_bytes = sum(p.numel() * 4 for m in experts for p in m.parameters())
        top_k = getattr(model.config, "num_experts_per_tok", 1)

        def step_weights(batch):
            if not experts:
                return weights
            n = experts[0].num_experts
            return weights - expert_bytes + expert_bytes * bench_utils.expected_routed(n, top_k, batch) / n

        # prompts of 3 and 5 tokens, 3 output tokens each: two decode steps each, at contexts 4, 5 and 6, 7
        both = bench_utils.workload_decode_roofline(model, [3, 5], [3, 3], 2, 1e-9)
        assert both == pytest.approx((2 * step_weights(2), (4 + 5 + 6 + 7) * per_token))
        one_at_a_time = bench_utils.workload_decode_roofline(model, [3, 5], [3, 3], 1, 1e-9)
        assert one_at_a_time == pytest.approx((4 * step_weights(1), (4 + 5 + 6 + 7) * per_token))
        # a one-token output has no decode step; the other request then runs alone
        assert bench_utils.workload_decode_roofline(model, [3, 5], [1, 2], 2, 1e-9) == \
            pytest.approx((step_weights(1), 6 * per_token))
        if experts:
            assert step_weights(1) < step_weights(2) < weights


def test_graph_us_or_none_names_a_launch_that_cannot_run(monkeypatch, capsys):
    """`bench_utils.graph_us_or_none`, the sweeps' timer: a launch that cannot be captured and run
    (here: no GPU at all) gives None and its error on stderr, so the sweep goes on to the next."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    if torch.cuda.is_available():
        pytest.skip("a CPU check: with a GPU the launch runs")
    assert bench_utils.graph_us_or_none(lambda: None) is None
    assert "  skipped: " in capsys.readouterr().err


def test_bits_at_row_counts_counts_differing_bits_and_reports_a_failing_launch(monkeypatch):
    """`bench_utils.bits_at_row_counts`: rows and elements whose bits differ (a -0.0 for a 0.0
    counts), over each row count; a launch that raises stops it and is reported, not raised."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    from bench_utils import bits_at_row_counts

    want = torch.zeros(6, 4, dtype=torch.bfloat16)
    got = want.clone()
    got[4, 1] = -0.0
    got[5, :2] = 1.0
    assert bits_at_row_counts(lambda m: got[:m], want, [1, 3]) == (4, 0, 0, "")
    assert bits_at_row_counts(lambda m: got[:m], want, [5, 6]) == (11, 3, 4, "")  # (1 + 3 elements)

    def fails(m):
        if m > 2:
            raise RuntimeError("out of shared memory")
        return want[:m]

    assert bits_at_row_counts(fails, want, [2, 4]) == (2, 0, 0, "RuntimeError: out of shared memory")


def test_timed_is_the_median_after_a_warm_up_and_tiny_or_cuda_picks_the_device(monkeypatch, capsys):
    """`bench_utils.timed` (fsdp_sync.py's and lora.py's weight syncs) calls once to warm up and
    returns the median of the rest; `tiny_or_cuda` gives a ``--tiny`` run the CPU in float32 and
    refuses a GPU run without a CUDA GPU (exit 2, saying so)."""
    import argparse
    import time

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    sleeps = iter([0.0, 0.03, 0.001, 0.01])  # the warm-up's first, then three timed calls
    calls = []

    def fn():
        calls.append(1)
        time.sleep(next(sleeps))

    seconds = bench_utils.timed(fn, torch.device("cpu"), repeat=3)
    assert len(calls) == 4 and 0.01 <= seconds < 0.03
    args = argparse.Namespace(tiny=True)
    bench_utils.tiny_or_cuda(args, "x.py")
    assert args.device == torch.device("cpu") and args.dtype == torch.float32
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as info:
        bench_utils.tiny_or_cuda(argparse.Namespace(tiny=False), "x.py")
    assert info.value.code == 2 and "x.py needs a CUDA GPU (or --tiny" in capsys.readouterr().err


def test_decode_floor_counts_a_hybrids_attention_pages_and_gated_deltanet_state(monkeypatch):
    """`decode_floor` (throughput.py's floor and roofline) on a gated-DeltaNet hybrid: KV bytes of
    the attention layers only, and per decode step and GDN layer the fp32 delta-rule state and
    the conv state, read and written back, from the config's shapes."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import decode_floor

    from vexact_models.conformance.models import build_model, make_config
    from vexact_models.registry import get
    from vexact_models.runtime.model_runner import kv_bytes_per_block

    arch = get("qwen3_5_moe")
    config = make_config(arch)  # 3 layers: GDN, attention, GDN; chunks of 16
    model = build_model(arch, config, torch.device("cpu"), torch.float32)
    assert config.layer_types == ["linear_attention", "full_attention", "linear_attention"]
    per_token = decode_floor.kv_bytes_per_token(model, torch.float32)
    assert per_token == kv_bytes_per_block(model.kv_cache_spec(), 1, torch.float32) // 3  # one layer of three
    hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
    dk, dv = config.linear_key_head_dim, config.linear_value_head_dim
    conv = (config.linear_conv_kernel_dim - 1) * (2 * hk * dk + hv * dv) * 4
    state = hv * dk * dv * 4
    assert decode_floor.linear_state_step_bytes(model, torch.float32) == 2 * 2 * (conv + state)  # read and written
    weights = decode_floor.decode_bytes(model, 0, 0)
    assert decode_floor.decode_bytes(model, 2, 10) == int(weights + 2 * (10 * per_token + 4 * (conv + state)))
    # prompt 15, 4 outputs: 3 decode steps; prompt 3, 2 outputs: 1
    got = decode_floor.workload_state_bytes(model, [15, 3], [4, 2])
    assert got == pytest.approx(4 * 4 * (conv + state))
    _, cache = decode_floor.workload_decode_roofline(model, [15, 3], [4, 2], 2, 1e-9)
    assert cache == pytest.approx((16 + 17 + 18 + 4) * per_token + got)
    plain = build_model(get("qwen3"), make_config(get("qwen3")), torch.device("cpu"), torch.float32)
    assert decode_floor.linear_state_step_bytes(plain, torch.float32) == 0
    assert decode_floor.workload_state_bytes(plain, [15], [4]) == 0


def test_kernel_seconds_names_each_op_once_with_its_own_time(monkeypatch):
    """`bench_utils.kernel_seconds` (training.py's and gated_delta.py's ``--profile``) on the CPU:
    every op that ran has its own time, positive, under its name; ops that did not run are absent."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    a = torch.randn(64, 64)
    seconds = bench_utils.kernel_seconds(lambda: (a @ a).relu(), "cpu")
    assert {"aten::mm", "aten::relu"} <= set(seconds) and "aten::softmax" not in seconds
    assert all(s > 0 for s in seconds.values())


def test_check_overrides_makes_each_config_and_turns_a_bad_override_into_a_usage_error(monkeypatch, capsys):
    """`bench_utils.check_overrides` (the ``--set`` of throughput.py, training.py, decode_profile.py):
    every named config takes the overrides, or the parser exits 2 naming the bad one."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    parser = argparse.ArgumentParser(prog="bench")
    bench_utils.check_overrides(parser, None, ["nope"])  # no --set: nothing is made
    bench_utils.check_overrides(parser, ["head_dim=64"], ["qwen3-0.6b", "qwen3-30b-a3b"])
    bench_utils.check_overrides(parser, ["linear_num_key_heads=2"], ["qwen3.5-35b-a3b"], tiny=True)
    for items, names, words in ((["num_experts=8"], ["qwen3-30b-a3b", "qwen3-0.6b"], "Qwen3Config has no field"),
                                (["head_dim"], ["qwen3-0.6b"], "--set 'head_dim': expected KEY=VALUE")):
        with pytest.raises(SystemExit) as info:
            bench_utils.check_overrides(parser, items, names)
        assert info.value.code == 2 and words in capsys.readouterr().err
