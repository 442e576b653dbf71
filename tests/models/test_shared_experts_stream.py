"""The DeepSeek-V3 / Moonlight shared experts on a side stream beside the routed experts
(`vexact_models.side_stream`): where they run, and that their output and the layer's stay bitwise
the in-line ones, eager and in a CUDA graph. The stream checks need a GPU (docs/gpu-results.md,
thirty-second session); the CPU tests cover the fallbacks and the errors."""

import pytest
import torch

import vexact_models.deepseek_v3 as deepseek_v3
from vexact_models.conformance.models import construct
from vexact_models.deepseek_v3.modeling import DeepseekV3MoE
from vexact_models.kernels import fused_moe
from vexact_models.side_stream import SHARED_EXPERTS, beside, side_stream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams)")


def moe_layer(device: str, dtype: torch.dtype) -> DeepseekV3MoE:
    config = deepseek_v3.tiny_config(hidden_size=256, moe_intermediate_size=128, n_shared_experts=2)
    torch.manual_seed(0)
    layer = construct(DeepseekV3MoE, config, torch.device(device), dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
        layer.gate.e_score_correction_bias.normal_(0.0, 0.1)
    return layer


def streams_of_shared_experts(layer: DeepseekV3MoE) -> list:
    seen = []
    layer.shared_experts.register_forward_pre_hook(lambda module, args: seen.append(
        torch.cuda.current_stream(args[0].device) if args[0].is_cuda else None))
    return seen


def test_beside_runs_the_module_in_line_on_cpu_without_an_event():
    layer = moe_layer("cpu", torch.float32)
    x = torch.randn(5, 256)
    with torch.no_grad():
        out, ready = beside(layer.shared_experts, x)
        assert ready is None and torch.equal(out, layer.shared_experts(x))


def test_shared_experts_switch_names_the_variable_and_the_modes(monkeypatch):
    monkeypatch.setenv("VEXACT_SHARED_EXPERTS", "parallel")
    with pytest.raises(ValueError, match=r"VEXACT_SHARED_EXPERTS='parallel'.*'side', 'inline'"):
        beside(moe_layer("cpu", torch.float32).shared_experts, torch.randn(2, 256))


def test_fused_moe_rejects_add_ready_without_add():
    layer = moe_layer("cpu", torch.float32)
    x = torch.randn(3, 256)
    _, weights, ids = layer.gate(x)
    with pytest.raises(ValueError, match="add_ready was given without add"):
        fused_moe(x, layer.experts.gate_up_proj, layer.experts.down_proj, weights, ids, add_ready=object())


@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [4, 64])
def test_shared_experts_run_on_the_side_stream_with_the_in_line_bits(tokens):
    layer = moe_layer("cuda", torch.bfloat16)
    seen = streams_of_shared_experts(layer)
    x = torch.randn(tokens, 256, device="cuda").bfloat16()
    main = torch.cuda.current_stream()
    with torch.no_grad():
        with SHARED_EXPERTS.use("inline"):
            want = layer(x)
        assert seen.pop() == main
        got = layer(x)  # the default: beside the routed experts
        assert seen.pop() == side_stream(x.device) != main
        assert torch.equal(got, want)

        graph, static = torch.cuda.CUDAGraph(), torch.empty_like(x)
        static.copy_(x)
        layer(static)  # warm-up outside the capture (compiles)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            captured = layer(static)
        seen.clear()
        for _ in range(3):
            captured.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, want)
    assert seen == []  # replays launch no Python


@needs_cuda
@pytest.mark.gpu
def test_shared_experts_stay_in_line_while_autograd_records():
    layer = moe_layer("cuda", torch.bfloat16)
    seen = streams_of_shared_experts(layer)
    x = torch.randn(8, 256, device="cuda").bfloat16()
    out = layer(x)  # the parameters require grad: a training forward
    assert seen == [torch.cuda.current_stream()]
    out.float().sum().backward()
    assert layer.shared_experts.down_proj.weight.grad is not None
