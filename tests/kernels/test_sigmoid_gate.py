import pytest
import torch

from vexact_models.kernels import sigmoid_gate

from ..conftest import rel_err


def _attention_gate(tokens, heads, dim, dtype):
    """The attention output and its gate as HF's gated attention has them: the gate a strided view
    of the ``q_proj`` output ``[tokens, heads, 2 * dim]`` (query, then gate, per head)."""
    q_proj = torch.randn(tokens, heads, 2 * dim).to(dtype) * 3
    return torch.randn(tokens, heads, dim).to(dtype), q_proj[..., dim:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_sigmoid_gate_matches_transformers(dtype):
    x, gate = _attention_gate(9, 4, 32, dtype)
    out = sigmoid_gate(x, gate)
    assert out.shape == x.shape and out.dtype == dtype
    hf = x * torch.sigmoid(gate)  # HF's torch path, at its rounding points
    assert rel_err(out, hf) < {torch.float64: 1e-15, torch.float32: 1e-6, torch.bfloat16: 1e-3}[dtype]
    if dtype == torch.bfloat16:  # HF rounds sigmoid(gate) to bf16 first, as we do; within one step of it
        assert ((out.double() - hf.double()).abs() <= 2 ** -7 * hf.double().abs() + 1e-30).all()
    # the shared expert's gate: one value a row
    h, g = torch.randn(7, 40).to(dtype), torch.randn(7, 1).to(dtype)
    assert rel_err(sigmoid_gate(h, g), torch.sigmoid(g) * h) < {torch.float64: 1e-15, torch.float32: 1e-6,
                                                                 torch.bfloat16: 1e-3}[dtype]


def test_sigmoid_gate_rows_invariant_to_batch():
    x, gate = _attention_gate(40, 3, 64, torch.bfloat16)
    single = torch.cat([sigmoid_gate(x[i:i + 1], gate[i:i + 1]) for i in range(40)])
    assert torch.equal(sigmoid_gate(x, gate), single)
    assert torch.equal(sigmoid_gate(x, gate.contiguous()), single)
    h, g = torch.randn(40, 24).bfloat16(), torch.randn(40, 1).bfloat16()
    assert torch.equal(sigmoid_gate(h, g), torch.cat([sigmoid_gate(h[i:i + 1], g[i:i + 1]) for i in range(40)]))


def test_sigmoid_gate_backward_matches_autograd():
    x = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    gate = torch.randn(5, 3, 8, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(5, 3, 8, dtype=torch.float64)
    got = torch.autograd.grad(sigmoid_gate(x, gate), (x, gate), dy)
    want = torch.autograd.grad(x * torch.sigmoid(gate), (x, gate), dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)
    g1 = torch.randn(5, 3, 1, dtype=torch.float64, requires_grad=True)
    got = torch.autograd.grad(sigmoid_gate(x, g1), (x, g1), dy)
    want = torch.autograd.grad(x * torch.sigmoid(g1), (x, g1), dy)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-14)


def test_sigmoid_gate_errors():
    with pytest.raises(ValueError, match=r"gate \(2, 3\) torch.float32 must be x's shape \(2, 4\) or \(2, 1\)"):
        sigmoid_gate(torch.randn(2, 4), torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"of x's dtype torch.float32"):
        sigmoid_gate(torch.randn(2, 4), torch.randn(2, 4).double())


def test_shared_expert_with_its_gate_on_fused_moe_matches_transformers():
    """What a Qwen3.5-MoE / Qwen3-Next MoE layer computes from these kernels: the shared expert
    (`linear`, `silu_and_mul`, `linear`), its gate (`linear` to one column, `sigmoid_gate`) and the
    routed experts with the gated shared output added in the combine (`fused_moe(add=...)`), against
    transformers' `Qwen3_5MoeSparseMoeBlock` in fp32."""
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    from vexact_models.kernels import fused_moe, linear, silu_and_mul, softmax_topk

    config = Qwen3_5MoeTextConfig(hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
                                  num_experts=8, num_experts_per_tok=2)
    block = Qwen3_5MoeSparseMoeBlock(config)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn_like(p) / 4)
    x = torch.randn(1, 11, 32)
    want = block(x).detach()[0]
    h = x[0]
    se = block.shared_expert
    shared = linear(silu_and_mul(linear(h, se.gate_proj.weight), linear(h, se.up_proj.weight)), se.down_proj.weight)
    gated = sigmoid_gate(shared, linear(h, block.shared_expert_gate.weight))
    weights, ids = softmax_topk(linear(h, block.gate.weight), 2, True)
    got = fused_moe(h, block.experts.gate_up_proj.detach(), block.experts.down_proj.detach(), weights, ids, add=gated)
    assert rel_err(got, want) < 1e-5
