"""PEFT LoRA on the routed experts' fused tensors (``target_parameters``, PEFT's ``ParamWrapper``)
at every MoE architecture: the adapters take stock's shapes, the forward matches stock HF + PEFT
in fp32 and adds the updates with the aligned kernels (`kernels/moe_lora.py`), never through
PEFT's effective weight; gradients match stock's; rollouts equal ``token_logprobs`` bitwise, also
in the engine's graph-shaped steps; what the aligned experts cannot add is an error
(docs/design.md section 8, drop-in). Real peft, real get_peft_model."""

import pytest
import torch
from peft import LoraConfig, get_peft_model
from peft.tuners.lora import ParamWrapper

from vexact_models.adapters import EXPERT_TARGETS, expert_adapters, expert_target_parameters
from vexact_models.experts import FusedExperts
from vexact_models.runtime import SamplingParams

from ..runtime.llm_support import gen, make_llm, prompts_for, training_logprobs
from ..runtime.test_lora_rollouts import graph_shaped_llm
from .model_support import ARCHS, SHAPES, rel, shape_id, stock_model

pytestmark = pytest.mark.compat

MOE_SHAPES = [case for case in SHAPES if expert_target_parameters(stock_model(case[0], shape=case[1])) is not None]


def expert_lora(**overrides) -> LoraConfig:
    # init_lora_weights=False: random A and B, so that the adapters change the output from the start
    fields = dict(r=4, lora_alpha=8, target_modules=[], target_parameters=list(EXPERT_TARGETS), init_lora_weights=False)
    fields.update(overrides)
    return LoraConfig(**fields)


def adapted_pair(arch, shape, **overrides):
    """Our model and stock's under the same expert adapters (ours drawn, stock's loaded from them)."""
    hf = stock_model(arch, shape=shape)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    torch.manual_seed(1)
    peft_ours = get_peft_model(ours, expert_lora(**overrides))
    peft_hf = get_peft_model(hf, expert_lora(**overrides))
    adapters = {k: v for k, v in peft_ours.state_dict().items() if "lora_" in k}
    stock_adapters = {k: v for k, v in peft_hf.state_dict().items() if "lora_" in k}
    assert adapters and {k: v.shape for k, v in adapters.items()} == {k: v.shape for k, v in stock_adapters.items()}
    peft_hf.load_state_dict(adapters, strict=False)
    return peft_ours, peft_hf


@pytest.fixture
def no_effective_weight(monkeypatch):
    """PEFT's effective-weight path (``ParamWrapper._activate_lora``) raises for expert tensors
    while set: our forward must add the experts' updates itself. (A 2-D parameter, the MoE
    router's under ``all-linear``, keeps PEFT's path: its forward reads the effective weight.)"""
    activate = ParamWrapper._activate_lora

    def refuse(self, *args, **kwargs):
        if self.num_experts > 1:
            raise AssertionError("PEFT's effective expert weight was built")
        return activate(self, *args, **kwargs)

    monkeypatch.setattr(ParamWrapper, "_activate_lora", refuse)


@pytest.mark.parametrize("case", MOE_SHAPES, ids=shape_id)
def test_expert_adapters_match_stock_peft_and_disabling_restores(case, no_effective_weight, monkeypatch):
    arch, shape = case
    peft_ours, peft_hf = adapted_pair(arch, shape)
    ids = torch.randint(0, 256, (2, 11))
    with torch.no_grad():
        with peft_ours.disable_adapter():
            base = peft_ours(ids).logits
        got = peft_ours(ids).logits
        assert not torch.equal(got, base)
        monkeypatch.undo()  # stock runs PEFT's own path
        assert rel(got, peft_hf(ids).logits) <= arch.fp32_parity


@pytest.mark.parametrize("case", MOE_SHAPES, ids=shape_id)
def test_expert_adapter_gradients_match_stock_peft(case):
    arch, shape = case
    peft_ours, peft_hf = adapted_pair(arch, shape)
    ids = torch.randint(0, 256, (2, 9))
    grads = []
    for model in (peft_ours, peft_hf):
        model.zero_grad()
        torch.log_softmax(model(ids).logits.float(), -1)[..., 5].sum().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if "lora_" in n})
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) >= 4
    for name, grad in grads[0].items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert rel(grad, grads[1][name]) <= 1e-4, name


@pytest.mark.parametrize("case", MOE_SHAPES, ids=shape_id)
def test_rollout_with_expert_adapters_equals_token_logprobs(case, no_effective_weight):
    arch, shape = case
    peft_ours, _ = adapted_pair(arch, shape)
    prompts = prompts_for(4, seed=3)
    params = SamplingParams(temperature=1.0, max_tokens=6, seed=5, ignore_eos=True)
    outs = gen(make_llm(peft_ours), prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        assert torch.equal(training_logprobs(peft_ours, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))


@pytest.mark.parametrize("name", [n for n in ("qwen3_moe", "gpt_oss") if n in ARCHS])  # GPT-OSS: transformers >= 5.24
def test_graph_shaped_rollouts_with_expert_and_linear_adapters(name, monkeypatch, no_effective_weight):
    """Experts and every linear layer adapted, the engine's steps padded to their graph buckets
    (`test_lora_rollouts.graph_shaped_llm`), then adapters disabled: bitwise `token_logprobs`."""
    arch = ARCHS[name]
    peft_ours, _ = adapted_pair(arch, None, target_modules="all-linear")
    llm = graph_shaped_llm(peft_ours, monkeypatch)
    prompts = prompts_for(5, seed=3) + prompts_for(1, seed=4, lo=40, hi=50)
    params = SamplingParams(temperature=1.0, max_tokens=5, seed=5, ignore_eos=True)
    with_adapters = []
    for disabled in (False, True):
        with peft_ours.disable_adapter() if disabled else torch.no_grad():
            outs = gen(llm, prompts, params)
            for prompt, out in zip(prompts, outs):
                c = out.outputs[0]
                assert torch.equal(training_logprobs(peft_ours, prompt, c.token_ids, 1.0), torch.tensor(c.logprobs))
            with_adapters.append([o.outputs[0].logprobs for o in outs])
    assert with_adapters[0] != with_adapters[1]


def test_expert_adapters_found_under_nested_wrappers_and_states():
    peft_ours, _ = adapted_pair(ARCHS["qwen3_moe"], None)
    wrapped = peft_ours.base_model.model.model.layers[0].mlp.experts
    base, adapters = expert_adapters(wrapped)
    assert isinstance(base, FusedExperts) and sorted(adapters) == ["down_proj", "gate_up_proj"]
    lora = adapters["gate_up_proj"]
    assert lora.a.shape == (base.num_experts * 4, base.gate_up_proj.shape[2]) and lora.scaling == 2.0
    with peft_ours.disable_adapter():
        assert expert_adapters(wrapped)[1] == {}
    peft_ours.merge_adapter()
    assert expert_adapters(wrapped)[1] == {}
    peft_ours.unmerge_adapter()
    assert sorted(expert_adapters(wrapped)[1]) == ["down_proj", "gate_up_proj"]


def test_two_active_expert_adapters_and_adapted_biases_are_errors():
    arch = ARCHS["qwen3_moe"]
    peft_ours, _ = adapted_pair(arch, None)
    peft_ours.add_adapter("second", expert_lora())
    peft_ours.base_model.set_adapter(["default", "second"])
    ids = torch.randint(0, 256, (1, 5))
    named = r"^layers\.0\.mlp\.experts\S*\.(gate_up|down)_proj: "  # the wrapped tensor's path (UnsupportedAdapter)
    with pytest.raises(ValueError, match=named + r"2 active adapters \['default', 'second'\]"):
        peft_ours(ids)
    if "gpt_oss" not in ARCHS:  # Architecture.min_transformers keeps it out on older releases
        return
    gpt_oss = ARCHS["gpt_oss"]
    hf = stock_model(gpt_oss)
    ours = gpt_oss.causal_lm_class(hf.config).eval()
    biased = get_peft_model(ours, expert_lora(target_parameters=["experts.gate_up_proj_bias"]))
    with pytest.raises(ValueError, match=r"LoRA on \['gate_up_proj_bias'\] is not supported"):
        biased(ids)
