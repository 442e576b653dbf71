"""The benchmarks' peers and checks compute what they claim (so that a timing compares like with
like): HF's router ops, norm, rotation and MLP, stock's linear-attention paths, PEFT's effective
expert weight, attention_fa4.py's alignment rows and paged cache, each against our kernels or
the peer's own code on CPU."""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
INVESTIGATIONS = BENCHMARKS / "investigations"


def test_moe_routing_peers_pick_what_the_routers_pick(monkeypatch):
    """benchmarks/moe_routing.py's torch peers (HF's router ops) compute the routing our kernels
    do: the same experts (in any order) and the same weights, so the timing compares like with
    like. Logits far apart, so float rounding cannot flip a pick; a bias large enough to change
    the picks, so a peer that dropped it would fail."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import moe_routing

    from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk_reference
    from vexact_models.kernels.moe_routing import softmax_topk_reference

    gen = torch.Generator().manual_seed(0)
    logits = torch.rand(12, 64, generator=gen).argsort(1).float() / 64 * 6 - 3
    bias = torch.rand(64, generator=gen) * 0.5
    for n_group, topk_group in ((1, 1), (8, 4)):
        w_peer, ids_peer = moe_routing.hf_grouped_topk(logits, bias, 6, n_group, topk_group, 2.5)
        w_ref, ids_ref, _ = sigmoid_grouped_topk_reference(logits, bias, 6, n_group, topk_group, True, 2.5)
        order_peer, order_ref = ids_peer.argsort(1), ids_ref.argsort(1)
        assert torch.equal(ids_peer.gather(1, order_peer), ids_ref.gather(1, order_ref))
        torch.testing.assert_close(w_peer.gather(1, order_peer), w_ref.gather(1, order_ref))
    w_peer, ids_peer = moe_routing.hf_softmax_topk(logits, 8)
    w_ref, ids_ref, _ = softmax_topk_reference(logits, 8, True)
    assert torch.equal(ids_peer, ids_ref)
    torch.testing.assert_close(w_peer, w_ref)


def test_row_kernels_peers_compute_what_the_kernels_compute(monkeypatch):
    """benchmarks/investigations/row_kernels.py's torch peers (HF's norm and rotation) compute what
    the timed kernels do, so the timing compares like with like; its tiles are the ones the norm takes."""
    monkeypatch.syspath_prepend(str(INVESTIGATIONS))
    import row_kernels

    from vexact_models.kernels import apply_rotary, rms_norm, rope_table
    from vexact_models.kernels.rms_norm import norm_tile

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 4, 128, generator=gen)
    weight = 1 + 0.1 * torch.randn(128, generator=gen)
    torch.testing.assert_close(row_kernels.hf_rms_norm(x, weight), rms_norm(x, weight, row_kernels.EPS))
    positions = torch.tensor([0, 1, 5, 17, 300, 4000])
    cos, sin = rope_table(1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128)), 4096)
    full_cos, full_sin = (torch.cat([t, t], dim=-1)[positions].unsqueeze(1) for t in (cos, sin))
    torch.testing.assert_close(row_kernels.hf_rotate(x, full_cos, full_sin), apply_rotary(x, positions, cos, sin))
    for n in (128, 1024, 4096):
        tiles = row_kernels.norm_tiles(n)
        assert norm_tile(n)[1:] in tiles
        assert all(rows * n <= 16384 for rows, _ in tiles) and (min(64, 16384 // n), 8) in tiles


def test_stock_linear_attention_puts_the_torch_path_back_and_says_why_fla_cannot_run(monkeypatch):
    """`stock_peers.stock_linear_attention`: ``torch`` makes stock's hybrid run transformers' torch
    path for the duration and restores the bound functions after; ``fla`` without the package
    raises `StockPathUnavailable` naming the import error; other paths and non-hybrids are
    ValueErrors. `bound_delta_rule` names what stock runs."""
    import sys as sys_

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import stock_peers

    from vexact_models.conformance.models import architecture_of

    arch = architecture_of("qwen3.5-35b-a3b")
    module = stock_peers.stock_module(arch)
    bound = {name: getattr(module, name) for name in stock_peers.STOCK_KERNEL_FUNCTIONS}
    assert stock_peers.is_hybrid(arch) and not stock_peers.is_hybrid(architecture_of("qwen3-30b-a3b"))
    with stock_peers.stock_linear_attention(arch, "torch"):
        for name, fn in bound.items():  # plain Python functions, not transformers 5.25's hub-kernel modules
            assert getattr(module, name) is stock_peers.plain_function(fn)
            assert not callable(fn) or inspect.isfunction(getattr(module, name)), name
        assert stock_peers.bound_delta_rule(arch) == f"{module.__name__}.torch_chunk_gated_delta_rule"
    assert all(getattr(module, name) is fn for name, fn in bound.items())
    monkeypatch.setitem(sys_.modules, "fla", None)
    with pytest.raises(stock_peers.StockPathUnavailable, match=r"^not installed \((ModuleNotFoundError|ImportError)"):
        with stock_peers.stock_linear_attention(arch, "fla"):
            pass
    with pytest.raises(ValueError, match="path 'triton' is not one of"):
        with stock_peers.stock_linear_attention(arch, "triton"):
            pass
    with pytest.raises(ValueError, match="qwen3_moe has no gated-DeltaNet layers"):
        with stock_peers.stock_linear_attention(architecture_of("qwen3-30b-a3b"), "torch"):
            pass


def test_moe_lora_peer_is_peft_s_effective_expert_weight(monkeypatch):
    """benchmarks/moe.py --lora's PEFT-way peer builds the expert tensor PEFT's ``ParamWrapper``
    builds (``W + delta``, its own `get_delta_weight`) from the same adapter tensors."""
    from peft import LoraConfig, get_peft_model

    from vexact_models.adapters import expert_adapters
    from vexact_models.registry import get

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import moe

    arch = get("qwen3_moe")
    torch.manual_seed(0)
    model = get_peft_model(arch.causal_lm_class(arch.tiny_config()), LoraConfig(
        r=4, lora_alpha=8, target_modules=[], target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        init_lora_weights=False))
    wrapper = model.base_model.model.model.layers[0].mlp.experts  # down_proj's, around gate_up_proj's
    experts, adapters = expert_adapters(wrapper)
    for name, module in (("down_proj", wrapper), ("gate_up_proj", wrapper.base_layer)):
        weight = getattr(experts, name).detach()
        with torch.no_grad():
            want = weight + module.get_delta_weight("default")
            got = moe.peft_effective(weight, adapters[name])
        assert got.shape == weight.shape and torch.allclose(got, want, rtol=1e-5, atol=1e-6), name


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


def test_gate_up_silu_refuses_swapped_configs_and_its_peer_is_the_mlp(monkeypatch):
    """benchmarks/gate_up_silu.py: a swap-AB config is refused by the parser (quack's gated epilogue
    has none), naming the option; its peer (HF's MLP ops on the fused weight) computes what
    `linear_silu_and_mul` computes."""
    run = subprocess.run([sys.executable, "gate_up_silu.py", "--configs", "64x96p:2x1,64x32ps"], cwd=BENCHMARKS,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "--configs '64x96p:2x1,64x32ps': swap-AB" in run.stderr
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gate_up_silu

    from vexact_models.kernels import linear_silu_and_mul

    x, w = torch.randn(5, 32), torch.randn(48, 32) / 32 ** 0.5
    torch.testing.assert_close(gate_up_silu.hf_ops(x, w), linear_silu_and_mul(x, w))


def test_gated_delta_torch_peer_repeats_heads_as_the_stock_layer_does(monkeypatch):
    """benchmarks/gated_delta.py hands transformers' torch chunk path q/k repeated to the value
    heads (transformers < 5.24 repeats them in the layer, not in the function): the output equals
    the function's own grouped-head result where it repeats them itself, and differs from q/k
    heads repeated in the wrong order, so the peer times the layer's arithmetic."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import gated_delta

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(70, 2, 16, generator=gen), torch.randn(70, 2, 16, generator=gen)  # 2 q/k heads
    v, g, beta = torch.randn(70, 4, 16, generator=gen), -torch.rand(70, 4, generator=gen), torch.rand(70, 4, generator=gen)
    torch_chunk = gated_delta._stock()[0]
    repeated_q, repeated_k = gated_delta._value_heads(q, k, v)
    assert repeated_q.shape == (70, 4, 16) and torch.equal(repeated_q[:, 1], q[:, 0])
    got = torch_chunk(*(x[None] for x in (repeated_q, repeated_k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0]
    wrong = torch_chunk(*(x[None] for x in (q.repeat(1, 2, 1), k.repeat(1, 2, 1), v, g, beta)),
                        use_qk_l2norm_in_kernel=True)[0]
    assert not torch.allclose(got, wrong)
    if _repeats_in_the_function(torch_chunk):
        want = torch_chunk(*(x[None] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)[0]
        assert torch.equal(got, want)


def _repeats_in_the_function(function) -> bool:
    return "repeat_interleave" in inspect.getsource(function)
