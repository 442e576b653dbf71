"""Timing helpers shared by the benchmark scripts (CUDA only)."""

from __future__ import annotations

import torch


def bench(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of `fn` (CUDA events, via triton.testing.do_bench)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written): the HBM reference."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = bench(lambda: dst.copy_(src))
    return 2 * (1 << 30) / ms / 1e6


def table(title: str, header: list[str], rows: list[list]) -> None:
    print(f"\n## {title}")
    widths = [max(len(str(h)), *(len(f"{r[i]}") for r in rows)) for i, h in enumerate(header)]
    print("  ".join(str(h).rjust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(f"{c}".rjust(w) for c, w in zip(r, widths)))
