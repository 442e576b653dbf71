"""Every ``VEXACT_*`` switch is a `KernelSwitch` that `vexact_models.switches.declared_switches`
finds from the source (no hand-kept list), and ``docs/switches.md`` lists exactly those switches
with their modes and defaults."""

import ast
import re
from pathlib import Path

from vexact_models.switches import MAPPED, declared_switches, declaring_modules, package_modules

ROOT = Path(__file__).resolve().parents[1]
SOURCE_FOLDERS = ("vexact_models", *MAPPED)
NAME = re.compile(r"VEXACT_[A-Z0-9_]+")


def _declared() -> dict:
    switches, failed = declared_switches()
    assert not failed, f"modules declaring switches could not be imported: {failed}"
    return {s.env_var: s for s in switches}


def test_mapped_subpackages_are_setup_pys():
    tree = ast.parse((ROOT / "setup.py").read_text())
    mapped = next(ast.literal_eval(node.value) for node in ast.walk(tree)
                  if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "MAPPED" for t in node.targets))
    assert tuple(mapped) == MAPPED


def test_the_walk_sees_every_source_file_of_the_package():
    found = {path.resolve() for _, path in package_modules()}
    on_disk = {path.resolve() for folder in SOURCE_FOLDERS for path in (ROOT / folder).rglob("*.py")}
    assert found == on_disk
    names = [name for name, _ in package_modules()]
    assert "vexact_models.kernels.backend" in names and "vexact_models.runtime" in names
    assert "vexact_models.integrations.verl" in names and len(names) == len(set(names))


def test_every_vexact_name_in_the_source_is_a_declared_switch():
    """A ``VEXACT_*`` name written as a string anywhere in the package (an ``os.environ`` read, a
    constant) must be a declared switch; and every declared switch is found by the source scan."""
    in_source: dict[str, list[str]] = {}
    for folder in SOURCE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                    in_source.setdefault(node.value, []).append(str(path.relative_to(ROOT)))
    declared = _declared()
    assert set(in_source) == set(declared), {n: in_source.get(n, "not in the source") for n in
                                             set(in_source) ^ set(declared)}
    assert len(declared) >= 10  # the ten of today at least
    for switch in declared.values():
        assert switch.module in declaring_modules() and switch.default in switch.modes and switch.label


def _docs_table() -> dict[str, tuple[tuple[str, ...], str, str, str]]:
    """name -> (modes, default, what it chooses, rule) from docs/switches.md's table."""
    rows = {}
    for line in (ROOT / "docs" / "switches.md").read_text().splitlines():
        if line.startswith("| `VEXACT_"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            assert len(cells) == 5, line
            name, modes, default, chooses, rule = cells
            assert name not in rows, f"{name} twice in docs/switches.md"
            rows[name.strip("`")] = (tuple(m.strip().strip("`") for m in modes.split(",")), default.strip("`"),
                                     chooses, rule)
    return rows


def test_the_docs_table_lists_exactly_the_declared_switches():
    table, declared = _docs_table(), _declared()
    assert set(table) == set(declared), f"docs/switches.md differs from the declarations: {set(table) ^ set(declared)}"
    for name, (modes, default, chooses, rule) in table.items():
        assert modes == declared[name].modes, f"{name}: docs say modes {modes}, the declaration {declared[name].modes}"
        assert default == declared[name].default, f"{name}: docs say default {default}"
        assert chooses and re.search(r"\b(rule|section) \d", rule), f"{name}: what it chooses and its design rule"


def test_every_override_the_page_names_is_importable_from_vexact_models_kernels():
    """docs/switches.md says the in-process overrides are ``set_*`` / ``use_*`` in
    `vexact_models.kernels`: each one it names is exported there (two were only in their modules)."""
    import vexact_models.kernels as kernels

    named = set(re.findall(r"`((?:set|use)_[a-z_]+)`", (ROOT / "docs" / "switches.md").read_text()))
    assert {"use_attention_backward", "use_gated_delta_backward"} <= named
    assert named <= set(kernels.__all__), named - set(kernels.__all__)
