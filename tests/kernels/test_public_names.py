"""Kernel names used across files are public, and model code imports ops from
`vexact_models.kernels` only (docs/design.md section 2): the model files do not depend on how the kernels package
is split into modules, and no file reaches into another's private names."""

import ast
from pathlib import Path

import vexact_models.kernels as kernels

ROOT = Path(__file__).resolve().parents[2]
MODEL_CODE = ROOT / "vexact_models"  # shared layers, causal_lm, heads, adapters and every architecture folder
CHECKED_FOLDERS = ("benchmarks", "conformance", "examples", "kernels", "patches", "runtime", "tests", "vexact_models")


def _kernel_imports(path: Path):
    """(line, module, names) for every import of a kernels module in `path` (absolute
    ``vexact_models.kernels[.x]`` or, inside kernels/, relative)."""
    in_kernels = path.parent == ROOT / "kernels"
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level == 0 and (module == "vexact_models.kernels" or module.startswith("vexact_models.kernels.")):
                yield node.lineno, module, [alias.name for alias in node.names]
            elif node.level == 1 and in_kernels:
                yield node.lineno, "vexact_models.kernels." + module if module else "vexact_models.kernels", \
                    [alias.name for alias in node.names]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("vexact_models.kernels."):
                    yield node.lineno, alias.name, []


def _python_files(*folders: str):
    for folder in folders:
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_model_code_imports_ops_from_the_kernels_package_only():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {module}"
                 for path in sorted(MODEL_CODE.rglob("*.py"))
                 for line, module, _ in _kernel_imports(path) if module != "vexact_models.kernels"]
    assert not offenders, f"import ops from vexact_models.kernels (export them in kernels/__init__.py): {offenders}"


def test_no_private_kernel_name_is_imported_from_another_file():
    offenders = [f"{path.relative_to(ROOT)}:{line}: {name} from {module}"
                 for path in _python_files(*CHECKED_FOLDERS)
                 for line, module, names in _kernel_imports(path) for name in names if name.startswith("_")]
    assert not offenders, f"give these kernel names a public name in their module: {offenders}"


def test_the_rule_sees_a_violation(tmp_path):
    """The parser finds both kinds of offence (a check that could not fail would prove nothing)."""
    bad = tmp_path / "modeling.py"
    bad.write_text("from vexact_models.kernels.linear import _helper, linear\nimport vexact_models.kernels.moe\n")
    found = list(_kernel_imports(bad))
    assert found == [(1, "vexact_models.kernels.linear", ["_helper", "linear"]), (2, "vexact_models.kernels.moe", [])]


def test_exported_ops_are_the_modules_own():
    from vexact_models.kernels.grouped_topk import sigmoid_grouped_topk
    from vexact_models.kernels.moe import fused_moe
    from vexact_models.kernels.moe_routing import softmax_topk

    assert kernels.fused_moe is fused_moe and kernels.softmax_topk is softmax_topk
    assert kernels.sigmoid_grouped_topk is sigmoid_grouped_topk
    assert all(hasattr(kernels, name) for name in kernels.__all__)
