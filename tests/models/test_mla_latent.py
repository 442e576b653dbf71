"""DeepSeek-V3 / Moonlight with the latent MLA KV cache (``mla_kv_cache="latent"``, docs/design.md rule 6):
conformance, HF parity, the absorbed attention's backward, the cache layout and size, the mode's
persistence, and the router reading its live weight."""

import json

import pytest
import torch
from transformers import AutoConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3ForCausalLM as HFDeepseekV3ForCausalLM

from vexact_models import deepseek_v3
from vexact_models.conformance import CONFIG_DIR, build_model
from vexact_models.conformance.suite import run_conformance
from vexact_models.deepseek_v3 import DeepseekV3ForCausalLM, randomize_router_bias
from vexact_models.deepseek_v3.latent_attention import DEFAULT_MLA_KV_CACHE, absorbed_attention
from vexact_models.deepseek_v3.modeling import DeepseekV3Attention
from vexact_models.kernels import linear
from vexact_models.kernels.attention_backward import attention_math
from vexact_models.layers import PackedContext
from vexact_models.registry import get
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.model_runner import kv_bytes_per_block


def moonlight_tiny_config(**overrides):
    """Moonlight's tiny shape (a named shape of deepseek_v3; older trees had it in its own module)."""
    fn = getattr(deepseek_v3, "moonlight_tiny_config", None)
    if fn is None:
        from vexact_models.moonlight import tiny_config as fn
    return fn(**overrides)


SHAPES = {"deepseek_v3": deepseek_v3.tiny_config, "moonlight": moonlight_tiny_config}


def rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("mode", [mode for mode in ("latent", "expanded") if mode != DEFAULT_MLA_KV_CACHE])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_rollout_logprobs_equal_training_logprobs_bitwise_in_the_other_mode(shape, mode):
    """The cache mode other than the default, set explicitly: tests/conformance/test_conformance.py
    runs every shape in the default one (`DEFAULT_MLA_KV_CACHE`)."""
    arch = get("deepseek_v3")
    model = build_model(arch, SHAPES[shape](mla_kv_cache=mode), torch.device("cpu"), torch.float32)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=16, max_tokens=8, prompt_len=40,
                             log=lambda *_: None)
    assert "preemptions" in " | ".join(s.name for s in report.scenarios), "the preemption scenario must preempt"
    assert report.tokens > 1000 and report.reproducibility_checked > 20
    assert report.mismatches == 0, [(s.name, s.mismatches, s.max_abs_diff) for s in report.scenarios]
    assert report.hf_parity is not None and report.hf_parity.vs_hf <= 1e-5 and report.ok


@pytest.fixture(scope="module", params=sorted(SHAPES))
def stock_checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"latent-{request.param}")
    torch.manual_seed(0)
    hf = HFDeepseekV3ForCausalLM(SHAPES[request.param](initializer_range=0.1))
    with torch.no_grad():
        randomize_router_bias(hf, seed=1, std=0.1)
    hf.save_pretrained(path)
    return path


def test_hf_parity_fp32_in_latent_mode(stock_checkpoint):
    """Logits, loss and every parameter's gradient of the latent mode (set at load time) against
    stock transformers; the expanded mode matches too, but not bitwise the latent one."""
    hf = HFDeepseekV3ForCausalLM.from_pretrained(stock_checkpoint, dtype=torch.float32).eval()
    ours = DeepseekV3ForCausalLM.from_pretrained(stock_checkpoint, dtype=torch.float32, mla_kv_cache="latent").eval()
    assert ours.config.mla_kv_cache == "latent"
    ids = torch.randint(0, 512, (2, 24))
    with torch.no_grad():
        want, latent = hf(ids).logits, ours(ids).logits
        ours.set_mla_kv_cache("expanded")
        expanded = ours(ids).logits
        ours.set_mla_kv_cache("latent")
    assert rel(latent, want) <= 1e-5 and rel(expanded, want) <= 1e-5
    assert not torch.equal(latent, expanded), "the latent mode must compute the absorbed form"
    loss_hf, loss_ours = hf(ids, labels=ids).loss, ours(ids, labels=ids).loss
    assert abs(float(loss_hf.detach()) - float(loss_ours.detach())) < 1e-5
    g_hf = torch.autograd.grad(loss_hf, list(hf.parameters()))
    g_ours = dict(zip([n for n, _ in ours.named_parameters()], torch.autograd.grad(loss_ours, list(ours.parameters()))))
    for (name, _), g in zip(hf.named_parameters(), g_hf):
        assert rel(g_ours[name], g) < 1e-4, name


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_absorbed_attention_backward_matches_float64_autograd(dtype, tol):
    """One layer's latent path (absorption GEMMs + latent attention, our kernels and backwards)
    against float64 autograd of the plain expanded MLA math: values and every input's gradient."""
    config = deepseek_v3.tiny_config(mla_kv_cache="latent")
    attn = DeepseekV3Attention(config, 0).to(dtype)
    heads, nope, rope, rank, v_dim = 4, config.qk_nope_head_dim, config.qk_rope_head_dim, config.kv_lora_rank, 12
    cu = torch.tensor([0, 5, 6, 19], dtype=torch.int32)
    t = 19
    inputs = [torch.randn(t, heads, nope), torch.randn(t, heads, rope), torch.randn(t, rank), torch.randn(t, 1, rope)]
    inputs = [x.to(dtype).requires_grad_() for x in inputs]
    weight = attn.kv_b_proj.weight
    out = absorbed_attention(attn, *inputs, PackedContext(cu, 13))
    grad = torch.randn(out.shape, dtype=dtype)
    got = torch.autograd.grad(out, [*inputs, weight], grad)

    ref_inputs = [x.detach().double().requires_grad_() for x in (*inputs, weight)]
    q_nope, q_rot, c, k_rot, w = ref_inputs
    k_nope, v = (c @ w.t()).view(t, heads, nope + v_dim).split([nope, v_dim], -1)
    q = torch.cat([q_nope, q_rot], -1)
    k = torch.cat([k_nope, k_rot.expand(t, heads, rope)], -1)
    want_out = attention_math(q, k, v, cu, attn.scaling)
    want = torch.autograd.grad(want_out, ref_inputs, grad.double())
    assert out.dtype == dtype and out.shape == (t, heads, v_dim) and rel(out.double(), want_out) < tol
    for name, a, b in zip(["q_nope", "q_rot", "c", "k_rot", "kv_b_proj.weight"], got, want):
        assert rel(a.double(), b) < tol, name


def _published(name, tmp_path):
    (tmp_path / "config.json").write_text((CONFIG_DIR / f"{name}.json").read_text())
    return AutoConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("name,per_token", [("moonlight-16b-a3b", 31_104), ("deepseek-v3", 70_272)])
def test_latent_kv_bytes_per_token_at_published_shapes(name, per_token, tmp_path):
    config = _published(name, tmp_path)
    layers = config.num_hidden_layers
    config.num_hidden_layers = 1  # build one layer on meta, then ask for the full stack's spec
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(config)
    model.config.num_hidden_layers = layers
    model.set_mla_kv_cache("latent")
    spec = model.kv_cache_spec()
    assert tuple(spec) == (layers, 1, 576, 512) and spec.value_in_key
    assert kv_bytes_per_block(spec, 1, torch.bfloat16) == per_token == layers * 576 * 2
    model.set_mla_kv_cache("expanded")
    assert kv_bytes_per_block(model.kv_cache_spec(), 1, torch.bfloat16) == layers * config.num_attention_heads * 320 * 2


def _tiny_latent_model(**overrides):
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(deepseek_v3.tiny_config(initializer_range=0.1, mla_kv_cache="latent", **overrides))
    with torch.no_grad():
        randomize_router_bias(model, seed=1, std=0.1)
    return model.eval()


def test_engine_allocates_the_latent_cache_with_v_a_view_of_k():
    """A silent fall-back to the expanded cache fails here: per layer one 24-dim key row per
    token (16 latent + 8 rope), V a view of K's storage, and blocks counted for K alone."""
    model = _tiny_latent_model()
    cfg = model.config
    budget = 1 << 18
    llm = LLM(model, device="cpu", kv_cache_bytes=budget, block_size=4)
    caches = llm.runner.kv_caches
    assert len(caches) == cfg.num_hidden_layers
    for k_cache, v_cache in caches:
        assert k_cache.shape[1:] == (4, 1, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        assert v_cache.shape[1:] == (4, 1, cfg.kv_lora_rank)
        assert v_cache.untyped_storage().data_ptr() == k_cache.untyped_storage().data_ptr()
        assert v_cache.data_ptr() == k_cache.data_ptr()
    assert llm.runner.num_blocks == budget // (cfg.num_hidden_layers * 4 * 24 * 4)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12]]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=5, seed=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt + out.outputs[0].token_ids])
        with torch.no_grad():
            assert torch.equal(model.token_logprobs(ids)[0, len(prompt):], torch.tensor(out.outputs[0].logprobs))


def test_engine_pages_hold_64_positions_for_a_latent_cache_and_16_otherwise():
    """`LLM`'s default page size: whole 64-key blocks per page for the latent cache (its decode
    reads them by TMA on Hopper), 16 for the expanded one; an explicit size wins."""
    from vexact_models.runtime.llm_args import default_block_size

    model = _tiny_latent_model()
    assert default_block_size(model.kv_cache_spec()) == 64
    llm = LLM(model, device="cpu", kv_cache_bytes=1 << 20)
    assert llm.engine_config.block_size == 64 and llm.runner.kv_caches[0][0].shape[1] == 64
    model.set_mla_kv_cache("expanded")
    assert default_block_size(model.kv_cache_spec()) == 16
    assert LLM(model, device="cpu", kv_cache_bytes=1 << 20).engine_config.block_size == 16
    assert LLM(model, device="cpu", kv_cache_bytes=1 << 20, block_size=8).engine_config.block_size == 8


def test_engine_refuses_a_mode_switched_after_its_cache_was_allocated():
    model = _tiny_latent_model()
    model.set_mla_kv_cache("expanded")
    llm = LLM(model, device="cpu", kv_cache_bytes=1 << 18, block_size=4)
    model.set_mla_kv_cache("latent")
    with pytest.raises(ValueError, match="mla_kv_cache='latent' but the engine's KV cache"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)


def test_mode_survives_save_pretrained_and_is_set_at_load_time(tmp_path):
    import vexact_models
    from transformers import AutoModelForCausalLM

    model = _tiny_latent_model()
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["mla_kv_cache"] == "latent"
    loaded = DeepseekV3ForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.mla_kv_cache == "latent" and loaded.kv_cache_spec().value_in_key
    assert HFDeepseekV3ForCausalLM.from_pretrained(tmp_path) is not None  # stock transformers ignores the field
    assert DeepseekV3ForCausalLM.from_pretrained(tmp_path, mla_kv_cache="expanded").config.mla_kv_cache == "expanded"
    vexact_models.patch()
    try:
        auto = AutoModelForCausalLM.from_pretrained(tmp_path, mla_kv_cache="expanded")
    finally:
        vexact_models.unpatch()
    assert type(auto) is DeepseekV3ForCausalLM and auto.config.mla_kv_cache == "expanded"
    llm = LLM(str(tmp_path), device="cpu", kv_cache_bytes=1 << 18, block_size=4)
    assert llm.runner.kv_caches[0][0].shape[-2:] == (1, 24)  # LLM(path) reads the saved mode


def test_bad_modes_are_named_errors(tmp_path):
    with pytest.raises(ValueError, match=r"config.mla_kv_cache='dense' is not an MLA KV cache mode"):
        DeepseekV3ForCausalLM(deepseek_v3.tiny_config(mla_kv_cache="dense"))
    model = _tiny_latent_model()
    with pytest.raises(ValueError, match=r"mla_kv_cache='Latent' is not an MLA KV cache mode; choose one of"):
        model.set_mla_kv_cache("Latent")
    assert model.config.mla_kv_cache == "latent"
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"mla_kv_cache=1 is not an MLA KV cache mode"):
        DeepseekV3ForCausalLM.from_pretrained(tmp_path, mla_kv_cache=1)


def test_lora_on_kv_b_proj_is_absorbed_and_rollouts_stay_bitwise():
    """PEFT LoRA on kv_b_proj (and o_proj): the latent mode absorbs the adapted weight; logits
    match stock transformers under the same adapters and rollouts equal token_logprobs."""
    peft = pytest.importorskip("peft")
    cfg = deepseek_v3.tiny_config(initializer_range=0.1)
    torch.manual_seed(0)
    hf = HFDeepseekV3ForCausalLM(cfg).eval()
    ours = DeepseekV3ForCausalLM(cfg).eval()
    ours.load_state_dict(hf.state_dict())
    ours.set_mla_kv_cache("latent")

    def lora():
        return peft.LoraConfig(r=4, lora_alpha=8, target_modules=["kv_b_proj", "o_proj"], lora_dropout=0.0,
                               init_lora_weights=False)

    hf, ours = peft.get_peft_model(hf, lora()), peft.get_peft_model(ours, lora())
    ours.load_state_dict(hf.state_dict())
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert rel(ours(input_ids=ids).logits, hf(input_ids=ids).logits) <= 1e-5
        with ours.disable_adapter():
            plain = ours(input_ids=ids).logits
        assert not torch.equal(plain, ours(input_ids=ids).logits)
    llm = LLM(ours, device="cpu", kv_cache_bytes=1 << 18, block_size=4)
    out = llm.generate([[7, 8, 9]], SamplingParams(temperature=1.0, max_tokens=5, seed=0), use_tqdm=False)[0]
    with torch.no_grad():
        lp = ours.get_base_model().token_logprobs(torch.tensor([[7, 8, 9] + out.outputs[0].token_ids]))[0, 3:]
    assert torch.equal(lp, torch.tensor(out.outputs[0].logprobs))


def test_lora_dropout_on_kv_b_proj_is_a_named_error_in_training_mode():
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_tiny_latent_model(), peft.LoraConfig(r=2, target_modules=["kv_b_proj"],
                                                                      lora_dropout=0.1))
    ids = torch.randint(0, 512, (1, 6))
    model.train()
    with pytest.raises(ValueError, match=r"self_attn.kv_b_proj: LoRA dropout on kv_b_proj cannot be absorbed"):
        model(input_ids=ids)
    model.eval()
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids).logits).all()


def test_router_reads_the_live_weight_without_an_fp32_copy():
    """bf16 router: fp32 logits equal the fp32 GEMM of the upcast operands (bitwise on the
    reference backend) and see every in-place update, including a ``.data`` write, which does
    not bump the version counter a cached copy would be keyed on."""
    model = DeepseekV3ForCausalLM(deepseek_v3.tiny_config()).to(torch.bfloat16).eval()
    gate = model.model.layers[1].mlp.gate
    hidden = torch.randn(7, 64).bfloat16()

    def fp32_logits():
        return linear(hidden.float(), gate.weight.detach().float())

    with torch.no_grad():
        before = gate(hidden)[0]
        assert before.dtype == torch.float32 and torch.equal(before, fp32_logits())
        gate.weight.add_(0.25)  # an optimizer-style update
        after_step = gate(hidden)[0]
        assert not torch.equal(after_step, before) and torch.equal(after_step, fp32_logits())
        version = gate.weight._version
        gate.weight.data.copy_(torch.randn_like(gate.weight))
        assert gate.weight._version == version  # the write a version-keyed cache would miss
        after_copy = gate(hidden)[0]
        assert not torch.equal(after_copy, after_step) and torch.equal(after_copy, fp32_logits())
