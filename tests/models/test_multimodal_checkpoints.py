"""Published multimodal checkpoints of the families we serve as text models (`vexact_models.multimodal`):
Qwen3.5 and Qwen3.5-MoE (``model.language_model.*`` beside ``model.visual.*``) and Gemma 3 4B+
(``language_model.model.*`` beside ``vision_tower.*`` and ``multi_modal_projector.*``), each
written here by transformers' own multimodal class. Every loading route of ours gives the text
model with the multimodal model's logits on text input: the classes' ``from_pretrained`` (a
folder, a hub id from a cache), the critic and reward heads, ``patch()`` + ``AutoModelForCausalLM``
where stock's gives a text class, ``LLM(path)`` (rolling out with ``token_logprobs``' bits) and
the pipeline stages' loader."""

import json
import logging
import shutil

import pytest
import torch
import transformers

import vexact_models
from vexact_models.registry import get

from .model_support import (MULTIMODAL_FAMILIES, check_rollouts_equal_recompute, registered_or_skip, rel,
                            save_multimodal)

pytestmark = pytest.mark.compat

#: what each family's multimodal checkpoint holds beside the text model
OTHER_PARTS = {"qwen3_5": ("model.visual.",), "qwen3_5_moe": ("model.visual.",),
               "gemma3": ("vision_tower.", "multi_modal_projector.")}


@pytest.fixture(params=sorted(MULTIMODAL_FAMILIES))
def multimodal(request, tmp_path):
    """(architecture, the multimodal model, its checkpoint folder): `save_multimodal` over the
    architecture's tiny text config."""
    arch = registered_or_skip(request.param)
    return arch, save_multimodal(arch, arch.tiny_config(), tmp_path), tmp_path


def stored_names(folder) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


def test_the_checkpoints_hold_the_published_layouts(multimodal):
    """What the other tests load is laid out as the published checkpoints are."""
    arch, _, folder = multimodal
    names = stored_names(folder)
    text_prefix = "language_model.model." if arch.name == "gemma3" else "model.language_model."
    assert any(n.startswith(text_prefix + "layers.0.") for n in names)
    assert all(any(n.startswith(p) for n in names) for p in OTHER_PARTS[arch.name])
    assert json.loads((folder / "config.json").read_text())["model_type"] == arch.name


def test_our_text_class_loads_the_text_model(multimodal, caplog, tmp_path_factory):
    """The text class's ``from_pretrained`` (the path by position or by name, or a hub id from a
    cache) loads the text model, says once what it skips, and gives the multimodal model's logits."""
    arch, model, folder = multimodal
    with caplog.at_level(logging.WARNING, logger="vexact_models"):
        ours = arch.causal_lm_class.from_pretrained(folder, dtype=torch.float32).eval()
    notices = [r.getMessage() for r in caplog.records if r.name == "vexact_models"]
    assert len(notices) == 1 and "loading its text model" in notices[0]
    assert all(part.rstrip(".") in notices[0] for part in OTHER_PARTS[arch.name])
    assert isinstance(ours.config, arch.config_class)
    assert not any("visual" in n or "vision" in n for n, _ in ours.named_parameters())
    ids = torch.randint(3, 512, (2, 20))
    with torch.no_grad():
        want = ours(ids).logits
        assert rel(want, model(input_ids=ids).logits) <= arch.fp32_parity
        by_name = arch.causal_lm_class.from_pretrained(pretrained_model_name_or_path=folder, dtype=torch.float32)
        assert torch.equal(by_name.eval()(ids).logits, want)
        given = arch.causal_lm_class.from_pretrained(folder, config=model.config, dtype=torch.float32)  # the multimodal one
        assert isinstance(given.config, arch.config_class) and torch.equal(given.eval()(ids).logits, want)
        cache = tmp_path_factory.mktemp("hub")  # the hub's cache layout, as a download leaves it
        snapshot = cache / "models--org--multimodal" / "snapshots" / ("0" * 40)
        shutil.copytree(folder, snapshot)
        (cache / "models--org--multimodal" / "refs").mkdir()
        (cache / "models--org--multimodal" / "refs" / "main").write_text("0" * 40)
        from_hub = arch.causal_lm_class.from_pretrained("org/multimodal", cache_dir=cache, local_files_only=True,
                                                        dtype=torch.float32)
        assert torch.equal(from_hub.eval()(ids).logits, want)


@pytest.mark.parametrize("tie", [True, False])
def test_the_head_is_tied_by_the_multimodal_configs_flag(multimodal, tie):
    """transformers ties a multimodal model's head by its own config's ``tie_word_embeddings``, not
    ``text_config``'s: with the two apart, our text class ties (or not) as the multimodal model
    did, with its logits."""
    arch, _, folder = multimodal
    model = save_multimodal(arch, arch.tiny_config(tie_word_embeddings=not tie), folder / "apart",
                            tie_word_embeddings=tie)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tie
    ours = arch.causal_lm_class.from_pretrained(folder / "apart", dtype=torch.float32).eval()
    assert ours.config.tie_word_embeddings == tie and (ours.lm_head.weight is ours.get_input_embeddings().weight) == tie
    ids = torch.randint(3, 512, (1, 12))
    with torch.no_grad():
        assert rel(ours(ids).logits, model(input_ids=ids).logits) <= arch.fp32_parity


def test_critic_and_reward_heads_load_the_text_model(multimodal):
    """verl's critic and TRL's reward model from the multimodal checkpoint: our heads over the text
    decoder (the same tensors as the causal LM's), a new ``score``."""
    arch, _, folder = multimodal
    causal = dict(arch.causal_lm_class.from_pretrained(folder, dtype=torch.float32).model.named_parameters())
    for head in (arch.token_classification_class, arch.sequence_classification_class):
        model = head.from_pretrained(folder, num_labels=1, dtype=torch.float32)
        decoder = dict(model.model.named_parameters())
        assert decoder.keys() == causal.keys()
        assert all(torch.equal(tensor, causal[name]) for name, tensor in decoder.items())


def test_auto_class_after_patch_follows_stock(multimodal):
    """After ``patch()``, ``AutoModelForCausalLM`` gives our text model where stock's gives its text
    class (Qwen3.5), and stock's multimodal class where stock's does (Gemma 3), which the engine
    refuses, naming how to load the text model."""
    arch, _, folder = multimodal
    stock = type(transformers.AutoModelForCausalLM.from_pretrained(folder))
    vexact_models.patch()
    try:
        auto = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    finally:
        vexact_models.unpatch()
    if stock is arch.hf_class():
        assert type(auto) is arch.causal_lm_class
        return
    assert type(auto) is stock and stock.__name__.endswith("ForConditionalGeneration")
    from vexact_models import LLM

    with pytest.raises(ValueError, match=rf"multimodal .*{stock.__name__}.*{arch.causal_lm_class.__name__}"
                                         r"\.from_pretrained\(path\)"):
        LLM(auto, device="cpu")


def test_llm_rolls_out_the_text_model(multimodal):
    """``LLM(path)`` loads the text model (the weights ``from_pretrained`` gives) and its sampled
    tokens' logprobs equal ``token_logprobs`` bitwise; the pipeline stages' loader reads the same
    tensors under their stored names."""
    from vexact_models import LLM
    from vexact_models.runtime.pipeline import PipelineStage
    from vexact_models.runtime.pipeline_load import load_stage_model

    arch, _, folder = multimodal
    want = dict(arch.causal_lm_class.from_pretrained(folder, dtype=torch.float32).named_parameters())
    llm = LLM(str(folder), dtype=torch.float32, device="cpu", block_size=4, kv_cache_bytes=1 << 21, max_num_seqs=4)
    model = llm.model.causal_lm
    assert type(model) is arch.causal_lm_class
    assert all(torch.equal(p, want[n]) for n, p in model.named_parameters())
    check_rollouts_equal_recompute(llm, max_tokens=10)
    layers = model.config.num_hidden_layers
    for stage in (PipelineStage(0, 2, range(0, 1), layers), PipelineStage(1, 2, range(1, layers), layers)):
        staged = load_stage_model(str(folder), arch, model.config, torch.float32, stage, torch.device("cpu"))
        held = {n: p for n, p in staged.named_parameters() if not p.is_meta}
        assert held and all(torch.equal(p, want[n]) for n, p in held.items())


def test_another_family_s_checkpoint_is_an_error(multimodal):
    """A multimodal checkpoint whose text model is of another architecture is refused by name."""
    arch, _, folder = multimodal
    other = get("qwen3_5") if arch.name == "gemma3" else registered_or_skip("gemma3")
    with pytest.raises(ValueError, match=rf"{other.causal_lm_class.__name__}\.from_pretrained: .* multimodal "
                                         rf"{arch.name} checkpoint"):
        other.causal_lm_class.from_pretrained(folder)


def test_text_tensor_names_of_both_layouts():
    """Both published layouts' text tensors get the text class's names; the other parts none."""
    from vexact_models.multimodal import is_multimodal, text_config_of, text_tensor_name

    assert text_tensor_name("model.language_model.layers.3.mlp.experts.7.up_proj.weight") == \
        "model.layers.3.mlp.experts.7.up_proj.weight"
    assert text_tensor_name("language_model.model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert text_tensor_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_tensor_name("lm_head.weight") == "lm_head.weight"
    for other in ("model.visual.blocks.0.attn.qkv.weight", "vision_tower.encoder.layers.0.mlp.fc1.weight",
                  "multi_modal_projector.mm_input_projection_weight", "mtp.layers.0.mlp.gate.weight"):
        assert text_tensor_name(other) is None, other
    text = get("qwen3_5").tiny_config()
    assert not is_multimodal(text) and text_config_of(text) is text
    assert not is_multimodal({"model_type": "gemma3"})  # no text_config: not a checkpoint we read
    assert is_multimodal(transformers.Qwen3_5Config(text_config=text.to_dict()).to_dict())
