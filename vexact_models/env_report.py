"""What a bug report needs (``vexact env``): the versions of Python, torch, Triton, transformers,
peft and every optional extra (read from the package's own requirements, so a new extra appears
without an edit here), the platform, the device, the kernel backend ops would run on it, and every
``VEXACT_*`` switch with its value, default and modes (`vexact_models.switches`)."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import platform
import re
import sys

import torch

import vexact_models
from vexact_models.kernels import current_backend
from vexact_models.switches import declared_switches

DISTRIBUTION = "vexact-models"
#: listed first, in this order; the other requirements follow in the order pyproject.toml gives them
FIRST = ("torch", "triton", "transformers", "peft")
#: extras that only run the tests or the examples: their packages say nothing about a user's setup
TOOLING_EXTRAS = ("test", "examples")
#: packages that compile an extra's kernels, listed after it: quack's and FlashAttention-4's bits
#: and whether they build at all depend on the CUTLASS DSL release as much as on their own
COMPILED_BY = {"quack-kernels": ("nvidia-cutlass-dsl",), "flash-attn-4": ("nvidia-cutlass-dsl",)}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def requirement_names(requirements: list[str]) -> list[str]:
    """The distribution names of `requirements` (PEP 508 strings, as `importlib.metadata.requires`
    gives them), `FIRST` first, without those only the `TOOLING_EXTRAS` ask for, each once, each
    followed by what `COMPILED_BY` names for it."""
    names = []
    for requirement in requirements:
        extra = _EXTRA.search(requirement)
        name = _NAME.match(requirement).group(0).lower().replace("_", "-")
        if extra is None or extra.group(1) not in TOOLING_EXTRAS:
            names.extend(n for n in (name, *COMPILED_BY.get(name, ())) if n not in names)
    return [*FIRST, *(n for n in names if n not in FIRST)]


def versions(requirements: list[str] | None = None) -> dict[str, str]:
    """Python's version, then each package of `requirement_names` (its version, or "not installed")
    of `requirements` (default: this distribution's own)."""
    if requirements is None:
        try:
            requirements = metadata.requires(DISTRIBUTION) or []
        except metadata.PackageNotFoundError:  # run from a source tree without installing it
            requirements = []
    found = {"python": platform.python_version()}
    for name in requirement_names(requirements):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def device_info() -> dict:
    """The devices torch sees: every CUDA device's name and compute capability, or "cpu"."""
    if not torch.cuda.is_available():
        return {"type": "cpu", "cuda_build": torch.version.cuda, "devices": []}
    devices = [{"index": i, "name": torch.cuda.get_device_name(i),
                "capability": "sm_{}{}".format(*torch.cuda.get_device_capability(i))}
               for i in range(torch.cuda.device_count())]
    return {"type": "cuda", "cuda_build": torch.version.cuda, "devices": devices}


def _switch_rows() -> tuple[list[dict], dict[str, str]]:
    switches, failed = declared_switches()
    rows = []
    for switch in switches:
        raw = os.environ.get(switch.env_var)
        try:
            value = switch.mode()
        except ValueError:  # a bad value is reported, not raised: the report is for bugs
            value = f"{raw!r} (invalid)"
        rows.append({"name": switch.env_var, "value": value, "environment": raw, "default": switch.default,
                     "modes": list(switch.modes), "chooses": switch.label, "module": switch.module})
    return rows, failed


def collect() -> dict:
    """The report as a dict (what ``vexact env --json`` prints)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        backend = current_backend(device)
    except ValueError as error:  # VEXACT_BACKEND holds a bad value
        backend = f"none: {error}"
    switches, failed = _switch_rows()
    return {"vexact-models": _own_version(), "platform": platform.platform(), "versions": versions(),
            "device": device_info(), "backend": {"device": str(device), "backend": backend},
            "triton_interpreter": os.environ.get("TRITON_INTERPRET", "0") == "1",
            "switches": switches, "switch_modules_not_imported": failed}


def _own_version() -> str:
    return f"{vexact_models.__version__} ({os.path.dirname(vexact_models.__file__)})"


def format_text(report: dict) -> str:
    """`report` (`collect`'s) as the lines to paste into an issue."""
    lines = ["Copy and paste the text below into your bug report.", "",
             f"- vexact-models: {report['vexact-models']}", f"- platform: {report['platform']}"]
    lines += [f"- {name}: {version}" for name, version in report["versions"].items()]
    device = report["device"]
    if device["type"] == "cpu":
        lines.append(f"- device: cpu (torch's CUDA build: {device['cuda_build'] or 'none'})")
    else:
        lines += [f"- device cuda:{d['index']}: {d['name']} ({d['capability']})" for d in device["devices"]]
    backend = report["backend"]
    lines.append(f"- kernel backend on {backend['device']}: {backend['backend']}"
                 + (" (Triton's CPU interpreter: TRITON_INTERPRET=1)" if report["triton_interpreter"] else ""))
    lines += ["- switches (docs/switches.md):"]
    width = max((len(row["name"]) for row in report["switches"]), default=0)
    for row in report["switches"]:
        source = "set" if row["environment"] is not None else "unset"
        lines.append(f"    {row['name']:<{width}} = {row['value']:<8} ({source}; default {row['default']}; "
                     f"modes {'|'.join(row['modes'])}; the {row['chooses']})")
    for module, why in report["switch_modules_not_imported"].items():
        lines.append(f"    (the switches of {module} are missing: {why})")
    return "\n".join(lines)


def main(as_json: bool = False) -> int:
    """Print the report (as JSON with `as_json`)."""
    report = collect()
    print(json.dumps(report, indent=2) if as_json else format_text(report))
    return 0


if __name__ == "__main__":
    sys.exit(main("--json" in sys.argv[1:]))
