"""The rollout side of the gated delta rule: a step over sequences that each add some tokens.

What a rollout keeps per sequence (docs/design.md section 6b): the state at its last chunk
boundary (fp32, in a pool) and the raw rows of its current, incomplete chunk (k, v, g, beta; no
queries: a row's output never reads another row's query). A step that adds tokens at positions
``p..p+m-1`` then

1. lays out, per sequence, the current chunk's kept rows followed by the new rows: rows from the
   chunk's start (a multiple of C) to ``p+m-1``, back to back;
2. folds the chunks this completes (`gated_delta_fold`), from the boundary state;
3. computes the new rows' outputs (`gated_delta_chunk_rows`), one segment per chunk touched, each
   from its boundary state (the kept one, or one just folded);
4. keeps the last folded state and the rows of the new incomplete chunk.

All sequences of a step share one fold launch and one rows launch. Every output is bitwise the
training forward's (`gated_delta_rule`) for the same token. `GatedDeltaRollout` does this for a
set of slots with python-side buffers: the protocol the engine's state cache implements, used by
the tests and the GPU invariance sweep.
"""

from __future__ import annotations

import torch

from .gated_delta_rule import CHUNK, gated_delta_chunk_rows, gated_delta_fold


class GatedDeltaRollout:
    """Boundary states and current-chunk rows of `slots` sequences of one layer.

    `heads`: ``(Hk, Hv)``, `dims`: ``(dk, dv)``; states in fp32 on `device`. `initial_state`
    (``[slots, Hv, dk, dv]``) starts each slot from a state instead of zeros."""

    def __init__(self, slots: int, heads: tuple[int, int], dims: tuple[int, int], *, device: torch.device | str = "cpu",
                 chunk_size: int = CHUNK, use_qk_l2norm: bool = True, scale: float | None = None,
                 initial_state: torch.Tensor | None = None) -> None:
        hk, hv = heads
        dk, dv = dims
        self.chunk, self.l2norm, self.scale = chunk_size, use_qk_l2norm, scale
        self.states = torch.zeros(slots, hv, dk, dv, dtype=torch.float32, device=device)
        if initial_state is not None:
            if tuple(initial_state.shape) != tuple(self.states.shape):
                raise ValueError(f"GatedDeltaRollout: initial_state {tuple(initial_state.shape)} must be "
                                 f"{tuple(self.states.shape)}")
            self.states.copy_(initial_state)
        self.positions = [0] * slots
        self.rows: list[tuple[torch.Tensor, ...] | None] = [None] * slots  # the current chunk's k, v, g, beta

    def step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             slots: list[int], counts: list[int]) -> torch.Tensor:
        """Add ``counts[i]`` tokens to slot ``slots[i]`` (rows packed in that order: q, k
        ``[T, Hk, dk]``, v ``[T, Hv, dv]``, g, beta ``[T, Hv]``); returns their outputs ``[T, Hv, dv]``."""
        if len(slots) != len(counts) or len(set(slots)) != len(slots) or sum(counts) != k.shape[0]:
            raise ValueError(f"GatedDeltaRollout.step: slots={slots} (distinct) and counts={counts} must pair up and "
                             f"cover the {k.shape[0]} rows")
        c = self.chunk
        laid: list[list[torch.Tensor]] = [[], [], [], []]  # per slot: its chunk's kept rows, then its new rows
        cu, first, index, fold_runs = [0], [], [], []
        base, offset = 0, 0
        for slot, m in zip(slots, counts):
            new = [x[offset:offset + m] for x in (k, v, g, beta)]
            offset += m
            kept = self.rows[slot]
            rows = [torch.cat([a, b]) for a, b in zip(kept, new)] if kept is not None else new
            for store, x in zip(laid, rows):
                store.append(x)
            total, lead = rows[0].shape[0], self.positions[slot] % c
            fold_runs.append((base, total // c * c, slot))
            for chunk in range(-(-total // c) if m else 0):  # the chunks touched: the segments, back to back
                cu.append(cu[-1] + min(c, total - chunk * c))
                first.append(lead if chunk == 0 else 0)
                index.append((slot, None) if chunk == 0 else (len(fold_runs) - 1, chunk - 1))
            base += total
        kk, vv, gg, bb = (torch.cat(x) if x else k[:0] for x in laid)
        folded = gated_delta_fold(kk, vv, gg, bb, [r[0] for r in fold_runs], [r[1] for r in fold_runs], self.states,
                                  [r[2] for r in fold_runs], use_qk_l2norm=self.l2norm, chunk_size=c)
        fold_at = [0]
        for r in fold_runs:
            fold_at.append(fold_at[-1] + r[1] // c)
        pool = self.states.shape[0]
        state_index = [i if j is None else pool + fold_at[i] + j for i, j in index]
        live = [torch.zeros(0, dtype=torch.long)] + [torch.arange(r[0], r[0] + x.shape[0]) for r, x, m in
                                                     zip(fold_runs, laid[0], counts) if m]
        rows = torch.cat(live).to(kk.device)  # the segments' rows (a slot adding nothing has none)
        out = gated_delta_chunk_rows(q, kk[rows], vv[rows], gg[rows], bb[rows], cu, first,
                                     torch.cat([self.states, folded]), state_index, scale=self.scale,
                                     use_qk_l2norm=self.l2norm, chunk_size=c)
        self._keep(slots, counts, laid, fold_runs, folded, fold_at)
        return out

    def _keep(self, slots, counts, laid, fold_runs, folded, fold_at) -> None:
        c = self.chunk
        for run, (slot, m) in enumerate(zip(slots, counts)):
            whole = fold_runs[run][1] // c
            if whole:
                self.states[slot] = folded[fold_at[run] + whole - 1]
            rest = [x[run][whole * c:] for x in laid]
            self.rows[slot] = rest if rest[0].shape[0] else None
            self.positions[slot] += m
