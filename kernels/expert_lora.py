"""One adapter of a fused expert tensor (`ExpertLora`, PEFT's ``ParamWrapper`` layout) and the B
operand the experts' expands read (`moe_lora.py`).

PEFT's ``lora_B`` of ``[N, r * E]`` puts expert e's rank j at column ``j * E + e``: read in place, each
value of an expand tile of one expert's rows is a 32-byte sector of its own. From
`REGROUP_PAIRS_PER_EXPERT` pairs an expert on average the launcher copies B to ``[E, N, r]`` first
(`expert_b_operand`, `b_by_expert_triton`), so that a tile reads whole sectors. A copy: every
value keeps its bits, so the expand's products are the same whichever operand it reads
(`ExpertLora.b_by_expert`, torch's copy of the permuted view, is the reference). One copy
program moves a ``[BLOCK_N, r, BLOCK_E]`` block: read as PEFT lays it out (runs of `BLOCK_E`
experts side by side), written as ``[BLOCK_E, BLOCK_N, r]`` (runs of ``BLOCK_N * r`` values), both
in whole sectors; torch's copy ran at about a quarter of the HBM's bandwidth
(`benchmarks/moe_lora_launches.py`, "B copy by expert").

Made at every forward, the copy is B as it is now, but a rollout step pays one launch per adapted
tensor, CUDA graphs included. The rollout engine keeps a copy of every adapted tensor's B by
expert instead (`KeptExpertB`), refreshed in place once per engine call (an optimizer step or a
weight update changes B in place between calls, never during one), and its forwards read it
(`reading_kept_b`): the expand then reads B copied by expert at every batch size, for no launch.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch

from ._triton import require_triton, tl, triton
from .backend import interpreting
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .kernel_switch import KernelSwitch

#: ``VEXACT_EXPERT_B``: ``kept`` (the default: the rollout engine keeps every adapted expert
#: tensor's B copied by expert, `KeptExpertB`) or ``call`` (B copied at each forward from
#: `REGROUP_PAIRS_PER_EXPERT`, read in place below it; no memory held between calls)
EXPERT_B = KernelSwitch("VEXACT_EXPERT_B", ("kept", "call"), "kept", "adapted experts' B operand in rollouts")

# B copied by expert (`b_by_expert_triton`) from this many pairs an expert on average: a
# tile of PEFT's layout reads 8 times its bytes in sectors (an expert's ranks lie E values apart),
# the copy reads and writes B once; below one pair an expert most experts get no tile and the copy
# would read B for them (`benchmarks/moe.py --lora 16`'s launch table, docs/performance.md section 10)
REGROUP_PAIRS_PER_EXPERT = 1


def view_by_expert(b: torch.Tensor, experts: int) -> torch.Tensor:
    """PEFT's expert-tensor B ``[N, r * E]`` indexed ``[E, N, r]`` (expert, row, rank), a view."""
    return b.unflatten(1, (b.shape[1] // experts, experts)).permute(2, 0, 1)


@dataclass(frozen=True)
class ExpertLora:
    """One adapter of a fused expert tensor, in PEFT's ``ParamWrapper`` layout.

    Attributes:
        a: ``[E * r, K]`` (expert e's A is rows ``e*r .. e*r + r - 1``), fp32 or x's dtype.
        b: ``[N, r * E]`` (expert e's B column j is column ``j * E + e``).
        scaling: PEFT's ``lora_alpha / r`` (or rsLoRA's).
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    def rank(self, experts: int) -> int:
        """The adapter's rank r over `experts` experts."""
        return self.a.shape[0] // experts

    def expert_a(self, expert: int, experts: int) -> torch.Tensor:
        """Expert `expert`'s A, ``[r, K]``."""
        r = self.rank(experts)
        return self.a[expert * r:(expert + 1) * r]

    def expert_b(self, expert: int, experts: int) -> torch.Tensor:
        """Expert `expert`'s B, ``[N, r]``."""
        return self.b[:, expert::experts]

    def b_view(self, experts: int) -> torch.Tensor:
        """B indexed ``[E, N, r]`` (expert, row, rank): a view of PEFT's tensor, whose experts' values
        of a rank lie side by side."""
        return view_by_expert(self.b, experts)

    def b_by_expert(self, experts: int) -> torch.Tensor:
        """`b_view` copied contiguous by torch: expert e's B in one block, each row's r ranks side by
        side, so that the expand reads a tile of it in whole sectors. The reference of the launch
        the expand's operand comes from (`b_by_expert_triton`, `expert_b_operand`),
        which is made at each call so that it is B as it is now (an optimizer step or a weight
        update changes B in place, also between CUDA-graph replays)."""
        return self.b_view(experts).contiguous()

    def check(self, name: str, experts: int, k: int, n: int, x: torch.Tensor) -> None:
        """ValueError naming `name` when the adapter does not fit an ``[E, N, K]`` expert tensor."""
        a, b = self.a, self.b
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] % experts or a.shape[0] == 0 or a.shape[1] != k \
                or tuple(b.shape) != (n, a.shape[0]):
            raise ValueError(f"fused_moe: {name}: lora A {tuple(a.shape)} and B {tuple(b.shape)} do not fit {experts} "
                             f"experts of [N={n}, K={k}] (want A [E * r, {k}] and B [{n}, r * E], PEFT's layout)")
        for label, t in (("A", a), ("B", b)):
            if t.device != x.device or t.dtype not in (torch.float32, x.dtype):
                raise ValueError(f"fused_moe: {name}: lora {label} is {t.dtype} on {t.device}; want fp32 or "
                                 f"{x.dtype} on {x.device} (like x)")


BLOCK_E = 32  # experts per copy program (and rows enough for 128 values an expert, `b_by_expert_triton`)


@triton.jit
def _b_by_expert_kernel(b_ptr, out_ptr, N, R, E, stride_bn, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_E: tl.constexpr, PDL: tl.constexpr = False):
    """``out[e, n, j] = b[n, j * E + e]`` over a block of rows n and experts e (every rank)."""
    wait_for_inputs(PDL)
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    j = tl.arange(0, BLOCK_R).to(tl.int64)
    e = (tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)).to(tl.int64)
    mask = (n < N)[:, None, None] & (j < R)[None, :, None] & (e < E)[None, None, :]
    values = tl.load(b_ptr + n[:, None, None] * stride_bn + j[None, :, None] * E + e[None, None, :], mask=mask)
    out = out_ptr + e[:, None, None] * (N * R) + n[None, :, None] * R + j[None, None, :]
    tl.store(out, tl.permute(values, (2, 0, 1)), mask=tl.permute(mask, (2, 0, 1)))


def b_by_expert_triton(b: torch.Tensor, experts: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """PEFT's expert-tensor B ``[N, r * E]`` as an ``[E, N, r]`` tensor (one launch), the values
    `ExpertLora.b_by_expert` gives; B's columns must be contiguous (a parameter's are). Written into
    `out` (contiguous, B's shape by expert, dtype and device) when given, else into a new tensor."""
    require_triton("fused_moe")
    n, columns = b.shape
    if columns % experts or b.stride(1) != 1:
        raise ValueError(f"b_by_expert_triton: b {tuple(b.shape)} with strides {b.stride()} is not PEFT's [N, r * E] "
                         f"layout over experts={experts} with contiguous columns")
    rank = columns // experts
    if out is None:
        out = torch.empty(experts, n, rank, device=b.device, dtype=b.dtype)
    elif tuple(out.shape) != (experts, n, rank) or out.dtype != b.dtype or out.device != b.device \
            or not out.is_contiguous():
        raise ValueError(f"b_by_expert_triton: out {tuple(out.shape)} {out.dtype} on {out.device} is not a contiguous "
                         f"[E={experts}, N={n}, r={rank}] {b.dtype} tensor on {b.device}, like b")
    if out.numel():
        block_r = triton.next_power_of_2(rank)
        block_n = max(1, 128 // block_r)  # 128 values an expert: 32 per thread at any rank
        _b_by_expert_kernel[(triton.cdiv(n, block_n), triton.cdiv(experts, BLOCK_E))](
            b, out, n, rank, experts, b.stride(0), BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_E=BLOCK_E, num_warps=4,
            **dependent_launch_kwargs(b.device), enable_fp_fusion=True)
    return out


def _copy_by_expert(b: torch.Tensor, experts: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """B ``[N, r * E]`` copied to ``[E, N, r]`` (into `out` when given): `b_by_expert_triton` where
    Triton runs (CUDA, the interpreter), else torch's copy of the permuted view (the same values)."""
    if b.is_cuda or interpreting():
        return b_by_expert_triton(b if b.stride(1) == 1 else b.contiguous(), experts, out)
    return view_by_expert(b, experts).contiguous() if out is None else out.copy_(view_by_expert(b, experts))


class KeptExpertB:
    """B of adapted expert tensors copied by expert and kept between forwards (the module docstring):
    the rollout engine's table (runtime/model_runner.py), made beside its KV cache and CUDA graphs,
    which read the copies' addresses, and dropped with them.

    A copy is found by its B's storage, shape, strides, dtype and device and the expert count; each
    copy keeps its address from creation until the table is dropped (or, where no graph reads the
    table, until its B is no longer adapted: `refresh`'s `only`), so a graph captured reading it
    stays valid. `refresh` copies B into it again, in place.
    """

    def __init__(self, sources: Iterable[tuple[torch.Tensor, int]] = ()) -> None:
        self._kept: dict[tuple, tuple[torch.Tensor, int, torch.Tensor]] = {}  # key -> (B, experts, copy)
        self.refresh(sources)

    @staticmethod
    def _key(b: torch.Tensor, experts: int) -> tuple:
        return b.data_ptr(), tuple(b.shape), b.stride(), b.dtype, b.device, experts

    def refresh(self, sources: Iterable[tuple[torch.Tensor, int]] = (), *, only: bool = False,
                limit: int | None = None) -> None:
        """Copy every kept B by expert again, in place, then add the (B, experts) of `sources` not
        kept yet (a new copy each), in their order, while the copies' bytes stay within `limit`
        (None: no limit); a B left out is copied by each forward instead (`expert_b_operand`).

        With `only`, the copies of a B not in `sources` (replaced, no longer adapted) are dropped
        first, with their hold on its storage: only where no CUDA graph reads the table, since a
        captured graph keeps reading the copies it was captured with."""
        sources = [(b.detach(), experts) for b, experts in sources]
        if only:
            wanted = {self._key(b, experts) for b, experts in sources}
            self._kept = {key: kept for key, kept in self._kept.items() if key in wanted}
        for b, experts, copy in self._kept.values():
            _copy_by_expert(b, experts, copy)
        held = self.nbytes
        for b, experts in sources:
            key, size = self._key(b, experts), b.numel() * b.element_size()
            if key not in self._kept and (limit is None or held + size <= limit):
                self._kept[key] = (b, experts, _copy_by_expert(b, experts))
                held += size

    def copy_of(self, b: torch.Tensor, experts: int) -> torch.Tensor | None:
        """The kept copy of `b` ``[N, r * E]`` by expert ``[E, N, r]``, or None when it is not kept."""
        kept = self._kept.get(self._key(b, experts))
        return None if kept is None else kept[2]

    def __len__(self) -> int:
        return len(self._kept)

    @property
    def nbytes(self) -> int:
        """Device bytes the copies hold."""
        return sum(copy.numel() * copy.element_size() for _, _, copy in self._kept.values())


_READING: ContextVar[KeptExpertB | None] = ContextVar("vexact_kept_expert_b", default=None)


@contextmanager
def reading_kept_b(kept: KeptExpertB | None) -> Iterator[None]:
    """Within the block (this thread), `expert_b_operand` reads B's copy from `kept` where it holds
    one; None reads none. The rollout engine's forwards run in it; training forwards never do."""
    token = _READING.set(kept)
    try:
        yield
    finally:
        _READING.reset(token)


def copies_b(experts: int, pairs: int) -> bool:
    """Whether the launcher copies B by expert for `pairs` over `experts`: from
    `REGROUP_PAIRS_PER_EXPERT` pairs an expert on average."""
    return pairs >= REGROUP_PAIRS_PER_EXPERT * experts


def expert_b_operand(lora: ExpertLora, experts: int, pairs: int,
                     regroup: bool | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """B as the expand reads it and its strides (expert, row, rank): copied by expert (`regroup`, by
    default `copies_b`; `b_by_expert_triton`), else PEFT's tensor in place through
    `ExpertLora.b_view`'s strides. By default, within `reading_kept_b`, the kept copy where there is
    one, whatever `pairs`. All hold the same values."""
    if regroup is None:
        kept = _READING.get()
        copy = None if kept is None else kept.copy_of(lora.b, experts)
        if copy is not None:
            return copy, copy.stride()
        regroup = copies_b(experts, pairs)
    if regroup:
        b = _copy_by_expert(lora.b, experts)
        return b, b.stride()
    return lora.b, lora.b_view(experts).stride()


@triton.jit
def expert_b_rows(b_ptr, expert, cols, N, stride_be, stride_bn, COLUMNS: tl.constexpr):
    """Pointers to expert `expert`'s B row of each base column in `cols` (rank 0): the column itself,
    or with `moe_lora.GATE_FIRST_FROM_INTERLEAVED` gate columns first over interleaved B rows (gate n at
    2n, up n at 2n + 1)."""
    if COLUMNS == 1:
        half = N // 2
        b_rows = tl.where(cols < half, 2 * cols, 2 * (cols - half) + 1)
    else:
        b_rows = cols
    return b_ptr + expert * stride_be + b_rows.to(tl.int64) * stride_bn
