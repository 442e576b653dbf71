"""Adapter-only weight sync (single process, CPU, real peft): the RL loop where only the LoRA
adapters train sends the engine its adapters and the base stays. The engine's next rollout
equals the trainer's recompute bitwise, whichever of PEFT's names the adapters arrive under
(``get_peft_model_state_dict``, ``PeftModel.state_dict()``, `stream_full_weights` with
``adapters_only=True``); bad names, shapes and dtypes are refused with nothing written. The
two-rank FSDP2 version is tests/distributed/test_fsdp_lora.py."""

import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

import vexact_models.qwen3 as qwen3
import vexact_models.qwen3_moe as qwen3_moe
from vexact_models.adapter_weights import PEFT_PREFIX, AdapterNames, adapter_tensors
from vexact_models.distributed import stream_full_weights
from vexact_models.runtime import SamplingParams

from ..runtime.llm_support import gen, make_llm, prompts_for, training_logprobs

pytestmark = pytest.mark.compat

PARAMS = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)


def lora(**overrides) -> LoraConfig:
    # init_lora_weights=False: random A and B, so that the adapters change the output from the start
    fields = dict(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, init_lora_weights=False)
    fields.update(overrides)
    return LoraConfig(**fields)


@pytest.fixture(scope="module")
def base():
    torch.manual_seed(0)
    return qwen3.Qwen3ForCausalLM(qwen3.tiny_config(initializer_range=0.5)).eval()


def with_adapters(base, seed: int, **overrides):
    """`base` (a copy) under LoRA adapters drawn with `seed`: trainer and engine share the base,
    not the adapters."""
    torch.manual_seed(seed)
    return get_peft_model(copy.deepcopy(base), lora(**overrides))


def adapters_of(model) -> dict[str, torch.Tensor]:
    return {t.name: t.param.detach().clone() for t in adapter_tensors(model)}


def check_rollout_is_the_trainers(llm, trainer, prompts):
    outs = gen(llm, prompts, PARAMS)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert torch.equal(training_logprobs(trainer, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))
    return [o.outputs[0].token_ids for o in outs]


def test_adapter_tensors_carry_peft_s_own_names(base):
    model = with_adapters(base, 1, modules_to_save=["lm_head"])
    tensors = adapter_tensors(model)
    saved = {n for n in model.state_dict() if "lora_" in n or "modules_to_save" in n}
    assert {t.name for t in tensors} == saved
    assert {t.short_name for t in tensors} == set(get_peft_model_state_dict(model))
    params = dict(model.named_parameters())
    assert all(params[t.name] is t.param for t in tensors)
    inner = {t.name for t in adapter_tensors(model.get_base_model())}
    assert {PEFT_PREFIX + n for n in inner} == saved
    assert adapter_tensors(base) == [] and not AdapterNames(base)


SOURCES = {
    "get_peft_model_state_dict": lambda t: get_peft_model_state_dict(t),
    "peft_state_dict": lambda t: {n: v for n, v in t.state_dict().items() if "lora_" in n},
    "stream_peft_model": lambda t: stream_full_weights(t, adapters_only=True),
    "stream_base_model": lambda t: stream_full_weights(t.get_base_model(), bucket_bytes=1024, adapters_only=True),
}


@pytest.mark.parametrize("source", list(SOURCES))
def test_rollout_after_an_adapter_only_update_equals_the_trainers_recompute(base, source):
    engine_model, trainer = with_adapters(base, 1), with_adapters(base, 2)
    llm = make_llm(engine_model)
    prompts = prompts_for(4, seed=3)
    before = [o.outputs[0].token_ids for o in gen(llm, prompts, PARAMS)]
    base_before = {n: p.detach().clone() for n, p in engine_model.named_parameters() if "lora_" not in n}
    copied = llm.update_weights(SOURCES[source](trainer))
    assert copied == len(adapter_tensors(trainer)) > 0
    after = check_rollout_is_the_trainers(llm, trainer, prompts)
    assert after != before  # the new adapters reached the rollout
    engine = dict(engine_model.named_parameters())
    assert all(torch.equal(engine[n], v) for n, v in base_before.items())  # the base stayed
    assert all(torch.equal(engine[n], v) for n, v in adapters_of(trainer).items())


def test_a_trained_modules_to_save_copy_syncs_with_the_adapters():
    torch.manual_seed(0)
    moe = qwen3_moe.Qwen3MoeForCausalLM(qwen3_moe.tiny_config(initializer_range=0.5)).eval()
    overrides = dict(target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"])
    engine_model, trainer = with_adapters(moe, 1, **overrides), with_adapters(moe, 2, **overrides)
    with torch.no_grad():
        trainer.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs
    llm = make_llm(engine_model)
    state = get_peft_model_state_dict(trainer)
    assert "base_model.model.lm_head.weight" in state  # PEFT's name for the trained copy
    llm.update_weights(state)
    check_rollout_is_the_trainers(llm, trainer, prompts_for(3, seed=4))


def _bad_inputs(trainer):
    good = get_peft_model_state_dict(trainer)
    first = next(iter(good))
    full = PEFT_PREFIX + "model.layers.0.self_attn.q_proj.lora_A.default.weight"
    return {
        "unknown_adapter": (dict(good, **{full.replace(".default.", ".other."): good[first]}), [".other.", "no adapter"]),
        "untargeted_module": (dict(good, **{"model.embed_tokens.lora_A.weight": good[first]}),
                              ["model.embed_tokens.lora_A.weight", "no adapter tensor"]),
        "shape": (dict(good, **{first: torch.zeros(8, good[first].shape[1])}), [first, "(8, ", "has (4, "]),
        "dtype": (dict(good, **{first: good[first].to(torch.bfloat16)}), [first, "torch.bfloat16", "torch.float32"]),
        "not_a_tensor": (dict(good, **{first: [1.0]}), [first, "list"]),
        "stream_shape_last": (iter(list(good.items()) + [(first, torch.zeros(3))]), [first, "(3,)"]),
        "stream_twice": (iter(list(good.items()) + [(full, good[first])]), [full, "each adapter tensor once"]),
    }


@pytest.mark.parametrize("case", ["unknown_adapter", "untargeted_module", "shape", "dtype", "not_a_tensor",
                                  "stream_shape_last", "stream_twice"])
def test_bad_adapter_updates_are_refused_with_nothing_written(base, case):
    engine_model, trainer = with_adapters(base, 1), with_adapters(base, 2)
    llm = make_llm(engine_model)
    weights, words = _bad_inputs(trainer)[case]
    snapshot = {n: p.detach().clone() for n, p in engine_model.named_parameters()}
    with pytest.raises(ValueError) as info:
        llm.update_weights(weights)
    assert all(w in str(info.value) for w in ["LLM.update_weights", *words]), str(info.value)
    assert all(torch.equal(p, snapshot[n]) for n, p in engine_model.named_parameters())


def test_names_without_the_adapter_name_are_refused_while_the_engine_holds_two_adapters(base):
    engine_model, trainer = with_adapters(base, 1), with_adapters(base, 2)
    engine_model.add_adapter("second", lora())
    llm = make_llm(engine_model)
    snapshot = adapters_of(engine_model)
    with pytest.raises(ValueError, match=r"holds 2 adapters \['default', 'second'\].*use the full name"):
        llm.update_weights(get_peft_model_state_dict(trainer))
    assert all(torch.equal(v, snapshot[n]) for n, v in adapters_of(engine_model).items())
    full = {n: v for n, v in trainer.state_dict().items() if "lora_" in n}  # names with the adapter: fine
    assert llm.update_weights(full) == len(full)


@pytest.mark.parametrize("kwargs, words", [
    ({"adapters_only": "yes"}, ["adapters_only='yes'", "bool"]),
    ({"adapters_only": True}, ["adapters_only=True", "Qwen3ForCausalLM holds no PEFT adapters"]),
])
def test_stream_full_weights_adapters_only_checks_its_arguments(base, kwargs, words):
    with pytest.raises(ValueError) as info:
        stream_full_weights(base, **kwargs)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_stream_full_weights_adapters_only_yields_exactly_the_adapters(base):
    trainer = with_adapters(base, 2, modules_to_save=["lm_head"])
    streamed = dict(stream_full_weights(trainer, adapters_only=True, dtype=torch.bfloat16))
    want = adapters_of(trainer)
    assert list(streamed) == list(want)
    assert all(torch.equal(streamed[n], v.to(torch.bfloat16)) for n, v in want.items())
