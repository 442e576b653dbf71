"""Which packages the distribution ships; everything else is in pyproject.toml.

The package list is computed, not kept by hand: ``vexact_models`` and every sub-package under
it (each architecture folder, ``integrations``) are found with `find_packages`, so a new
architecture folder ships without editing this file (tests/test_packaging.py builds a wheel to
check). The top-level folders in `MAPPED` are sub-packages of ``vexact_models`` mapped from the
repository root (``kernels/`` is ``vexact_models.kernels``). Never install a top-level package
called ``kernels``, ``runtime`` or ``patches``: transformers imports a package named ``kernels``
when it finds one.
"""

from setuptools import find_packages, setup

#: top-level folders installed as ``vexact_models.<folder>``
MAPPED = ("kernels", "runtime", "patches", "conformance")


def packages() -> list[str]:
    """Every package the wheel holds, and nothing outside ``vexact_models``."""
    found = []
    for name, folder in (("vexact_models", "vexact_models"), *((f"vexact_models.{f}", f) for f in MAPPED)):
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


setup(
    packages=packages(),
    package_dir={"vexact_models": "vexact_models", **{f"vexact_models.{folder}": folder for folder in MAPPED}},
    package_data={"vexact_models.conformance": ["configs/*.json"]},
)
