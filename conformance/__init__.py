"""The conformance suite: rollout logprobs equal training logprobs bitwise, per architecture.

`run_conformance` runs the scenarios for one model; ``vexact-conformance`` (or
``python -m vexact_models.conformance``) runs every registered architecture and prints a table;
`kernel_invariance` is the GPU proof of the kernels' batch invariance.
"""

from .suite import Parity, Report, ScenarioResult, hf_parity, request_pool, run_conformance

__all__ = ["Parity", "Report", "ScenarioResult", "hf_parity", "request_pool", "run_conformance"]
