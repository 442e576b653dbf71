"""The benchmark scripts need a GPU to measure; on CPU they must still import, explain
themselves (--help) and refuse cleanly."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.mark.parametrize("script", ["kernels.py", "moe.py", "throughput.py", "decode_profile.py", "training.py",
                                    "attention_configs.py", "attention_fa4.py", "sampler.py"])
def test_benchmark_script_help_and_cpu_refusal(script):
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "usage" in (help_run.stdout + help_run.stderr).lower()
    cpu_run = subprocess.run([sys.executable, script], cwd=BENCHMARKS, capture_output=True, text=True, timeout=120,
                             env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert cpu_run.returncode == 2 and "needs a CUDA GPU" in cpu_run.stderr


def test_step_overhead_runs_on_cpu():
    """benchmarks/step_overhead.py measures host time only: it runs (tiny) on CPU."""
    script = "step_overhead.py"
    help_run = subprocess.run([sys.executable, script, "--help"], cwd=BENCHMARKS, capture_output=True, text=True,
                              timeout=120)
    assert help_run.returncode == 0 and "--context-len" in help_run.stdout
    run = subprocess.run([sys.executable, script, "--batch", "3,8", "--steps", "3", "--warmup", "1",
                          "--context-len", "20", "--block-size", "4"],
                         cwd=BENCHMARKS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    header = next(line for line in lines if "schedule" in line).split()
    assert header[:2] == ["batch", "schedule"] and "postprocess" in header
    rows = [line.split() for line in lines if line.split() and line.split()[0] in ("3", "8")]
    assert [r[0] for r in rows] == ["3", "8"] and all(len(r) == 9 for r in rows)
    bad = subprocess.run([sys.executable, script, "--batch", "0"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2


def test_training_profile_groups_kernels(monkeypatch, capsys):
    """`training.py --profile`: kernel names land in the step part they belong to, and the
    per-group table adds each side's kernels up."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import training

    assert training.kernel_group("_attention_fwd_kernel") == "attention forward"
    assert training.kernel_group("void flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<...>") == "attention backward"
    assert training.kernel_group("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma") == "attention backward"
    assert training.kernel_group("_linear_tma_kernel") == "GEMM (Triton linear)"
    assert training.kernel_group("nvjet_hsh_256x128_64x4_2x1_v_bz_coopA_TNT") == "GEMM (cuBLAS)"
    assert training.kernel_group("void at::native::vectorized_elementwise_kernel<4, ...>") == "copies, casts, elementwise"
    assert training.kernel_group("something_new") == "other"
    training.print_profiles("t", {"hf": {"nvjet_a": 0.002, "flash_fwd": 0.001},
                                  "vexact": {"_linear_kernel": 0.0015, "_attention_fwd_kernel": 0.0005}}, top=1)
    out = capsys.readouterr().out
    total = next(line for line in out.splitlines() if line.strip().startswith("total")).split()
    assert total == ["total", "3.00", "2.00"]
    assert "top 1 kernels" in out and "_linear_kernel" in out and "_attention_fwd_kernel" not in out.split("vexact: top")[1]


def test_throughput_attention_skipped_bound(monkeypatch):
    """`throughput.py --engines aligned-no-attention`: inside `attention_skipped` the attention
    forward returns zeros of the output's shape (value head dim, fp32 lse), and the real kernel
    entry is back afterwards."""
    import importlib

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput

    module = importlib.import_module("vexact_models.kernels.attention")
    real = module.attention_forward_triton
    q, k, v = torch.randn(5, 4, 24), torch.randn(5, 1, 24), torch.randn(5, 1, 16)
    with throughput.attention_skipped():
        assert module.attention_forward_triton is not real
        out, lse = module.attention_forward_triton(q, k, v, None, 0.1)
    assert module.attention_forward_triton is real
    assert out.shape == (5, 4, 16) and out.dtype == q.dtype and not out.any()
    assert lse.shape == (5, 4) and lse.dtype == torch.float32 and not lse.any()


def test_throughput_step_breakdown(monkeypatch):
    """`throughput.py --step-breakdown`: decode-only and prompt steps are counted, summed and
    their medians taken apart."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput

    times = [(64, True, 0.002), (64, True, 0.004), (64, False, 0.010), (64, True, 0.003), (3, False, 0.030),
             (5, False, 0.020)]
    decode, prompt = throughput.step_breakdown(times).splitlines()
    assert decode.split() == ["decode-only", "steps", "3", "steps", "0.01", "s", "median", "3.00", "ms"]
    assert prompt.split() == ["steps", "with", "prompt", "tokens", "3", "steps", "0.06", "s", "median", "20.00", "ms"]
    assert throughput.step_breakdown([]).split()[2:5] == ["0", "steps", "0.00"]


def test_throughput_graph_counts(monkeypatch):
    """`throughput.py --step-breakdown`: an engine's mixed-step graphs are reported from the real
    `StepGraphs` counters (an eager engine has none)."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import throughput

    from vexact_models.runtime.cuda_graphs import StepGraphs

    counters = SimpleNamespace(num_mixed=3, mixed_capture_seconds=0.456, mixed_replays=17)
    assert {"num_mixed", "mixed_capture_seconds", "mixed_replays"} <= set(StepGraphs.__init__.__code__.co_names)
    assert throughput.graph_counts(counters).split() == ["3", "CUDA", "graphs", "of", "steps", "with", "prompt", "tokens",
                                                          "captured", "in", "0.46", "s", "(all", "runs", "so", "far),",
                                                          "17", "replays"]
    assert throughput.graph_counts(None).strip() == "no CUDA graphs"


def test_fa4_alignment_check_counts_a_broken_path(monkeypatch):
    """`attention_fa4.py`'s alignment rows (run here on our reference kernel, CPU): every path
    agrees with the packed call, and a decode path that reads the wrong pages is caught."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import attention_fa4

    torch.manual_seed(0)
    rows = attention_fa4.alignment_rows("ours", attention_fa4.OurPaths(), [37, 20, 1], (4, 2), (64, 64), chunk=16,
                                        page=8, dev="cpu")
    assert [r[1] for r in rows] == ["each sequence alone", "chunked prefill (16-token chunks, page 8)",
                                    "decode (one query per call, page 8)"]
    assert all(r[2] == 58 * 4 * 64 and r[3] == 0 and r[4] == 0.0 for r in rows)

    class WrongPages(attention_fa4.OurPaths):
        def paged(self, q, k_cache, v_cache, cu_q, max_q, seen, table_):
            return super().paged(q, k_cache, v_cache, cu_q, max_q, seen, table_.flip(1).contiguous())

    torch.manual_seed(0)
    broken = attention_fa4.alignment_rows("broken", WrongPages(), [37, 20, 1], (4, 2), (64, 64), chunk=16, page=8,
                                          dev="cpu")
    assert broken[0][3] == 0 and broken[1][3] > 0 and broken[2][3] > 0


def test_fa4_paged_cache_holds_each_sequence_in_its_pages(monkeypatch):
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import attention_fa4
    k, v = torch.randn(21, 2, 8), torch.randn(21, 2, 4)
    k_cache, v_cache, table_ = attention_fa4.paged_cache(k, v, [5, 16], page=4)
    assert k_cache.shape == (6, 4, 2, 8) and v_cache.shape == (6, 4, 2, 4) and table_.shape == (2, 4)
    assert sorted(table_[0, :2].tolist() + table_[1].tolist()) == list(range(6))
    for s, (start, n) in enumerate([(0, 5), (5, 16)]):
        slots = (table_[s].long()[:, None] * 4 + torch.arange(4)).flatten()[:n]
        assert torch.equal(k_cache.view(-1, 2, 8)[slots], k[start:start + n])
        assert torch.equal(v_cache.view(-1, 2, 4)[slots], v[start:start + n])


def test_linear_quack_config_specs_round_trip_and_bad_ones_are_refused(monkeypatch):
    """`benchmarks/linear_quack.py --configs`: every default spec parses to the config its label
    names; a bad spec is a usage error naming it, before any GPU check."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import linear_quack

    from vexact_models.kernels.linear_quack import SM90_DEFAULT, QuackConfig

    for spec in linear_quack.DEFAULT_SPECS.split(","):
        assert linear_quack.config_label(linear_quack.parse_config(spec)).split()[0] == spec
    assert linear_quack.parse_config("64x16ps") == QuackConfig(64, 16, True, swap_ab=True)
    assert linear_quack.parse_config("128x128c:1x2") == QuackConfig(128, 128, False, 1, 2)
    assert linear_quack.config_label(SM90_DEFAULT) == "128x192p:2x1 (default)"
    with pytest.raises(ValueError, match="'64x64q'"):
        linear_quack.parse_config("64x64q")
    run = subprocess.run([sys.executable, "linear_quack.py", "--configs", "64x64p,12xp"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and "--configs" in run.stderr and "'12xp'" in run.stderr


def test_linear_quack_times_lm_heads_with_fp32_logits(monkeypatch):
    """`benchmarks/linear_quack.py`: LM heads are timed writing fp32 logits, as the engine's are;
    every other weight in the input's dtype."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import linear_quack

    x = torch.zeros(2, 4, dtype=torch.bfloat16)
    heads = [name for name, _, n in linear_quack.SHAPES if n > 65536]
    assert heads == ["0.6b lm_head", "8b lm_head", "moonlight lm_head"]
    assert all(linear_quack.out_dtype(name, x) == torch.float32 for name in heads)
    assert all(linear_quack.out_dtype(name, x) == torch.bfloat16 for name, _, n in linear_quack.SHAPES if n <= 65536)


@pytest.mark.parametrize("script,option", [("decode_profile.py", "--block-size"), ("throughput.py", "--block-size"),
                                           ("attention_configs.py", "--page-size")])
def test_page_size_options_refuse_values_below_one(script, option):
    """`bench_utils.positive_int`: the parser names the option, the value and the limit, before
    anything needs a GPU."""
    run = subprocess.run([sys.executable, script, option, "0"], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 2 and option in run.stderr and "must be >= 1, got 0" in run.stderr


@pytest.mark.parametrize("script,option", [("sampler.py", "--rows"), ("linear_quack.py", "--ms")])
@pytest.mark.parametrize("value,words", [("128,x", "expected comma-separated integers"), ("64,0", "must be >= 1")])
def test_count_list_options_refuse_bad_values(script, option, value, words):
    """`bench_utils.positive_ints`: the parser names the option, the value and what it expected,
    before anything needs a GPU."""
    run = subprocess.run([sys.executable, script, option, value], cwd=BENCHMARKS, capture_output=True, text=True,
                         timeout=120, env={"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 2 and option in run.stderr and words in run.stderr and repr(value) in run.stderr


def test_decode_profile_attributes_kernels_to_steps_and_spans_them(monkeypatch):
    """`decode_profile._kernels_in_ranges`: kernels starting inside a step's range count for it
    (others, the range's own GPU annotation and CPU events do not), and each step's span runs from
    its first kernel's start to its last kernel's end (the median over steps is returned)."""
    from types import SimpleNamespace

    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import decode_profile

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, start, end, device=cuda):
        return SimpleNamespace(name=name, device_type=device, time_range=SimpleNamespace(start=start, end=end),
                               device_time_total=end - start)

    ranges = [(0.0, 100.0), (200.0, 300.0), (400.0, 500.0)]
    events = [event("gemm", 10, 40), event("attn", 45, 140), event("gemm", 210, 230), event("attn", 235, 260),
              event("gemm", 405, 410), event("attn", 420, 700), event("prefill", 150, 190),
              event(decode_profile.DECODE_STEP, 0, 900), event("host", 0, 1000, device=cpu)]
    kernels, counts, span = decode_profile._kernels_in_ranges(events, ranges)
    assert counts == {"gemm": 3, "attn": 3} and kernels[decode_profile.LAUNCHES] == 6
    assert kernels["gemm"] == (30 + 20 + 5) * 1e-6 and kernels["attn"] == (95 + 25 + 280) * 1e-6
    assert span == 130 * 1e-6  # spans 130, 50 and 295 us
    assert decode_profile._kernels_in_ranges([], ranges)[2] == 0.0


def test_decode_profile_stand_ins_launch_nothing_after_the_first_call_and_are_undone(monkeypatch):
    """`stand_ins.without` (decode_profile's --without): inside it the layers call kernel-free
    stand-ins that hand back the first call's real output (silu_and_mul, rotary_cache_write without
    touching the model's caches) or the input (RMSNorm); on exit the real ops are back. A GatedMLP,
    which looks its op up at call time, then gives one output for two inputs."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import stand_ins

    from vexact_models import layers
    from vexact_models.kernels import rope_table, rotary_cache_write, silu_and_mul

    assert stand_ins.parse_ops("silu_and_mul,rms_norm") == ["silu_and_mul", "rms_norm"]
    with pytest.raises(ValueError, match="--without: unknown op.*silu.*expected"):
        stand_ins.parse_ops("silu,rms_norm")
    gen = torch.Generator().manual_seed(0)
    g1, u1, g2, u2 = (torch.randn(3, 8, generator=gen) for _ in range(4))
    mlp = layers.GatedMLP(8, 8)
    x1, x2 = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    q, k, v = (torch.randn(2, h, 4, generator=gen) for h in (2, 1, 1))
    cos, sin = rope_table(1.0 / 10000.0 ** (torch.arange(2) / 2), 16)
    caches = [torch.zeros(4, 1, 4), torch.zeros(4, 1, 4)]
    args = (q, k, v, torch.tensor([3, 5]), cos, sin, *caches, torch.tensor([0, 2]))
    with torch.no_grad(), stand_ins.without(list(stand_ins.OPS)) as calls:
        first = layers.silu_and_mul(g1, u1)
        assert torch.equal(first, silu_and_mul(g1, u1)) and layers.silu_and_mul(g2, u2) is first
        assert torch.equal(mlp(x1), mlp(x2))
        rotated = layers.rotary_cache_write(*args)
        assert torch.equal(rotated, rotary_cache_write(q, k, v, args[3], cos, sin, torch.zeros(2, 1, 4),
                                                       torch.zeros(2, 1, 4), torch.tensor([0, 1])))
        assert all(not c.any() for c in caches) and layers.rotary_cache_write(*args) is rotated
        norm = layers.RMSNorm(8)
        assert norm(x1) is x1 and norm(x1, x2) == (x1, x1)
    assert calls == {"silu_and_mul": 4, "rotary_cache_write": 2, "rms_norm": 2}
    with stand_ins.without(["rotary_cache_write"]) as calls:
        mlp(x1)  # runs no rotary op: the stand-in bounds nothing, and says so
    assert calls == {"rotary_cache_write": 0}
    with torch.no_grad():
        assert layers.silu_and_mul is silu_and_mul and layers.rotary_cache_write is rotary_cache_write
        assert not torch.equal(mlp(x1), mlp(x2)) and not torch.equal(layers.RMSNorm(8)(x1), x1)


def test_gpu_clocks_parses_nvidia_smi_samples_and_survives_without_it(monkeypatch, tmp_path):
    """`gpu_clocks` (decode_profile's clock line): the CSV samples' medians and extremes, lines
    that are not four numbers skipped; a sampler process that prints until it is terminated; no
    nvidia-smi at all gives no summary and says so, never an error."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gpu_clocks

    text = "1980, 1980, 500.5, 700.00\n[N/A], 1980, [N/A], 700.00\n1755, 1980, 690.0, 700.00\n1830, 1980, 650.0, 700.00\n"
    summary = gpu_clocks.parse_samples(text)
    assert (summary.samples, summary.sm_median, summary.sm_min, summary.sm_max_clock) == (3, 1830, 1755, 1980)
    assert (summary.power_median, summary.power_max, summary.power_limit) == (650.0, 690.0, 700.0)
    assert "SM clock median 1830 MHz (min 1755, the card's max 1980)" in summary.line()
    assert gpu_clocks.parse_samples("No devices were found\n") is None
    uuid = "ffc79498-8ff3-c2dc-3b0d-fafd804516ae"  # as torch prints a device's uuid
    assert gpu_clocks.nvidia_smi_id(SimpleNamespace(uuid=uuid)) == "GPU-" + uuid
    assert gpu_clocks.nvidia_smi_id(SimpleNamespace(uuid="GPU-" + uuid)) == "GPU-" + uuid
    with pytest.raises(ValueError, match="interval_ms must be >= 1, got 0"):
        gpu_clocks.GpuClocks(interval_ms=0)

    with gpu_clocks.GpuClocks(command=str(tmp_path / "no-such-nvidia-smi")) as missing:
        pass
    assert missing.summary is None and "no samples" in missing.summary_line()

    sampler, printed = tmp_path / "fake-smi", tmp_path / "printed"  # samples until terminated
    sampler.write_text(f"#!{sys.executable}\nimport pathlib, sys, time\nassert '--query-gpu=clocks.sm,clocks.max.sm,"
                       "power.draw,power.limit' in sys.argv\n"
                       f"assert '--id=GPU-{uuid}' in sys.argv\nwhile True:\n    print('1500, 1980, 400, 700', flush=True)\n"
                       f"    pathlib.Path({str(printed)!r}).touch()\n    time.sleep(0.01)\n")
    sampler.chmod(0o755)
    with gpu_clocks.GpuClocks("GPU-" + uuid, command=str(sampler)) as clocks:
        import time

        deadline = time.monotonic() + 60
        while not printed.exists() and time.monotonic() < deadline:  # (a busy machine starts it slowly)
            time.sleep(0.05)
    assert clocks.summary is not None and clocks.summary.samples >= 1 and clocks.summary.sm_median == 1500


def test_workload_decode_roofline_counts_each_decode_step_once(monkeypatch):
    """`bench_utils.workload_decode_roofline` (throughput.py's floor per KV cache mode): a
    request's ``output - 1`` decode steps each read the weights and its cache up to the new
    token, at most `max_seqs` requests run at a time, and routed experts count only as many as
    the step's batch reaches."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_utils

    from vexact_models.conformance.models import build_model, make_config
    from vexact_models.layers import FusedExperts
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


def test_weight_gemms_are_the_steps_gemms_and_time_on_cpu(monkeypatch):
    """`weight_gemms` (decode_profile's cuBLAS peer): the weights are one matrix per GEMM a rollout
    step runs (q/k/v and gate/up as one once fused, every other linear, the LM head), the same
    storage as the model's parameters; a MoE model is refused by name; the CPU timing runs every
    GEMM and counts the weights' bytes; bad arguments name the argument, the value and the limit."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import weight_gemms

    from vexact_models.projections import fuse_projections
    from vexact_models.qwen3 import Qwen3ForCausalLM, tiny_config
    from vexact_models.qwen3_moe import Qwen3MoeForCausalLM
    from vexact_models.qwen3_moe import tiny_config as tiny_moe_config

    model = Qwen3ForCausalLM(tiny_config())
    layers, hidden = model.config.num_hidden_layers, model.config.hidden_size
    separate = weight_gemms.step_gemm_weights(model)
    assert len(separate) == 7 * layers + 1  # q, k, v, o, gate, up, down; the LM head
    fuse_projections(model)
    fused = weight_gemms.step_gemm_weights(model)
    assert len(fused) == 4 * layers + 1
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    qkv = fused[0]
    assert qkv.shape == (attn.q_proj.out_features + 2 * attn.k_proj.out_features, hidden)
    assert qkv.data_ptr() == attn.q_proj.weight.data_ptr() and torch.equal(qkv[-attn.v_proj.out_features:],
                                                                          attn.v_proj.weight)
    assert fused[1].data_ptr() == attn.o_proj.weight.data_ptr()
    assert fused[2].shape[0] == 2 * mlp.gate_proj.out_features
    assert fused[-1].data_ptr() == model.lm_head.weight.data_ptr()
    assert sum(w.numel() for w in fused) == sum(w.numel() for w in separate)

    with pytest.raises(ValueError, match="Qwen3MoeForCausalLM has routed-expert weights .*dense models only"):
        weight_gemms.step_gemm_weights(Qwen3MoeForCausalLM(tiny_moe_config()))

    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, w: calls.append((x.shape, w.shape)) or real_mm(x, w))
    peer = weight_gemms.time_weight_gemms(fused, batch=3, seconds=0.01)
    assert peer.seconds > 0 and peer.weight_bytes == sum(w.numel() * w.element_size() for w in fused)
    assert peer.bandwidth_gbs == peer.weight_bytes / peer.seconds / 1e9 and "no clock samples" in peer.clocks
    assert calls[:len(fused)] == [((3, w.shape[1]), (w.shape[1], w.shape[0])) for w in fused]
    calls_before = len(calls)
    from vexact_models.kernels import linear

    ours = weight_gemms.time_weight_gemms(fused[:2], batch=2, seconds=0.01, gemm=linear)
    assert ours.seconds > 0 and len(calls) == calls_before  # the given GEMM ran, not torch.mm
    for kwargs, words in [(dict(batch=0), "batch must be >= 1, got 0"), (dict(batch=2, seconds=0), "seconds must be > 0"),
                          (dict(batch=2, weights=[]), "weights is empty")]:
        with pytest.raises(ValueError, match=words):
            weight_gemms.time_weight_gemms(**{"weights": fused, **kwargs})


def test_decode_profile_reports_both_gemm_peers_and_refuses_moe(monkeypatch, capsys):
    """`decode_profile._report_gemm_peer`: one line per GEMM (cuBLAS, ours) with the weights'
    bytes, then the two rooflines, each the GEMMs' time plus the rest of the step's bytes at copy
    bandwidth; a MoE model gets one line saying why there is no peer."""
    from torch import nn

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import decode_profile

    from vexact_models.qwen3 import Qwen3ForCausalLM, tiny_config
    from vexact_models.qwen3_moe import Qwen3MoeForCausalLM
    from vexact_models.qwen3_moe import tiny_config as tiny_moe_config

    model = Qwen3ForCausalLM(tiny_config())
    weight_bytes = sum(m.weight.numel() * 4 for m in model.modules() if isinstance(m, nn.Linear))
    decode_profile._report_gemm_peer(model, 2, step=1.0, step_bytes=weight_bytes + 10 ** 9, hbm=1.0, seconds=0.01)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(",")[1].strip() for line in lines[:2]] == ["cuBLAS (torch.mm)", "ours (kernels.linear)"]
    assert all(f"{weight_bytes / 1e9:.2f} GB of weights" in line for line in lines[:2])
    # the rest, 1e9 bytes at 1 GB/s, is a second: both rooflines add the GEMMs' time to it
    cublas_ms, ours_ms = (float(x) for x in re.findall(r"(\d+\.\d+) ms", lines[2]))
    assert lines[2].startswith("Roofline with the GEMMs at those times") and min(cublas_ms, ours_ms) > 1000
    decode_profile._report_gemm_peer(Qwen3MoeForCausalLM(tiny_moe_config()), 2, 1.0, 1, 1.0, seconds=0.01)
    assert capsys.readouterr().out.startswith("GEMM peers: none (step_gemm_weights: Qwen3MoeForCausalLM has routed")
