"""`kernels.lora_add`'s invariance checks of `kernel_invariance` (``--only lora``), on a GPU: at
the projection groups of Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B (q/k/v and gate/up stacked, o and
down alone) and ranks 8, 16 and 64, with fp32 (PEFT's default) and bf16 adapter weights: every
row of an M-row call equals that row computed alone; a stacked group's output equals its
members' separate calls (what training runs: the rollout fuses, section 3); in place equals out
of place; the two launches (the shrink's partials, the expand that adds them up) equal three
(the partials' sum in a launch of its own, then the expand of u), and so do the expand's other
tiles (`EXPAND_TILES`); the training forward (which also keeps u) equals the rollout's; and a call
captured in a CUDA graph replays the eager call's bits."""

from __future__ import annotations

import torch

from vexact_models.kernels import lora_add
from vexact_models.kernels.lora import lora_partials_triton, lora_shrink_triton
from vexact_models.kernels.lora_expand import ExpandTile, lora_expand_triton

from .invariance_result import Result

# (model, group, K, member output sizes)
LORA_GROUPS = [
    ("qwen3-0.6b", "q/k/v", 1024, (2048, 1024, 1024)), ("qwen3-0.6b", "o", 2048, (1024,)),
    ("qwen3-0.6b", "gate/up", 1024, (3072, 3072)), ("qwen3-0.6b", "down", 3072, (1024,)),
    ("qwen3-8b", "q/k/v", 4096, (4096, 1024, 1024)), ("qwen3-8b", "o", 4096, (4096,)),
    ("qwen3-8b", "gate/up", 4096, (12288, 12288)), ("qwen3-8b", "down", 12288, (4096,)),
    ("qwen3-30b-a3b", "q/k/v", 2048, (4096, 512, 512)), ("qwen3-30b-a3b", "o", 4096, (2048,)),
]
SCALINGS = (2.0, 0.5, 1.25)
#: expand tiles besides the default that must give its bits (`benchmarks/lora_expand.py` times them)
EXPAND_TILES = (ExpandTile(16, 32, 4), ExpandTile(32, 32, 4), ExpandTile(64, 64, 4), ExpandTile(32, 64, 2))


def _operands(m: int, k: int, sizes: tuple[int, ...], rank: int, adapter_dtype: torch.dtype):
    n = sum(sizes)
    x = torch.randn(m, k, device="cuda").bfloat16()
    a = (torch.randn(len(sizes) * rank, k, device="cuda") / k ** 0.5).to(adapter_dtype)
    b = (torch.randn(n, rank, device="cuda") * 0.1).to(adapter_dtype)
    base = torch.randn(m, n, device="cuda").bfloat16()
    return base, x, a, b


def check_lora_group(result: Result, k: int, sizes: tuple[int, ...], rank: int, adapter_dtype: torch.dtype,
                     m_values: list[int], what: str) -> None:
    m_max = max(m_values)
    base, x, a, b = _operands(m_max, k, sizes, rank, adapter_dtype)
    scalings = SCALINGS[:len(sizes)]
    single = torch.empty_like(base)
    for i in range(m_max):
        single[i:i + 1] = lora_add(base[i:i + 1], x[i:i + 1], a, b, scalings, sizes=sizes)
    for m in m_values:
        result.compare(lora_add(base[:m], x[:m], a, b, scalings, sizes=sizes), single[:m], f"{what} M={m}")
    perm = torch.randperm(m_max, device="cuda")
    result.compare(lora_add(base[perm], x[perm], a, b, scalings, sizes=sizes), single[perm], f"{what} permuted")
    col, parts = 0, []
    for g, (size, s) in enumerate(zip(sizes, scalings)):
        parts.append(lora_add(base[:, col:col + size], x, a[g * rank:(g + 1) * rank], b[col:col + size], (s,)))
        col += size
    result.compare(torch.cat(parts, dim=1), single, f"{what} members separately")
    inplace = base.clone()
    lora_add(inplace, x, a, b, scalings, sizes=sizes, inplace=True)
    result.compare(inplace, single, f"{what} in place")
    three = lora_expand_triton(base, lora_shrink_triton(x, a)[None], b, None, sizes, scalings, torch.empty_like(base))
    result.compare(three, single, f"{what} three launches (reduce, then expand of u)")
    partials = lora_partials_triton(x, a)  # the partials themselves at every K (`lora_partials` sums them from 8 chunks)
    for tile in EXPAND_TILES:
        tiled = lora_expand_triton(base, partials, b, None, sizes, scalings, torch.empty_like(base), tile=tile)
        result.compare(tiled, single, f"{what} expand tile {tile.block_m}x{tile.block_n}, {tile.warps} warps")
    with torch.enable_grad():
        trained = lora_add(base, x, a, b.detach().requires_grad_(), scalings, sizes=sizes)
    result.compare(trained.detach(), single, f"{what} training forward (keeps u)")
    m = min(m_max, 256)  # a decode-sized step in a CUDA graph, as the engine captures it
    static = base[:m].clone()
    lora_add(static, x[:m], a, b, scalings, sizes=sizes, inplace=True)  # warm-up (compiles outside the capture)
    static.copy_(base[:m])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_add(static, x[:m], a, b, scalings, sizes=sizes, inplace=True)
    static.copy_(base[:m])
    graph.replay()
    result.compare(static, single[:m], f"{what} CUDA graph M={m}")


def run_lora(results: dict[str, Result], m_sweep: list[int], quick: bool) -> None:
    """Every group of `LORA_GROUPS` at ranks 8, 16, 64 (16 only with `quick`), fp32 and bf16
    adapters, rows of `m_sweep` (up to 1024 with `quick`, else 4096)."""
    m_values = [m for m in m_sweep if m <= (1024 if quick else 4096)]
    for model, group, k, sizes in LORA_GROUPS:
        for rank in ((16,) if quick else (8, 16, 64)):
            for adapter_dtype in (torch.float32, torch.bfloat16):
                what = f"{model} {group} K={k} r={rank} {str(adapter_dtype).replace('torch.', '')} adapters"
                check_lora_group(results["lora_add"], k, sizes, rank, adapter_dtype, m_values, what)
        print(f"{model} {group}: {results['lora_add'].mismatches} lora_add mismatches so far", flush=True)
