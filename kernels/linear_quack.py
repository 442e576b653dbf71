"""linear_quack: quack-kernels' Hopper GEMM (the optional ``quack-kernels`` package) as a faster
launch of `linear` for decode-sized batches, with `linear`'s bits.

Why it can stand in for our Triton GEMM (docs/design.md rule 1). On SM90, quack's GEMM with a
fixed `GemmConfig`, no split-K and no autotuning accumulates each output element over K the way
our kernel does: sequentially in 64-wide K tiles of wgmma into one fp32 accumulator, then one
rounding to the output dtype. On the H200 its rows were bitwise equal to our `linear` rows for
every one of 27 tile/cluster/pingpong/swap-AB configs tried, M = 1 .. 8,192 and the Qwen3 decode
weights (`benchmarks/linear_quack.py`, 2026-11-24 and 2026-11-25),
and ``kernel_invariance --only quack`` checks every config `pick_config` returns against our
kernel on every bundled model's weights. So a rollout may run quack where it is faster while
training runs our kernel, and the logprobs stay bitwise equal (the conformance suite checks that
pair whole).

Where it is faster: decode batches of 1-256 rows, where our kernel has few tiles per weight and
quack's narrow tiles, swap-AB and clusters keep more SMs streaming the weight. On the H200 it
takes 0.55-0.9x our time on the Qwen3 decode weights at the engine's batch buckets (CUDA graphs;
3 of 40 Qwen3-8B cells are 2-5% slower); from a few hundred rows on, our kernel is as fast.
`pick_config` holds the measured table; shapes outside it run our kernel.

The choice (`VEXACT_LINEAR=auto|triton|quack`, or `set_linear_backend`):
- ``auto`` (default) runs quack while a CUDA graph is being captured (the engine's decode and
  mixed steps, at the batch buckets the table was timed at), where `pick_config` has a config
  and quack can run, else ours. An eager call of these sizes is bound by its host launch, and
  `linear` through quack took ~9 us a call more than through ours (67.6 vs 58.4 us at one row,
  Qwen3-0.6B q/k/v; H200, 2026-11-25). Inside `as_in_capture` eager calls choose as captured
  ones do: the warm-up before a capture then compiles quack's kernels outside it;
- ``triton`` never runs quack;
- ``quack`` runs it for every shape it can (the table's config, else quack's default) and raises
  `UnsupportedError` naming why when it cannot.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import AbstractContextManager
from contextvars import ContextVar
from typing import NamedTuple

import torch

from ._triton import unverified_gpu_reason
from .backend import UnsupportedError
from .kernel_switch import KernelSwitch

ENV_VAR = "VEXACT_LINEAR"
MODES = ("auto", "triton", "quack")
_switch = KernelSwitch(ENV_VAR, MODES, "auto", "linear backend")
#: compute capability majors where quack's alignment with our kernel was checked
VERIFIED_MAJORS = (9,)
QUACK_DTYPES = (torch.bfloat16, torch.float16)
#: rows per launch for which `pick_config` has measured configs (decode batches)
AUTO_ROWS = (1, 256)
#: set by `as_in_capture`: eager calls choose as calls inside a CUDA-graph capture do
_AS_IN_CAPTURE: ContextVar[bool] = ContextVar("vexact_linear_as_in_capture", default=False)


class QuackConfig(NamedTuple):
    """The `quack.gemm_config.GemmConfig` fields we set (the rest stay quack's defaults)."""
    tile_m: int
    tile_n: int
    pingpong: bool
    cluster_m: int = 1
    cluster_n: int = 1
    swap_ab: bool = False


#: quack's own SM90 default (`quack.gemm_config.default_config`): what forced mode runs where the
#: table has no config
SM90_DEFAULT = QuackConfig(128, 192, True, 2, 1)


def pick_config(m: int, n: int, k: int) -> QuackConfig | None:
    """The quack config for an (m, n, k) problem in ``auto`` mode, or None where our kernel is as
    fast or the shape was not measured. From `benchmarks/linear_quack.py` on the H200 (CUDA
    graphs, weights from HBM, LM heads writing fp32 logits; 2026-11-24 to 2026-11-27; the figures
    in docs/performance.md).

    The idea behind the table: a decode GEMM reads its weight once, so it is as fast as the
    number of SMs streaming the weight at once. Few rows leave few output tiles, so the tiles
    get narrow (64 wide, the smallest wgmma M) and, up to 64 rows, the weight becomes the M
    operand (swap-AB) with the rows as a 16-64 wide N; from 65 rows a 2x1 cluster multicasts each
    weight tile to the two 64-row tiles that need it; 129-192 rows take one 192-row tile. LM
    heads (N > 65,536) from 129 rows are bound by their arithmetic, not by the weight: one
    192-row tile, then quack's default, 1.2-1.9x our kernel. The table was timed at the engine's
    CUDA-graph batch buckets (`runtime.cuda_graphs`), the row counts `auto` runs it at: quack is
    slow on partly filled M tiles (with 64x64 tiles the Qwen3-8B o projection took 16.5 us at 80
    rows, 11.7 at 128; N = 2,048 weights at 129-160 rows are faster in our kernel). ``k`` is not
    used: no choice depended on it."""
    if not AUTO_ROWS[0] <= m <= AUTO_ROWS[1]:
        return None
    lm_head = n > 65536
    if m <= 64:
        if lm_head:  # LM heads stream at ~95% of HBM either way
            return None
        rows = 16 if m <= 16 or n <= 1024 else (32 if m <= 32 else 64)
        return QuackConfig(64, rows, True, swap_ab=True)
    if m <= 128:
        if lm_head:
            return QuackConfig(64, 192, True, 2, 1)
        if n <= 1024:
            return QuackConfig(64, 32, True, swap_ab=True)
        return QuackConfig(64, 192 if n >= 16384 else 96 if n > 4096 else 64, True, 2, 1)
    if n <= 1024:
        return QuackConfig(64, 64, True, swap_ab=True)
    if m <= 192:  # one 192-row tile: quack is slow on a partly filled second M tile
        if lm_head:
            return QuackConfig(192, 128, True)
        if n <= 2048:
            return None if m <= 160 else QuackConfig(64, 64, True, swap_ab=True)
        return QuackConfig(192, 128 if n >= 16384 else 64, True)
    if n >= 16384:
        return SM90_DEFAULT
    if n <= 2048:
        return QuackConfig(64, 64, True, 2, 1)
    return QuackConfig(64, 192, True, 2, 1) if n > 4096 else QuackConfig(128, 64, True, 2, 1)


def table_configs() -> list[QuackConfig]:
    """Every config `pick_config` can return (each branch visited once), then quack's default (the
    forced mode's config where the table has none): what the GPU proofs run."""
    configs = []
    for m in (1, 17, 33, 65, 129, 193):
        for n in (1024, 4096, 6144, 24576, 151936):
            cfg = pick_config(m, n, 4096)
            if cfg is not None and cfg not in configs:
                configs.append(cfg)
    return configs + ([SM90_DEFAULT] if SM90_DEFAULT not in configs else [])


def linear_mode() -> str:
    """The linear backend choice now: `set_linear_backend`'s if set, else ``VEXACT_LINEAR``
    (``auto`` when unset). Read at every call."""
    return _switch.mode()


def set_linear_backend(mode: str | None) -> None:
    """Force the linear backend (``"auto"``, ``"triton"`` or ``"quack"``); None hands the choice
    back to the environment variable."""
    _switch.set(mode)


def use_linear_backend(mode: str | None) -> AbstractContextManager[None]:
    """Context manager form of `set_linear_backend`; restores the previous choice on exit."""
    return _switch.use(mode)


@contextlib.contextmanager
def as_in_capture() -> Iterator[None]:
    """Inside this block ``auto`` chooses for eager calls what it chooses inside a CUDA-graph
    capture (quack where `pick_config` has a config and quack can run).

    For the eager warm-up run before a capture (`runtime.cuda_graphs`, `bench_utils.capture_graph`):
    quack compiles a kernel on its first call in a process, and without this the first call came
    inside the capture, the only place ``auto`` takes quack. The bits do not change (rule 1)."""
    token = _AS_IN_CAPTURE.set(True)
    try:
        yield
    finally:
        _AS_IN_CAPTURE.reset(token)


def _captured_choice(x2d: torch.Tensor) -> bool:
    """Whether ``auto`` chooses for `x2d` as inside a capture: a CUDA tensor while the current
    stream captures, or inside `as_in_capture`."""
    return x2d.is_cuda and (_AS_IN_CAPTURE.get() or torch.cuda.is_current_stream_capturing())


@functools.lru_cache(maxsize=None)
def _quack():
    """(``quack.gemm_interface.gemm_tuned``, ``quack.gemm_config.GemmConfig``) or the import
    error's text."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_tuned
    except Exception as exc:  # noqa: BLE001 - a broken install is as unavailable as a missing one
        return f"{type(exc).__name__}: {exc}"
    return gemm_tuned, GemmConfig


def quack_unavailable_reason(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             out_dtype: torch.dtype) -> str | None:
    """Why quack cannot compute ``x2d @ weight.T (+ bias)`` in `out_dtype`, or None when it can.
    Checked in a fixed order (package, dtypes, layout, device, GPU), so the first failing
    requirement is named."""
    quack = _quack()
    if isinstance(quack, str):
        return f"quack (pip install quack-kernels) cannot be imported: {quack}"
    if x2d.dtype not in QUACK_DTYPES or out_dtype not in (x2d.dtype, torch.float32):
        return f"dtypes x={x2d.dtype}, out={out_dtype}: quack needs x in {QUACK_DTYPES} and out x's dtype or fp32"
    if bias is not None and bias.dtype != x2d.dtype:
        return f"bias dtype {bias.dtype}: quack needs x's dtype {x2d.dtype}"
    k, n = x2d.shape[1], weight.shape[0]
    if k % 8 or n % 8 or x2d.stride(1) != 1 or weight.stride(1) != 1 or x2d.stride(0) % 8 or weight.stride(0) % 8:
        return (f"layout K={k}, N={n}, strides x={x2d.stride()}, weight={weight.stride()}: quack needs K and N "
                f"multiples of 8 and rows of 16-byte multiples with unit column stride")
    if any(t.data_ptr() % 16 for t in (x2d, weight)):
        return "x or weight is not 16-byte aligned: quack loads through TMA"
    if x2d.device.type != "cuda" or weight.device != x2d.device:
        return f"devices x={x2d.device}, weight={weight.device}: quack needs CUDA tensors on one GPU"
    return unverified_gpu_reason(x2d.device, VERIFIED_MAJORS, "quack's alignment with our linear")


def device_unavailable_reason(device: torch.device | str = "cuda") -> str | None:
    """Why quack cannot run a bf16 GEMM on `device` at all (package, CUDA, GPU generation), or
    None: what the GPU tests, benchmarks and proofs ask before they start."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"device {device}: quack needs a CUDA GPU"
    probe = torch.zeros(8, 8, device=device, dtype=torch.bfloat16)
    return quack_unavailable_reason(probe, probe, None, torch.bfloat16)


def choose(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype) -> QuackConfig | None:
    """The quack config to run under `linear_mode`, or None for our kernel. Raises
    `UnsupportedError` when ``quack`` is forced and cannot run."""
    mode = linear_mode()
    if mode == "triton":
        return None
    if mode == "auto" and not _captured_choice(x2d):
        # eager: decode-sized calls are bound by their host launch, and this path (the checks below,
        # quack's launch) took ~9 us a call more than ours; first, so eager calls skip the checks
        return None
    m, k = x2d.shape
    cfg = pick_config(m, weight.shape[0], k)
    if mode == "auto":
        return cfg if cfg is not None and quack_unavailable_reason(x2d, weight, bias, out_dtype) is None else None
    reason = quack_unavailable_reason(x2d, weight, bias, out_dtype)
    if reason is not None:
        raise UnsupportedError(f"{ENV_VAR}=quack cannot run this linear: {reason}")
    return cfg or SM90_DEFAULT


def linear_quack(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                 config: QuackConfig) -> torch.Tensor:
    """``x2d @ weight.T (+ bias)`` in `out_dtype` by quack's SM90 GEMM with `config` (no split-K,
    no autotuning), forward only. The caller checked `quack_unavailable_reason`."""
    gemm_tuned, gemm_config = _quack()
    out = torch.empty((x2d.shape[0], weight.shape[0]), device=x2d.device, dtype=out_dtype)
    if x2d.shape[0] == 0:
        return out
    cfg = gemm_config(tile_m=config.tile_m, tile_n=config.tile_n, pingpong=config.pingpong,
                      cluster_m=config.cluster_m, cluster_n=config.cluster_n, swap_ab=config.swap_ab,
                      is_dynamic_persistent=False)
    gemm_tuned.fn(x2d, weight.t(), out, bias=bias, config=cfg, split_k=1)
    return out
