"""`vexact new-architecture` (vexact_models/scaffold.py): the template proven by using it.

Llama scaffolded as Mistral (Mistral is Llama's architecture under its own config class) into a
temporary out-of-tree package that registers through the ``vexact_models.architectures`` entry
point, with no model-specific edit: the registry discovers it, `patch()` routes it, the
conformance suite (HF parity included) passes, and so does the test module the scaffold wrote.
The registry, sys.path and the Auto classes are restored afterwards.
"""

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, MistralConfig, MistralForCausalLM

import vexact_models
from vexact_models import registry, scaffold
from vexact_models.conformance.suite import run_conformance

NEW_CLASSES = {"MistralForCausalLM", "MistralForCausalLMInference", "MistralModel", "MistralPreTrainedModel",
               "MistralAttention", "MistralMLP", "MistralDecoderLayer", "MistralRMSNorm",
               "MistralForSequenceClassification", "MistralForTokenClassification"}


@pytest.fixture
def isolated_registry():
    """Whatever a test registers, imports or patches is undone: the registry, its loaded flag,
    sys.path, the generated modules and the Auto classes."""
    saved, loaded, path, modules = dict(registry._REGISTRY), registry._loaded, list(sys.path), set(sys.modules)
    was_patched = vexact_models.is_patched()
    yield
    if not was_patched:
        vexact_models.unpatch()
    registry._REGISTRY.clear()
    registry._REGISTRY.update(saved)
    registry._loaded = loaded
    sys.path[:] = path
    for name in set(sys.modules) - modules:
        if name == "mistral" or name.startswith(("mistral.", "test_mistral")):
            del sys.modules[name]
    importlib.invalidate_caches()
    assert registry.for_model_type("mistral") is None


def install_entry_point(dest, name: str) -> None:
    """What ``pip install -e dest`` with the printed pyproject lines would leave: a dist-info
    with the entry point, on sys.path."""
    info = dest / f"vexact_{name}-0.1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vexact-{name}\nVersion: 0.1.0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINT_GROUP}]\n{name} = {name}\n")
    sys.path.insert(0, str(dest))
    importlib.invalidate_caches()


def discover():
    """The registry loaded again, as a fresh process would (built-in folders + entry points)."""
    registry._loaded = False
    return {arch.name: arch for arch in registry.architectures()}


def defined_names(text: str) -> set[str]:
    return {node.name for node in ast.walk(ast.parse(text)) if isinstance(node, (ast.ClassDef, ast.FunctionDef))}


@pytest.fixture
def mistral(tmp_path, isolated_registry):
    plan = scaffold.plan("mistral", "llama", dest=tmp_path)
    scaffold.write(plan)
    install_entry_point(tmp_path, "mistral")
    return plan, discover()["mistral"]


def test_llama_scaffolded_as_mistral_is_registered_and_conforms(mistral):
    plan, arch = mistral
    modeling = (plan.folder / "modeling.py").read_text()
    assert NEW_CLASSES <= defined_names(modeling) and not [n for n in defined_names(modeling) if "Llama" in n]
    assert "LlamaConfig" not in modeling and "from vexact_models.causal_lm import" in modeling  # works out of tree
    assert (arch.model_types, arch.config_class, arch.hf_class()) == (("mistral",), MistralConfig, MistralForCausalLM)
    assert arch.causal_lm_class.__module__ == "mistral.modeling" and arch.causal_lm_class.__name__ == "MistralForCausalLM"
    assert [s.name for s in arch.shapes] == ["mistral", "mistral_tied"] and arch.published_configs == ()
    assert registry.for_model_type("mistral") is arch and registry.for_model_type("llama").name == "llama"
    # MistralConfig has no attention_bias / mlp_bias: the copy reads Llama's defaults, and says so
    assert 'getattr(config, "attention_bias", False)' in modeling and plan.defaulted_fields == {
        "attention_bias": False, "mlp_bias": False}
    assert "sliding_window" in plan.ignored_fields and "sliding_window" in scaffold.next_steps(plan)
    assert 'mistral = "mistral"' in scaffold.pyproject_snippet(plan)

    vexact_models.patch()  # built as users build it; the fixture unpatches
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(arch.tiny_config(), dtype=torch.float32).eval()
    assert type(model) is arch.causal_lm_class
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=4, max_tokens=4, prompt_len=8,
                             log=lambda *_: None)
    assert report.tokens > 100 and report.mismatches == 0 and report.reproducibility_mismatches == 0
    assert report.hf_parity.vs_hf <= 1e-5 and report.ok


def test_the_generated_test_module_passes(mistral, tmp_path):
    """Its checks but the conformance run (the test above runs that), called as pytest would."""
    plan, _ = mistral
    spec = importlib.util.spec_from_file_location("test_mistral_generated", plan.test_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.test_registered_and_discovered()
    for tie in (False, True):
        (tmp_path / f"ckpt_{tie}").mkdir()
        module.test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path / f"ckpt_{tie}", tie)
    module.test_config_as_published_builds_hf_model()
    module.test_patch_routes_the_auto_classes()
    assert not vexact_models.is_patched()


def test_generated_test_catches_a_field_the_config_class_lacks(tmp_path, isolated_registry, monkeypatch):
    """Without the getattr rewrite, a hub MistralConfig (no attention_bias) cannot build the copy:
    the generated test must say so rather than pass on the tiny config's extra fields."""
    monkeypatch.setattr(scaffold, "_default_missing_fields", lambda text, fields: text)
    plan = scaffold.plan("mistral", "llama", dest=tmp_path)
    scaffold.write(plan)
    install_entry_point(tmp_path, "mistral")
    discover()
    spec = importlib.util.spec_from_file_location("test_mistral_unedited", plan.test_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(AttributeError, match="attention_bias"):
        module.test_config_as_published_builds_hf_model()


@pytest.mark.parametrize("template", [arch.name for arch in registry.architectures()])
def test_every_architecture_is_a_template(template, tmp_path):
    """Rendered only: the copy compiles, defines the template's classes under the new prefix,
    keeps the names it imports from shared code, and registers the new model type."""
    old = scaffold.template_names(registry.get(template))
    plan = scaffold.plan("mistral", template, dest=tmp_path)
    assert not any(tmp_path.iterdir())  # plan writes nothing
    template_dir = Path(sys.modules[registry.get(template).causal_lm_class.__module__].__file__).parent
    for path, text in plan.files.items():
        if path.parent != plan.folder:
            continue
        original = (template_dir / path.name).read_text()
        want = {n.replace(old.prefix, "Mistral") for n in defined_names(original)}
        assert defined_names(text) == want, path.name
        imported = {alias.name for node in ast.walk(ast.parse(original)) if isinstance(node, ast.ImportFrom)
                    and node.level == 0 and node.module.startswith("vexact_models") for alias in node.names}
        assert imported <= {alias.name for node in ast.walk(ast.parse(text)) if isinstance(node, ast.ImportFrom)
                            for alias in node.names}, path.name
    init = plan.files[plan.folder / "__init__.py"]
    assert 'model_types=("mistral",)' in init and 'hf_causal_lm_class="transformers.MistralForCausalLM"' in init
    assert "MistralConfig" in init and old.config_class not in init


def test_in_tree_plan_targets_the_package_and_the_test_folder():
    plan = scaffold.plan("mistral", "qwen3")
    assert plan.folder == scaffold._PACKAGE_DIR / "mistral" and plan.package == "vexact_models.mistral"
    assert plan.test_path.parts[-3:] == ("tests", "models", "test_mistral.py") and not plan.folder.exists()
    text = plan.files[plan.test_path]
    assert "from vexact_models.mistral import ARCHITECTURE" in text and "builtin_architecture_packages" in text
    assert "run_conformance" not in text  # in tree, tests/conformance runs it over every architecture
    assert "Mistral with one forward" in plan.files[plan.folder / "modeling.py"]


@pytest.mark.parametrize("args, kwargs, message", [
    (("Mistral",), {}, "NAME 'Mistral' must be a lowercase Python identifier"),
    (("mis-tral",), {}, "NAME 'mis-tral' must be a lowercase Python identifier"),
    (("class",), {}, "NAME 'class'"),
    (("mistral", "nope"), {}, r"--from 'nope' is not a registered architecture; choose one of \[.*'llama'.*'qwen3'"),
    (("qwen3_copy", "qwen3"), {"model_type": "qwen3"}, "'qwen3' is already served by architecture 'qwen3'"),
    (("qwen3",), {"model_type": "mistral"}, "architecture 'qwen3' is registered under that name"),
    (("mistral",), {"config_class": "NoSuchConfig"}, "--config-class 'NoSuchConfig': transformers .* has no config class"),
    (("mistral",), {"config_class": "LlamaConfig"}, "its model_type is 'llama', not --model-type 'mistral'"),
    (("mistral",), {"hf_class": "NoSuchForCausalLM"}, "--hf-class 'NoSuchForCausalLM'"),
    (("mistral",), {"hf_class": "LlamaForCausalLM"}, "it takes LlamaConfig, not --config-class MistralConfig"),
    (("mistral",), {"class_prefix": "mistral"}, "--class-prefix 'mistral' must be an identifier starting with a capital"),
    (("json",), {"model_type": "mistral"}, "a module 'json' is already importable"),
])
def test_bad_requests_are_refused_before_anything_is_written(args, kwargs, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        scaffold.plan(*args, **{"dest": tmp_path, **kwargs})
    assert not any(tmp_path.iterdir())


def test_an_existing_folder_or_test_is_never_overwritten(tmp_path):
    (tmp_path / "mistral").mkdir()
    with pytest.raises(ValueError, match="mistral already exists; the scaffold never overwrites"):
        scaffold.plan("mistral", "llama", dest=tmp_path)
    (tmp_path / "mistral").rmdir()
    plan = scaffold.plan("mistral", "llama", dest=tmp_path)
    plan.test_path.parent.mkdir()
    plan.test_path.write_text("# mine\n")  # appeared between plan and write
    with pytest.raises(ValueError, match="test_mistral.py already exists"):
        scaffold.write(plan)
    assert plan.test_path.read_text() == "# mine\n" and not plan.folder.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tests"]  # no staging folder left behind
