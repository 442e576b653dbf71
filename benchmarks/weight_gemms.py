"""A decode step's GEMMs alone, by cuBLAS and by ours, under the card's sustained clocks: the
peers that say how fast the step's weight reads can go on this card at this batch.

The HBM roofline (`bench_utils.decode_bytes` over the copy bandwidth) assumes that the weights
stream at the bandwidth of a lone copy kernel. At batch 128-256 a step's GEMMs do tensor-core
work too, and on an H200 at Qwen3-8B shape they draw the card to its power limit: its SM clock
falls from 1980 to about 1500 MHz; at Qwen3-0.6B shape they are too small to fill the card
(H200, 2026-11-27). `time_weight_gemms` times a GEMM (``torch.mm``, cuBLAS, not
batch-invariant, the speed peer; or our `kernels.linear`) over the same weight matrices as the
step, one after another inside one CUDA graph, replayed for seconds so that the clocks settle
where a long rollout's would, with `gpu_clocks.GpuClocks` sampling them. Every GEMM writes bf16
(the step's LM head writes fp32 logits: 4 bytes more per vocabulary entry and row).

Usage (decode_profile.py prints both beside the step):
    weights = step_gemm_weights(model)
    peer = time_weight_gemms(weights, batch=128)                 # cuBLAS
    ours = time_weight_gemms(weights, batch=128, gemm=linear)    # vexact_models.kernels.linear
    print(peer.seconds, ours.seconds, peer.clocks)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from bench_utils import capture_graph
from gpu_clocks import ClockSummary, GpuClocks, nvidia_smi_id
from vexact_models.layers import _fused_weight


def step_gemm_weights(model: nn.Module) -> list[torch.Tensor]:
    """The ``[N, K]`` weight of every GEMM a decode step of `model` runs, in module order: each
    projection group (``projection_groups()``: q/k/v, gate/up) as one matrix where
    `fuse_projections` fused it (the runtime does when an engine is built), its members otherwise,
    and every other `nn.Linear` (o, down, the LM head; a gated-DeltaNet layer's projections, not
    its depthwise convolution). Raises ValueError for a model with 3-D routed-expert weights,
    whose GEMMs depend on the routing."""
    experts = [f"{name}.{p_name}" if name else p_name for name, module in model.named_modules()
               if not isinstance(module, nn.Conv1d)
               for p_name, p in module.named_parameters(recurse=False) if p.dim() == 3]
    if experts:
        raise ValueError(f"step_gemm_weights: {type(model).__name__} has routed-expert weights ({experts[0]}, "
                         f"{len(experts)} in all); the peer covers dense models only")
    grouped: set[int] = set()
    weights = []
    for module in model.modules():
        groups = getattr(module, "projection_groups", None)
        for group in (groups() if callable(groups) else []):
            members = [lin.weight for lin in group]
            fused = _fused_weight(members)
            weights += [fused] if fused is not None else [w.detach() for w in members]
            grouped.update(id(lin) for lin in group)
        if isinstance(module, nn.Linear) and id(module) not in grouped:
            weights.append(module.weight.detach())
    return weights


@dataclass
class GemmPeer:
    """`time_weight_gemms`'s result: seconds for one pass over the weights (median of the
    replays), the bytes they hold and the clocks sampled meanwhile (a `GpuClocks` line, and its
    numbers where there were samples)."""

    seconds: float
    weight_bytes: int
    clocks: str
    clock_summary: ClockSummary | None = None

    @property
    def bandwidth_gbs(self) -> float:
        """The weights' bytes over the pass's time, GB/s."""
        return self.weight_bytes / self.seconds / 1e9


def cublas_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` by ``torch.mm`` (cuBLAS on a GPU): the peer's GEMM."""
    return torch.mm(x, weight.t())


def time_weight_gemms(weights: list[torch.Tensor], batch: int, seconds: float = 3.0,
                      gemm: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = cublas_gemm) -> GemmPeer:
    """Time ``gemm(x, w)`` (default `cublas_gemm`; `kernels.linear` for ours) for every ``w`` of
    `weights` (a random ``x`` of `batch` rows per input width, in the weights' dtype), one pass
    after another for about `seconds`. On CUDA the pass is one CUDA graph (no host launch gaps)
    replayed after a one-second warm-up, the clocks sampled over the timed replays; on CPU (the
    tests) a plain loop, with no clock samples."""
    if batch < 1:
        raise ValueError(f"time_weight_gemms: batch must be >= 1, got {batch}")
    if not weights:
        raise ValueError("time_weight_gemms: weights is empty")
    if seconds <= 0:
        raise ValueError(f"time_weight_gemms: seconds must be > 0, got {seconds}")
    first = weights[0]
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype, device=w.device) for w in weights}

    def one_pass() -> None:
        for w in weights:
            gemm(inputs[w.shape[1]], w)

    if first.device.type != "cuda":
        return GemmPeer(_median_seconds(_wall_seconds(one_pass), seconds), weight_bytes(weights),
                        "no GPU: no clock samples")
    replay = _replay_seconds(capture_graph([one_pass]))
    _median_seconds(replay, 1.0)  # clocks and power settle
    with GpuClocks(nvidia_smi_id(torch.cuda.get_device_properties(first.device))) as clocks:
        median = _median_seconds(replay, seconds)
    return GemmPeer(median, weight_bytes(weights), clocks.summary_line(), clocks.summary)


def weight_bytes(weights: list[torch.Tensor]) -> int:
    """The bytes `weights` hold."""
    return sum(w.numel() * w.element_size() for w in weights)


def _median_seconds(run: Callable[[], float], seconds: float) -> float:
    """Median of `run`'s results (seconds each), called back to back for about `seconds` (at
    least 3 calls)."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < end:
        times.append(run())
    return sorted(times)[len(times) // 2]


def _wall_seconds(fn: Callable[[], None]) -> Callable[[], float]:
    """`fn` timed by the host clock (CPU work)."""

    def run() -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return run


def _replay_seconds(graph: torch.cuda.CUDAGraph) -> Callable[[], float]:
    """One replay of `graph` timed by CUDA events."""

    def run() -> float:
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        stop.record()
        stop.synchronize()
        return start.elapsed_time(stop) * 1e-3

    return run
