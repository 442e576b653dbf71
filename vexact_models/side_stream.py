"""Work beside the current CUDA stream: a MoE layer's shared experts (DeepSeek-V3 / Moonlight's, and
the gated shared expert of Qwen3.5-MoE / Qwen3-Next) run on a side stream while its router and
routed experts run on the current one.

Why: at decode batches the routed experts' grouped GEMMs are bound by reading every expert's
weights, while the shared experts are small dense GEMMs bound by their own latency; one after the
other they add their times. Side by side in a CUDA graph, the shared experts' programs fill the
routed kernels' gaps. H200, Moonlight-16B-A3B, one MoE layer (eight in a CUDA graph, 2026-11-28;
`benchmarks/shared_experts.py` times it): 348.8 -> 323.3 us at 256 tokens, 211 -> 189 us at 16,
2,525 -> 2,512 us at 8,192; DeepSeek-V3 3,247 -> 3,214 us at 256.

The bits cannot move: the same kernels read the same inputs; only when they run changes. The
routed experts' combine, the one consumer of the shared output, waits for the side stream's event
first (`kernels.moe.fused_moe`'s ``add_ready``). No ``record_stream`` is needed: the layer's
stream waits for that event before the forward returns, so nothing it frees is still being read,
and the next fork waits for everything the layer's stream has issued, so the side stream never
writes a block the layer's stream still reads.

Only inside CUDA-graph captures (the engine's decode steps and captured mixed steps) where no
autograd graph is recorded. Eager calls keep the shared experts in line. With the side stream in
eager calls too, the engine's eager prompt steps of 7,300 tokens ran 1.11x slower (H200, one MoE
model, `benchmarks/decode_profile.py --prompt-steps`, 2026-11-28):
- 51-57 ms of a step's GPU time sat idle instead of 3;
- the slowdown stayed even when eager calls of more than 1,024 tokens, those steps among them,
  kept the shared experts in line;
- with the side stream in captures only, the steps took 111.2 ms against 111.4 in line.
The likely cause: the blocks of the side stream's eager allocations stay cached for that stream
alone, so the layer's stream, short of memory beside a full KV cache, frees and allocates anew. A
capture takes its memory from the graph's private pool, once.
A training forward keeps the shared experts in line too, where their backward expects them.
``VEXACT_SHARED_EXPERTS=inline`` keeps them in line everywhere (to compare; the same bits).

A LoRA group's shrink (``x A^T`` of its adapters, `kernels.lora_partials`) reads only the group's
input, so in the same captures it starts on the side stream before the base GEMM and runs beside
it (`shrink_beside`); the expand that adds the update into the base output waits for it. At decode
batches the base GEMMs leave SMs idle (few output tiles) and each launch on the step's one stream
adds its latency: beside, a group's shrink leaves that chain. Same protocol, same bits (the same
launches on the same inputs). ``VEXACT_LORA_SHRINK=inline`` keeps the shrinks in line.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from vexact_models.kernels import (LORA_SHRINK, KernelSwitch, begin_beside, current_backend, forks_here, lora_partials,
                                   side_stream)

__all__ = ["LORA_SHRINK", "SHARED_EXPERTS", "beside", "joined", "shrink_beside", "side_stream"]

#: ``VEXACT_SHARED_EXPERTS``: ``side`` (the default: the shared experts beside the routed ones, where
#: `beside` may) or ``inline`` (one stream, one kernel after the other)
SHARED_EXPERTS = KernelSwitch("VEXACT_SHARED_EXPERTS", ("side", "inline"), "side", "shared experts' placement")


def _records_autograd(module: nn.Module, x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def beside(module: nn.Module, x: torch.Tensor,
           call: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``(module(x), ready)``: `module` run on the side stream of `x`'s device, started where the
    current stream is now, and the event its consumer must wait for (`torch.cuda.Stream.wait_event`)
    before reading the result, while a CUDA graph is being captured. Elsewhere (a CPU tensor, an
    eager call, an autograd graph being recorded, ``VEXACT_SHARED_EXPERTS=inline``) `module` runs
    here and `ready` is None. `call`: run ``call(x)`` instead of ``module(x)`` (work over
    `module`'s parameters that is not its forward, e.g. a shared expert and its gate)."""
    call = module if call is None else call
    # the mode first: a bad value is an error on any device
    if (SHARED_EXPERTS.mode() == "inline" or not x.is_cuda or not torch.cuda.is_current_stream_capturing()
            or _records_autograd(module, x)):
        return call(x), None
    return begin_beside(lambda: call(x), x.device)


def shrink_beside(x: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event] | None:
    """``(partials, ready)``: the LoRA shrink of `x` and `a` (`kernels.lora_partials`, what
    `kernels.lora_add`'s ``partials`` takes) started on the side stream, while a CUDA graph is being
    captured with autograd off and the Triton backend; `joined` hands it to the expand. None
    elsewhere (the caller's `lora_add` runs the shrink in line), and with ``VEXACT_LORA_SHRINK=inline``."""
    if LORA_SHRINK.mode() == "inline" or not forks_here(x) or current_backend(x.device) != "triton":
        return None
    return begin_beside(lambda: lora_partials(x, a), x.device)


def joined(started: tuple[torch.Tensor, torch.cuda.Event] | None) -> torch.Tensor | None:
    """The partials of a `shrink_beside` once the current stream waits for them (None stays None)."""
    if started is None:
        return None
    partials, ready = started
    torch.cuda.current_stream(partials.device).wait_event(ready)
    return partials
