"""The per-sequence state of gated-DeltaNet layers beside the paged KV cache (docs/design.md section 6b).

A gated DeltaNet (GDN) layer keeps no K/V per position; a rollout keeps per sequence slot and GDN
layer (`LinearStateCache`):

- the conv state: the last ``K - 1`` inputs of the causal conv1d (`kernels.causal_conv1d`), in the
  model dtype;
- the boundary state: the delta rule's state at the sequence's last chunk boundary (fp32,
  ``[Hv, dk, dv]``);
- the current chunk's raw rows ``k, v, g, beta`` (at most ``C - 1``; never ``q``: a row's output
  reads no other row's query).

A slot is the sequence's row of the BlockManager's block-table mirror (`BlockTables`): taken with
its first page, given back when its pages are freed (finished, preempted), so at most
``max_num_seqs`` are held at once and a preempted sequence, re-prefilled from position 0, starts
from zeros: a step whose chunk starts at position 0 reads neither the conv state nor the boundary
state (`LinearStep`), so a slot is never cleared.

`LinearStep` is one step's plan, built once on the host and shared by every GDN layer of the step
(the model reads it from ``PagedContext.linear_states``): per sequence the slot, the first new
position and the count. A GDN layer's step (`LinearStep.delta_rule`) lays out each sequence's kept
rows followed by its new ones, folds the chunks they complete (`gated_delta_fold`, one launch),
computes the new rows' outputs (`gated_delta_chunk_rows`, one launch, one segment per chunk
touched, each from its boundary state), then keeps the last state and the new partial chunk: the
protocol of `kernels.gated_delta_rollout.GatedDeltaRollout`, on pooled tensors. Every output is
bitwise the training forward's (the kernels' contract), whatever the split of a prompt into
pieces, at chunk boundaries or not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vexact_models.gated_deltanet import GatedDeltaNet
from vexact_models.kernels import causal_conv1d, gated_delta_chunk_rows, gated_delta_fold
from vexact_models.kernels.gated_delta_rule import CHUNK

__all__ = ["LinearStateCache", "LinearStateSpec", "LinearStep", "linear_state_spec"]


@dataclass(frozen=True)
class LinearStateSpec:
    """The GDN layers of a model and the shapes of their per-sequence state."""

    layers: tuple[int, ...]  #: the decoder layer indices of the GDN layers
    heads: tuple[int, int]  #: (key heads Hk, value heads Hv)
    dims: tuple[int, int]  #: (key head dim dk, value head dim dv)
    conv_channels: int  #: the conv1d's channels (q, k and v together)
    conv_kernel: int  #: the conv1d's kernel size K
    chunk: int = CHUNK  #: rows of a chunk C

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        """Bytes of one sequence's state over all GDN layers: conv state, fp32 boundary state and
        ``C - 1`` kept rows of k, v (model dtype), g (fp32) and beta (model dtype)."""
        (hk, hv), (dk, dv) = self.heads, self.dims
        size = torch.empty((), dtype=dtype).element_size()
        conv = (self.conv_kernel - 1) * self.conv_channels * size
        state = hv * dk * dv * 4
        rows = (self.chunk - 1) * ((hk * dk + hv * dv + hv) * size + hv * 4)
        return len(self.layers) * (conv + state + rows)


def linear_state_spec(model: torch.nn.Module, layers: range | None = None) -> LinearStateSpec | None:
    """The `LinearStateSpec` of an inference (or training) model's GDN layers, or None when it has
    none (or is no module); with `layers` (a pipeline stage's decoder layers), of those among them
    only. Raises ValueError when its GDN layers differ in shape (one pool serves them all)."""
    modules = model.modules() if isinstance(model, torch.nn.Module) else ()
    found = [m for m in modules if isinstance(m, GatedDeltaNet) and (layers is None or m.layer_idx in layers)]
    if not found:
        return None
    shapes = {((m.num_k_heads, m.num_v_heads), (m.head_k_dim, m.head_v_dim), m.conv_dim, m.conv_kernel_size,
               m.chunk_size) for m in found}
    if len(shapes) != 1:
        raise ValueError(f"linear_state_spec: the gated DeltaNet layers differ in shape {sorted(shapes)}; one state "
                         "pool needs one shape")
    heads, dims, channels, kernel, chunk = shapes.pop()
    return LinearStateSpec(tuple(sorted(m.layer_idx for m in found)), heads, dims, channels, kernel, chunk)


class LinearStateCache:
    """The GDN state of `slots` sequences for every GDN layer of `spec`, on `device`; conv state
    and kept k, v, beta rows in `dtype` (the model's), boundary states and kept g rows in fp32.
    Contents are undefined until a sequence's first step writes them (see the module docstring)."""

    def __init__(self, spec: LinearStateSpec, slots: int, device: torch.device, dtype: torch.dtype) -> None:
        if slots < 1:
            raise ValueError(f"LinearStateCache: slots={slots} must be >= 1")
        (hk, hv), (dk, dv) = spec.heads, spec.dims
        keep = spec.chunk - 1
        self.spec, self.slots = spec, slots
        empty = dict(device=device)
        self.conv = {i: torch.zeros(slots, spec.conv_kernel - 1, spec.conv_channels, dtype=dtype, **empty)
                     for i in spec.layers}
        self.states = {i: torch.zeros(slots, hv, dk, dv, dtype=torch.float32, **empty) for i in spec.layers}
        #: kept rows, slot s's at [s * (C - 1), (s + 1) * (C - 1)): k, v, g, beta
        self.rows = {i: (torch.zeros(slots * keep, hk, dk, dtype=dtype, **empty),
                         torch.zeros(slots * keep, hv, dv, dtype=dtype, **empty),
                         torch.zeros(slots * keep, hv, dtype=torch.float32, **empty),
                         torch.zeros(slots * keep, hv, dtype=dtype, **empty)) for i in spec.layers}

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy slot ``src[i]``'s state (conv state, boundary state, kept rows) into slot
        ``dst[i]`` in every GDN layer (int64 index tensors on the cache's device; `dst` distinct
        and disjoint from `src`): a sample taking its prompt's state from a sibling
        (`runtime.scheduler_siblings`). The copy is the data itself, so the slot continues
        bitwise as the source would."""
        keep = self.spec.chunk - 1
        offsets = torch.arange(keep, device=src.device)
        rows_src, rows_dst = ((s[:, None] * keep + offsets).reshape(-1) for s in (src, dst))
        for i in self.spec.layers:
            for pool, (a, b) in ((self.conv[i], (src, dst)), (self.states[i], (src, dst)),
                                 *((t, (rows_src, rows_dst)) for t in self.rows[i])):
                pool.index_copy_(0, b, pool.index_select(0, a))

    def zero_(self) -> None:
        """Overwrite every state with zeros, in place (after a step that wrote non-finite values)."""
        for tensors in (self.conv.values(), self.states.values(), (t for r in self.rows.values() for t in r)):
            for t in tensors:
                t.zero_()


class LinearStep:
    """One step's plan over the `cache`: sequence ``b`` adds ``counts[b]`` tokens from position
    ``starts[b]`` in slot ``slots[b]`` (host int arrays, in the step's order); `cu_seqlens` (int32,
    on the device) and `max_seqlen` as the step's layout has them."""

    def __init__(self, cache: LinearStateCache, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                 cu_seqlens: torch.Tensor, max_seqlen: int) -> None:
        slots, starts, counts = (np.asarray(x, np.int64) for x in (slots, starts, counts))
        if len(slots) and (slots.min() < 0 or slots.max() >= cache.slots):
            raise ValueError(f"LinearStep: slots {slots.tolist()} must lie in [0, {cache.slots}) (the cache's "
                             "slots: max_num_seqs)")
        if len(set(slots.tolist())) != len(slots):
            raise ValueError(f"LinearStep: slots {slots.tolist()} must be distinct")
        self.cache, self.cu_seqlens, self.max_seqlen = cache, cu_seqlens, max_seqlen
        device = cu_seqlens.device
        self.slot_index = torch.as_tensor(slots, dtype=torch.int32).to(device)
        self.context = torch.as_tensor(starts, dtype=torch.int32).to(device)
        self._plan(slots, starts, counts, device)

    def _plan(self, slots: np.ndarray, starts: np.ndarray, counts: np.ndarray, device: torch.device) -> None:
        """Index arrays shared by every GDN layer of the step (the module docstring's steps)."""
        c, keep = self.cache.spec.chunk, self.cache.spec.chunk - 1
        lead = starts % c
        total = lead + counts
        whole = total // c
        laid_at = np.concatenate([[0], np.cumsum(total)])
        kept_src, kept_dst, new_dst, first, index, keep_src, keep_dst = [], [], [], [], [], [], []
        cu_rows = [0]
        fold_start, fold_len, fold_index, fold_at, fold_slots = [], [], [], [], []
        folds = 0
        for b, (slot, start) in enumerate(zip(slots.tolist(), starts.tolist())):
            kept_src += range(slot * keep, slot * keep + int(lead[b]))
            kept_dst += range(int(laid_at[b]), int(laid_at[b]) + int(lead[b]))
            new_dst += range(int(laid_at[b]) + int(lead[b]), int(laid_at[b + 1]))
            boundary = -1 if start - lead[b] == 0 else slot  # the first chunk starts from zeros
            if whole[b]:
                fold_start.append(int(laid_at[b]))
                fold_len.append(int(whole[b]) * c)
                fold_index.append(boundary)
                fold_at.append(folds)
                fold_slots.append((slot, folds + int(whole[b]) - 1))
                folds += int(whole[b])
            for chunk in range(-(-int(total[b]) // c)):
                cu_rows.append(cu_rows[-1] + min(c, int(total[b]) - chunk * c))
                first.append(int(lead[b]) if chunk == 0 else 0)
                index.append(("pool", boundary) if chunk == 0 else ("fold", fold_at[-1] + chunk - 1))
            rest = int(total[b]) - int(whole[b]) * c
            keep_src += range(int(laid_at[b]) + int(whole[b]) * c, int(laid_at[b]) + int(total[b]))
            keep_dst += range(slot * keep, slot * keep + rest)
        long = dict(dtype=torch.long)
        self.rows_total = int(laid_at[-1])
        self.kept_src, self.kept_dst, self.new_dst = (torch.tensor(x, **long).to(device)
                                                      for x in (kept_src, kept_dst, new_dst))
        self.keep_src, self.keep_dst = (torch.tensor(x, **long).to(device) for x in (keep_src, keep_dst))
        self.cu_rows, self.first = cu_rows, first
        self.fold = (fold_start, fold_len, fold_index)
        self.folds = folds
        pools = sorted({i for kind, i in index if kind == "pool" and i >= 0})
        # without folds the rows read the pool itself; else its used states, then the folded ones
        self.pool_gather = None if not folds else torch.tensor(pools, **long).to(device)
        where = {s: (s if not folds else n) for n, s in enumerate(pools)}
        self.state_index = [(where[i] if i >= 0 else -1) if kind == "pool" else len(pools) + i for kind, i in index]
        self.fold_slots = (torch.tensor([s for s, _ in fold_slots], **long).to(device),
                           torch.tensor([f for _, f in fold_slots], **long).to(device))

    def conv(self, layer: int, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             activation: str | None = "silu") -> torch.Tensor:
        """`causal_conv1d` of the step's rows `x` reading and moving on layer `layer`'s conv states."""
        return causal_conv1d(x, weight, bias, self.cu_seqlens, self.max_seqlen, activation,
                             conv_state=self.cache.conv[layer], state_indices=self.slot_index, context_lens=self.context)

    def _lay_out(self, store: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
        """Each sequence's kept rows (from `store`) followed by its `new` rows, back to back."""
        laid = store.new_empty(self.rows_total, *store.shape[1:])
        laid.index_copy_(0, self.kept_dst, store.index_select(0, self.kept_src))
        return laid.index_copy_(0, self.new_dst, new.to(store.dtype))

    def delta_rule(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, *, scale: float | None = None, use_qk_l2norm: bool = True) -> torch.Tensor:
        """The outputs ``[T, Hv, dv]`` of the step's new rows (q, k ``[T, Hk, dk]``, v ``[T, Hv,
        dv]``, g, beta ``[T, Hv]``) for layer `layer`, bitwise `gated_delta_rule`'s; advances the
        layer's boundary states and kept rows."""
        cache, c = self.cache, self.cache.spec.chunk
        kept = cache.rows[layer]
        laid = [self._lay_out(store, new) for store, new in zip(kept, (k, v, g, beta))]
        pool = cache.states[layer]
        folded = None
        if self.folds:
            starts, lengths, index = self.fold
            folded = gated_delta_fold(*laid, starts, lengths, pool, index, use_qk_l2norm=use_qk_l2norm, chunk_size=c)
        states = pool if self.pool_gather is None else torch.cat([pool.index_select(0, self.pool_gather), folded])
        out = gated_delta_chunk_rows(q, *laid, self.cu_rows, self.first, states, self.state_index, scale=scale,
                                     use_qk_l2norm=use_qk_l2norm, chunk_size=c)
        if self.folds:
            pool.index_copy_(0, self.fold_slots[0], folded.index_select(0, self.fold_slots[1]))
        for store, rows in zip(kept, laid):
            store.index_copy_(0, self.keep_dst, rows.index_select(0, self.keep_src))
        return out
