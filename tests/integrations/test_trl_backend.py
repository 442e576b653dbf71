"""`VexactGeneration`, TRL's generation-backend contract, on its own: the weight sync into an engine
that does not share the policy's parameters (the trainers' ``llm=``), PEFT policies included, and
what it does with a completion the engine could not sample."""

import pytest
import torch

pytest.importorskip("trl")
peft = pytest.importorskip("peft")

from vexact_models.integrations.trl_backend import VexactGeneration  # noqa: E402
from vexact_models.registry import get  # noqa: E402
from vexact_models.runtime import LLM  # noqa: E402

SAMPLING = {"temperature": 1.0, "max_tokens": 4}
PROMPTS = [[3, 4, 5], [9, 2, 2, 7, 11], [6]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    arch = get("qwen3")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("qwen3")
    arch.causal_lm_class(arch.tiny_config(vocab_size=16, initializer_range=0.5)).save_pretrained(path)
    return path


def _lora(path, seed: int, **options):
    torch.manual_seed(seed)  # random A and B (init_lora_weights=False): every adapter changes the outputs
    base = get("qwen3").causal_lm_class.from_pretrained(path)
    config = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False,
                             **options)
    return peft.get_peft_model(base, config)


def _recompute(model, prompt, tokens):
    with torch.no_grad():
        return model.token_logprobs(torch.tensor([prompt + tokens]))[0, len(prompt):]


@pytest.mark.parametrize("options", [{}, {"modules_to_save": ["lm_head"]}], ids=["adapters", "modules_to_save"])
def test_a_peft_policy_syncs_its_adapters_into_an_engine_of_its_own(ckpt, options):
    """The engine holds other adapters of the same config: `sync_weights` sends the policy's
    adapters and trained copies (the frozen base stays), and the rollouts then equal the policy's
    recompute."""
    policy, engine_model = _lora(ckpt, 1, **options), _lora(ckpt, 2, **options)
    if options:
        with torch.no_grad():  # "trained": the policy's copy of lm_head apart from the engine's
            policy.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    llm = LLM(engine_model, device="cpu", kv_cache_bytes=1 << 20)
    gen = VexactGeneration(llm, policy, SAMPLING)
    assert not gen.shares_weights
    gen.sync_weights()
    engine = dict(llm.model.causal_lm.named_parameters())
    for name, p in policy.get_base_model().named_parameters():
        assert torch.equal(engine[name], p), name
    _, completions, nested, _ = gen.generate(PROMPTS)
    model = policy.get_base_model()
    for prompt, tokens, lps in zip(PROMPTS, completions, nested):
        assert torch.equal(torch.tensor([lp[0] for lp in lps]), _recompute(model, prompt, tokens))


def test_a_peft_policy_beside_an_engine_without_adapters_is_refused(ckpt):
    llm = LLM(str(ckpt), device="cpu", kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match=r"the policy is a PEFT model and the engine \(llm=\) holds no adapters"):
        VexactGeneration(llm, _lora(ckpt, 1), SAMPLING)


def test_a_completion_the_engine_could_not_sample_is_an_error_not_data(ckpt):
    """Settings that leave a row no token (EOS alone allowed, and banned by min_tokens): the engine
    ends it with finish_reason "error"; TRL must not train on its placeholder token."""
    policy = get("qwen3").causal_lm_class.from_pretrained(ckpt)
    eos = policy.config.eos_token_id
    gen = VexactGeneration(LLM(policy, device="cpu", kv_cache_bytes=1 << 20), policy,
                           {**SAMPLING, "stop_token_ids": [eos], "allowed_token_ids": [eos], "min_tokens": 2})
    with pytest.raises(RuntimeError, match=r"VexactGeneration.generate: request 0: .*excluded every token"):
        gen.generate(PROMPTS[:1])
