"""vexact-models: HF architectures whose rollout logprobs equal training logprobs bitwise."""

__version__ = "0.1.0"
