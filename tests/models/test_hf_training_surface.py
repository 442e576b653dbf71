"""What transformers' and PEFT's training utilities expect of a model, for every registered
architecture, against stock transformers where it has the behaviour: the decoder layers are
``GradientCheckpointingLayer`` instances that ``gradient_checkpointing_enable/disable`` switch
(and that then recompute); ``set_experts_implementation`` refuses what it cannot honour and only
MoE classes claim to take one; ``output_hidden_states`` given as indices returns what stock
returns on this release; ``output_attentions=True`` is an error naming it; ``generate`` from padded
``inputs_embeds`` runs past the first step and gives the tokens of the same prompt as ids."""

import inspect

import pytest
import torch
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer

from vexact_models.patches.compat import has_routed_experts

from .model_support import ARCHS, rel, stock_class, stock_lacks, stock_model

pytestmark = pytest.mark.compat

NAMES = sorted(ARCHS)


@pytest.fixture(scope="module", params=NAMES)
def pair(request):
    """(architecture, stock causal LM, ours with the same weights), fp32, eval mode; an init
    range that makes greedy tokens depend on the prompt."""
    arch = ARCHS[request.param]
    hf = stock_model(arch, initializer_range=0.2)
    ours = arch.causal_lm_class(hf.config).eval()
    ours.load_state_dict(hf.state_dict())
    return arch, hf, ours


def checkpointing_flags(model) -> list[bool]:
    return [m.gradient_checkpointing for m in model.modules() if hasattr(m, "gradient_checkpointing")]


def test_decoder_layers_are_gradient_checkpointing_layers_that_enable_and_disable(pair):
    """transformers' ``test_gradient_checkpointing_enable_disable``, and its
    ``test_training_gradient_checkpointing``'s look-up of a ``GradientCheckpointingLayer``."""
    _, _, ours = pair
    found = [m for m in ours.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert found == list(ours.model.layers)
    assert not ours.is_gradient_checkpointing and not any(checkpointing_flags(ours))
    try:
        ours.gradient_checkpointing_enable()
        assert ours.is_gradient_checkpointing and all(checkpointing_flags(ours))
    finally:
        ours.gradient_checkpointing_disable()
    assert not ours.is_gradient_checkpointing and not any(checkpointing_flags(ours))


def test_checkpointed_layers_recompute_and_keep_the_gradients(pair):
    """With checkpointing on, each layer's MLP starts again in the backward (the layer
    checkpoints itself; a pre-hook, as torch stops the recompute once it has what the backward
    needs), and the gradients are bitwise those without it."""
    _, _, ours = pair
    ids = torch.randint(0, 512, (2, 9))
    calls = []
    hook = ours.model.layers[-1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    params = [p for p in ours.parameters() if p.requires_grad]

    def grads():
        calls.clear()
        return torch.autograd.grad(ours(ids, labels=ids).loss, params), len(calls)

    ours.train()
    try:
        plain, once = grads()
        ours.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})  # made non-reentrant
        kept, twice = grads()
    finally:
        ours.gradient_checkpointing_disable()
        ours.eval()
        hook.remove()
    assert (once, twice) == (1, 2)
    assert all(torch.equal(a, b) for a, b in zip(kept, plain))


def test_every_n_layers_where_transformers_has_it(pair):
    _, _, ours = pair
    if "every_n_layers" not in inspect.signature(PreTrainedModel._set_gradient_checkpointing).parameters:
        pytest.skip("this transformers release has no every_n_layers")
    try:
        ours.gradient_checkpointing_enable(every_n_layers=2)
        flags = [layer.gradient_checkpointing for layer in ours.model.layers]
    finally:
        ours.gradient_checkpointing_disable()
    assert flags == [i % 2 == 0 for i in range(len(flags))]


def test_experts_implementation_is_claimed_as_stock_and_a_switch_is_refused(pair):
    arch, hf, ours = pair
    routed = has_routed_experts(type(ours))
    for ours_class, head in ((type(ours), "ForCausalLM"), (arch.base_model_class, "Model"),
                             (arch.token_classification_class, "ForTokenClassification")):
        assert ours_class._can_set_experts_implementation() == routed
        if stock_lacks(arch, head) is None:  # else nothing to compare with (Qwen3.5-MoE's text model has no stock heads)
            assert stock_class(arch, head)._can_set_experts_implementation() == routed, head
    current = ours.config._experts_implementation
    ours.set_experts_implementation(current)  # nothing to switch
    other = "batched_mm" if current != "batched_mm" else "grouped_mm"
    with pytest.raises(ValueError, match=f"{other!r}"):
        ours.set_experts_implementation(other)
    with pytest.raises(ValueError, match="'fastest'"):
        ours.set_experts_implementation("fastest")
    assert ours.config._experts_implementation == current


@pytest.mark.parametrize("request_", [[0, -1], [1], (2, 0), 1, [], [0, 99], True],
                         ids=["first-last", "one", "tuple", "int", "empty", "out-of-range", "flag"])
def test_output_hidden_states_as_indices_returns_what_stock_returns(pair, request_):
    """The selected hidden states, as stock selects them, within the architecture's parity; under
    right padding (stock's left-padded batch is other arithmetic for the gated-DeltaNet hybrids:
    `test_architectures.test_padded_logits_match_stock`)."""
    arch, hf, ours = pair
    ids = torch.randint(2, 512, (2, 7))
    mask = torch.ones_like(ids)
    mask[1, 4:] = 0
    keep = mask.bool()
    for mine, stock in ((ours, hf), (ours.model, hf.model)):
        with torch.no_grad():
            a = mine(ids, attention_mask=mask, output_hidden_states=request_).hidden_states
            b = stock(ids, attention_mask=mask, output_hidden_states=request_).hidden_states
        assert (a is None) == (b is None), (type(mine).__name__, request_)
        if a is None:
            continue
        assert [x is None for x in a] == [x is None for x in b], (type(mine).__name__, request_)
        assert all(rel(x[keep], y[keep]) <= arch.fp32_parity for x, y in zip(a, b) if x is not None)


def test_output_attentions_is_an_error_naming_it(pair):
    _, _, ours = pair
    ids = torch.randint(0, 512, (1, 5))
    for model in (ours, ours.model):
        with pytest.raises(ValueError, match="output_attentions=True"):
            model(ids, output_attentions=True)
        model(ids, output_attentions=False)


def test_generate_from_padded_inputs_embeds_equals_ids_and_stock(pair):
    _, hf, ours = pair
    ids = torch.tensor([[5, 9, 33, 2, 17, 40], [0, 0, 0, 44, 3, 8]])
    mask = (torch.arange(6) >= torch.tensor([[0], [3]])).long()
    embeds = ours.get_input_embeddings()(ids).detach()
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None, pad_token_id=0)
    from_embeds = ours.generate(inputs_embeds=embeds, **kwargs)
    from_ids = ours.generate(ids, **kwargs)
    assert from_embeds.shape == (2, 5) and torch.equal(from_embeds, from_ids[:, 6:])
    assert torch.equal(from_embeds, hf.generate(inputs_embeds=embeds, **kwargs))
    both = ours.generate(ids, inputs_embeds=embeds, **kwargs)  # ids given too: HF returns prompt + new tokens
    assert torch.equal(both, from_ids)
