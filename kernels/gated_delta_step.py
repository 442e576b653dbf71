"""A rollout step of the gated delta rule on pooled states, from a plan of fixed-shape index arrays
that a CUDA graph can replay (docs/design.md section 6b, "The engine's state cache").

The pool (``[slots + 1, Hv, dk, dv]`` fp32) holds per slot ``s`` the state after its sequence's
last token, at ``states[s]``; ``states[slots]`` takes the writes of a dry run. A step's sequence
``b`` adds ``counts[b]`` tokens from position ``starts[b]`` (the step's rows ``cu[b] ..``): one
recurrent launch (`gated_delta_recurrent`) walks each sequence's new rows from its slot's state
(zeros where ``starts[b] == 0``) and leaves the last state in the slot, the training forward's
kernel on the same rows in the same order, so every output is bitwise `gated_delta_rule`'s. A
decode and a prompt piece are the same entry; the launch's grid is the step's sequence capacity,
and a padding entry (``count`` 0) is a program that exits at once.

`plan_step` builds the arrays on the host (numpy) at a capacity; `dry_run` turns a plan into one
that reads the same inputs and writes only the padding state and no conv state (a graph's eager
warm-up must not advance the states). The arrays are int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .backend import select
from .gated_delta_launch import prepare_rows, state_dtype
from .gated_delta_recurrent import RecurrentPlan, launch_recurrent

__all__ = ["StepPlan", "dry_run", "gated_delta_step", "plan_sizes", "plan_step"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def plan_sizes(tokens: int, seqs: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The plan's arrays (name -> (dtype, shape)) for a step of up to `tokens` tokens and `seqs`
    sequences: ``slot`` and ``context`` (the conv's state row and context length) and ``segment``
    (`RecurrentPlan`'s four fields), one entry per sequence. `tokens` sizes no array: the launch
    reads the rows the entries name."""
    i32 = np.dtype(np.int32)
    return dict(slot=(i32, (seqs,)), context=(i32, (seqs,)), segment=(i32, (4, seqs)))


def _check(slots: np.ndarray, counts: np.ndarray, pool_slots: int, tokens: int, seqs: int) -> None:
    if len(slots) > seqs or counts.sum() > tokens or (len(counts) and counts.min() < 0):
        raise ValueError(f"plan_step: {len(slots)} sequences of {counts.tolist()} tokens do not fit a step of "
                         f"{seqs} sequences and {tokens} tokens")
    if len(slots) and (slots.min() < 0 or slots.max() >= pool_slots):
        raise ValueError(f"plan_step: slots {slots.tolist()} must lie in [0, {pool_slots}) (the cache's slots: "
                         "max_num_seqs)")
    if len(set(slots.tolist())) != len(slots):
        raise ValueError(f"plan_step: slots {slots.tolist()} must be distinct")


def plan_step(slots, starts, counts, pool_slots: int, tokens: int, seqs: int) -> dict[str, np.ndarray]:
    """The plan of a step (the module docstring) at capacity `tokens`, `seqs` (`plan_sizes`):
    sequence ``b`` adds ``counts[b]`` tokens from position ``starts[b]`` in slot ``slots[b]`` of a
    pool of `pool_slots`; its tokens are rows ``sum(counts[:b]) ..`` of the step. Raises
    ValueError for slots out of range or repeated, or a step past the capacity."""
    slots, starts, counts = (np.asarray(x, np.int64).reshape(-1) for x in (slots, starts, counts))
    _check(slots, counts, pool_slots, tokens, seqs)
    out = {name: np.zeros(shape, dtype) for name, (dtype, shape) in plan_sizes(tokens, seqs).items()}
    out["slot"][:] = -1
    out["segment"][2:] = -1
    n = len(slots)
    cu = np.concatenate([[0], np.cumsum(counts)])
    out["slot"][:n], out["context"][:n] = slots, starts
    out["segment"][:, :n] = [cu[:-1], counts, np.where(starts == 0, -1, slots), slots]
    return out


def dry_run(plan: dict[str, np.ndarray], pool_slots: int) -> dict[str, np.ndarray]:
    """`plan` with every state write sent to the padding state and no conv state: the same launch,
    reading what the step reads, advancing nothing (a graph's warm-up)."""
    out = {name: a.copy() for name, a in plan.items()}
    out["slot"][:] = -1
    out["segment"][3] = np.where(out["segment"][1] > 0, pool_slots, -1)
    return out


@dataclass(frozen=True)
class StepPlan:
    """A plan's arrays as tensors on the step's device (`plan_sizes`' names; views of a fixed
    buffer in a CUDA graph)."""

    arrays: dict[str, torch.Tensor]

    def segments(self) -> RecurrentPlan:
        return RecurrentPlan(*self.arrays["segment"].unbind(0))


@torch.no_grad()
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool_states: torch.Tensor, plan: StepPlan, *, scale: float | None = None,
                     use_qk_l2norm: bool = True) -> torch.Tensor:
    """The outputs ``[T, Hv, dv]`` (q's dtype) of a step's rows (q, k ``[T, Hk, dk]``, v ``[T, Hv,
    dv]``, g, beta ``[T, Hv]``; rows of no sequence get no defined output), advancing
    `pool_states` (``[slots + 1, Hv, dk, dv]`` fp32) in place. Bitwise `gated_delta_rule`'s rows
    (the module docstring). No host sync, no shape that depends on the plan's values: a CUDA graph
    captures it."""
    backend = select("gated_delta_rule", k, dtypes=_DTYPES)
    dk, hv, dv = k.shape[2], v.shape[1], v.shape[2]
    scale = dk ** -0.5 if scale is None else float(scale)
    if pool_states.dtype != state_dtype(k) or tuple(pool_states.shape[1:]) != (hv, dk, dv):
        raise ValueError(f"gated_delta_step: pool_states {tuple(pool_states.shape)} {pool_states.dtype} must be "
                         f"{state_dtype(k)} [slots + 1, {hv}, {dk}, {dv}]")
    q, k, v, g, beta = (prepare_rows(x, backend) for x in (q, k, v, g, beta))
    out = torch.empty(q.shape[0], hv, dv, dtype=q.dtype, device=q.device)
    launch_recurrent(backend, q, k, v, g, beta, pool_states, out, plan.segments(), scale, use_qk_l2norm)
    return out
