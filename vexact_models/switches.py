"""Every ``VEXACT_*`` switch, found where it is declared.

A switch is a `vexact_models.kernels.KernelSwitch` constructed at the top of the module that reads
it; constructing one records it (`KernelSwitch.declared`). `declared_switches` imports every
module of the package whose source constructs one, so the list it returns is complete without a
hand-kept list of names or modules: ``vexact env`` prints it, and ``docs/switches.md`` is tested
against it (tests/test_switches.py, which also scans the source for ``VEXACT_*`` names that no
switch declares).
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

from vexact_models.kernels import KernelSwitch

#: the sub-packages mapped from top-level folders (setup.py's ``MAPPED``; tests/test_switches.py
#: checks the two agree); every other sub-package lives under vexact_models/ and is walked there
MAPPED = ("kernels", "runtime", "patches", "conformance")
_CONSTRUCTS = re.compile(r"\bKernelSwitch\(")


def package_modules() -> list[tuple[str, Path]]:
    """(module name, source file) of every module of the installed package, sub-packages' too."""
    found = []
    for package in ("vexact_models", *(f"vexact_models.{name}" for name in MAPPED)):
        spec = importlib.util.find_spec(package)
        for folder in map(Path, spec.submodule_search_locations or ()):
            for path in sorted(folder.rglob("*.py")):
                parts = path.relative_to(folder).with_suffix("").parts
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                if package == "vexact_models" and parts and parts[0] in MAPPED:
                    continue  # a wheel installs the mapped folders here: walked under their own name
                found.append((".".join((package, *parts)), path))
    return found


def declaring_modules() -> list[str]:
    """The modules whose source constructs a `KernelSwitch` (the class's own module aside)."""
    return [name for name, path in package_modules()
            if name != KernelSwitch.__module__ and _CONSTRUCTS.search(path.read_text(encoding="utf-8"))]


def declared_switches() -> tuple[list[KernelSwitch], dict[str, str]]:
    """Every switch the package declares, by environment variable name, and the declaring modules
    that could not be imported (module -> why: an optional package missing), whose switches the
    list then lacks."""
    failed = {}
    for name in declaring_modules():
        try:
            importlib.import_module(name)
        except ImportError as error:  # an integration whose framework is not installed
            failed[name] = f"{type(error).__name__}: {error}"
    ours = [s for s in KernelSwitch.declared() if s.module.split(".")[0] == "vexact_models"]
    return ours, failed
