"""Work beside the current CUDA stream: a DeepSeek-V3 / Moonlight MoE layer's shared experts run on
a side stream while its router and routed experts run on the current one.

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
"""

from __future__ import annotations

import torch
from torch import nn

from vexact_models.kernels import KernelSwitch

__all__ = ["SHARED_EXPERTS", "beside", "side_stream"]

#: ``VEXACT_SHARED_EXPERTS``: ``side`` (the default: the shared experts beside the routed ones, where
#: `beside` may) or ``inline`` (one stream, one kernel after the other)
SHARED_EXPERTS = KernelSwitch("VEXACT_SHARED_EXPERTS", ("side", "inline"), "side", "shared experts' placement")

_streams: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream of CUDA `device`, one per device for the process (created on first use)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]


def _records_autograd(module: nn.Module, x: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in module.parameters()))


def beside(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """``(module(x), ready)``: `module` run on the side stream of `x`'s device, started where the
    current stream is now, and the event its consumer must wait for (`torch.cuda.Stream.wait_event`)
    before reading the result, while a CUDA graph is being captured. Elsewhere (a CPU tensor, an
    eager call, an autograd graph being recorded, ``VEXACT_SHARED_EXPERTS=inline``) `module` runs
    here and `ready` is None."""
    # the mode first: a bad value is an error on any device
    if (SHARED_EXPERTS.mode() == "inline" or not x.is_cuda or not torch.cuda.is_current_stream_capturing()
            or _records_autograd(module, x)):
        return module(x), None
    side = side_stream(x.device)
    side.wait_stream(torch.cuda.current_stream(x.device))
    with torch.cuda.stream(side):
        out = module(x)
        ready = torch.cuda.Event()
        ready.record(side)
    return out, ready
