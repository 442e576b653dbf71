"""decode_profile.py's helpers, on CPU: kernels attributed to decode steps and their GPU span,
the kernel-free stand-ins of `--without`, the clock sampler, and the GEMM peers."""

import re
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


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
    # idle stretches inside the steps, by the kernel after them: 40 -> 45 before attn, 230 -> 235
    # before attn, 410 -> 420 before attn; an overlapping kernel (norm inside attn) is no gap,
    # and the prefill between the ranges counts for none
    overlapping = events + [event("norm", 430, 440), event("sampler", 710, 712)]
    idle = decode_profile._idle_before(overlapping, ranges)
    assert idle == {"attn": pytest.approx((5 + 5 + 10) * 1e-6)}
    assert decode_profile._idle_before([], ranges) == {}


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
    from vexact_models.qwen3_5 import Qwen3_5ForCausalLM
    from vexact_models.qwen3_5 import tiny_config as tiny_hybrid_config
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
    # a dense hybrid: its gated-DeltaNet layers' 3-D depthwise convolution is no routed expert;
    # their projections (q/k/v/z, b/a fused, out) are GEMMs of the step, the convolution is not
    hybrid = Qwen3_5ForCausalLM(tiny_hybrid_config())
    fuse_projections(hybrid)
    gemms = weight_gemms.step_gemm_weights(hybrid)
    delta = hybrid.model.layers[0].linear_attn
    assert any(p.dim() == 3 for p in hybrid.parameters())
    assert all(w.dim() == 2 for w in gemms) and delta.conv1d.weight.data_ptr() not in {w.data_ptr() for w in gemms}
    assert delta.out_proj.weight.data_ptr() in {w.data_ptr() for w in gemms}
    linear_values = sum(m.weight.numel() for m in hybrid.modules() if isinstance(m, torch.nn.Linear))
    assert sum(w.numel() for w in gemms) == linear_values

    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda x, w: calls.append((x.shape, w.shape)) or real_mm(x, w))
    peer = weight_gemms.time_weight_gemms(fused, batch=3, seconds=0.01)
    assert peer.seconds > 0 and peer.weight_bytes == sum(w.numel() * w.element_size() for w in fused)
    assert peer.bandwidth_gbs == peer.weight_bytes / peer.seconds / 1e9 and "no clock samples" in peer.clocks
    assert peer.clock_summary is None  # the numbers behind the line: none without samples
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


def test_profiled_steps_are_the_full_batch_decode_steps_or_the_prompt_steps(monkeypatch):
    """`decode_profile._mark_steps` on a real engine (tiny Qwen3, CPU): by default it marks exactly
    the decode steps of the whole batch; with `prompt_steps`, exactly the steps with prompt
    tokens, whose new tokens add up to the prompts' (and the decode rows sharing them);
    `_median_step` times the same kinds of steps."""
    import torch

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import decode_profile

    from vexact_models import qwen3
    from vexact_models.runtime import LLM, SamplingParams

    torch.manual_seed(0)
    model = qwen3.Qwen3ForCausalLM(qwen3.tiny_config()).eval()
    prompts = [[5 + i + j for j in range(20)] for i in range(3)]  # 60 prompt tokens, chunks of <= 24
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    for prompt_steps in (False, True):
        llm = LLM(model, device="cpu", block_size=4, max_num_seqs=3, max_num_batched_tokens=24,
                  kv_cache_bytes=1 << 22)
        seen = []
        launch = llm._launch
        llm._launch = lambda scheduled: seen.append([item.num_new_tokens for item in scheduled]) or launch(scheduled)
        tokens = decode_profile._mark_steps(llm, 3, prompt_steps)
        llm.step_times = []
        llm.generate(prompts, params, use_tqdm=False)
        want = [sum(s) for s in seen if (max(s) > 1 if prompt_steps else s == [1, 1, 1])]
        assert tokens == want and want
        # the timed run (_median_step) picks the same steps from the steps' summaries
        assert sum(decode_profile._picked(n, d, 3, prompt_steps) for n, d, _ in llm.step_times) == len(want)
        if prompt_steps:
            assert sum(tokens) >= 60 and all(n <= 24 for n in tokens)
        assert not llm.async_scheduling
        assert decode_profile._median_step(llm, prompts, params, 3, False, prompt_steps) > 0
    assert decode_profile.is_profiled_step([], 3) is False and decode_profile.is_profiled_step([], 3, True) is False
