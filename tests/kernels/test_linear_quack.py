"""quack's Hopper GEMM as a launch of `linear` (`kernels/linear_quack.py`, ``VEXACT_LINEAR``).

On CPU: the measured config table, the switch, and the reasons quack cannot run. On a Hopper GPU
with the optional quack-kernels package: quack rows bitwise equal to our Triton kernel's (every
config the table returns, bias, fp32 logits, M from 1 to 1,000), ``auto`` really running quack at
decode batches (and ``triton`` not), CUDA-graph replay, and an engine's rollout through quack
equal to the training recompute through our kernel."""

import pytest
import torch

from vexact_models.kernels import UnsupportedError, linear, linear_backend_mode, use_linear_backend
from vexact_models.kernels import linear_quack as lq


def test_the_table_covers_decode_batches_only():
    assert lq.pick_config(0, 4096, 1024) is None and lq.pick_config(257, 4096, 1024) is None  # prefill, training
    assert lq.pick_config(1, 4096, 4096) == lq.QuackConfig(64, 16, True, swap_ab=True)  # one sequence
    assert lq.pick_config(16, 151936, 4096) is None  # LM head below 65 rows: ours is as fast
    assert lq.pick_config(32, 4096, 4096) == lq.QuackConfig(64, 32, True, swap_ab=True)
    assert lq.pick_config(64, 1024, 3072) == lq.QuackConfig(64, 16, True, swap_ab=True)  # 0.6B down: narrow N
    assert lq.pick_config(64, 24576, 4096) == lq.QuackConfig(64, 64, True, swap_ab=True)
    assert lq.pick_config(128, 4096, 4096) == lq.QuackConfig(64, 64, True, 2, 1)  # Qwen3-8B o
    assert lq.pick_config(128, 6144, 4096) == lq.QuackConfig(64, 96, True, 2, 1)  # Qwen3-8B q/k/v
    assert lq.pick_config(128, 24576, 4096) == lq.QuackConfig(64, 192, True, 2, 1)  # Qwen3-8B gate/up
    assert lq.pick_config(128, 5632, 2048) == lq.QuackConfig(64, 96, True, 2, 1)  # Moonlight shared gate/up
    assert lq.pick_config(128, 151936, 4096) == lq.QuackConfig(64, 192, True, 2, 1)  # LM head
    assert lq.pick_config(128, 1024, 3072) == lq.QuackConfig(64, 32, True, swap_ab=True)
    assert lq.pick_config(160, 151936, 1024) == lq.QuackConfig(192, 128, True)  # LM heads: compute-bound
    assert lq.pick_config(200, 151936, 4096) == lq.SM90_DEFAULT
    assert lq.pick_config(256, 163840, 2048) == lq.SM90_DEFAULT
    assert lq.pick_config(160, 4096, 4096) == lq.QuackConfig(192, 64, True)  # one 192-row tile
    assert lq.pick_config(160, 2048, 2048) is None  # Moonlight o: ours is faster there
    assert lq.pick_config(192, 2048, 2816) == lq.QuackConfig(64, 64, True, swap_ab=True)
    assert lq.pick_config(256, 2048, 2048) == lq.QuackConfig(64, 64, True, 2, 1)
    assert lq.pick_config(256, 5120, 2048) == lq.QuackConfig(64, 192, True, 2, 1)  # Qwen3-30B-A3B q/k/v
    assert lq.pick_config(192, 24576, 4096) == lq.QuackConfig(192, 128, True)
    assert lq.pick_config(192, 1024, 3072) == lq.QuackConfig(64, 64, True, swap_ab=True)
    assert lq.pick_config(224, 4096, 4096) == lq.QuackConfig(128, 64, True, 2, 1)
    assert lq.pick_config(256, 4096, 12288) == lq.QuackConfig(128, 64, True, 2, 1)  # Qwen3-8B down
    assert lq.pick_config(256, 6144, 4096) == lq.QuackConfig(64, 192, True, 2, 1)
    assert lq.pick_config(256, 24576, 4096) == lq.SM90_DEFAULT


def test_table_configs_lists_every_config_the_table_returns():
    listed = lq.table_configs()
    assert len(listed) == len(set(listed)) and listed[-1] == lq.SM90_DEFAULT
    for m in range(1, 300):
        for n in (8, 1024, 1032, 2048, 3648, 4096, 5120, 6144, 16384, 24576, 65536, 65544, 151936):
            cfg = lq.pick_config(m, n, 4096)
            assert cfg is None or cfg in listed, (m, n, cfg)


def test_the_default_is_auto_and_the_environment_or_override_chooses(monkeypatch):
    monkeypatch.delenv(lq.ENV_VAR, raising=False)
    assert linear_backend_mode() == "auto"
    monkeypatch.setenv(lq.ENV_VAR, "triton")
    assert linear_backend_mode() == "triton"
    with use_linear_backend("quack"):
        assert linear_backend_mode() == "quack"
    assert linear_backend_mode() == "triton"
    monkeypatch.setenv(lq.ENV_VAR, "cublas")
    with pytest.raises(ValueError, match="VEXACT_LINEAR='cublas' is not a linear backend"):
        linear_backend_mode()


def test_cpu_tensors_run_ours_under_auto_and_a_forced_quack_says_why():
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert lq.choose(x, w, None, torch.bfloat16) is None
    with use_linear_backend("triton"):
        assert lq.choose(x, w, None, torch.bfloat16) is None
    with use_linear_backend("quack"), pytest.raises(UnsupportedError, match="VEXACT_LINEAR=quack cannot run"):
        lq.choose(x, w, None, torch.bfloat16)


def test_as_in_capture_holds_for_its_block_only_and_cpu_tensors_still_run_ours():
    x, w = torch.zeros(128, 64, dtype=torch.bfloat16), torch.zeros(256, 64, dtype=torch.bfloat16)
    assert not lq._captured_choice(x)
    with lq.as_in_capture():
        assert lq._AS_IN_CAPTURE.get()
        assert not lq._captured_choice(x)  # a CPU tensor: nothing to capture, ours runs
        assert lq.choose(x, w, None, torch.bfloat16) is None
        with lq.as_in_capture():
            pass
        assert lq._AS_IN_CAPTURE.get()  # a nested block leaves the outer one in force
    assert not lq._AS_IN_CAPTURE.get()
    with pytest.raises(RuntimeError, match="inside"), lq.as_in_capture():
        raise RuntimeError("inside")
    assert not lq._AS_IN_CAPTURE.get()


def test_a_device_without_cuda_is_named():
    assert "needs a CUDA GPU" in lq.device_unavailable_reason("cpu")
    if not torch.cuda.is_available():
        assert "needs a CUDA GPU" in lq.device_unavailable_reason()


def test_unavailable_reasons_name_the_first_failing_requirement(monkeypatch):
    x, w = torch.zeros(16, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    monkeypatch.setattr(lq, "_quack", lambda: "ModuleNotFoundError: No module named 'quack'")
    assert "pip install quack-kernels" in lq.quack_unavailable_reason(x, w, None, torch.bfloat16)
    monkeypatch.setattr(lq, "_quack", lambda: (None, None))  # importable: the next checks speak
    assert "dtypes x=torch.float32" in lq.quack_unavailable_reason(x.float(), w.float(), None, torch.float32)
    assert "bias dtype torch.float32" in lq.quack_unavailable_reason(x, w, torch.zeros(32), torch.bfloat16)
    assert "K=60" in lq.quack_unavailable_reason(x[:, :60], w[:, :60], None, torch.bfloat16)
    assert "devices x=cpu" in lq.quack_unavailable_reason(x, w, None, torch.bfloat16)


_QUACK_MISSING = lq.device_unavailable_reason()
needs_quack = pytest.mark.skipif(_QUACK_MISSING is not None, reason=f"quack: {_QUACK_MISSING}")


@pytest.mark.parametrize("k,n,bias,out_dtype", [(1024, 4096, False, torch.bfloat16), (3072, 1024, True, torch.bfloat16),
                                                (4096, 6144, True, torch.bfloat16),
                                                (1024, 151936, False, torch.float32)])
@pytest.mark.parametrize("config", lq.table_configs(), ids=str)
@pytest.mark.gpu
@needs_quack
def test_quack_rows_are_our_linear_rows_bitwise(k, n, bias, out_dtype, config):
    from vexact_models.kernels.linear import linear_triton

    gen = torch.Generator(device="cuda").manual_seed(k + n)
    x = torch.randn(1000, k, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=gen) / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda", generator=gen).bfloat16() if bias else None
    want = linear_triton(x, w, b, out_dtype)
    for m in (1, 16, 33, 65, 128, 256, 1000):
        assert torch.equal(lq.linear_quack(x[:m], w, b, out_dtype, config), want[:m]), m


def _kernel_names(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.gpu
@needs_quack
def test_auto_runs_quack_while_a_graph_captures_and_ours_eagerly(monkeypatch):
    """``auto`` takes quack only inside CUDA-graph capture (an eager call is host-bound, and
    quack's launch costs more); ``triton`` never does. The first quack call compiles inside the
    capture (a shape no other test runs)."""
    x = torch.randn(96, 1536, device="cuda").bfloat16()
    w = torch.randn(2560, 1536, device="cuda").bfloat16()
    calls = []
    real = lq.linear_quack
    monkeypatch.setattr(lq, "linear_quack", lambda *args: calls.append(args[0].shape[0]) or real(*args))

    def captured(mode):
        with use_linear_backend(mode):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = linear(x, w)
            graph.replay()
            return out.clone()

    with use_linear_backend("auto"):
        eager = linear(x, w)
        eager_kernels = _kernel_names(lambda: linear(x, w))
    assert not calls and any("_linear" in name for name in eager_kernels), eager_kernels
    auto_out = captured("auto")
    assert calls == [96]
    calls.clear()
    assert torch.equal(captured("triton"), auto_out) and not calls
    assert torch.equal(eager, auto_out)


@pytest.mark.gpu
@needs_quack
def test_quack_replays_in_a_cuda_graph():
    x = torch.randn(128, 2048, device="cuda").bfloat16()
    w = torch.randn(1024, 2048, device="cuda").bfloat16()
    with use_linear_backend("quack"):
        linear(x, w)  # compiles outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = linear(x, w)
        x.copy_(torch.randn_like(x))
        graph.replay()
    with use_linear_backend("triton"):
        assert torch.equal(out, linear(x, w))


@pytest.mark.gpu
@needs_quack
def test_an_engine_rollout_through_quack_equals_the_training_recompute_through_ours(monkeypatch):
    """Decode steps of 80 sequences run quack (auto); the training recompute of whole sequences
    runs our kernel. The logprobs are bitwise equal; under ``triton`` quack never runs, and the
    logprobs are the same again. Each graph's eager warm-up runs quack first (`as_in_capture`), so
    that quack compiles outside the capture."""
    import vexact_models.qwen3 as qwen3
    from vexact_models.runtime import LLM, SamplingParams

    ran = []  # the shapes quack computed (a spy: the real function runs)
    captured_first = set()  # (weight shape, config, dtype) whose first quack call came inside a capture
    seen = set()
    real = lq.linear_quack

    def spy(x2d, weight, bias, out_dtype, config):
        ran.append((x2d.shape[0], weight.shape[0], x2d.shape[1]))
        key = (tuple(weight.shape), config, out_dtype)
        if key not in seen and torch.cuda.is_current_stream_capturing():
            captured_first.add(key)
        seen.add(key)
        return real(x2d, weight, bias, out_dtype, config)

    monkeypatch.setattr(lq, "linear_quack", spy)
    asked = set()  # what `choose` answered, for the failure message
    real_choose = lq.choose

    def choose_spy(x2d, weight, bias, out_dtype):
        cfg = real_choose(x2d, weight, bias, out_dtype)
        reason = lq.quack_unavailable_reason(x2d, weight, bias, out_dtype) if cfg is None else None
        asked.add((x2d.shape[0], weight.shape[0], x2d.shape[1], cfg is not None, reason))
        return cfg

    monkeypatch.setattr(lq, "choose", choose_spy)
    torch.manual_seed(0)
    config = qwen3.tiny_config(initializer_range=0.5, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                               head_dim=64, intermediate_size=512)
    model = qwen3.Qwen3ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompts = [[(7 * i + j) % 500 + 2 for j in range(5 + i % 9)] for i in range(80)]
    params = SamplingParams(temperature=0.8, max_tokens=12, seed=5, ignore_eos=True)

    def rollout(mode):
        with use_linear_backend(mode):  # a fresh engine: its graphs capture under `mode`
            llm = LLM(model, block_size=16, max_num_seqs=80, max_num_batched_tokens=1024, kv_cache_bytes=1 << 26)
            outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    got = rollout("auto")
    assert any(m >= 65 for m, _, _ in ran), f"auto never ran quack at a decode batch: {sorted(asked, key=str)[:40]}"
    # the graphs' eager warm-ups (`as_in_capture`) ran every quack kernel before its capture did
    assert not captured_first, f"first quack calls inside a capture: {sorted(captured_first, key=str)[:5]}"
    ran.clear()
    assert rollout("triton") == got and not ran
    for prompt, (tokens, logprobs) in zip(prompts[:: 9], got[:: 9]):
        with torch.no_grad(), use_linear_backend("triton"):
            lp = model.token_logprobs(torch.tensor([prompt + tokens] * 3, device="cuda"), temperature=0.8)
        assert torch.equal(lp[0, len(prompt):].cpu(), torch.tensor(logprobs))


def test_an_unverified_gpu_generation_is_named(monkeypatch):
    from vexact_models.kernels._triton import unverified_gpu_reason

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert unverified_gpu_reason("cuda:7", (9,), "quack's alignment") == (
        "GPU capability 8.0: quack's alignment is verified on capability 9.x (Hopper) only")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert unverified_gpu_reason("cuda:6", (9,), "quack's alignment") is None
