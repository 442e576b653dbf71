"""What several integration test files share."""

import importlib.util
import sys
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def trl_grpo_example():
    """examples/trl_grpo.py as a module (its toy task, tokenizer and trainer factory)."""
    path = Path(__file__).resolve().parents[2] / "examples" / "trl_grpo.py"
    spec = importlib.util.spec_from_file_location("trl_grpo_example", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
