"""Routed experts shared by the MoE architectures: HF's fused expert tensors run through
`kernels.fused_moe` (batch-invariant), and the one way the MoE blocks call them (`call_experts`),
which hands the active PEFT adapters of the expert tensors (``target_parameters``) to the kernel
(docs/design.md section 8, drop-in)."""

from __future__ import annotations

import torch
from torch import nn

from vexact_models.kernels import ExpertLora, fused_moe

from .adapters import expert_adapters


def call_experts(experts: nn.Module, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 **kwargs) -> torch.Tensor:
    """`experts` (a fused experts module, `FusedExperts` or an architecture's own, maybe under
    PEFT's ``ParamWrapper`` layers) on the routed tokens, the MoE blocks' one way to call them:
    the base module's forward with the active adapters of its tensors (`adapters.expert_adapters`),
    which `kernels.fused_moe` adds over its sorted rows; PEFT's own forward is not called."""
    base, adapters = expert_adapters(experts)
    if adapters:
        kwargs["adapters"] = adapters
    return base(hidden, topk_ids, topk_weights, **kwargs)


def expert_loras(adapters: dict[str, ExpertLora] | None, where: str) -> dict[str, ExpertLora]:
    """`fused_moe`'s ``gate_up_lora`` / ``down_lora`` from `call_experts`'s adapters; ValueError
    naming an adapted tensor the experts' forward does not read through its GEMMs (a bias)."""
    adapters = adapters or {}
    unknown = sorted(set(adapters) - {"gate_up_proj", "down_proj"})
    if unknown:
        raise ValueError(f"{where}: LoRA on {unknown} is not supported by vexact-models' aligned experts; adapt "
                         "gate_up_proj and/or down_proj")
    return dict(gate_up_lora=adapters.get("gate_up_proj"), down_lora=adapters.get("down_proj"))


class FusedExperts(nn.Module):
    """Routed experts as HF stores them: fused 3-D tensors ``gate_up_proj [E, 2I, H]`` and
    ``down_proj [E, H, I]``, run through `kernels.moe.fused_moe` (batch-invariant)."""

    is_transposed = False  # ``[E, out, in]``, as HF's: PEFT's target_parameters adapters take HF's shapes

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def init_random(self, std: float) -> None:
        """HF's init for the fused expert tensors (called by `InitHookMixin`)."""
        nn.init.normal_(self.gate_up_proj, 0.0, std)
        nn.init.normal_(self.down_proj, 0.0, std)

    def forward(self, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                add: torch.Tensor | None = None, add_ready: torch.cuda.Event | None = None,
                adapters: dict[str, ExpertLora] | None = None) -> torch.Tensor:
        """The routed experts' output, plus `add` when given (bitwise ``experts(...) + add``; see
        `fused_moe`), read only once `add_ready` (if given: `add` computed on a side stream) fired;
        with the LoRA `adapters` of its tensors (`call_experts`)."""
        return fused_moe(hidden, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, add, add_ready,
                         **expert_loras(adapters, type(self).__name__))
