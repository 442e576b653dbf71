"""Which packages the distribution ships; everything else is in pyproject.toml.

The package list is computed, not kept by hand: ``vexact_models`` and every sub-package under
it (each architecture folder, ``integrations``) are found with `find_namespace_packages`, so a new
architecture folder ships without editing this file (tests/test_packaging.py builds a wheel to
check). Folders of data only (``conformance/configs``) are packages too, without an
``__init__.py``, so setuptools ships their files as declared instead of warning that it would
ignore them. The top-level folders in `MAPPED` are sub-packages of ``vexact_models`` mapped from the
repository root (``kernels/`` is ``vexact_models.kernels``). Never install a top-level package
called ``kernels``, ``runtime`` or ``patches``: transformers imports a package named ``kernels``
when it finds one.
"""

from setuptools import find_namespace_packages, setup

#: top-level folders installed as ``vexact_models.<folder>``
MAPPED = ("kernels", "runtime", "patches", "conformance")


def packages() -> list[str]:
    """Every package the wheel holds, and nothing outside ``vexact_models``."""
    found = []
    for name, folder in (("vexact_models", "vexact_models"), *((f"vexact_models.{f}", f) for f in MAPPED)):
        found += [name] + [f"{name}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]
    return sorted(found)


setup(
    packages=packages(),
    package_dir={"vexact_models": "vexact_models", **{f"vexact_models.{folder}": folder for folder in MAPPED}},
    package_data={"vexact_models.conformance.configs": ["*.json"]},
)
