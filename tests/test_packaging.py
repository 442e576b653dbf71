"""Every architecture folder is registered, and packaged: a wheel built from this tree (setup.py's
computed package list) holds every source file of every package, including a new architecture
folder nobody listed anywhere: a test fails if an architecture is importable but unregistered
or unpackaged (docs/design.md section 2)."""

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from vexact_models import registry

ROOT = Path(__file__).resolve().parents[1]
#: repository folders installed as ``vexact_models.<folder>`` (setup.py's MAPPED)
MAPPED = ("kernels", "runtime", "patches", "conformance")
#: a folder added to the copied tree only, to prove that packaging needs no edit for a new one
NEW_ARCH = "zz_new_architecture"


def package_files() -> dict[str, Path]:
    """Wheel path -> source file, for every file the wheel must hold: each ``.py`` under
    ``vexact_models/`` and the mapped folders, and the bundled configs."""
    want = {}
    for name, folder in (("vexact_models", "vexact_models"), *((f"vexact_models/{f}", f) for f in MAPPED)):
        for path in (ROOT / folder).rglob("*.py"):
            if "__pycache__" not in path.parts:
                want[f"{name}/{path.relative_to(ROOT / folder).as_posix()}"] = path
    for path in (ROOT / "conformance" / "configs").glob("*.json"):
        want[f"vexact_models/conformance/configs/{path.name}"] = path
    return want


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> dict[str, object]:
    """A wheel built (``pip wheel``, setuptools as in pyproject.toml) from a copy of this tree with
    one more architecture folder in it: its file ``names``, its ``metadata`` text and the ``log``
    the build printed."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist")
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in ("vexact_models", *MAPPED):
        shutil.copytree(ROOT / folder, src / folder, ignore=ignore)
    new = src / "vexact_models" / NEW_ARCH
    new.mkdir()
    (new / "__init__.py").write_text('"""A new architecture folder."""\n')
    (new / "modeling.py").write_text('"""Its modeling code."""\n')
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp / "dist"), str(src)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("vexact_models-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        return {"names": names, "metadata": archive.read(metadata).decode(), "log": done.stdout + done.stderr}


@pytest.fixture(scope="module")
def wheel_names(built_wheel) -> set[str]:
    return built_wheel["names"]


def test_the_build_warns_nothing(built_wheel):
    """setuptools' deprecation and packaging warnings turn into errors on a dated release (the
    `license` table's did, for builds after 2027-02-18), so the build must print none."""
    assert "Warning" not in built_wheel["log"], built_wheel["log"][-3000:]


def test_wheel_metadata_states_the_license(built_wheel):
    """The SPDX expression (PEP 639) that replaced the deprecated ``license = {text = ...}``."""
    assert "License-Expression: Apache-2.0" in built_wheel["metadata"].splitlines()


def test_every_architecture_folder_is_registered():
    """A folder with a modeling.py is discovered; it must register an architecture named after it
    whose classes live in it. A folder that defines an Architecture but has no modeling.py would
    never be discovered."""
    registered = {arch.name: arch for arch in registry.architectures()}
    folders = registry.builtin_architecture_packages()
    assert folders, "no architecture folder discovered"
    for package in folders:
        name = package.rpartition(".")[2]
        assert name in registered, f"{package} has a modeling.py but registers no architecture named {name!r}"
        arch = registered[name]
        for cls in (arch.causal_lm_class, arch.base_model_class, arch.inference_class):
            assert cls.__module__.startswith(package + "."), (name, cls)
    for init in (ROOT / "vexact_models").glob("*/__init__.py"):
        package = f"vexact_models.{init.parent.name}"
        if package not in folders:
            assert not re.search(r"\bArchitecture\(", init.read_text()), \
                f"{package} defines an Architecture but has no modeling.py, so the registry never imports it"


def test_wheel_holds_every_package_file_and_every_architecture_folder(wheel_names):
    missing = sorted(set(package_files()) - wheel_names)
    assert not missing, f"files the wheel lacks: {missing[:20]}"
    for package in [*registry.builtin_architecture_packages(), f"vexact_models.{NEW_ARCH}"]:
        folder = package.replace(".", "/")
        assert {f"{folder}/__init__.py", f"{folder}/modeling.py"} <= wheel_names, package


def test_wheel_installs_nothing_outside_vexact_models(wheel_names):
    """The mapped folders ship as vexact_models.kernels etc.: a top-level ``kernels`` package
    would be imported by transformers as the hub kernels package."""
    top = {name.split("/")[0] for name in wheel_names}
    assert top == {"vexact_models", next(t for t in top if t.endswith(".dist-info"))}, top
