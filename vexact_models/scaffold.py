"""``vexact new-architecture``: a new architecture folder copied from a registered one.

`plan` checks the request and renders every file in memory (nothing is written when a check
fails); `write` puts them in place, the package folder last and in one rename, so a failure
leaves nothing half-written. The copy renames what the template defines (its classes,
functions and module constants: ``Qwen3Attention`` -> ``MistralAttention``), the HF config
class, the architecture's name, ``model_types`` and stock HF class, and leaves every name
imported from shared code alone. Config fields the new config class lacks are read with the
template's default and dropped from the tiny configs (`scaffold_fields`). What it cannot decide
is listed by `next_steps` (with a notice for each field dropped and each copied head class stock
transformers lacks); the guide is docs/adding-an-architecture.md.

In-tree (the default) the folder is ``vexact_models/<name>`` (discovered by the registry) and
the test ``tests/models/test_<name>.py``; with ``dest`` it is ``<dest>/<name>`` plus
``<dest>/tests/test_<name>.py``, a package that registers through the
``vexact_models.architectures`` entry point (`pyproject_snippet`).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import keyword
import os
import re
import shutil
import sys
import tokenize
from dataclasses import dataclass, field
from pathlib import Path

from . import registry, scaffold_fields
from .checkpoint_writer import make_parents, new_folder, remove_empty, unwritable
from .scaffold_fields import line_offsets
from .scaffold_template import render_test_module

_PACKAGE_DIR = Path(__file__).resolve().parent
_REPO_TESTS = _PACKAGE_DIR.parent / "tests" / "models"
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_PREFIX = re.compile(r"^[A-Z][A-Za-z0-9]*$")
#: the heads a template may define beside its causal LM (HF class-name suffixes)
_HEADS = ("ForSequenceClassification", "ForTokenClassification")


@dataclass(frozen=True)
class Names:
    """The identifiers of one architecture, template or new."""

    name: str  # registry name and folder (``qwen3``)
    prefix: str  # class-name prefix (``Qwen3``)
    model_type: str
    config_class: str  # a transformers class name (``Qwen3Config``)
    hf_class: str  # a transformers class name (``Qwen3ForCausalLM``)


@dataclass
class Scaffold:
    """What `plan` rendered and `write` writes: ``files`` maps each path to its text."""

    template: Names
    new: Names
    package: str  # import name of the new package
    folder: Path
    test_path: Path
    in_tree: bool
    files: dict[Path, str] = field(default_factory=dict)
    defaulted_fields: dict[str, object] = field(default_factory=dict)  # config.<f> -> template default
    ignored_fields: list[str] = field(default_factory=list)  # the new config's fields neither template nor shared code has
    dropped_fields: dict[str, str] = field(default_factory=dict)  # tiny-config field -> its value's source, removed
    heads_without_stock: list[str] = field(default_factory=list)  # copied head classes transformers lacks for the type
    review_lines: list[str] = field(default_factory=list)  # prose that still names the template


def _transformers_class(kind: str, flag: str, name: str, base: str):
    """The transformers class `name` (a subclass of transformers' `base`), or a ValueError naming the flag."""
    import transformers

    cls = getattr(transformers, name, None) if name.isidentifier() else None
    if not isinstance(cls, type) or not issubclass(cls, getattr(transformers, base)):
        raise ValueError(f"{flag} {name!r}: transformers {transformers.__version__} has no {kind} class of that name "
                         f"(a {base} subclass exported by `transformers`)")
    return cls


def template_names(arch: registry.Architecture) -> Names:
    """The identifiers of a registered architecture, as the copy must find them."""
    prefix = arch.causal_lm_class.__name__.removesuffix("ForCausalLM")
    return Names(arch.name, prefix, arch.model_types[0], arch.config_class.__name__,
                 arch.hf_causal_lm_class.rpartition(".")[2])


def new_names(name: str, class_prefix: str | None, model_type: str | None, config_class: str | None,
              hf_class: str | None) -> Names:
    """Check the requested identifiers and fill the defaults: prefix from NAME (``my_model`` ->
    ``MyModel``), model_type NAME, and the config and causal-LM classes transformers maps that
    model_type to (else ``<prefix>Config`` / ``<prefix>ForCausalLM``)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if not _NAME.match(name) or keyword.iskeyword(name):
        raise ValueError(f"NAME {name!r} must be a lowercase Python identifier (letters, digits, _; e.g. 'mistral')")
    prefix = class_prefix or "".join(part[:1].upper() + part[1:] for part in name.split("_"))
    if not _PREFIX.match(prefix):
        raise ValueError(f"--class-prefix {prefix!r} must be an identifier starting with a capital letter (e.g. 'Mistral')")
    model_type = model_type or name
    config_name = config_class or CONFIG_MAPPING_NAMES.get(model_type, f"{prefix}Config")
    config_cls = _transformers_class("config", "--config-class", config_name, "PreTrainedConfig")
    if config_cls.model_type != model_type:
        raise ValueError(f"--config-class {config_name}: its model_type is {config_cls.model_type!r}, not --model-type "
                         f"{model_type!r}; checkpoints of one are not checkpoints of the other")
    hf_name = (hf_class or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, f"{prefix}ForCausalLM")).removeprefix(
        "transformers.")
    hf_cls = _transformers_class("model", "--hf-class", hf_name, "PreTrainedModel")
    if hf_cls.config_class is not config_cls:
        raise ValueError(f"--hf-class {hf_name}: it takes {hf_cls.config_class.__name__}, not --config-class {config_name}")
    return Names(name, prefix, model_type, config_name, hf_name)


def _check_free(new: Names, folder: Path, test_path: Path, package: str) -> None:
    """Refuse a name, model type or path that is taken, before anything is written."""
    served = registry.for_model_type(new.model_type)
    if served is not None:
        raise ValueError(f"--model-type {new.model_type!r} is already served by architecture {served.name!r} "
                         f"({served.causal_lm_class.__module__.rpartition('.')[0]}); add a Shape to it instead of a "
                         f"second architecture")
    taken = [a.name for a in registry.architectures() if a.name == new.name or a.config_class.__name__ == new.config_class]
    if taken:
        raise ValueError(f"NAME {new.name!r} / --config-class {new.config_class}: architecture {taken[0]!r} is registered "
                         f"under that name or config class")
    for path in (folder, test_path):
        if path.exists():
            raise ValueError(f"{path} already exists; the scaffold never overwrites (pick another NAME or --dest)")
    if importlib.util.find_spec(package) is not None:
        raise ValueError(f"NAME {new.name!r}: a module {package!r} is already importable; the new package would shadow it")


def plan(name: str, template: str = "qwen3", *, class_prefix: str | None = None, model_type: str | None = None,
         config_class: str | None = None, hf_class: str | None = None, dest: str | os.PathLike | None = None) -> Scaffold:
    """Check a ``new-architecture`` request and render its files; writes nothing.

    Raises ValueError naming the argument for: NAME not a lowercase identifier, a template that
    is not registered (listing those that are), a config / HF class transformers lacks or that
    do not belong together, a model type or name already served, a target that exists.
    """
    known = {arch.name: arch for arch in registry.architectures()}
    if template not in known:
        raise ValueError(f"--from {template!r} is not a registered architecture; choose one of {sorted(known)}")
    source = known[template]
    old = template_names(source)
    new = new_names(name, class_prefix, model_type, config_class, hf_class)
    in_tree = dest is None
    if in_tree and not (_PACKAGE_DIR.parent / "pyproject.toml").is_file():
        raise ValueError(f"vexact_models is installed at {_PACKAGE_DIR}, not in a source checkout: pass --dest DIR "
                         f"for a package of your own (or run from a clone of vexact-models)")
    if not in_tree and Path(dest).exists() and not Path(dest).is_dir():
        raise ValueError(f"--dest {str(dest)!r} is a file, not a folder; name a folder (new or existing) to hold "
                         f"{name}/ and tests/")
    package = f"vexact_models.{name}" if in_tree else name
    folder = _PACKAGE_DIR / name if in_tree else Path(dest).resolve() / name
    test_path = _REPO_TESTS / f"test_{name}.py" if in_tree else Path(dest).resolve() / "tests" / f"test_{name}.py"
    _check_free(new, folder, test_path, package)
    _check_writable(folder, test_path, dest)
    scaffold = Scaffold(old, new, package, folder, test_path, in_tree)
    template_dir = Path(sys.modules[source.causal_lm_class.__module__].__file__).parent
    sources = {path.name: path.read_text() for path in sorted(template_dir.glob("*.py"))}
    defined = _defined_names(sources.values(), old)
    new_config_class = _transformers_class("config", "--config-class", new.config_class, "PreTrainedConfig")
    scaffold.defaulted_fields, scaffold.ignored_fields = scaffold_fields.field_differences(
        source.config_class, new_config_class, sources.values())
    scaffold.heads_without_stock = _heads_without_stock(new, defined)
    for file_name, text in sources.items():
        text = _rename(text, old, new, defined)
        text = scaffold_fields.default_missing_fields(text, scaffold.defaulted_fields)
        text = re.sub(r"^(\s*)from \.\.(\w)", r"\1from vexact_models.\2", text, flags=re.M)  # absolute: works out of tree
        text = re.sub(r"^(\s*)from \.\. import", r"\1from vexact_models import", text, flags=re.M)
        if file_name == "__init__.py":
            text = _rewrite_registration(text, old, new)
            text, scaffold.dropped_fields = scaffold_fields.drop_tiny_config_fields(text, new_config_class)
        scaffold.files[folder / file_name] = text
        scaffold.review_lines += [f"{folder.name}/{file_name}:{i}: {line.strip()}" for i, line in
                                  enumerate(text.splitlines(), 1) if re.search(re.escape(old.name), line, re.I)
                                  and f"copied from the ``{old.name}``" not in line]
    scaffold.files[test_path] = render_test_module(new, package, in_tree)
    _compile_all(scaffold)
    return scaffold


def _heads_without_stock(new: Names, defined: set[str]) -> list[str]:
    """The head classes the copy defines (``<prefix>ForTokenClassification``, ...) that stock
    transformers has no class for at the new model type (OLMo2 has no token-classification head):
    they work, but nothing stock checks them, and the shared head tests skip them."""
    import transformers

    heads = [new.hf_class.replace("ForCausalLM", head) for head in _HEADS if any(n.endswith(head) for n in defined)]
    return [name for name in heads if not hasattr(transformers, name)]


def _compile_all(scaffold: Scaffold) -> None:
    """Every rendered Python file must at least compile (a template the renamer broke is our bug)."""
    for path, text in scaffold.files.items():
        compile(text, str(path), "exec")


def _defined_names(texts, old: Names) -> set[str]:
    """Classes, functions and module-level names the template defines that carry its prefix or name."""
    names = set()
    for text in texts:
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {n for n in names if old.prefix in n or old.name in n}


def _word(text: str, old: str, new: str, lower: bool) -> str:
    """Replace `old` where it starts a word part: ``Qwen3`` in ``Qwen3Attention`` but not in
    ``Qwen3Moe`` or ``Llama-3.1`` when ``lower`` is False; ``qwen3`` in ``modeling_qwen3`` /
    ``"qwen3_tied"`` but not in ``qwen3moe``."""
    tail = r"(?![a-z0-9])" if lower else r"(?![a-z])(?!-\d)"  # "Llama-3.1" names a release, not the class prefix
    return re.sub(r"(?<![A-Za-z0-9])" + re.escape(old) + tail, new, text)


def _rename_text(text: str, old: Names, new: Names, defined: set[str]) -> str:
    for name in sorted(defined | {old.config_class, old.hf_class}, key=len, reverse=True):
        text = re.sub(rf"\b{re.escape(name)}\b", _renamed(name, old, new), text)
    return _word(_word(text, old.prefix, new.prefix, False), old.name, new.name, True)


def _renamed(name: str, old: Names, new: Names) -> str:
    if name == old.config_class:
        return new.config_class
    if name == old.hf_class:
        return new.hf_class
    return _word(_word(name, old.prefix, new.prefix, False), old.name, new.name, True)


def _rename(text: str, old: Names, new: Names, defined: set[str]) -> str:
    """Rename by token: identifiers the template defines and its config class; in strings and
    comments also the template's words. Other identifiers (shared helpers, attributes, module
    paths) stay as they are."""
    offsets = line_offsets(text)
    edits = []
    prose = {tokenize.STRING, tokenize.COMMENT} | ({tokenize.FSTRING_MIDDLE} if hasattr(tokenize, "FSTRING_MIDDLE") else set())
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and (tok.string in defined or tok.string == old.config_class):
            replacement = _renamed(tok.string, old, new)
        elif tok.type in prose:
            replacement = _rename_text(tok.string, old, new, defined)
        else:
            continue
        if replacement != tok.string:
            start = offsets[tok.start[0] - 1] + tok.start[1]
            edits.append((start, offsets[tok.end[0] - 1] + tok.end[1], replacement))
    for start, end, replacement in reversed(edits):
        text = text[:start] + replacement + text[end:]
    return text


def _rewrite_registration(text: str, old: Names, new: Names) -> str:
    """The ``register(Architecture(...))`` call: model_types, the stock HF class, no published
    configs yet; and a module docstring that says where the folder came from."""
    for pattern, replacement in ((r"model_types=\((?:[^()]|\([^()]*\))*\)", f'model_types=("{new.model_type}",)'),
                                 (r"hf_causal_lm_class=(['\"])[^'\"]*\1", f'hf_causal_lm_class="transformers.{new.hf_class}"')):
        text, count = re.subn(pattern, lambda _: replacement, text)
        if count != 1:
            raise ValueError(f"--from {old.name}: its __init__.py has {count} `{pattern.split('=')[0]}=` arguments, "
                             f"expected one register(Architecture(...)) call")
    text = re.sub(r"published_configs=\((?:[^()]|\([^()]*\))*\)", "published_configs=()", text)
    doc = ast.get_docstring(ast.parse(text), clean=False)
    header = (f'"""{new.prefix} (HF ``{new.hf_class}``, model_type ``{new.model_type}``): copied from the '
              f'``{old.name}`` architecture\nby ``vexact new-architecture``; the checklist is '
              f'docs/adding-an-architecture.md."""')
    if doc is not None:
        body = ast.parse(text).body[0]
        lines = text.splitlines(keepends=True)
        text = header + "\n" + "".join(lines[body.end_lineno:])
    return text


def _check_writable(folder: Path, test_path: Path, dest: str | os.PathLike | None) -> None:
    """Refuse a package folder or test that cannot be made (a file on the way, no permission to
    write), before anything is written."""
    for path in (folder, test_path):
        problem = unwritable(path.parent)
        if problem:
            where = f"--dest {str(dest)!r}" if dest is not None else "the source checkout"
            raise ValueError(f"{where}: cannot write {path}: {problem}")


def write(scaffold: Scaffold) -> None:
    """Write the rendered files: the test first, then the package folder in one rename (so an
    interrupted run never leaves a half-written architecture the registry would discover). A
    ValueError naming the path where writing fails, nothing written left behind (the folders
    made for it included)."""
    _check_free(scaffold.new, scaffold.folder, scaffold.test_path, scaffold.package)
    made: list[Path] = []
    staging, done = None, False
    try:
        made = make_parents(scaffold.folder.parent)
        staging = new_folder(scaffold.folder.parent, f".{scaffold.new.name}-")  # (a plain mkdir's mode)
        for path, text in scaffold.files.items():
            if path.parent == scaffold.folder:
                (staging / path.name).write_text(text)
        made = make_parents(scaffold.test_path.parent) + made  # (deepest first)
        scaffold.test_path.write_text(scaffold.files[scaffold.test_path])
        staging.rename(scaffold.folder)
        done = True
    except OSError as error:
        where = str(scaffold.folder.parent) if scaffold.in_tree else f"--dest {str(scaffold.folder.parent)!r}"
        raise ValueError(f"{where}: cannot write {scaffold.new.name}/ and its test {scaffold.test_path}: {error}; "
                         "nothing is left behind") from None
    finally:
        if not done:
            if staging is not None:
                scaffold.test_path.unlink(missing_ok=True)  # (ours: _check_free saw none)
                shutil.rmtree(staging, ignore_errors=True)
            remove_empty(made)
    importlib.invalidate_caches()


def pyproject_snippet(scaffold: Scaffold) -> str:
    """The ``pyproject.toml`` lines an out-of-tree package needs to be discovered."""
    return (f'[project]\nname = "vexact-{scaffold.new.name.replace("_", "-")}"\nversion = "0.1.0"\n'
            f'dependencies = ["vexact-models"]\n\n'
            f'[project.entry-points."{registry.ENTRY_POINT_GROUP}"]\n{scaffold.new.name} = "{scaffold.package}"\n\n'
            f'[tool.setuptools]\npackages = ["{scaffold.package}"]\n')


def next_steps(scaffold: Scaffold, written: bool = True) -> str:
    """What the copy could not decide, in the order the guide (docs/adding-an-architecture.md) takes it."""
    new, old = scaffold.new, scaffold.template
    test = scaffold.test_path
    files = ", ".join(sorted(path.name for path in scaffold.files if path.parent == scaffold.folder))
    steps = [f"{'Wrote' if written else 'Would write (dry run)'} {scaffold.folder} ({files}) "
             f"and {test}: architecture {new.name!r}, model_type {new.model_type!r}, {new.config_class}, "
             f"stock class transformers.{new.hf_class}; copied from {old.name!r}.",
             "Next (docs/adding-an-architecture.md):",
             f"  1. Diff modeling.py against transformers' modeling_{new.model_type}.py: module tree and parameter names "
             f"must be HF's; change only what differs from {old.prefix}."]
    if scaffold.defaulted_fields:
        steps.append(f"     {new.config_class} has no {', '.join(scaffold.defaulted_fields)}: the copy reads them with "
                     f"getattr(config, name, <{old.config_class}'s default>) = "
                     f"{', '.join(f'{k}={v!r}' for k, v in scaffold.defaulted_fields.items())}; check HF's model agrees.")
    if scaffold.ignored_fields:
        steps.append(f"     {new.config_class} has fields that {old.config_class} and the shared code lack, which the copy "
                     f"ignores: {', '.join(scaffold.ignored_fields)}. Implement each, or raise ValueError for configs "
                     f"that use it.")
    if scaffold.heads_without_stock:
        steps.append(f"     transformers has no {', '.join(scaffold.heads_without_stock)}: the copy's head classes of those "
                     f"names have no stock counterpart (the shared head tests skip them); keep them (e.g. PPO critics) or "
                     f"remove them and their register() arguments.")
    steps.append(f"  2. __init__.py: tiny_config() fields for a {new.config_class}; Shapes; published_configs once you "
                 f"bundle a config.json under conformance/configs.")
    if scaffold.dropped_fields:
        steps.append(f"     NOTICE: {new.config_class} has no field {', '.join(scaffold.dropped_fields)}: removed from the "
                     f"copied tiny configs ({', '.join(f'{k}={v}' for k, v in scaffold.dropped_fields.items())}); a "
                     f"hub config.json of model_type {new.model_type!r} never sets them; HF's defaults apply"
                     + (" (head_dim: hidden_size // num_attention_heads)." if "head_dim" in scaffold.dropped_fields else "."))
    steps += [f"  3. Run: python -m pytest -q {test}" + (" tests/conformance tests/models" if scaffold.in_tree else
                                                       " (after the pip install -e below: the test finds the "
                                                       "package through its entry point)"),
              f"  4. GPU: vexact-conformance --arch {new.name} --device cuda --dtype bfloat16 --config <config.json>"]
    if scaffold.review_lines:
        steps.append(f"  Prose that still names {old.name!r} (review): " + "; ".join(scaffold.review_lines[:8])
                     + (f" (+{len(scaffold.review_lines) - 8} more)" if len(scaffold.review_lines) > 8 else ""))
    if not scaffold.in_tree:
        steps += ["", f"Out of tree: add to {scaffold.folder.parent / 'pyproject.toml'} and `pip install -e "
                  f"{scaffold.folder.parent}`:", "", pyproject_snippet(scaffold)]
    return "\n".join(steps)
