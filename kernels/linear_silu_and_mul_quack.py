"""linear_silu_and_mul_quack: the gated MLP's gate/up GEMM with SwiGLU in quack's epilogue, bitwise
`linear` followed by `silu_and_mul`.

A decode step of a dense model runs, per layer, the fused gate/up GEMM (``[T, 2I]``, bf16) and
then `silu_and_mul` over its two halves: one more launch and a round trip of the ``[T, 2I]``
output through memory. quack's SM90 GEMM can apply a gated activation to each (gate, up)
accumulator pair before it stores (``quack.epilogue`` "acc_pair" mode; ``concat_layout``
reads a ``[gate; up]`` weight as it lies). Its own ``swiglu`` works on the fp32 accumulator
with another exponential and reciprocal, so not our numbers; the epilogue here does what the
two separate ops do, instruction for instruction:

1. each accumulator rounded to bf16 (round to nearest even), as the GEMM's store rounds it:
   quack's GEMM with these configs gives `linear`'s bits (docs/design.md rule 1, `linear_quack`);
2. ``g / (1 + exp(-g)) * u`` in fp32 by the PTX sequence Triton compiles `silu_and_mul` to on
   sm_90: ``sub.f32 0-g``, ``mul.f32`` by log2(e), ``ex2.approx.f32``, ``add.f32 1``,
   ``div.full.f32``, ``mul.f32`` by ``u`` (read from its PTX with `benchmarks/sm90_compile.py`;
   `tests/kernels/test_linear_silu_and_mul.py` checks that Triton still emits it);
3. rounded once to bf16.

The same instructions on the same inputs give the same bits, so the rollout may run this where
training runs the two ops (rule 5: element-wise). The GPU proof compares every output with
``silu_and_mul(*linear(x, w).split)`` (`benchmarks/gate_up_silu.py`, ``kernel_invariance``).

Forward only, no bias, bf16 only, SM90 only; `unavailable_reason` names what is
missing. quack's gated configs have no swap-AB, so the decode table (`pick_config`) uses it from
65 rows on.
"""

from __future__ import annotations

import functools

import torch

from . import linear_quack
from .linear_quack import QuackConfig, quack_unavailable_reason

#: `silu_and_mul`'s arithmetic on one (gate, up) pair of fp32 accumulators, as inline PTX: both
#: rounded to bf16 first (what the GEMM would store), the result rounded to bf16 (returned as the
#: fp32 value of that bf16, which the epilogue's bf16 store keeps exactly)
SILU_MUL_PTX = """{
.reg .b16 vx_g, vx_u, vx_y;
.reg .f32 vx_fg, vx_fu, vx_t, vx_y32;
cvt.rn.bf16.f32 vx_g, $1;
cvt.f32.bf16 vx_fg, vx_g;
cvt.rn.bf16.f32 vx_u, $2;
cvt.f32.bf16 vx_fu, vx_u;
sub.f32 vx_t, 0f00000000, vx_fg;
mul.f32 vx_t, vx_t, 0f3FB8AA3B;
ex2.approx.f32 vx_t, vx_t;
add.f32 vx_t, vx_t, 0f3F800000;
div.full.f32 vx_y32, vx_fg, vx_t;
mul.f32 vx_y32, vx_y32, vx_fu;
cvt.rn.bf16.f32 vx_y, vx_y32;
cvt.f32.bf16 $0, vx_y;
}"""


@functools.lru_cache(maxsize=None)
def _epilogue():
    """quack's epilogue module running `SILU_MUL_PTX` on each (gate, up) accumulator pair, or the
    text of the error that importing quack or building the module raised.

    Building can fail where importing did not: quack fingerprints an epilogue's source and every
    global it reaches, and treats a function as a library's only when its file lies under a
    ``site-packages`` folder. With quack and cutlass-dsl on a plain ``PYTHONPATH`` (``pip install
    --target``) it walks into cutlass's own helpers and raises TypeError on a ContextVar there
    (quack 0.6.5, cutlass-dsl 4.8.1). Such an install runs the two separate ops, as a missing one
    does (the same bits)."""
    try:
        from cutlass import Float32
        from cutlass._mlir.dialects import llvm
        from cutlass.cutlass_dsl import T, dsl_user_op
        from quack.epilogue.frontend import gemm_epilogue
        from quack.epilogue.math import unpack

        @dsl_user_op
        def silu_mul_bf16(gate, up, *, loc=None, ip=None):
            args = [Float32(gate).ir_value(loc=loc, ip=ip), Float32(up).ir_value(loc=loc, ip=ip)]
            return Float32(llvm.inline_asm(T.f32(), args, SILU_MUL_PTX, "=f,f,f", has_side_effects=False,
                                           is_align_stack=False))

        @gemm_epilogue(outputs=("postact",), mode="acc_pair")
        def vexact_silu_mul(acc):
            gate, up = unpack(acc)
            return {"postact": silu_mul_bf16(gate, up)}
    except Exception as exc:  # noqa: BLE001 - a broken install is as unavailable as a missing one
        return f"{type(exc).__name__}: {exc}"
    return vexact_silu_mul


def epilogue_unavailable_reason(x2d: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the epilogue itself cannot run (bf16, whole [gate; up] halves, quack's epilogue module),
    or None: `unavailable_reason` without `linear_quack`'s checks of the GEMM, which `choose` has
    from `linear_quack.choose` already."""
    if x2d.dtype != torch.bfloat16:
        return f"x dtype {x2d.dtype}: the fused epilogue rounds to bf16, so it takes bf16 only"
    if weight.shape[0] % 16:
        return f"weight rows {weight.shape[0]}: the [gate; up] halves must each be a multiple of 8 rows"
    epilogue = _epilogue()
    if isinstance(epilogue, str):
        return f"quack's epilogue module cannot be imported or built: {epilogue}"
    return None


def unavailable_reason(x2d: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `linear_silu_and_mul_quack` cannot run on `x2d` (``[T, K]``) and the fused ``[2I, K]``
    `weight`, or None when it can. Checked in a fixed order (dtype, halves, package, then
    `linear_quack`'s own checks), so the first failing requirement is named."""
    return epilogue_unavailable_reason(x2d, weight) or quack_unavailable_reason(x2d, weight, None, x2d.dtype)


def choose(x2d: torch.Tensor, weight: torch.Tensor) -> QuackConfig | None:
    """The quack config to run the fused launch with, or None for the two separate ops: the config
    `linear_quack.choose` gives the gate/up GEMM itself (the measured table, under the
    ``VEXACT_LINEAR`` mode: in ``auto`` only inside CUDA-graph capture), when it does not swap A
    and B (decode batches up to 64 rows) and the epilogue can run here. On the H200 the fused
    launch took 0.79-0.97x the two launches' time at 128-256 rows with the table's configs
    (`benchmarks/gate_up_silu.py`, 2026-11-29)."""
    config = linear_quack.choose(x2d, weight, None, x2d.dtype)
    # a config means linear_quack found quack able to run this GEMM: only the epilogue's own needs remain
    if config is None or config.swap_ab or epilogue_unavailable_reason(x2d, weight) is not None:
        return None
    return config


def linear_silu_and_mul_quack(x2d: torch.Tensor, weight: torch.Tensor, config: QuackConfig) -> torch.Tensor:
    """``silu_and_mul(*(x2d @ weight.T).split(I, dim=1))``: one quack GEMM over the fused
    ``[gate; up]`` `weight` (``[2I, K]``) whose epilogue applies `SILU_MUL_PTX`; returns the
    contiguous ``[T, I]`` output. `config` must not swap A and B (quack's gated configs do not).
    The caller checked `unavailable_reason`."""
    if config.swap_ab:
        raise ValueError(f"linear_silu_and_mul_quack: config={config} swaps A and B; the gated epilogue cannot")
    epilogue = _epilogue()
    if isinstance(epilogue, str):
        raise RuntimeError(f"linear_silu_and_mul_quack: quack's epilogue module cannot be imported or built: {epilogue}")
    from quack.gemm_config import GemmConfig

    rows, inter = x2d.shape[0], weight.shape[0] // 2
    out = torch.empty(rows, inter, device=x2d.device, dtype=x2d.dtype)
    if rows == 0:
        return out
    cfg = GemmConfig(tile_m=config.tile_m, tile_n=config.tile_n, pingpong=config.pingpong,
                     cluster_m=config.cluster_m, cluster_n=config.cluster_n, is_dynamic_persistent=False)
    epilogue(x2d, weight.t(), out={"postact": out}, store_d=False, config=cfg, tuned=False, concat_layout=("B",))
    return out
