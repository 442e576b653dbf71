"""vexact-models: HF architectures whose rollout logprobs equal training logprobs bitwise.

    import torch, vexact_models
    from transformers import AutoModelForCausalLM

    vexact_models.patch()                                  # Auto* classes return our training variants
    model = AutoModelForCausalLM.from_pretrained(path)
    llm = vexact_models.LLM(model)                         # paged-KV rollouts, sharing the model's weights
    out = llm.generate([prompt_ids], vexact_models.SamplingParams(temperature=1.0, max_tokens=64, seed=0))[0]
    ids = torch.tensor([out.prompt_token_ids + out.outputs[0].token_ids])
    logprobs = model.token_logprobs(ids)                   # == out.outputs[0].logprobs, bitwise

`LLM` also takes a checkpoint folder (``vexact_models.LLM(path)``: it loads its own copy). The
design, the invariance rules and what is proven where: ``docs/design.md``.
"""

from .patches import is_patched, patch, unpatch
from .registry import Architecture, architectures, register

__version__ = "0.1.0"

__all__ = ["LLM", "Architecture", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams", "architectures",
           "is_patched", "patch", "register", "unpatch"]

#: Imported from `vexact_models.runtime` on first use: ``import vexact_models`` stays light (no
#: kernels, no triton) and free of import cycles (the runtime imports the model code).
_LAZY = {"LLM": "vexact_models.runtime", "SamplingParams": "vexact_models.runtime",
         "StructuredOutputsParams": "vexact_models.runtime", "RequestOutputKind": "vexact_models.runtime"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'vexact_models' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
