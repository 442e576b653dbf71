"""The DeepSeek-V3 / Moonlight shared experts and the gated shared expert of Qwen3.5-MoE / Qwen3-Next
on a side stream beside the routed experts (`vexact_models.side_stream`): where they run, and that
their output and the layer's stay bitwise the in-line ones. Only a CUDA-graph capture puts them
beside (eager calls stay in line). The stream checks need a GPU (`python -m pytest -q -m gpu` on
it; H200 figures from `benchmarks/shared_experts.py` in docs/performance.md); the CPU tests cover
the fallbacks and the errors."""

import pytest
import torch

import vexact_models.deepseek_v3 as deepseek_v3
import vexact_models.qwen3_5_moe as qwen3_5_moe
from vexact_models.conformance.models import construct
from vexact_models.deepseek_v3.modeling import DeepseekV3MoE
from vexact_models.qwen3_5_moe.modeling import Qwen3_5MoeSparseMoeBlock
from vexact_models.kernels import fused_moe
from vexact_models.side_stream import SHARED_EXPERTS, _records_autograd, beside, side_stream

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams)")


def random_layer(cls, config, device: str, dtype: torch.dtype):
    """A MoE block of `cls` on `device`, its weights (and router bias, where it has one) random."""
    torch.manual_seed(0)
    layer = construct(cls, config, torch.device(device), dtype).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0.0, 0.05)
        bias = getattr(layer.gate, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0.0, 0.1)
    return layer


def moe_layer(device: str, dtype: torch.dtype) -> DeepseekV3MoE:
    config = deepseek_v3.tiny_config(hidden_size=256, moe_intermediate_size=128, n_shared_experts=2)
    return random_layer(DeepseekV3MoE, config, device, dtype)


def qwen3_5_moe_layer(device: str, dtype: torch.dtype) -> Qwen3_5MoeSparseMoeBlock:
    config = qwen3_5_moe.tiny_config(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=256)
    return random_layer(Qwen3_5MoeSparseMoeBlock, config, device, dtype)


LAYERS = {"deepseek_v3": (moe_layer, "shared_experts"), "qwen3_5_moe": (qwen3_5_moe_layer, "shared_expert")}


def streams_of_shared_experts(layer, name: str = "shared_experts") -> list:
    seen = []
    getattr(layer, name).register_forward_pre_hook(lambda module, args: seen.append(
        torch.cuda.current_stream(args[0].device) if args[0].is_cuda else None))
    return seen


def test_beside_runs_a_call_over_the_module_in_line_on_cpu():
    """`call` in place of the module's forward (the Qwen3.5-MoE block's gated shared expert): run
    here without an event, and the block's output is the routed experts plus it."""
    layer = qwen3_5_moe_layer("cpu", torch.float32)
    x = torch.randn(5, 256)
    with torch.no_grad():
        out, ready = beside(layer, x, call=layer.gated_shared_expert)
        want = torch.sigmoid(layer.shared_expert_gate(x)) * layer.shared_expert(x)
        assert ready is None and torch.allclose(out, want, rtol=1e-6, atol=1e-7)
        _, weights, ids = layer.gate(x)
        routed = fused_moe(x, layer.experts.gate_up_proj, layer.experts.down_proj, weights, ids)
        assert torch.equal(layer(x), routed + out)


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
@pytest.mark.parametrize("arch", sorted(LAYERS))
def test_shared_experts_run_on_the_side_stream_in_a_graph_with_the_in_line_bits(tokens, arch):
    make, name = LAYERS[arch]
    layer = make("cuda", torch.bfloat16)
    seen = streams_of_shared_experts(layer, name)
    x = torch.randn(tokens, 256, device="cuda").bfloat16()
    with torch.no_grad():
        with SHARED_EXPERTS.use("inline"):
            want = layer(x)
        assert seen.pop() == torch.cuda.current_stream()
        assert torch.equal(layer(x), want)  # eager calls stay in line, whatever the mode
        assert seen.pop() == torch.cuda.current_stream()

        for mode, beside_it in (("side", True), ("inline", False)):
            graph, static = torch.cuda.CUDAGraph(), x.clone()
            with SHARED_EXPERTS.use(mode):
                with torch.cuda.graph(graph):
                    capturing = torch.cuda.current_stream()
                    captured = layer(static)
            assert (seen.pop() == side_stream(x.device) != capturing) if beside_it else seen.pop() == capturing
            for _ in range(3):
                captured.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, want)
    assert seen == []  # replays run no Python


def test_shared_experts_stay_in_line_while_autograd_records():
    """The rule `beside` applies before it forks (it forks only in a capture, on CUDA)."""
    layer = moe_layer("cpu", torch.float32)
    x = torch.randn(3, 256)
    assert _records_autograd(layer.shared_experts, x)  # the parameters require grad: a training forward
    assert _records_autograd(layer.shared_experts, x.requires_grad_()) and not _records_autograd(
        layer.shared_experts.requires_grad_(False), x.detach())
    with torch.no_grad():
        assert not _records_autograd(layer.shared_experts.requires_grad_(True), x)
