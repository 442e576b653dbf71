"""The linear kernel's invariance checks of `kernel_invariance` (docs/design.md rule 1), on a GPU:
every row of an M-row launch equals that row computed alone, at the (K, N) of every Qwen3 layer,
rows permuted too; every tile config of the table and every one `pick_config` picks gives the
same rows; and (``--only quack``) quack's GEMM gives our kernel's rows."""

from __future__ import annotations

import torch

from vexact_models.kernels import linear
from vexact_models.kernels.linear import LinearConfig, linear_triton, pick_config
from vexact_models.kernels.linear_quack import linear_quack, table_configs
from vexact_models.kernels.linear_silu_and_mul_quack import linear_silu_and_mul_quack
from vexact_models.kernels.silu_and_mul import silu_and_mul_triton

from .invariance_result import Result

M_SWEEP = [1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 63, 64, 100, 127, 128, 255, 256, 511, 512, 1000, 1024, 2048,
           4096, 8192]

# (model, layer, K, N) of every distinct linear in the three Qwen3 shapes.
LINEAR_SHAPES = [
    ("qwen3-0.6b", "q_proj", 1024, 2048), ("qwen3-0.6b", "k/v_proj", 1024, 1024),
    ("qwen3-0.6b", "o_proj", 2048, 1024), ("qwen3-0.6b", "gate/up_proj", 1024, 3072),
    ("qwen3-0.6b", "down_proj", 3072, 1024), ("qwen3-0.6b", "lm_head", 1024, 151936),
    ("qwen3-8b", "q/o_proj", 4096, 4096), ("qwen3-8b", "k/v_proj", 4096, 1024),
    ("qwen3-8b", "gate/up_proj", 4096, 12288), ("qwen3-8b", "down_proj", 12288, 4096),
    ("qwen3-8b", "lm_head", 4096, 151936),
    ("qwen3-30b-a3b", "q_proj", 2048, 4096), ("qwen3-30b-a3b", "k/v_proj", 2048, 512),
    ("qwen3-30b-a3b", "o_proj", 4096, 2048), ("qwen3-30b-a3b", "router", 2048, 128),
    ("qwen3-30b-a3b", "expert gate/up", 2048, 768), ("qwen3-30b-a3b", "expert down", 768, 2048),
    ("qwen3-30b-a3b", "lm_head", 2048, 151936),
]


def check_linear(result: Result, k: int, n: int, m_values: list[int], out_dtype: torch.dtype) -> None:
    m_max = max(m_values)
    x = torch.randn(m_max, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    single = torch.empty(m_max, n, device="cuda", dtype=out_dtype)
    for i in range(m_max):
        single[i:i + 1] = linear(x[i:i + 1], w, out_dtype=out_dtype)
    for m in m_values:
        result.compare(linear(x[:m], w, out_dtype=out_dtype), single[:m], f"K={k} N={n} M={m}")
    perm = torch.randperm(m_max, device="cuda")
    result.compare(linear(x[perm], w, out_dtype=out_dtype), single[perm], f"K={k} N={n} permuted M={m_max}")


def picked_linear_configs() -> list:
    """Every distinct config `linear.pick_config` returns for bf16 inputs over a grid of the
    bundled models' GEMM shapes and row counts on both sides of each threshold."""
    found = []
    for m in (1, 16, 64, 65, 128, 129, 256, 257, 4096):
        for n in (256, 576, 1024, 2048, 2112, 4096, 6144, 8192, 12288, 16384, 24576, 32768, 65537, 151936):
            for k in (512, 1536, 2048, 4096, 7168):
                for out in (torch.bfloat16, torch.float32):
                    cfg = pick_config(m, n, k, torch.bfloat16, out)
                    if cfg not in found:
                        found.append(cfg)
    return found


def check_linear_configs(result: Result, k: int, n: int) -> None:
    """Every config of the tile table, and every one `pick_config` returns for bf16 inputs, gives
    the same rows (so the M -> config map may change)."""
    configs = [LinearConfig(64, 32, 4, 6), LinearConfig(64, 16, 4, 8), LinearConfig(64, 64, 4, 6),
               LinearConfig(64, 128, 4, 4), LinearConfig(128, 128, 8, 3), LinearConfig(128, 256, 8, 3),
               LinearConfig(64, 32, 4, 6, tma=True), LinearConfig(128, 256, 8, 3, tma=True),
               LinearConfig(128, 128, 4, 4, tma=True), LinearConfig(128, 256, 8, 3, tma=True, persistent=True),
               LinearConfig(64, 128, 4, 4, tma=True), LinearConfig(128, 128, 8, 4, tma=True, persistent=True)]
    configs += [c for c in picked_linear_configs() if c not in configs]
    x = torch.randn(300, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    want = linear_triton(x, w, None, torch.bfloat16, configs[0])
    for cfg in configs[1:]:
        for m in (1, 77, 300):
            result.compare(linear_triton(x[:m], w, None, torch.bfloat16, cfg), want[:m], f"K={k} N={n} {cfg} M={m}")


def check_linear_quack(result: Result, k: int, n: int, out_dtype: torch.dtype, bias: bool) -> None:
    """quack's GEMM (`kernels.linear_quack`) with every config its `pick_config` returns, and
    quack's default, gives our Triton kernel's rows (so a rollout may run it while training runs
    ours). Run by ``--only quack``: quack-kernels is optional."""
    configs = table_configs()
    x = torch.randn(1000, k, device="cuda").bfloat16()
    w = (torch.randn(n, k, device="cuda") / k ** 0.5).bfloat16()
    b = torch.randn(n, device="cuda").bfloat16() if bias else None
    want = linear_triton(x, w, b, out_dtype)
    for cfg in configs:
        for m in (1, 16, 33, 65, 128, 200, 256, 1000):
            result.compare(linear_quack(x[:m], w, b, out_dtype, cfg), want[:m],
                           f"K={k} N={n} bias={bias} out={out_dtype} {cfg} M={m}")


#: (model, K, I) of the gated MLPs whose fused [gate; up] weight a decode step may run through
#: `linear_silu_and_mul` (Moonlight's two shared experts: I = 2 x 1,408)
GATED_SHAPES = [("qwen3-0.6b", 1024, 3072), ("qwen3-8b", 4096, 12288), ("llama-3.1-8b", 4096, 14336),
                ("qwen2.5-7b", 3584, 18944), ("moonlight shared experts", 2048, 2816)]


def check_linear_silu_and_mul_quack(result: Result, k: int, inter: int) -> None:
    """The fused gate/up GEMM with SwiGLU in quack's epilogue (`kernels.linear_silu_and_mul_quack`),
    with every config of quack's table that does not swap A and B, gives our `linear` then
    `silu_and_mul` bitwise. Run by ``--only quack``."""
    x = (torch.randn(1000, k, device="cuda") * 2).bfloat16()
    w = (torch.randn(2 * inter, k, device="cuda") / k ** 0.5).bfloat16()
    want = silu_and_mul_triton(*linear_triton(x, w, None, torch.bfloat16).split(inter, dim=1))
    for cfg in [c for c in table_configs() if not c.swap_ab]:
        for m in (1, 16, 65, 128, 200, 256, 1000):
            result.compare(linear_silu_and_mul_quack(x[:m], w, cfg), want[:m], f"K={k} I={inter} {cfg} M={m}")


def run_linear(results: dict[str, Result], quick: bool) -> None:
    """Every linear shape's rows alone against in batches, then the tile configs forced."""
    ms = [m for m in M_SWEEP if m <= (1024 if quick else 8192)]
    for model, layer, k, n in LINEAR_SHAPES[::3] if quick else LINEAR_SHAPES:
        check_linear(results["linear"], k, n, ms, torch.float32 if layer == "lm_head" else torch.bfloat16)
        print(f"linear {model} {layer} K={k} N={n}: {results['linear'].mismatches} mismatches so far", flush=True)
    for k, n in ((1024, 3072), (4096, 1024)):
        check_linear_configs(results["linear configs"], k, n)


def run_linear_quack(results: dict[str, Result], quick: bool) -> None:
    """quack's GEMM against our linear's rows at every linear shape (with a bias where Qwen2 has one),
    then the gated MLPs' fused gate/up + SwiGLU launch against `linear` and `silu_and_mul`."""
    for model, layer, k, n in LINEAR_SHAPES[::3] if quick else LINEAR_SHAPES:
        lm_head = layer == "lm_head"
        check_linear_quack(results["linear quack"], k, n, torch.float32 if lm_head else torch.bfloat16, False)
        if not lm_head:  # Qwen2's q/k/v carry a bias
            check_linear_quack(results["linear quack"], k, n, torch.bfloat16, True)
        print(f"linear quack {model} {layer} K={k} N={n}: {results['linear quack'].mismatches} mismatches so far",
              flush=True)
    for model, k, inter in GATED_SHAPES[::2] if quick else GATED_SHAPES:
        check_linear_silu_and_mul_quack(results["linear silu_and_mul quack"], k, inter)
        print(f"linear silu_and_mul quack {model} K={k} I={inter}: "
              f"{results['linear silu_and_mul quack'].mismatches} mismatches so far", flush=True)
