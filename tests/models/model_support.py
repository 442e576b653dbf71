"""What the parametrised model tests share: every registered (architecture, shape) as a test case,
and stock transformers models of a shape with the same random weights our models get."""

import pytest
import torch
import transformers
from transformers.models.auto import modeling_auto

from vexact_models.random_init import randomize_norms_and_biases
from vexact_models.registry import Architecture, Shape, architectures, shapes

#: every registered (architecture, shape): tests whose code path a shape changes (MLA with or
#: without q-LoRA, tied or untied heads) run over these
SHAPES: list[tuple[Architecture, Shape]] = shapes()
#: every registered architecture, at its default shape: tests no shape changes run over these
ARCHS: dict[str, Architecture] = {arch.name: arch for arch in architectures()}


def module_tree(arch: Architecture, shape: Shape) -> list[tuple[str, str]]:
    """(name, class) of every module of `arch`'s training variant at `shape` (built on the meta
    device: no memory, no init)."""
    with torch.device("meta"):
        model = arch.causal_lm_class(shape.tiny_config())
    return [(name, type(module).__name__) for name, module in model.named_modules()]


#: the default shapes, and the other shapes whose module tree differs from their architecture's
#: default (MLA's q_proj instead of q-LoRA does; a tied head or another RoPE scaling does not):
#: the costly tests (the full conformance suite) run over these, the others over `SHAPES`
DISTINCT_SHAPES: list[tuple[Architecture, Shape]] = [
    (arch, shape) for arch, shape in SHAPES
    if shape is arch.shapes[0] or module_tree(arch, shape) != module_tree(arch, arch.shapes[0])]


def shape_id(case: tuple[Architecture, Shape]) -> str:
    """A test id: the shape's name, prefixed by the architecture's when they differ
    (``qwen3``, ``deepseek_v3:moonlight``)."""
    arch, shape = case
    return shape.name if shape.name == arch.name else f"{arch.name}:{shape.name}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """``max |a - b| / max |b|``: the HF-parity error measure (docs/design.md section 7)."""
    return float((a - b).abs().max() / b.abs().max())


def check_window_parity_and_batch_invariance(arch: Architecture, hf: torch.nn.Module, ours: torch.nn.Module) -> None:
    """Two prompts of 40 tokens, the second left-padded by 11, through `ours` and `hf` (stock with
    eager attention, its sliding-window mask) built with windows shorter than the prompts: fp32
    logits within ``arch.fp32_parity`` of stock's, padded too; each sequence's logprobs bitwise
    the same alone, packed and padded."""
    ids = torch.randint(3, 512, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, :11] = 0
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) <= arch.fp32_parity
        stock_padded = hf(ids, attention_mask=mask).logits
        assert rel(ours(ids, attention_mask=mask).logits[1, 11:], stock_padded[1, 11:]) <= arch.fp32_parity
        alone = [ours.token_logprobs(row[None])[0] for row in (ids[0], ids[1, 11:])]
        packed = ours.token_logprobs(torch.cat([ids[0], ids[1, 11:]]), cu_seqlens=torch.tensor([0, 40, 69]))
        padded = ours.token_logprobs(ids, attention_mask=mask)
    assert torch.equal(packed[:40], alone[0]) and torch.equal(packed[40:], alone[1])
    assert torch.equal(padded[0], alone[0]) and torch.equal(padded[1, 11:], alone[1])


def saved_name(tensors: dict, name: str) -> str:
    """The key under which a checkpoint's `tensors` (as stock's ``save_pretrained`` wrote them)
    hold the model's parameter `name`: `name` itself or, where stock saved the text model under
    ``model.language_model.`` (transformers 5.2 for Qwen3.5's text models: its conversion for
    ``qwen3_5_text`` renames ``model.language_model`` to ``model`` on load and back on save; 5.17
    and 5.24 save ``model.``), that key."""
    nested = "model.language_model." + name.removeprefix("model.")
    return nested if name not in tensors and name.startswith("model.") and nested in tensors else name


def stock_class(arch: Architecture, head: str = "ForCausalLM") -> type:
    """The stock transformers class of `arch` with `head` (``ForCausalLM``, ``Model``,
    ``ForSequenceClassification``...)."""
    return arch.hf_class(head)


#: the stock Auto mapping (model_type -> class name) of each head
AUTO_MAPPING_NAMES = {"Model": modeling_auto.MODEL_MAPPING_NAMES,
                      "ForCausalLM": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                      "ForSequenceClassification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
                      "ForTokenClassification": modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES}


def stock_lacks(arch: Architecture, head: str) -> str | None:
    """Why stock transformers has nothing to compare with for `arch` with `head`, or None when
    it has: no such class (OLMo2 has no ``ForTokenClassification``), or no entry for `arch`'s
    model type in the stock Auto class of `head` (``Qwen3_5ForTokenClassification`` exists, but
    for the multimodal config: ``AutoModelForTokenClassification`` maps nothing to Qwen3.5's text
    config; Qwen3.5-MoE's text config has no classification head at all)."""
    model_type, version = arch.model_types[0], transformers.__version__
    try:
        stock = arch.hf_class(head)
    except AttributeError:
        path = dict(arch.hf_head_classes).get(head) or arch.hf_causal_lm_class.replace("ForCausalLM", head)
        return f"stock transformers {version} has no {path.rpartition('.')[2]} for model_type {model_type!r}"
    mapping = AUTO_MAPPING_NAMES.get(head)
    if mapping is not None and model_type not in mapping:
        other = getattr(stock, "config_class", None)
        takes = f" ({stock.__name__} takes {other.__name__})" if other not in (None, arch.config_class) else ""
        return (f"stock transformers {version} has no {head} head for model_type {model_type!r}: its "
                f"AutoModel{'' if head == 'Model' else head} has no entry for it{takes}")
    return None


def skip_unless_stock_has(arch: Architecture, head: str) -> None:
    """Skip the calling test, saying why (`stock_lacks`), when stock transformers has no `head`
    for `arch`'s model type: there is nothing to compare with."""
    reason = stock_lacks(arch, head)
    if reason is not None:
        pytest.skip(reason)


def stock_model(arch: Architecture, head: str = "ForCausalLM", shape: Shape | None = None, seed: int = 0,
                **overrides) -> torch.nn.Module:
    """A stock transformers model of `arch` at `shape` (default: its first) in eval mode, with
    random weights (seeded): every norm weight and bias random too (`randomize_norms_and_biases`:
    HF's init leaves them at 1 and 0, where swapping two norms changes nothing), then the
    architecture's conformance init (e.g. DeepSeek's expert selection bias); `overrides` replace
    config fields."""
    torch.manual_seed(seed)
    model = stock_class(arch, head)((shape or arch.shapes[0]).tiny_config(**overrides)).eval()
    randomize_norms_and_biases(model, seed)
    if arch.init_for_conformance is not None:
        with torch.no_grad():
            arch.init_for_conformance(model, seed)
    return model


def attention_layers(model: torch.nn.Module) -> list[int]:
    """Indices of the decoder layers with (full) attention, ``self_attn``: every layer, except in
    the gated-DeltaNet hybrids, whose ``linear_attention`` layers have a ``linear_attn``."""
    base = getattr(model, "model", model)
    return [i for i, layer in enumerate(base.layers) if hasattr(layer, "self_attn")]


def adapts_experts(model: torch.nn.Module) -> bool:
    """Whether PEFT adapted a fused expert tensor of `model` (a ``ParamWrapper`` over experts)."""
    return any(getattr(m, "num_experts", 1) > 1 and hasattr(m, "lora_A") for m in model.modules())


def attention_output_name(model: torch.nn.Module, nth: int = 0) -> str:
    """The parameter name of the `nth` attention layer's output projection weight."""
    return f"model.layers.{attention_layers(model)[nth]}.self_attn.o_proj.weight"


def skip_without_rollout(arch: Architecture, feature: str) -> None:
    """Skip the calling test when the rollout engine cannot use the engine `feature` (one of
    `registry.ROLLOUT_FEATURES`) for `arch` yet, with the reason the architecture gives
    (`Architecture.rollout_features_missing`: the capabilities tests consult)."""
    why = arch.rollout_feature_missing(feature)
    if why is not None:
        pytest.skip(f"{arch.name}: no {feature} in rollouts yet: {why}")


_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
                    temporal_patch_size=2, spatial_merge_size=2, in_channels=3)
#: the architectures whose published checkpoints are multimodal (`vexact_models.multimodal`) -> (stock's
#: multimodal config class, its model class, tiny fields beside the text config)
MULTIMODAL_FAMILIES = {
    "qwen3_5": ("Qwen3_5Config", "Qwen3_5ForConditionalGeneration", dict(vision_config=_QWEN_VISION)),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", dict(vision_config=_QWEN_VISION)),
    "gemma3": ("Gemma3Config", "Gemma3ForConditionalGeneration", dict(mm_tokens_per_image=4, vision_config=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14))),
}


def save_multimodal(arch: Architecture, text_config, folder, seed: int = 0, **top) -> torch.nn.Module:
    """A published-style multimodal checkpoint in `folder`: transformers' own multimodal class of
    `arch` (`MULTIMODAL_FAMILIES`) over `text_config` and a tiny vision tower (`top`: more fields of
    the multimodal config), random weights and norms, written with ``save_pretrained``; returns the
    model (eval mode)."""
    config_class, model_class, fields = MULTIMODAL_FAMILIES[arch.name]
    config = getattr(transformers, config_class)(text_config=text_config.to_dict(), **fields, **top)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():
        (arch.init_for_conformance or randomize_norms_and_biases)(model, seed)
    model.save_pretrained(folder)
    return model


def registered_or_skip(name: str) -> Architecture:
    """The registered architecture `name`, or a skip where the installed transformers is too old for it."""
    from vexact_models.registry import get

    try:
        return get(name)
    except ValueError as error:
        pytest.skip(str(error))


def check_rollouts_equal_recompute(llm, max_tokens: int) -> None:
    """Two prompts (11 and 3 tokens) sampled at temperature 0.9 by `llm` for `max_tokens` tokens
    each: every sampled token's logprob equals the engine's training model's ``token_logprobs``
    bitwise."""
    from vexact_models import SamplingParams

    model = llm.model.causal_lm  # the training model the engine wraps
    prompts = [[5, 9, 31, 7, 200, 11, 3, 44, 90, 17, 23], [400, 8, 12]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=3), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor(prompt + out.outputs[0].token_ids)
        with torch.no_grad():
            recomputed = model.token_logprobs(ids[None], temperature=0.9)[0, len(prompt):]
        assert len(out.outputs[0].token_ids) == max_tokens
        assert torch.equal(recomputed, torch.tensor(out.outputs[0].logprobs, dtype=torch.float32))
