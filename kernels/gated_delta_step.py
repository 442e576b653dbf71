"""A rollout step of the gated delta rule on pooled state, from a plan of fixed-shape index arrays
that a CUDA graph can replay (docs/design.md section 6b, "The engine's state cache").

The pools (`pool_shapes`): per slot ``s`` the boundary state ``states[s]`` (fp32) and the rows of
its current chunk at ``rows[s * C .. s * C + C - 1]`` (k, v, g, beta); one more state
(``states[slots]``) and one more row (``rows[slots * C]``) take the writes of padding entries. A
step's sequence ``b`` adds ``counts[b]`` tokens from position ``starts[b]``: with ``lead = starts % C``
kept rows, its chunk 0 (the chunk ``starts`` lies in) reads them from the pool, its chunks
1, 2, ... read the step's own new rows in place, so no row is gathered:

1. ``store``: the new rows of chunk 0 go to the pool's rows (a copy of the step's tokens);
2. ``decode``: a sequence adding one token (a decode: row ``i`` of chunk 0) gets its output and
   its row of ``T`` from the decode launch (`gated_delta_decode`: the pool's rows of the chunk and
   its kept rows of ``T``; it reads the boundary state, never writes one);
3. ``rows0``: chunk 0's outputs of the other sequences (rows launch over the pool's rows, boundary
   states read in the pool in place through the slots: no gather of the used states);
   ``fold0``: every sequence's chunk 0 folded where it completes, a decode's too, into its slot's
   pool state in place (after ``decode`` and ``rows0`` have read it), by the training forward's
   fold kernels;
4. ``rows1``: chunk 1 (boundary: the state ``fold0`` wrote), where the step reaches it;
5. ``fold1``: chunks 1.. that complete, one run per sequence, into a scratch of states;
   ``rows2``: chunks 2.. from the scratch; ``copy``: the last folded state into the pool;
6. ``keep``: the rows of a new incomplete chunk past chunk 0 go to the pool's rows.

The rows launch that computes a sequence's last, incomplete chunk keeps its rows of ``T`` in the
slot's rows of the T pool (``t_out``, beside the raw rows ``store`` and ``keep`` write), and the
decode launch keeps its row: a decode reads only rows of ``T`` its chunk's earlier steps wrote in
the same slot (a sequence from position 0 writes them all again; `LinearStateCache.copy_slots`
copies them with the rows).

Every launch has a grid fixed by the step's capacity ``(tokens, seqs)`` (`plan_sizes`), and an
entry without work is a program that exits at once (a rows entry with no rows wanted, a fold run
of length 0) or a copy into the padding row or state; 4 and 6 run only when a step may touch a
second chunk (``max_q >= 2``), 5 only when it may complete one (``max_q > C``); ``rows0`` only
where a sequence may add more than one token (``max_q >= 2``: a decode bucket runs 1, 2 and
``fold0``). A chunk's rows are at the same tile positions whatever the padding, and a fold of one
chunk is the loop body of a longer run, so every output and state is bitwise
`gated_delta_rule`'s (the kernels' contract).

`plan_step` builds the arrays on the host (numpy) at a capacity; `dry_run` turns a plan into one
that reads the same inputs and writes only the padding row and state (a graph's eager warm-up
must not advance the states). The arrays are int32 but the copies' indices (int64).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .backend import select
from .gated_delta_decode import DecodePlan, launch_decode
from .gated_delta_launch import FoldPlan, RowsPlan, Shapes, launch_fold, launch_rows, prepare_rows, state_dtype

__all__ = ["StepPlan", "dry_run", "gated_delta_step", "plan_sizes", "plan_step"]

_ROWS = 6  # kv_start, n_rows, first_row, q_start, state_index, t_out (RowsPlan's fields)
_FOLD = 4  # start, length, state_index, out_index (FoldPlan's fields)
_DECODE = 5  # kv_start, row, q_start, state_index, t_out (DecodePlan's fields)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def plan_sizes(tokens: int, seqs: int, chunk: int) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """The plan's arrays (name -> (dtype, shape)) for a step of up to `tokens` tokens and `seqs`
    sequences: ``slot``, ``context`` (the conv's), ``rows0``, ``fold0``, ``rows1``, ``fold1``
    (one entry per sequence), ``rows2`` (``tokens // C``: a sequence's chunks past its second),
    ``store``, ``keep`` (a pool row per token), ``copy`` (source in the scratch, slot: at most one per
    ``C + 1`` tokens), ``decode`` (one entry per sequence)."""
    i32, i64 = np.dtype(np.int32), np.dtype(np.int64)
    return dict(slot=(i32, (seqs,)), context=(i32, (seqs,)), decode=(i32, (_DECODE, seqs)),
                rows0=(i32, (_ROWS, seqs)), fold0=(i32, (_FOLD, seqs)),
                rows1=(i32, (_ROWS, seqs)), fold1=(i32, (_FOLD, seqs)), rows2=(i32, (_ROWS, scratch_states(tokens, chunk))),
                store=(i64, (tokens,)), keep=(i64, (tokens,)),
                copy=(i64, (2, max(1, min(seqs, tokens // (chunk + 1))))))


def scratch_states(tokens: int, chunk: int) -> int:
    """States the scratch of a step of up to `tokens` tokens holds (chunks 1.. completing): at most
    ``tokens // C``."""
    return max(1, tokens // chunk)


def _padding(sizes: dict, chunk: int, pool_slots: int) -> dict[str, np.ndarray]:
    """Arrays whose every entry has no work: no state slot, rows launches with no rows and no row
    of T kept, decodes of no row, runs of length 0, copies into the padding row and state."""
    out = {name: np.zeros(shape, dtype) for name, (dtype, shape) in sizes.items()}
    out["slot"][:] = -1
    for name in ("rows0", "rows1", "rows2"):
        out[name][4:6] = -1
    out["decode"][[1, 3, 4]] = -1
    for name in ("fold0", "fold1"):
        out[name][2] = -1
    out["store"][:] = out["keep"][:] = pool_slots * chunk
    out["copy"][1] = pool_slots
    return out


def _check(slots: np.ndarray, counts: np.ndarray, pool_slots: int, tokens: int, seqs: int) -> None:
    if len(slots) > seqs or counts.sum() > tokens or (len(counts) and counts.min() < 0):
        raise ValueError(f"plan_step: {len(slots)} sequences of {counts.tolist()} tokens do not fit a step of "
                         f"{seqs} sequences and {tokens} tokens")
    if len(slots) and (slots.min() < 0 or slots.max() >= pool_slots):
        raise ValueError(f"plan_step: slots {slots.tolist()} must lie in [0, {pool_slots}) (the cache's slots: "
                         "max_num_seqs)")
    if len(set(slots.tolist())) != len(slots):
        raise ValueError(f"plan_step: slots {slots.tolist()} must be distinct")


def plan_step(slots, starts, counts, chunk: int, pool_slots: int, tokens: int, seqs: int) -> dict[str, np.ndarray]:
    """The plan of a step (the module docstring) at capacity `tokens`, `seqs` (`plan_sizes`):
    sequence ``b`` adds ``counts[b]`` tokens from position ``starts[b]`` in slot ``slots[b]`` of a
    pool of `pool_slots`; its tokens are rows ``sum(counts[:b]) ..`` of the step. Raises
    ValueError for slots out of range or repeated, or a step past the capacity."""
    slots, starts, counts = (np.asarray(x, np.int64).reshape(-1) for x in (slots, starts, counts))
    _check(slots, counts, pool_slots, tokens, seqs)
    c, n, t = chunk, len(slots), int(counts.sum())
    out = _padding(plan_sizes(tokens, seqs, chunk), chunk, pool_slots)
    lead = starts % c
    total = lead + counts
    whole, touched = total // c, -(-total // c)
    cu = np.concatenate([[0], np.cumsum(counts)])
    boundary = np.where(starts == lead, -1, slots)  # a chunk starting at position 0 starts from zeros
    out["slot"][:n], out["context"][:n] = slots, starts
    one = counts == 1  # a decode: row `lead` of chunk 0, by the decode launch
    base_row = slots * c
    out["decode"][:, :n] = np.where(one, [base_row, lead, cu[:-1], boundary, np.where(lead < c - 1, base_row, -1)],
                                    out["decode"][:, :n])
    kept0 = np.where(total < c, base_row, -1)  # chunk 0 stays incomplete: its rows of T are kept
    out["rows0"][:, :n] = [base_row, np.where(one, lead, np.minimum(c, total)), lead, cu[:-1], boundary, kept0]
    done = whole >= 1  # a decode of row C - 1 too
    out["fold0"][:, :n] = np.where(done, [base_row, np.full(n, c), boundary, slots], out["fold0"][:, :n])
    owner = np.repeat(np.arange(n), counts)  # each token's sequence, its row in its chunk sequence
    row = lead[owner] + np.arange(t) - cu[:-1][owner]
    out["store"][:t] = np.where(row < c, slots[owner] * c + row, pool_slots * c)
    out["keep"][:t] = np.where((row >= c) & (row // c == whole[owner]), slots[owner] * c + row % c, pool_slots * c)
    second = cu[:-1] + c - lead  # the step's row that starts chunk 1
    out["rows1"][:, :n] = np.where(touched >= 2, [second, np.minimum(c, total - c), 0 * slots, second, slots,
                                                  np.where(total < 2 * c, base_row, -1)], out["rows1"][:, :n])
    deep = np.maximum(whole - 1, 0)  # chunks 1.. that complete: the scratch's states
    base = np.concatenate([[0], np.cumsum(deep)])[:-1]
    out["fold1"][:, :n] = np.where(deep > 0, [second, deep * c, slots, base], out["fold1"][:, :n])
    later = np.maximum(touched - 2, 0)  # chunks 2.. touched
    who = np.repeat(np.arange(n), later)
    j = 2 + np.arange(len(who)) - (np.cumsum(later) - later)[who]
    start = second[who] + (j - 1) * c
    rows2 = np.minimum(c, total[who] - j * c)
    out["rows2"][:, :len(who)] = [start, rows2, 0 * start, start, base[who] + j - 2,
                                  np.where(rows2 < c, base_row[who], -1)]
    last = np.flatnonzero(deep > 0)
    out["copy"][:, :len(last)] = [base[last] + deep[last] - 1, slots[last]]
    return out


def dry_run(plan: dict[str, np.ndarray], chunk: int, pool_slots: int) -> dict[str, np.ndarray]:
    """`plan` with every write of the pools sent to the padding row and state and no conv state:
    the same launches, reading what the step reads, advancing nothing (a graph's warm-up)."""
    out = {name: a.copy() for name, a in plan.items()}
    out["slot"][:] = -1
    out["fold0"][3] = pool_slots
    out["decode"][4] = -1
    for name in ("rows0", "rows1", "rows2"):
        out[name][5] = -1
    out["store"][:] = out["keep"][:] = pool_slots * chunk
    out["copy"][1] = pool_slots
    return out


@dataclass(frozen=True)
class StepPlan:
    """A plan's arrays as tensors on the step's device (`plan_sizes`' names; views of a fixed
    buffer in a CUDA graph), and what sizes its launches: `max_q` (the most tokens of one
    sequence the plan may hold: ``>= 2`` launches chunk 1's rows, ``> C`` the folds past chunk 0)."""

    arrays: dict[str, torch.Tensor]
    chunk: int
    max_q: int

    def rows(self, name: str) -> RowsPlan:
        return RowsPlan(*self.arrays[name].unbind(0))

    def fold(self, name: str) -> FoldPlan:
        return FoldPlan(*self.arrays[name].unbind(0))

    def decode(self) -> DecodePlan:
        return DecodePlan(*self.arrays["decode"].unbind(0))


def _host(plan, kind: str):
    """A plan of host lists without its entries that have no work (the reference's form: each
    chunk is computed on its own, so dropping one changes no other's bits)."""
    fields = [x.tolist() for x in plan.__dict__.values()]
    work = {"rows": lambda i: fields[1][i] > fields[2][i], "fold": lambda i: fields[1][i] > 0,
            "decode": lambda i: fields[1][i] >= 0}[kind]
    keep = [i for i in range(len(fields[0])) if work(i)]
    return type(plan)(*([f[i] for i in keep] for f in fields))


def _rows(backend, q, k, v, g, beta, states, out, plan: RowsPlan, shapes, chunk, scale, l2norm, pool_t) -> None:
    launch_rows(backend, q, k, v, g, beta, states, out, plan if backend == "triton" else _host(plan, "rows"), shapes,
                chunk, scale, l2norm, t_cache=pool_t)


def _fold(backend, k, v, g, beta, states_in, states_out, plan: FoldPlan, shapes, chunk, l2norm,
          most_chunks: int | None = None) -> None:
    launch_fold(backend, k, v, g, beta, states_in, states_out, plan if backend == "triton" else _host(plan, "fold"),
                shapes, chunk, l2norm, most_chunks=most_chunks)


@torch.no_grad()
def gated_delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     pool_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], pool_states: torch.Tensor,
                     plan: StepPlan, *, pool_t: torch.Tensor, scale: float | None = None,
                     use_qk_l2norm: bool = True) -> torch.Tensor:
    """The outputs ``[T, Hv, dv]`` (q's dtype) of a step's rows (q, k ``[T, Hk, dk]``, v ``[T, Hv,
    dv]``, g, beta ``[T, Hv]``; T the plan's token capacity: rows of no sequence get no defined
    output), advancing the pools in place: `pool_rows` (k, v, g, beta ``[slots * C + 1, ...]`` in
    k's dtype, g's fp32), `pool_t` (the rows of ``T`` of each slot's chunk, ``[slots * C, Hv, C]``
    fp32) and `pool_states` (``[slots + 1, Hv, dk, dv]`` fp32). Bitwise `gated_delta_rule`'s rows
    (the module docstring). No host sync, no shape that depends on the plan's values: a CUDA graph
    captures it."""
    c, arrays = plan.chunk, plan.arrays
    shapes = Shapes(k.shape[1], v.shape[1], k.shape[2], v.shape[2])
    backend = select("gated_delta_rule", k, dtypes=_DTYPES)
    scale = shapes.dk ** -0.5 if scale is None else float(scale)
    if pool_states.dtype != state_dtype(k) or pool_rows[0].dtype != k.dtype or pool_t.dtype != pool_states.dtype:
        raise ValueError(f"gated_delta_step: pool_states {pool_states.dtype}, pool_t {pool_t.dtype} and pool_rows "
                         f"{pool_rows[0].dtype} must be {state_dtype(k)} (twice) and k's {k.dtype}")
    if tuple(pool_t.shape) != ((pool_rows[0].shape[0] - 1), shapes.hv, c):
        raise ValueError(f"gated_delta_step: pool_t {tuple(pool_t.shape)} must be [slots * C, Hv, C] = "
                         f"{(pool_rows[0].shape[0] - 1, shapes.hv, c)}")
    new = [prepare_rows(x, backend) for x in (k, v, g, beta)]
    for store, x in zip(pool_rows, new):
        store.index_copy_(0, arrays["store"], x.to(store.dtype))
    q = prepare_rows(q, backend)
    out = torch.empty(q.shape[0], shapes.hv, shapes.dv, dtype=q.dtype, device=q.device)
    decode = plan.decode()
    launch_decode(backend, q, *pool_rows, pool_t, pool_states, out, decode if backend == "triton" else _host(decode, "decode"),
                  shapes, c, scale, use_qk_l2norm)
    if plan.max_q >= 2:  # a sequence may add more than one token
        _rows(backend, q, *pool_rows, pool_states, out, plan.rows("rows0"), shapes, c, scale, use_qk_l2norm, pool_t)
    fold0 = plan.fold("fold0")  # one chunk a run at most: the prep launch's capacity is the runs', not the pool's
    _fold(backend, *pool_rows, pool_states, pool_states, fold0, shapes, c, use_qk_l2norm, most_chunks=len(fold0.start))
    if plan.max_q < 2:  # every sequence adds one token at most: all decodes
        return out
    _rows(backend, q, *new, pool_states, out, plan.rows("rows1"), shapes, c, scale, use_qk_l2norm, pool_t)
    if plan.max_q > c:
        scratch = pool_states.new_empty(arrays["rows2"].shape[1], *pool_states.shape[1:])
        _fold(backend, *new, pool_states, scratch, plan.fold("fold1"), shapes, c, use_qk_l2norm)
        _rows(backend, q, *new, scratch, out, plan.rows("rows2"), shapes, c, scale, use_qk_l2norm, pool_t)
        pool_states.index_copy_(0, arrays["copy"][1], scratch.index_select(0, arrays["copy"][0]))
    for store, x in zip(pool_rows, new):
        store.index_copy_(0, arrays["keep"], x.to(store.dtype))
    return out
