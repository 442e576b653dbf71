"""A LoRA group's shrink begun on the side stream before its base GEMM (`side_stream.shrink_beside`,
`adapters.start_shrinks`, `projections.grouped_linear`): only inside a CUDA-graph capture without
autograd; elsewhere the shrink runs in line in `lora_add`. The CPU tests cover the fallbacks and the
switch; the capture is the `gpu` test, which also checks the engine's rollouts bitwise against
``token_logprobs`` with the shrinks beside and in line."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vexact_models.adapters import lora_terms, stacked_lora, start_shrinks
from vexact_models.projections import grouped_linear
from vexact_models.side_stream import LORA_SHRINK, joined, shrink_beside, side_stream

from .model_support import SHAPES


def adapted_attention(device: str, dtype: torch.dtype):
    """A tiny Qwen3 under PEFT LoRA (r 8, fp32 adapters) and its first layer's q/k/v group."""
    arch = next(a for a, _ in SHAPES if a.name == "qwen3")
    torch.manual_seed(0)
    dims = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    model = arch.causal_lm_class(arch.shapes[0].tiny_config(**dims)).to(device, dtype).eval()
    model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", lora_dropout=0.0,
                                             init_lora_weights=False))
    attention = model.base_model.model.model.layers[0].self_attn
    return model, [attention.q_proj, attention.k_proj, attention.v_proj], attention.o_proj


def test_shrinks_stay_in_line_outside_a_capture():
    """On CPU, or on any device outside a capture, no shrink begins beside: `start_shrinks` and
    `shrink_beside` give None and `joined(None)` is None."""
    _, group, o_proj = adapted_attention("cpu", torch.float32)
    x = torch.randn(3, 128)
    term = lora_terms(o_proj)[0]
    with torch.no_grad():
        assert shrink_beside(x, term.lora_a.weight) is None and start_shrinks(x, lora_terms(o_proj)) is None
        assert joined(None) is None
        with LORA_SHRINK.use("side"):
            assert start_shrinks(x, lora_terms(group[0])) is None


def test_lora_shrink_switch_names_the_variable_and_the_modes(monkeypatch):
    monkeypatch.setenv("VEXACT_LORA_SHRINK", "parallel")
    _, _, o_proj = adapted_attention("cpu", torch.float32)
    with pytest.raises(ValueError, match=r"VEXACT_LORA_SHRINK='parallel'.*'side', 'inline'"):
        shrink_beside(torch.randn(2, 128), lora_terms(o_proj)[0].lora_a.weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (streams, CUDA graphs)")
@pytest.mark.parametrize("tokens", [4, 64])
def test_group_shrinks_run_beside_the_base_gemm_in_a_graph_with_the_in_line_bits(tokens, monkeypatch):
    """A q/k/v group with fused, stacked adapters (`fuse_linears`, `fuse_adapters`) captured in a
    CUDA graph: with ``side`` its shrink runs on the side stream, with ``inline`` on the capturing
    one; every replay equals the eager call bitwise."""
    import vexact_models.side_stream as side_stream_module
    from vexact_models.projections import fuse_linears

    model, group, _ = adapted_attention("cuda", torch.bfloat16)
    assert fuse_linears(group) and stacked_lora(group) is not None  # one shrink and one expand for the group
    streams = []
    real = side_stream_module.lora_partials
    monkeypatch.setattr(side_stream_module, "lora_partials",
                        lambda x, a: streams.append(torch.cuda.current_stream()) or real(x, a))
    x = torch.randn(tokens, 128, device="cuda").bfloat16()
    with torch.no_grad():
        want = torch.cat(grouped_linear(x, group), dim=-1)
        assert streams == []  # eager: the shrink in line, inside lora_add
        for mode in ("side", "inline"):
            graph, static = torch.cuda.CUDAGraph(), x.clone()
            with LORA_SHRINK.use(mode):
                with torch.cuda.graph(graph):
                    capturing = torch.cuda.current_stream()
                    captured = torch.cat(grouped_linear(static, group), dim=-1)
            if mode == "side":
                assert streams.pop() == side_stream(x.device) != capturing
            assert streams == []
            for _ in range(3):
                captured.zero_()
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(captured, want)
