"""Kernel-free stand-ins for the decode step's small ops: what fusing an op away could gain at most.

`decode_profile.py --without OP,...` swaps each named op of `vexact_models.layers` for a stand-in
that launches no kernel, then profiles the decode step as usual. The step's numbers are wrong
(the model no longer computes what it should), its time is the bound: a fusion that removes the
op's launch cannot make the step faster than this.

Every stand-in returns real values: the op's own output of its first call at that shape (the
engine's eager warm-up before each CUDA graph capture), kept and handed back ever after, or the
op's input. A first, throwaway version returned uninitialised memory for `silu_and_mul`: Qwen3-8B's
decode step at 128 sequences (quack's GEMMs, H200) took 0.45 ms less than with the op (8.31 ->
7.86 ms), where this stand-in took 0.09 ms less on another machine (8.08 -> 7.99 ms;
a scratch driver around `decode_profile.py`, 2026-11-27). Whether the values or the machine made that
difference was not measured; kernels whose speed follows their inputs' values (power, NaN paths)
would, so the stand-ins keep the values real.

- ``silu_and_mul``: the kept output.
- ``rotary_cache_write``: the kept rotated queries; the KV cache is not written, so the new
  tokens' cache rows keep what they held (the attention reads as many bytes either way).
- ``rms_norm``: every `RMSNorm` returns its input (with a residual, ``(x + residual)``'s stand-in
  ``x`` for both the normed rows and the new residual): the input is a real activation.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch

OPS = ("silu_and_mul", "rotary_cache_write", "rms_norm")


def _kept(op, name: str, calls: Counter):
    """`op` run once per (shapes, dtype, device) of its first argument; later calls of that key
    return the first call's output (no launch). Counts its calls under `name` in `calls`."""
    outputs: dict[tuple, torch.Tensor] = {}

    def stand_in(first: torch.Tensor, *args, **kwargs):
        calls[name] += 1
        key = (tuple(first.shape), first.dtype, first.device)
        if key not in outputs:
            outputs[key] = op(first, *args, **kwargs)
        return outputs[key]

    return stand_in


def _norm_input(calls: Counter):
    """An `RMSNorm.forward` that returns its input, counting its calls under ``rms_norm``."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        calls["rms_norm"] += 1
        return x if residual is None else (x, x)

    return forward


def parse_ops(text: str) -> list[str]:
    """The comma-separated op names of ``--without`` (ValueError naming an unknown one)."""
    names = [name for name in text.split(",") if name]
    unknown = [name for name in names if name not in OPS]
    if unknown:
        raise ValueError(f"--without: unknown op(s) {', '.join(unknown)}; expected a comma-separated subset of "
                         f"{', '.join(OPS)}")
    return names


@contextlib.contextmanager
def without(names: list[str]) -> Iterator[Counter]:
    """Swap the named ops (`OPS`) of `vexact_models.layers` for their stand-ins inside the block;
    the originals come back on exit. Build and run the model inside it: the layers look the ops
    up at call time, and the CUDA graphs keep whatever ran while they were captured. Yields the
    stand-ins' call counts by op name: an op a model never calls (MLA layers write their cache
    with their own op) reads 0, and then bounds nothing."""
    from vexact_models import layers

    saved = {"silu_and_mul": layers.silu_and_mul, "rotary_cache_write": layers.rotary_cache_write,
             "rms_norm": layers.RMSNorm.forward}
    calls = Counter({name: 0 for name in names})
    try:
        if "silu_and_mul" in names:
            layers.silu_and_mul = _kept(saved["silu_and_mul"], "silu_and_mul", calls)
        if "rotary_cache_write" in names:
            layers.rotary_cache_write = _kept(_rotate_only(saved["rotary_cache_write"]), "rotary_cache_write", calls)
        if "rms_norm" in names:
            layers.RMSNorm.forward = _norm_input(calls)
        yield calls
    finally:
        layers.silu_and_mul = saved["silu_and_mul"]
        layers.rotary_cache_write = saved["rotary_cache_write"]
        layers.RMSNorm.forward = saved["rms_norm"]


def _rotate_only(op):
    """`rotary_cache_write` into scratch caches: its queries are computed (once, by `_kept`) and
    the model's caches are left alone."""

    def rotate(q, k, v, positions, cos, sin, k_cache, v_cache, slot_mapping, *weights):
        rows = torch.arange(len(slot_mapping), device=slot_mapping.device, dtype=slot_mapping.dtype)
        scratch_k = torch.empty((len(rows), *k.shape[1:]), dtype=k_cache.dtype, device=k_cache.device)
        scratch_v = torch.empty((len(rows), *v.shape[1:]), dtype=v_cache.dtype, device=v_cache.device)
        return op(q, k, v, positions, cos, sin, scratch_k, scratch_v, rows, *weights)

    return rotate
