"""The routed experts' activations of `fused_moe` (moe.py): SwiGLU, and GPT-OSS's clamped SwiGLU.

Plain (Qwen3-MoE, DeepSeek): ``silu(g) * u``. Clamped (`SwigluClamp`, GPT-OSS: alpha 1.702,
limit 7.0; stock transformers' ``GptOssExperts._apply_gate``)::

    g = min(g, limit); u = clamp(u, -limit, limit)
    act = g * sigmoid(alpha * g) * (u + 1)

Both in fp32 from the gate and up products already rounded to the model dtype (biases added and
rounded again, as stock's ``x @ W + b``), rounded once (docs/design.md rule 5: element-wise, the
same expression for every element). The Triton epilogue (`expert_activation`) and the CPU
reference (`expert_activation_reference`, `exact_math.sigmoid`) are the two implementations; the
backward (rule 8) is the analytic formula in fp32 (`expert_activation_backward`), with torch's
clamp gradient (passed where the bound holds, inclusive).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import exact_math
from ._triton import next_power_of_2, tl, triton
from .moe_lora import ExpertLora


@dataclass(frozen=True)
class SwigluClamp:
    """GPT-OSS's clamped SwiGLU: the gate clamped from above at `limit`, the up product to
    ``[-limit, limit]`` and shifted by one, the gate's sigmoid taken at ``alpha * g``."""

    alpha: float = 1.702
    limit: float = 7.0

    def __post_init__(self) -> None:
        for name in ("alpha", "limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 \
                    or value == float("inf"):
                raise ValueError(f"SwigluClamp: {name}={value!r} must be a finite number > 0")


@triton.jit
def expert_activation(g, u, alpha, limit, CLAMPED: tl.constexpr):
    """fp32 ``g``, ``u`` tiles -> the fp32 activation (module docstring); rounded by the caller."""
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-(g * alpha))) * (u + 1.0)
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _expert_activation_rows_kernel(pre_ptr, act_ptr, block_expert_ptr, inter, stride_pre, stride_act, alpha, limit,
                                   BLOCK_EXPERT_ROWS: tl.constexpr, CLAMPED: tl.constexpr, BLOCK: tl.constexpr):
    """``act[row] = expert_activation(gate, up)`` of one row of gate-first rounded products (rows
    of unused blocks, which hold no products, are skipped)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(block_expert_ptr + row // BLOCK_EXPERT_ROWS) < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < inter
    g = tl.load(pre_ptr + row * stride_pre + offs, mask=ok, other=0.0)
    u = tl.load(pre_ptr + row * stride_pre + inter + offs, mask=ok, other=0.0)
    act = expert_activation(g.to(tl.float32), u.to(tl.float32), alpha, limit, CLAMPED)
    tl.store(act_ptr + row * stride_act + offs, act.to(act_ptr.dtype.element_ty), mask=ok)


def expert_activation_rows(preact: torch.Tensor, clamp: SwigluClamp | None, block_expert: torch.Tensor,
                           block_m: int) -> torch.Tensor:
    """The activation ``[P, I]`` of gate-first rounded products ``[P, 2I]`` over a MoE layout's
    sorted rows (`block_expert`: each `block_m` rows' expert, -1 unused) by a Triton launch: the
    operations of `moe.moe_gate_up_kernel`'s epilogue, for rows whose products were changed after
    the GEMM (the experts' LoRA update, `moe_lora.py`)."""
    rows, inter = preact.shape[0], preact.shape[1] // 2
    act = torch.empty(rows, inter, device=preact.device, dtype=preact.dtype)
    if rows:
        block = min(1024, next_power_of_2(inter))
        _expert_activation_rows_kernel[(rows, triton.cdiv(inter, block))](
            preact, act, block_expert, inter, preact.stride(0), act.stride(0), float(clamp.alpha) if clamp else 1.0,
            float(clamp.limit) if clamp else 1.0, BLOCK_EXPERT_ROWS=block_m, CLAMPED=clamp is not None, BLOCK=block,
            num_warps=4, enable_fp_fusion=True)
    return act


def expert_activation_reference(gate: torch.Tensor, up: torch.Tensor, clamp: SwigluClamp | None) -> torch.Tensor:
    """The activation of rounded ``gate``/``up`` products (any shape, one dtype) in fp32 (fp64
    for fp64), rounded once to their dtype; position-independent on CPU (`exact_math.sigmoid`)."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u = gate.to(compute), up.to(compute)
    if clamp is None:
        return (g * exact_math.sigmoid(g).to(compute) * u).to(gate.dtype)
    g = g.clamp(max=clamp.limit)
    u = u.clamp(-clamp.limit, clamp.limit)
    return (g * exact_math.sigmoid(g * clamp.alpha).to(compute) * (u + 1.0)).to(gate.dtype)


def expert_activation_backward(gate: torch.Tensor, up: torch.Tensor, grad: torch.Tensor,
                               clamp: SwigluClamp | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d gate, d up) in fp32 (fp64 for fp64 inputs) of the activation at the rounded products
    `gate`, `up`, for the output gradient `grad` (rule 8)."""
    compute = torch.float64 if gate.dtype == torch.float64 else torch.float32
    g, u, grad = gate.to(compute), up.to(compute), grad.to(compute)
    if clamp is None:
        sig = torch.sigmoid(g)
        return grad * u * sig * (1.0 + g * (1.0 - sig)), grad * g * sig
    gc = g.clamp(max=clamp.limit)
    uc = u.clamp(-clamp.limit, clamp.limit)
    sig = torch.sigmoid(gc * clamp.alpha)
    d_gc = grad * (uc + 1.0) * sig * (1.0 + clamp.alpha * gc * (1.0 - sig))
    d_uc = grad * gc * sig
    return d_gc * (g <= clamp.limit), d_uc * ((u >= -clamp.limit) & (u <= clamp.limit))


def expert_activation_math(gate: torch.Tensor, up: torch.Tensor, clamp: SwigluClamp | None) -> torch.Tensor:
    """Plain differentiable torch: the oracle of the tests and `moe_backward.moe_math`."""
    if clamp is None:
        return torch.nn.functional.silu(gate) * up
    gate = gate.clamp(max=clamp.limit)
    up = up.clamp(-clamp.limit, clamp.limit)
    return gate * torch.sigmoid(gate * clamp.alpha) * (up + 1)


@dataclass(frozen=True)
class ExpertForm:
    """What a MoE's experts compute beyond the plain two GEMMs and SwiGLU (Qwen3-MoE, DeepSeek:
    `PLAIN`): biases on the gate/up (``[E, 2I]``, in the gate/up rows' order) and down (``[E, H]``)
    products, GPT-OSS's `SwigluClamp`, and whether the ``[E, 2I, H]`` gate/up rows interleave
    (GPT-OSS: gate row n at 2n, up row n at 2n + 1) instead of all gate rows first; and LoRA
    adapters on either expert tensor (`moe_lora.ExpertLora`, PEFT's ``target_parameters``)."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    clamp: SwigluClamp | None = None
    interleaved: bool = False
    gate_up_lora: ExpertLora | None = None
    down_lora: ExpertLora | None = None

    def split(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) columns of ``[..., 2I]`` products (or rows' values) in this form's order."""
        inter = gate_up.shape[-1] // 2
        if self.interleaved:
            return gate_up[..., 0::2], gate_up[..., 1::2]
        return gate_up[..., :inter], gate_up[..., inter:]

    def join(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """`split`'s inverse: ``[..., 2I]`` in this form's order."""
        if self.interleaved:
            return torch.stack([gate, up], dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
        return torch.cat([gate, up], dim=-1)


PLAIN = ExpertForm()
