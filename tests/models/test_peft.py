"""PEFT LoRA on every architecture at every shape (LoRA targets and the fused rollout
projections differ, e.g. MLA with and without q-LoRA): adapters run (with the aligned kernels) in the training
forward and in rollouts, bitwise alike; gradients reach every adapter; unsupported PEFT features
are errors (docs/design.md section 8, drop-in). Real peft, real get_peft_model."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from vexact_models.runtime import SamplingParams

from ..runtime.llm_support import gen, make_llm, prompts_for, training_logprobs
from .model_support import ARCHS, SHAPES, rel, shape_id, stock_model

pytestmark = pytest.mark.compat


def lora(**overrides) -> LoraConfig:
    # init_lora_weights=False: random A and B, so that the adapters change the output from the start
    fields = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    fields.update(overrides)
    return LoraConfig(**fields)


def ours_and_stock(arch, shape=None):
    """Our model and the stock HF model with the same weights, at `shape` (default: the first)."""
    hf = stock_model(arch, shape=shape)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    return ours, hf


@pytest.fixture(scope="module", params=SHAPES, ids=shape_id)
def peft_pair(request):
    """(architecture, our model with LoRA on every linear layer, stock HF + the same LoRA, base logits)."""
    arch, shape = request.param
    ours, hf = ours_and_stock(arch, shape)
    ids = torch.randint(0, 512, (2, 11))
    with torch.no_grad():
        base_logits = ours(ids).logits
    torch.manual_seed(1)
    peft_ours = get_peft_model(ours, lora())
    peft_hf = get_peft_model(hf, lora())
    adapters = {k: v for k, v in peft_ours.state_dict().items() if "lora_" in k}
    assert adapters and peft_hf.load_state_dict(adapters, strict=False).unexpected_keys == []
    return arch, peft_ours, peft_hf, ids, base_logits


def stock_peft_runs(arch) -> bool:
    """Stock DeepSeek-V3 (and GLM-4.5, whose router is DeepSeek-V3's) before transformers 5.13 reads
    its router's bias through the module PEFT wraps around the router, and fails: no stock reference
    there (our model is unaffected)."""
    import transformers
    from packaging.version import Version

    return arch.hf_causal_lm_class not in ("transformers.DeepseekV3ForCausalLM", "transformers.Glm4MoeForCausalLM") \
        or Version(transformers.__version__) >= Version("5.13")


def test_adapters_change_logits_as_stock_peft_does_and_disabling_restores(peft_pair):
    arch, peft_ours, peft_hf, ids, base_logits = peft_pair
    with torch.no_grad():
        with_adapters = peft_ours(ids).logits
        assert not torch.equal(with_adapters, base_logits)
        if stock_peft_runs(arch):
            assert rel(with_adapters, peft_hf(ids).logits) <= arch.fp32_parity
        with peft_ours.disable_adapter():
            assert torch.equal(peft_ours(ids).logits, base_logits)
        assert torch.equal(peft_ours(ids).logits, with_adapters)


def test_rollout_with_adapters_equals_token_logprobs(peft_pair):
    arch, peft_ours, _, _, _ = peft_pair
    prompts = prompts_for(4, seed=3)
    llm = make_llm(peft_ours)
    outs = gen(llm, prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True))
    base = make_llm(peft_ours.get_base_model())
    with peft_ours.disable_adapter():
        plain = gen(base, prompts, SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True))
    assert [o.outputs[0].logprobs for o in outs] != [o.outputs[0].logprobs for o in plain]
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert torch.equal(training_logprobs(peft_ours, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))


def test_generate_with_adapters_steps_over_its_cache_as_the_rollout(peft_pair):
    """PEFT's ``generate`` reaches ours, whose steps run over its own KV cache with the adapters
    active: the logits are bitwise ``use_cache=False``'s, greedy tokens the rollout's."""
    _, peft_ours, _, _, _ = peft_pair
    prompts = [[5, 9, 33, 2, 17], [44, 3, 8]]
    ids = torch.tensor([prompts[0], [0, 0] + prompts[1]])
    kwargs = dict(input_ids=ids, attention_mask=torch.tensor([[1] * 5, [0, 0, 1, 1, 1]]), max_new_tokens=5,
                  do_sample=False, eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    cached, whole = (peft_ours.generate(**kwargs, use_cache=use_cache) for use_cache in (True, False))
    assert torch.equal(cached.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(cached.logits, whole.logits, strict=True))
    rollout = gen(make_llm(peft_ours), prompts, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    assert [row[5:].tolist() for row in cached.sequences] == [o.outputs[0].token_ids for o in rollout]


def test_every_adapter_gets_a_gradient(peft_pair):
    _, peft_ours, _, ids, _ = peft_pair
    peft_ours.zero_grad()
    peft_ours.token_logprobs(ids).sum().backward()
    trainable = {n: p for n, p in peft_ours.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    for name, p in trainable.items():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    peft_ours.zero_grad()


def test_merge_and_unload_gives_a_plain_model():
    arch = ARCHS["qwen3"]
    ours, _ = ours_and_stock(arch)
    model = get_peft_model(ours, lora())
    ids = torch.randint(0, 512, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits
        merged = model.merge_and_unload()
        assert type(merged) is arch.causal_lm_class
        assert not any(hasattr(m, "base_layer") for m in merged.modules())
        assert rel(merged(ids).logits, expected) <= 1e-5


def test_modules_to_save_lm_head_reaches_the_rollout():
    arch = ARCHS["qwen3_moe"]
    ours, _ = ours_and_stock(arch)
    model = get_peft_model(ours, lora(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs
    prompts = prompts_for(3, seed=4)
    outs = gen(make_llm(model), prompts, SamplingParams(temperature=1.0, max_tokens=5, seed=2, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert torch.equal(training_logprobs(model, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        with model.disable_adapter():
            plain = model(ids).logits
        assert not torch.equal(model(ids).logits, plain)


@pytest.mark.parametrize("config, message", [
    (dict(use_dora=True), r"^layers\.0\.self_attn\.q_proj: adapter 'default' uses the LoRA variant DoraLinearVariant"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head: PEFT adapters"),
    (dict(target_modules=["embed_tokens"]), "embed_tokens"),
])
def test_unsupported_peft_features_are_errors(config, message):
    ours, _ = ours_and_stock(ARCHS["qwen3"])
    model = get_peft_model(ours, lora(**config))
    with pytest.raises(ValueError, match=message):
        model(torch.tensor([[1, 2, 3]]))


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_moe"])
def test_peft_prefix_tuning_is_refused_and_prompt_tuning_runs_as_stock(name):
    """PEFT's prefix tuning passes its virtual tokens as a KV-cache prefix (``past_key_values``;
    ``cache`` from PEFT 0.22 on transformers 5.25), which the training forward (no KV cache) would
    not read: it gave the base model's logits, silently, and is now a ValueError naming the argument.
    Prompt tuning passes them as ``inputs_embeds`` and runs: the same logits as stock PEFT, within parity."""
    from peft import PrefixTuningConfig, PromptTuningConfig

    ours, stock = ours_and_stock(ARCHS[name])
    ids = torch.tensor([[5, 9, 33, 2], [44, 3, 8, 1]])
    prefix = get_peft_model(ours, PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    with pytest.raises(ValueError, match="(past_key_values|cache) holds 4 cached tokens, a prefix the training forward"):
        prefix(input_ids=ids)
    ours, stock = ours_and_stock(ARCHS[name])
    logits = []
    for model in (ours, stock):
        torch.manual_seed(0)
        prompted = get_peft_model(model, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
        with torch.no_grad():
            logits.append(prompted(input_ids=ids).logits)
    assert logits[0].shape == (2, 8, ours.config.vocab_size) and rel(logits[0], logits[1]) <= 1e-5
    # generate: PEFT prepends the virtual tokens' embeddings at every step; ours runs the new ones only
    prompted = get_peft_model(ours, PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    kwargs = dict(input_ids=ids, max_new_tokens=4, do_sample=False, eos_token_id=None, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    cached, whole = (prompted.generate(**kwargs, use_cache=use_cache) for use_cache in (True, False))
    assert torch.equal(cached.sequences, whole.sequences)
    assert all(torch.equal(a, b) for a, b in zip(cached.logits, whole.logits, strict=True))


def test_unsupported_adapter_errors_name_the_module_in_training_and_rollout():
    """An `adapters.UnsupportedAdapter` names the module by its path in the model, not by its
    class: here DoRA on one later layer's down_proj, in the training forward and in a rollout."""
    ours, _ = ours_and_stock(ARCHS["qwen3"])
    last = ours.config.num_hidden_layers - 1
    model = get_peft_model(ours, lora(target_modules=["down_proj"], layers_to_transform=[last], use_dora=True))
    message = rf"^layers\.{last}\.mlp\.down_proj: adapter 'default' uses the LoRA variant DoraLinearVariant"
    with pytest.raises(ValueError, match=message):
        model(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=message):
        gen(make_llm(model), prompts_for(1, seed=0), SamplingParams(max_tokens=2))


@pytest.mark.parametrize("name", ["qwen3", "qwen2", "qwen3_moe", "deepseek_v3"])
def test_bf16_model_with_fp32_adapters_keeps_the_low_precision_parity_rule(name):
    """PEFT's default on a bf16 model (fp32 adapter weights; PEFT runs the update in fp32): our
    update (bf16 shrink operands, fp32 accumulation and expand, `kernels.lora_add`) is no further
    from the fp32 reference than stock HF + PEFT in bf16 is, within LOW_PRECISION_SLACK
    (docs/design.md section 8, drop-in)."""
    from vexact_models.conformance.suite import LOW_PRECISION_SLACK

    arch = ARCHS[name]
    ours, hf32 = ours_and_stock(arch)
    hf16 = stock_model(arch).to(torch.bfloat16)
    torch.manual_seed(1)
    models = [get_peft_model(m, lora()) for m in (ours.to(torch.bfloat16), hf16, hf32)]
    adapters = {k: v for k, v in models[0].state_dict().items() if "lora_" in k}
    assert all(v.dtype == torch.float32 for v in adapters.values())
    for m in models[1:]:
        assert m.load_state_dict(adapters, strict=False).unexpected_keys == []
    with torch.no_grad():  # B at a fine-tuned size, as conformance.suite.add_random_lora makes it
        for m in models:
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.1)
    ids = torch.randint(0, 512, (3, 24), generator=torch.Generator().manual_seed(2))
    if not stock_peft_runs(arch):
        pytest.skip("stock DeepSeek-V3 / GLM-4.5 + PEFT fails before transformers 5.13")
    with torch.no_grad():
        got, stock, reference = (m(ids).logits.float() for m in models)
    assert rel(got, reference) <= LOW_PRECISION_SLACK * rel(stock, reference), (rel(got, reference), rel(stock, reference))
    mean = [float((t - reference).abs().mean()) for t in (got, stock)]
    assert mean[0] <= LOW_PRECISION_SLACK * mean[1], mean
