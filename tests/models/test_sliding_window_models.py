"""What is specific to the sliding-window models (GPT-OSS, Gemma 3, OLMo 3) beyond the shared
architecture tests: HF parity in fp32 with windows shorter than the prompts (and GPT-OSS's sinks
and clamped, biased experts on), each sequence's logprobs bitwise the same alone, packed and
padded; GPT-OSS's MoE block against stock's (forward and gradients; its MXFP4 checkpoints:
test_gpt_oss_mxfp4.py); Gemma 3's per-layer-type RoPE, embedding scale, final logit soft cap and
refused options (OLMo 3's own checks: test_olmo3.py)."""

import pytest
import torch
import transformers

from vexact_models.registry import architectures

from .model_support import check_window_parity_and_batch_invariance, rel, stock_model

ARCHS = {arch.name: arch for arch in architectures() if arch.name in ("gpt_oss", "gemma3", "olmo3")}
if not ARCHS:  # Architecture.min_transformers keeps them out on older releases
    pytest.skip(f"GPT-OSS, Gemma 3 and OLMo 3 need a newer transformers than {transformers.__version__}",
                allow_module_level=True)


def stock_and_ours(arch, **overrides):
    """Stock (eager attention) and our training variant of `arch`'s tiny shape (`overrides`:
    config fields) with the same random weights, norms, biases, sinks and expert biases included."""
    hf = stock_model(arch, initializer_range=0.1, **overrides)
    hf.config._attn_implementation = "eager"  # stock's reference attention (sinks, sliding-window mask)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    return arch, hf, ours


@pytest.fixture(scope="module", params=sorted(ARCHS), ids=str)
def pair(request):
    return stock_and_ours(ARCHS[request.param])


def test_parity_with_windows_shorter_than_the_prompts(pair):
    """Windows of 8 under prompts of 40 (sinks and GPT-OSS's experts on): parity with stock and
    batch invariance (`model_support.check_window_parity_and_batch_invariance`)."""
    check_window_parity_and_batch_invariance(*pair)


def test_gradients_match_stock(pair):
    """fp32 gradients of the loss through windows, sinks and the experts match stock's."""
    _, hf, ours = pair
    ids = torch.randint(3, 512, (2, 24))
    losses = [model(ids, labels=ids).loss for model in (hf, ours)]
    for loss in losses:
        loss.backward()
    mine, stock = dict(ours.named_parameters()), dict(hf.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.embed_tokens.weight", *[n for n in mine if n.endswith(("sinks", "experts.gate_up_proj",
                                                                              "experts.down_proj_bias"))]):
        assert rel(mine[name].grad, stock[name].grad) < 1e-4, name
    hf.zero_grad()
    ours.zero_grad()


def test_windows_and_sinks_change_the_output(pair):
    """The tests above would pass with the window or the sinks ignored if they made no difference
    at these shapes: widening the window (and, for GPT-OSS, zeroing the sinks) changes the logits."""
    arch, hf, ours = pair
    wide = arch.causal_lm_class(arch.tiny_config(sliding_window=64)).eval()
    wide.load_state_dict(ours.state_dict())
    ids = torch.randint(3, 512, (1, 40))
    with torch.no_grad():
        base = ours(ids).logits
        assert rel(wide(ids).logits, base) > 1e-3
        if arch.name == "gpt_oss":
            sinkless = arch.causal_lm_class(ours.config).eval()
            sinkless.load_state_dict(ours.state_dict())
            for layer in sinkless.model.layers:
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: no sink
            assert rel(sinkless(ids).logits, base) > 1e-3


def _gpt_oss_mlps(seed: int = 0):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP as StockMLP

    from vexact_models.gpt_oss.modeling import GptOssMLP

    torch.manual_seed(seed)
    config = ARCHS["gpt_oss"].tiny_config()
    config._experts_implementation = "eager"
    stock = StockMLP(config)
    with torch.no_grad():
        for param in stock.parameters():
            param.normal_(0.0, 0.5)
    ours = GptOssMLP(config)
    ours.load_state_dict(stock.state_dict())
    return stock, ours


@pytest.mark.skipif("gpt_oss" not in ARCHS, reason="GPT-OSS is not registered on this transformers")
def test_gpt_oss_moe_block_matches_stock_forward_and_backward():
    """The router (bias, top-k softmax) and the experts (interleaved gate/up, biases, the clamped
    SwiGLU, which these weights drive past the limit) against stock's ``GptOssMLP`` in fp32."""
    stock, ours = _gpt_oss_mlps()
    x = torch.randn(1, 40, 64)
    want = stock(x)[0][0]
    got = ours(x[0])
    assert rel(got, want) < 1e-5
    gate_up = x[0] @ stock.experts.gate_up_proj[0] + stock.experts.gate_up_proj_bias[0]
    assert gate_up.abs().max() > 7.0  # the clamp acts
    g = torch.randn_like(got)
    names = ["router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias", "experts.down_proj",
             "experts.down_proj_bias"]
    want_grads = torch.autograd.grad(want, [dict(stock.named_parameters())[n] for n in names], g)
    got_grads = torch.autograd.grad(got, [dict(ours.named_parameters())[n] for n in names], g)
    for name, a, b in zip(names, got_grads, want_grads):
        assert rel(a, b) < 1e-5, name


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
def test_gemma3_layer_types_take_their_own_rope_and_embeddings_are_scaled():
    """Local and global layers read different RoPE tables (bases 1e4 and 1e6 with linear scaling
    2), and the embeddings are the table rows times sqrt(hidden) rounded to the model dtype."""
    arch = ARCHS["gemma3"]
    model = arch.causal_lm_class(arch.tiny_config()).eval()
    tables = model.model.rope.get(torch.device("cpu"))
    assert set(tables) == {"sliding_attention", "full_attention"}
    assert not torch.equal(tables["sliding_attention"][0], tables["full_attention"][0])
    ids = torch.tensor([3, 7])
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        emb = model.model.embed_tokens(ids)
        assert torch.equal(emb, model.model.embed_tokens.weight[ids] * torch.tensor(64 ** 0.5, dtype=dtype))


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
@pytest.mark.parametrize("field, value, match", [
    ("use_bidirectional_attention", True, "use_bidirectional_attention=True is not supported"),
    ("final_logit_softcapping", 0.0, "final_logit_softcapping=0.0 must be a finite number > 0"),
    ("final_logit_softcapping", float("inf"), "final_logit_softcapping=inf must be a finite number > 0"),
    ("final_logit_softcapping", -30.0, "final_logit_softcapping=-30.0 must be a finite number > 0")])
def test_gemma3_refuses_what_it_cannot_run(field, value, match):
    arch = ARCHS["gemma3"]
    with pytest.raises(ValueError, match=match):
        arch.causal_lm_class(arch.tiny_config(**{field: value}))


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
@pytest.mark.parametrize("cap", [30.0, 3.0])
def test_gemma3_final_logit_softcapping_matches_stock(cap):
    """``final_logit_softcapping``: fp32 logits and gradients as stock ``Gemma3ForCausalLM``'s
    (``cap * tanh(logits / cap)``); the cap acts (cap 3: logits bounded by it, far from the
    uncapped ones); `token_logprobs` are the capped logits' log-softmax, bitwise."""
    from vexact_models.kernels import gather_logprobs

    arch, hf, ours = stock_and_ours(ARCHS["gemma3"], final_logit_softcapping=cap)
    ids = torch.randint(3, 512, (2, 30))
    with torch.no_grad():
        logits = ours(ids).logits
        assert rel(logits, hf(ids).logits) <= arch.fp32_parity
        lp = ours.token_logprobs(ids)
        uncapped = arch.causal_lm_class(arch.tiny_config(initializer_range=0.1)).eval()
        uncapped.load_state_dict(hf.state_dict())
        plain = uncapped(ids).logits
    assert float(logits.abs().max()) <= cap
    if cap == 3.0:
        assert float(plain.abs().max()) > 5.0 and rel(logits, plain) > 0.2
    for row in range(2):
        assert torch.equal(lp[row, 1:], gather_logprobs(logits[row, :-1].contiguous(), ids[row, 1:], 1.0))
    losses = [model(ids, labels=ids).loss for model in (hf, ours)]
    for loss in losses:
        loss.backward()
    mine, stock = dict(ours.named_parameters()), dict(hf.named_parameters())
    for name in ("model.embed_tokens.weight", "model.layers.2.self_attn.q_proj.weight", "model.norm.weight"):
        assert rel(mine[name].grad, stock[name].grad) < 1e-4, name


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
def test_gemma3_final_logit_softcapping_rollouts_equal_training_bitwise():
    """The conformance suite on the tiny Gemma 3 with ``final_logit_softcapping=30.0`` (reference
    backend): every rollout logprob, in every scenario, equals `token_logprobs`' recompute
    bitwise, and the model is within the fp32 bound of stock's."""
    from vexact_models.conformance.models import build_model
    from vexact_models.conformance.suite import run_conformance

    arch = ARCHS["gemma3"]
    model = build_model(arch, arch.tiny_config(final_logit_softcapping=30.0), torch.device("cpu"), torch.float32)
    assert model.logit_softcap() == 30.0
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=32, max_tokens=16, prompt_len=30,
                             log=lambda *_: None)
    assert report.tokens > 1000 and report.mismatches == 0, [(s.name, s.mismatches) for s in report.scenarios]
    assert report.reproducibility_mismatches == 0 and report.hf_parity.vs_hf <= 1e-5 and report.ok


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
def test_gemma3_attn_logit_softcapping_is_ignored_as_stock_ignores_it():
    """Stock's Gemma 3 attention reads ``attn_logit_softcapping`` but passes no ``softcap`` to its
    attention call, so a config setting it (Gemma 2's 50.0) gives stock the same logits as without
    it; ours follows stock. Should stock ever apply it, the first assertion fails, and this model
    must then refuse the field (the attention kernels take no soft cap)."""
    arch, plain, _ = stock_and_ours(ARCHS["gemma3"])
    _, capped, ours = stock_and_ours(arch, attn_logit_softcapping=0.5)
    ids = torch.randint(3, 512, (1, 30))
    with torch.no_grad():
        want = capped(ids).logits
        assert torch.equal(want, plain(ids).logits)
        assert rel(ours(ids).logits, want) <= arch.fp32_parity


def test_layer_types_other_than_sliding_or_full_are_refused():
    from vexact_models.layers import layer_window

    config = ARCHS[sorted(ARCHS)[0]].tiny_config()
    config.layer_types = ["sliding_attention", "linear_attention", "full_attention"]
    assert layer_window(config, 0) == config.sliding_window and layer_window(config, 2) is None
    with pytest.raises(ValueError, match=r"layer_types\[1\]='linear_attention'"):
        layer_window(config, 1)


@pytest.mark.skipif("gpt_oss" not in ARCHS, reason="GPT-OSS is not registered on this transformers")
def test_gpt_oss_router_logits_and_aux_loss_match_stock():
    """``output_router_logits``: each layer's full router logits (the router's bias included) and
    HF's load-balancing loss added to the loss, as stock computes them (`_moe_forward`)."""
    _, hf, ours = stock_and_ours(ARCHS["gpt_oss"])
    ids = torch.randint(3, 512, (2, 16))
    with torch.no_grad():
        want = hf(ids, labels=ids, output_router_logits=True)
        got = ours(ids, labels=ids, output_router_logits=True)
    assert len(got.router_logits) == len(want.router_logits) == 3
    for a, b in zip(got.router_logits, want.router_logits):
        assert rel(a, b.reshape(a.shape)) < 1e-5
    assert rel(got.aux_loss, want.aux_loss) < 1e-5 and rel(got.loss, want.loss) < 1e-5


@pytest.mark.skipif("gemma3" not in ARCHS, reason="Gemma 3 is not registered on this transformers")
def test_conformance_cli_takes_the_model_type_as_arch(capsys):
    """``--arch gemma3_text`` (the HF model_type) selects the ``gemma3`` architecture."""
    from vexact_models.conformance.cli import main

    assert main(["--arch", "gemma3_text", "--parity-only"]) == 0
    out = capsys.readouterr().out
    assert "gemma3" in out and "FAIL" not in out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels at a published layer shape)")
@pytest.mark.parametrize("config_name, softcap", [("gpt-oss-20b", None), ("gemma3-text-default", None),
                                                  ("gemma3-text-default", 30.0), ("olmo3-default", None)])
def test_published_layer_shapes_conform_on_gpu(config_name, softcap):
    """The published configs at 2 layers (one sliding, one full: GPT-OSS's window of 128 with
    sinks, head dim 64; Gemma 3's window of 4096 shrunk to 64 so that prompts pass it, head dim
    256; Gemma 3 with ``final_logit_softcapping=30.0``: the Triton cap on both sides; OLMo 3 at
    transformers' default config, its window shrunk to 64 too, head dim 128), random
    bf16 weights, prompts of 200 and up to 64 new tokens: rollout logprobs equal the training
    recompute bitwise in every scenario, pages freed behind the windows included."""
    from vexact_models.conformance.models import build_model, make_config, published_shape
    from vexact_models.conformance.suite import run_conformance

    arch, _ = published_shape(config_name)
    shrunk = {"sliding_window": 64, "layer_types": ["sliding_attention", "full_attention"]}
    overrides = ({**shrunk, "final_logit_softcapping": softcap} if config_name.startswith("gemma3")
                 else shrunk if config_name.startswith("olmo3") else {})
    config = make_config(arch, config_name, layers=2, max_positions=4096, overrides=overrides)
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    report = run_conformance(arch, model, device=torch.device("cuda"), pool_size=64, max_tokens=64, prompt_len=200,
                             log=lambda *_: None)
    assert report.tokens > 2000 and report.mismatches == 0, [(s.name, s.mismatches) for s in report.scenarios]
    assert report.reproducibility_mismatches == 0 and report.ok, str(report.hf_parity)
