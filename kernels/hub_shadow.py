"""When this folder is imported as the top-level ``kernels``, hand that name to the installed
``kernels`` distribution (Hugging Face's hub kernels) where there is one.

The repository keeps the aligned ops in a folder named ``kernels/`` (installed as
``vexact_models.kernels``). A process whose ``sys.path`` holds the repository root (``python -m
pytest`` or ``python -m vexact_models.conformance`` run from it) finds this folder first for a bare
``import kernels``. From transformers 5.25 on, transformers depends on the ``kernels``
distribution and imports names from it at import time (``transformers.integrations.hub_kernels``:
``from kernels import CUDAProperties, ...``), which this folder does not have, so importing
transformers failed there. `hand_over` loads the distribution's package under that name instead,
from the ``sys.path`` entries other than the repository root; without such a distribution the
folder stays the top-level ``kernels`` as before (tests/kernels/test_hub_shadow.py).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> bool:
    """Load the package `name` found on ``sys.path`` outside the folder above `init_file`'s
    package (this repository's root) into ``sys.modules[name]``, where one exists: the importing
    statement then returns it. Returns whether it did."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
    if spec is None or spec.loader is None:
        return False
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return True
