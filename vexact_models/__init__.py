"""vexact-models: HF architectures whose rollout logprobs equal training logprobs bitwise.

    import vexact_models
    vexact_models.patch()            # AutoModelForCausalLM now returns our training variants
    llm = vexact_models.LLM(path)    # paged-KV rollouts with the same forward
"""

from .patches import is_patched, patch, unpatch
from .registry import Architecture, architectures, register

__version__ = "0.1.0"

__all__ = ["Architecture", "architectures", "is_patched", "patch", "register", "unpatch"]
