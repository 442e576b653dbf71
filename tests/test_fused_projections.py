"""Projection fusion: q/k/v and gate/up weights (and biases) moved into one buffer run as one
GEMM in rollouts, with bitwise the numbers of the separate GEMMs the training step runs."""

import pytest
import torch

from vexact_models.projections import fuse_linears, fuse_projections, grouped_linear
from vexact_models.qwen3 import Qwen3ForCausalLM, tiny_config


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Qwen3ForCausalLM(tiny_config(initializer_range=0.3)).eval()


def _storage(t):
    return t.untyped_storage().data_ptr()


def test_fusion_keeps_parameters_and_values(model):
    before = {k: v.clone() for k, v in model.state_dict().items()}
    params = dict(model.named_parameters())
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert _storage(attn.q_proj.weight) == _storage(attn.k_proj.weight) == _storage(attn.v_proj.weight)
    assert _storage(mlp.gate_proj.weight) == _storage(mlp.up_proj.weight)
    assert fuse_projections(model) == 2 * model.config.num_hidden_layers  # idempotent


def test_fused_forward_equals_separate_and_autograd_forward_bitwise(model):
    ids = torch.randint(0, 512, (2, 17))
    with torch.no_grad():
        separate = model(ids).logits
    fuse_projections(model)
    with torch.no_grad():
        fused = model(ids).logits
    with_grad = model(ids).logits  # autograd on: the separate GEMMs
    assert torch.equal(fused, separate) and torch.equal(with_grad.detach(), separate)


def _count_gemms(monkeypatch) -> list:
    """Record (weight shape, bias shape or None) of every GEMM `grouped_linear` launches."""
    import vexact_models.projections as projections

    calls = []
    real = projections.linear

    def counted(x, w, b=None, *args, **kwargs):
        calls.append((w.shape, None if b is None else b.shape))
        return real(x, w, b, *args, **kwargs)

    monkeypatch.setattr(projections, "linear", counted)
    return calls


def test_grouped_linear_uses_one_gemm_only_when_fused(model, monkeypatch):
    calls = _count_gemms(monkeypatch)
    attn = model.model.layers[0].self_attn
    group = [attn.q_proj, attn.k_proj, attn.v_proj]
    x = torch.randn(3, model.config.hidden_size)
    with torch.no_grad():
        want = grouped_linear(x, group)
        assert len(calls) == 3
        fuse_linears(group)
        calls.clear()
        got = grouped_linear(x, group)
    assert len(calls) == 1 and calls[0][0][0] == sum(lin.weight.shape[0] for lin in group)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_in_place_updates_reach_the_fused_gemm(model):
    """An optimizer step writes the parameters in place: the fused buffer sees it."""
    fuse_projections(model)
    ids = torch.randint(0, 512, (1, 9))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
        fused = model(ids).logits
    assert torch.equal(fused, model(ids).logits.detach())  # vs the separate GEMMs (autograd on)


def test_fused_model_saves_and_loads(model, tmp_path):
    fuse_projections(model)
    model.save_pretrained(tmp_path)
    again = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), model.state_dict().values()))


def _biased_group(widths=(12, 4, 4), k=8):
    """q/k/v-like linears with nonzero biases (nn.Linear's own init: uniform, never all zero)."""
    torch.manual_seed(1)
    return [torch.nn.Linear(k, n, bias=True) for n in widths]


def test_biases_fuse_into_one_buffer_and_one_gemm_bitwise(monkeypatch):
    group = _biased_group()
    params = [(lin.weight, lin.bias) for lin in group]
    values = [(lin.weight.clone(), lin.bias.clone()) for lin in group]
    x = torch.randn(5, 8)
    with torch.no_grad():
        want = [torch.nn.functional.linear(x, w, b) for w, b in values]  # biases really count
        separate = grouped_linear(x, group)
        assert fuse_linears(group) and fuse_linears(group)  # idempotent
        calls = _count_gemms(monkeypatch)
        fused = grouped_linear(x, group)
    assert calls == [(torch.Size([20, 8]), torch.Size([20]))]  # one GEMM, with the fused bias
    assert [(lin.weight, lin.bias) for lin in group] == params  # the same Parameter objects
    assert all(torch.equal(lin.weight, w) and torch.equal(lin.bias, b) for lin, (w, b) in zip(group, values))
    assert _storage(group[0].bias) == _storage(group[1].bias) == _storage(group[2].bias) != _storage(group[0].weight)
    assert all(torch.equal(f, s) for f, s in zip(fused, separate))
    assert all(torch.allclose(f, w, atol=1e-6) for f, w in zip(fused, want))


def test_a_replaced_bias_falls_back_to_separate_gemms(monkeypatch):
    """Fused weights with a bias whose ``.data`` was replaced since: the separate GEMMs, new bias included."""
    group = _biased_group()
    fuse_linears(group)
    with torch.no_grad():
        group[1].bias.data = group[1].bias.detach() + 1.0
        x = torch.randn(3, 8)
        calls = _count_gemms(monkeypatch)
        got = grouped_linear(x, group)
    assert len(calls) == 3
    assert torch.allclose(got[1], torch.nn.functional.linear(x, group[1].weight, group[1].bias), atol=1e-6)
    assert fuse_linears(group)  # fusing again picks the new bias up
    with torch.no_grad():
        assert all(torch.equal(a, b) for a, b in zip(grouped_linear(x, group), got))


def test_biased_fused_in_place_update_reaches_the_one_gemm():
    group = _biased_group()
    fuse_linears(group)
    x = torch.randn(4, 8)
    with torch.no_grad():
        for lin in group:
            lin.bias.add_(0.5)  # an optimizer step writes in place
        fused = grouped_linear(x, group)
    separate = grouped_linear(x, group)  # autograd on: the separate GEMMs
    assert all(torch.equal(f, s.detach()) for f, s in zip(fused, separate))


def test_fuse_linears_refuses_what_one_gemm_cannot_do():
    mixed = [torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 4, bias=False)]
    assert not fuse_linears(mixed)  # a zero bias for the bias-free one would flip -0.0 to +0.0
    assert not fuse_linears(mixed[::-1])
    c, d = torch.nn.Linear(8, 4, bias=False), torch.nn.Linear(6, 4, bias=False)
    assert not fuse_linears([c, d])
    e = torch.nn.Linear(8, 4, bias=False).double()
    assert not fuse_linears([c, e])
    f, g = torch.nn.Linear(8, 4, bias=True), torch.nn.Linear(8, 4, bias=True)
    g.bias.data = g.bias.data.double()
    assert not fuse_linears([f, g])
    for lin in (*mixed, c, d, e, f, g):  # refused groups are left as they were: separate storages
        assert _storage(lin.weight) not in {_storage(o.weight) for o in (*mixed, c, d, e, f, g) if o is not lin}


@pytest.mark.parametrize("shape", ["deepseek_v3", "moonlight"])
def test_mla_query_and_latent_projections_fuse_bitwise(shape):
    """MLA: q_proj (Moonlight) or q_a_proj (q-LoRA) with kv_a_proj_with_mqa, one GEMM."""
    from vexact_models.registry import get

    arch = get("deepseek_v3")
    torch.manual_seed(0)
    model = arch.causal_lm_class(arch.shape(shape).tiny_config(initializer_range=0.3)).eval()
    ids = torch.randint(0, 512, (2, 13))
    with torch.no_grad():
        separate = model(ids).logits
    layers = model.config.num_hidden_layers
    # per layer: the MLA pair; a gated MLP in the dense layer and the shared experts elsewhere
    assert fuse_projections(model) == 2 * layers
    attn = model.model.layers[0].self_attn
    first = attn.q_proj if attn.q_lora_rank is None else attn.q_a_proj
    assert _storage(first.weight) == _storage(attn.kv_a_proj_with_mqa.weight)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, separate)
    assert torch.equal(model(ids).logits.detach(), separate)
