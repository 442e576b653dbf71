"""`vexact new-architecture` (vexact_models/scaffold.py): the template proven by using it.

Llama scaffolded as Mistral (Mistral is Llama's architecture under its own config class) into a
temporary out-of-tree package that registers through the ``vexact_models.architectures`` entry
point, with no model-specific edit: the registry discovers it, `patch()` routes it, the
conformance suite (HF parity included) passes, and so does the test module the scaffold wrote.
Llama scaffolded as OLMo2 with the guide's worked example (docs/adding-an-architecture.md: a
post-norm layer, q/k norms over the whole projection) spliced in as written: it matches stock
``Olmo2ForCausalLM`` with random norm weights and conforms; with two norms swapped the parity
checks (generated and shared) fail. The registry, sys.path and the Auto classes are restored
afterwards.
"""

import ast
import copy
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, MistralForCausalLM
from transformers.models.llama.modeling_llama import LlamaForCausalLM  # stock's, whether or not patched

import vexact_models
from vexact_models import registry, scaffold
from vexact_models.conformance.suite import run_conformance
from vexact_models.random_init import is_norm, randomize_norms_and_biases
from vexact_models.scaffold_fields import drop_tiny_config_fields

from .models.model_support import rel, skip_unless_stock_has, stock_model

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "adding-an-architecture.md"
#: the packages the tests below generate (removed from sys.modules afterwards)
GENERATED = ("mistral", "olmo2")

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
        if name.split(".")[0] in GENERATED or name.startswith(tuple(f"test_{g}" for g in GENERATED)):
            del sys.modules[name]
    importlib.invalidate_caches()
    assert all(registry.for_model_type(g) is None for g in GENERATED)


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


def load_generated_tests(path, module_name: str):
    """The generated test module at `path`, imported."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_generated_checks(module, tmp_path) -> None:
    """The generated module's checks but the conformance run, called as pytest would."""
    module.test_registered_and_discovered()
    for tie in (False, True):
        (tmp_path / f"ckpt_{tie}").mkdir()
        module.test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path / f"ckpt_{tie}", tie)
    module.test_config_as_published_builds_hf_model()
    module.test_patch_routes_the_auto_classes()
    assert not vexact_models.is_patched()


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
    # MistralConfig.sliding_window is honoured (layers.layer_window, shared code): nothing is ignored
    assert plan.ignored_fields == [] and "sliding_window" not in scaffold.next_steps(plan)
    # ... and drops them from the tiny configs, with a notice
    assert plan.dropped_fields == {"attention_bias": "False", "mlp_bias": "False"} and plan.heads_without_stock == []
    assert "NOTICE: MistralConfig has no field attention_bias, mlp_bias" in scaffold.next_steps(plan)
    assert not any(hasattr(arch.tiny_config(), f) for f in ("attention_bias", "mlp_bias"))
    assert arch.tiny_config().head_dim == 16  # MistralConfig has head_dim: kept
    assert 'mistral = "mistral"' in scaffold.pyproject_snippet(plan)

    vexact_models.patch()  # built as users build it; the fixture unpatches
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(arch.tiny_config(), dtype=torch.float32).eval()
    assert type(model) is arch.causal_lm_class
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=4, max_tokens=4, prompt_len=8,
                             log=lambda *_: None)
    assert report.tokens > 100 and report.mismatches == 0 and report.reproducibility_mismatches == 0
    assert report.hf_parity.vs_hf <= 1e-5 and report.ok


def test_scaffolded_mistral_honours_sliding_window(mistral):
    """A window shorter than the prompts: the copy's logits are stock MistralForCausalLM's (fp32),
    differ from the same weights without a window, and its rollouts conform bitwise."""
    _, arch = mistral
    config = arch.tiny_config()
    config.sliding_window = 3
    torch.manual_seed(0)
    model = arch.causal_lm_class(config).eval()
    stock = MistralForCausalLM(config).eval()
    stock.load_state_dict(model.state_dict())
    ids = torch.randint(0, config.vocab_size, (2, 12))
    with torch.no_grad():
        ours, want = model(ids).logits, stock(ids).logits
        full_config = copy.deepcopy(config)
        full_config.sliding_window = None
        unwindowed = arch.causal_lm_class(full_config).eval()
        unwindowed.load_state_dict(model.state_dict())
        full = unwindowed(ids).logits
    assert (ours - want).abs().max() <= 1e-5 and (ours - full).abs().max() > 1e-3
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [3] * config.num_hidden_layers
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=4, max_tokens=4, prompt_len=8,
                             log=lambda *_: None)
    assert report.tokens > 100 and report.mismatches == 0 and report.hf_parity.vs_hf <= 1e-5 and report.ok


def test_the_generated_test_module_passes(mistral, tmp_path):
    """Its checks but the conformance run (the test above runs that), called as pytest would."""
    plan, _ = mistral
    run_generated_checks(load_generated_tests(plan.test_path, "test_mistral_generated"), tmp_path)


def test_generated_test_catches_a_field_the_config_class_lacks(tmp_path, isolated_registry, monkeypatch):
    """Without the getattr rewrite, a hub MistralConfig (no attention_bias) cannot build the copy:
    the generated test must say so rather than pass on the tiny config's extra fields."""
    monkeypatch.setattr(scaffold.scaffold_fields, "default_missing_fields", lambda text, fields: text)
    plan = scaffold.plan("mistral", "llama", dest=tmp_path)
    scaffold.write(plan)
    install_entry_point(tmp_path, "mistral")
    discover()
    module = load_generated_tests(plan.test_path, "test_mistral_unedited")
    with pytest.raises(AttributeError, match="attention_bias"):
        module.test_config_as_published_builds_hf_model()


def guide_example() -> str:
    """The worked example's code block in docs/adding-an-architecture.md (after its marker)."""
    text = GUIDE.read_text()
    return text[text.index("<!-- worked-example:"):].split("```python\n", 1)[1].split("```", 1)[0]


def replace_classes(module_text: str, classes_text: str) -> str:
    """`module_text` with each class `classes_text` defines in place of its class of that name."""
    new = {node.name: ast.get_source_segment(classes_text, node) for node in ast.parse(classes_text).body
           if isinstance(node, ast.ClassDef)}
    lines = module_text.splitlines(keepends=True)
    old = [node for node in ast.parse(module_text).body if isinstance(node, ast.ClassDef) and node.name in new]
    assert sorted(node.name for node in old) == sorted(new), "the example replaces classes the copy defines"
    for node in sorted(old, key=lambda n: -n.lineno):
        lines[node.lineno - 1:node.end_lineno] = [new[node.name] + "\n"]
    return "".join(lines)


def scaffold_olmo2(dest, example: str):
    """Llama scaffolded as OLMo2 into `dest` with `example` (the guide's classes) spliced in as the
    guide says, installed and discovered: (plan, architecture, the generated test module)."""
    plan = scaffold.plan("olmo2", "llama", dest=dest)
    modeling = plan.folder / "modeling.py"
    plan.files[modeling] = replace_classes(plan.files[modeling], example).replace("PreNormDecoderLayer, ", "")
    scaffold.write(plan)
    install_entry_point(dest, "olmo2")
    return plan, discover()["olmo2"], load_generated_tests(plan.test_path, "test_olmo2_generated")


def test_olmo2_from_llama_with_the_guides_worked_example(tmp_path, isolated_registry):
    """What a user does for a post-norm model: the scaffold flags Llama's tiny-config fields
    Olmo2Config lacks and the head stock lacks; with the guide's two classes the copy passes its
    generated tests (stock checkpoints with random norm weights) and the conformance suite."""
    plan, arch, module = scaffold_olmo2(tmp_path, guide_example())
    assert plan.dropped_fields == {"head_dim": "16", "mlp_bias": "False"} and plan.defaulted_fields == {"mlp_bias": False}
    assert plan.heads_without_stock == ["Olmo2ForTokenClassification"]
    steps = scaffold.next_steps(plan)
    assert "NOTICE: Olmo2Config has no field head_dim, mlp_bias" in steps and "no Olmo2ForTokenClassification" in steps
    assert not hasattr(arch.tiny_config(), "head_dim") and arch.hf_class() is transformers.Olmo2ForCausalLM
    with pytest.raises(pytest.skip.Exception, match="has no Olmo2ForTokenClassification for model_type 'olmo2'"):
        skip_unless_stock_has(arch, "ForTokenClassification")  # the shared head tests skip it, saying why
    skip_unless_stock_has(arch, "ForSequenceClassification")  # stock has that one: compared
    run_generated_checks(module, tmp_path)
    model = arch.causal_lm_class(arch.tiny_config()).eval()
    randomize_norms_and_biases(model)
    report = run_conformance(arch, model, device=torch.device("cpu"), pool_size=4, max_tokens=4, prompt_len=8,
                             log=lambda *_: None)
    assert report.tokens > 100 and report.mismatches == 0 and report.hf_parity.vs_hf <= 1e-5 and report.ok


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the Triton kernels at a real layer shape)")
def test_olmo2_worked_example_conforms_on_gpu_at_an_olmo2_7b_layer_shape(tmp_path, isolated_registry):
    """The guide's worked example with the GPU kernels, bf16, at OLMo2-7B's layer shape (hidden
    4096, 32 heads of 128: the whole-projection q/k norms run over rows of 4096; 2 layers),
    random norm weights: rollout logprobs equal training logprobs bitwise in every scenario, and
    HF parity is within HF's own bf16 error."""
    from vexact_models.conformance.models import build_model

    _, arch, _ = scaffold_olmo2(tmp_path, guide_example())
    config = arch.tiny_config(hidden_size=4096, intermediate_size=11008, num_attention_heads=32, num_key_value_heads=32,
                              num_hidden_layers=2, vocab_size=100352, max_position_embeddings=4096,
                              rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    model = build_model(arch, config, torch.device("cuda"), torch.bfloat16)
    randomize_norms_and_biases(model)
    report = run_conformance(arch, model, device=torch.device("cuda"), pool_size=64, max_tokens=48, prompt_len=64,
                             log=lambda *_: None)
    assert report.tokens > 2000 and report.mismatches == 0, [(s.name, s.mismatches) for s in report.scenarios]
    assert report.reproducibility_mismatches == 0 and report.ok, str(report.hf_parity)


def test_swapped_norms_fail_parity_with_random_norm_weights(tmp_path, isolated_registry, monkeypatch):
    """The post-norm layer with its two norms swapped: the generated parity test and the shared
    helper's stock model (random norm weights) see it; with HF's init (every norm weight 1) the
    same check passes, which is why the parity tests randomise norms."""
    example = guide_example()
    swapped = (example.replace("self.post_attention_layernorm(self.self_attn", "self.post_feedforward_layernorm(self.self_attn")
               .replace("return self.post_feedforward_layernorm(self.mlp", "return self.post_attention_layernorm(self.mlp"))
    assert swapped.count("self.post_feedforward_layernorm(self.self_attn") == 1 and swapped.count(
        "return self.post_attention_layernorm(self.mlp") == 1
    _, arch, module = scaffold_olmo2(tmp_path, swapped)
    (tmp_path / "random").mkdir()
    with pytest.raises(AssertionError):
        module.test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path / "random", False)
    stock_model(arch).save_pretrained(tmp_path / "shared")
    ours = arch.causal_lm_class.from_pretrained(tmp_path / "shared", dtype=torch.float32).eval()
    hf = arch.hf_class().from_pretrained(tmp_path / "shared", dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 16))
    with torch.no_grad():
        assert rel(ours(ids).logits, hf(ids).logits) > 1e-2
    monkeypatch.setattr(module, "randomize_norms_and_biases", lambda model, seed: 1)  # HF's init: norms at 1
    (tmp_path / "ones").mkdir()
    module.test_stock_checkpoint_loads_and_matches_hf_logits(tmp_path / "ones", False)


def test_randomize_norms_and_biases_touches_every_norm_and_bias():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    model = LlamaForCausalLM(config)
    norms = [m.weight for m in model.modules() if is_norm(m)]
    biases = [p for name, p in model.named_parameters() if name.endswith(".bias")]
    assert len(norms) == 5 and len(biases) == 2 * 7 and all(torch.all(w == 1) for w in norms)
    assert randomize_norms_and_biases(model, seed=3) == len(norms) + len(biases)
    values = [w.detach() for w in norms]
    assert all(0.5 <= float(w.min()) and float(w.max()) < 1.5 and len(set(w.tolist())) == w.numel() for w in values)
    assert all(torch.all(b != 0) for b in biases) and not torch.equal(norms[0], norms[1])
    before = [w.clone() for w in norms]
    randomize_norms_and_biases(model, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(before, norms))  # seeded


def test_tiny_config_fields_the_target_lacks_are_dropped():
    """Keywords of the ``dict(...)`` / ``XConfig(...)`` calls in ``tiny*`` functions: the last one,
    neighbours, one per line and ``**overrides`` kept; code outside ``tiny*`` untouched."""
    text = ("def tiny_config(**overrides):\n"
            "    fields = dict(hidden_size=64, head_dim=16,\n"
            "                  mlp_bias=False,\n"
            "                  vocab_size=8, sliding=1, window=2)\n"
            "    return MistralConfig(**fields, head_dim=8)\n\n\n"
            "def other():\n"
            "    return dict(head_dim=16)\n")
    out, dropped = drop_tiny_config_fields(text, LlamaConfig)
    assert dropped == {"sliding": "1", "window": "2"} and "head_dim=8" in out
    out, dropped = drop_tiny_config_fields(text, transformers.Olmo2Config)
    assert dropped == {"head_dim": "8", "mlp_bias": "False", "sliding": "1", "window": "2"}
    assert out == ("def tiny_config(**overrides):\n"
                   "    fields = dict(hidden_size=64, vocab_size=8)\n"
                   "    return MistralConfig(**fields)\n\n\n"
                   "def other():\n"
                   "    return dict(head_dim=16)\n")


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
