"""The rollout side of the gated delta rule: steps over sequences that each add some tokens.

A rollout keeps per sequence the state after its last token (fp32, docs/design.md section 6b). A
step that adds tokens at positions ``p..p+m-1`` runs the training forward's recurrent kernel
(`gated_delta_recurrent`) on those rows from the kept state and keeps the state after them; all
sequences of a step share one launch, and every output is bitwise the training forward's
(`gated_delta_rule`) for the same token. `GatedDeltaRollout` does this for a set of slots: the
protocol the engine's state cache implements on pooled tensors with a fixed-shape plan
(`gated_delta_step`), used by the tests and the GPU invariance sweep.
"""

from __future__ import annotations

import itertools

import torch

from .backend import select
from .gated_delta_launch import prepare_rows, state_dtype
from .gated_delta_recurrent import RecurrentPlan, launch_recurrent

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GatedDeltaRollout:
    """The states of `slots` sequences of one layer.

    `heads`: ``(Hk, Hv)``, `dims`: ``(dk, dv)``; states in fp32 on `device` (fp64 for fp64 rows).
    `initial_state` (``[slots, Hv, dk, dv]``) starts each slot from a state instead of zeros."""

    def __init__(self, slots: int, heads: tuple[int, int], dims: tuple[int, int], *, device: torch.device | str = "cpu",
                 use_qk_l2norm: bool = True, scale: float | None = None, initial_state: torch.Tensor | None = None,
                 dtype: torch.dtype = torch.float32) -> None:
        _, hv = heads
        dk, dv = dims
        self.l2norm, self.scale = use_qk_l2norm, dk ** -0.5 if scale is None else float(scale)
        self.states = torch.zeros(slots, hv, dk, dv, dtype=dtype, device=device)
        if initial_state is not None:
            if tuple(initial_state.shape) != tuple(self.states.shape):
                raise ValueError(f"GatedDeltaRollout: initial_state {tuple(initial_state.shape)} must be "
                                 f"{tuple(self.states.shape)}")
            self.states.copy_(initial_state)
        self.started = [initial_state is not None] * slots

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             slots: list[int], counts: list[int]) -> torch.Tensor:
        """Add ``counts[i]`` tokens to slot ``slots[i]`` (rows packed in that order: q, k
        ``[T, Hk, dk]``, v ``[T, Hv, dv]``, g, beta ``[T, Hv]``); returns their outputs ``[T, Hv, dv]``."""
        if len(slots) != len(counts) or len(set(slots)) != len(slots) or sum(counts) != k.shape[0]:
            raise ValueError(f"GatedDeltaRollout.step: slots={slots} (distinct) and counts={counts} must pair up and "
                             f"cover the {k.shape[0]} rows")
        bad = [s for s in slots if not 0 <= s < self.states.shape[0]]
        if bad or min(counts, default=0) < 0:
            raise ValueError(f"GatedDeltaRollout.step: slots={slots} must lie in [0, {self.states.shape[0]}) and "
                             f"counts={counts} be >= 0")
        hv, dk, dv = self.states.shape[1:]
        if k.dim() != 3 or k.shape[2] != dk or tuple(v.shape[1:]) != (hv, dv) or hv % k.shape[1]:
            raise ValueError(f"GatedDeltaRollout.step: k {tuple(k.shape)} and v {tuple(v.shape)} must be [T, Hk, {dk}] "
                             f"and [T, {hv}, {dv}] (Hk dividing {hv}), the rollout's heads")
        if self.states.dtype != state_dtype(k):
            raise ValueError(f"GatedDeltaRollout.step: rows of {k.dtype} need states of {state_dtype(k)}, "
                             f"the rollout holds {self.states.dtype}")
        backend = select("gated_delta_rule", k, dtypes=_DTYPES)
        starts = [0, *itertools.accumulate(counts)][:-1]
        plan = RecurrentPlan(starts, list(counts), [s if self.started[s] else -1 for s in slots], list(slots))
        q, k, v, g, beta = (prepare_rows(x, backend) for x in (q, k, v, g, beta))
        out = torch.empty(k.shape[0], v.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        launch_recurrent(backend, q, k, v, g, beta, self.states, out, plan, self.scale, self.l2norm)
        for s, m in zip(slots, counts):
            self.started[s] = self.started[s] or m > 0
        return out
