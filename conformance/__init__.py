"""The conformance suite: rollout logprobs equal training logprobs bitwise, per architecture and shape.

`run_conformance` runs the scenarios for one model (`suite`); `models` builds the configs (tiny
shapes, bundled published configs) and the random-weight models the suite, the benchmarks and
the examples check; ``vexact-conformance`` (or ``python -m vexact_models.conformance``) runs every
registered (architecture, shape) and prints a table; `kernel_invariance` is the GPU proof of the
kernels' batch invariance.
"""

from .models import (CONFIG_DIR, architecture_of, build_model, bundled_configs, construct, make_config, published_config,
                     published_shape)
from .suite import Parity, Report, ScenarioResult, format_table, hf_parity, print_table, request_pool, run_conformance

__all__ = ["CONFIG_DIR", "Parity", "Report", "ScenarioResult", "architecture_of", "build_model", "bundled_configs",
           "construct", "format_table", "hf_parity", "make_config", "print_table", "published_config", "published_shape",
           "request_pool", "run_conformance"]
