"""The KV cache of HF's ``generate`` on our causal LMs (`vexact_models.generation`).

HF's loop drives our models without a cache of its own (``use_cache=False``): each step's forward
gets the whole sequence so far. Inside ``generate`` the forward keeps a `GenerateCache` instead:
the inference variant's paged KV cache (docs/design.md rule 6), one run of pages per batch row,
and a gated-DeltaNet state per row (`runtime.linear_state_cache`). A step whose input continues
the previous step's (the same ids, or embeddings, and the same mask in the columns before; new
columns after) runs only the new columns' tokens through the paged forward, at the positions the
whole sequence gives them, and returns each row's last-column logits: the bits the whole
recompute gives, since a token's K/V and attention output do not depend on how its sequence was
cut into steps (rules 2 and 6; what the conformance suite proves of every rollout). Any other
input (a first step, rows reordered by a beam search, a prompt changed between calls) starts the
cache over with a prefill of the whole input, and a forward it cannot serve (labels, hidden
states, every position's logits) is the whole recompute, after which it starts over.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from vexact_models.flat_batch import check_tokens
from vexact_models.kernels import PagedLayout
from vexact_models.layers import PagedContext

from .linear_state_cache import LinearStateCache, LinearStep, linear_state_spec
from .llm_args import default_block_size
from .model_runner import kv_pair
from .staging import to_device
from .step_inputs import attention_order

__all__ = ["GenerateCache"]


@dataclass
class _StepRows:
    """A step's rows on the host: the rows with new tokens (`active`, in row order), each flat
    token's row (`owner`) and position, the rows' offsets in the flat batch (`cu`), and per batch
    row its cached tokens (`starts`), new tokens (`counts`) and whether its last column is a token
    (`sampling`)."""

    starts: np.ndarray
    counts: np.ndarray
    sampling: np.ndarray
    active: np.ndarray
    owner: np.ndarray
    positions: np.ndarray
    cu: np.ndarray

    @classmethod
    def of(cls, starts: np.ndarray, counts: np.ndarray, sampling: np.ndarray) -> _StepRows:
        active = np.flatnonzero(counts)
        cu = np.zeros(len(active) + 1, np.int64)
        np.cumsum(counts[active], out=cu[1:])
        owner = np.repeat(active, counts[active])
        positions = starts[owner] + np.arange(len(owner)) - np.repeat(cu[:-1], counts[active])
        return cls(starts, counts, sampling, active, owner, positions, cu)


class GenerateCache:
    """The paged KV cache (and gated-DeltaNet states) of one ``generate`` call on `causal_lm`.

    Row ``r`` of the batch owns pages ``r * pages_per_row .. (r + 1) * pages_per_row - 1``; its
    ``lengths[r]`` tokens are cached. The pages grow (doubling, the cached rows copied) as the
    rows do. `tokens_run` counts the tokens its steps have run, prefills included."""

    def __init__(self, causal_lm: nn.Module) -> None:
        self.causal_lm = causal_lm
        self.spec = causal_lm.kv_cache_spec()
        self.linear_spec = linear_state_spec(causal_lm)
        self.block_size = default_block_size(self.spec)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None] = []
        self.linear_states: LinearStateCache | None = None
        self.rows = 0
        self.pages_per_row = 0
        self.lengths = np.zeros(0, np.int64)
        self._where: tuple[torch.device, torch.dtype] | None = None
        self._previous: tuple[torch.Tensor, torch.Tensor] | None = None  # the last step's (input, mask)
        self.tokens_run = 0

    def forget(self) -> None:
        """Start over at the next step (a forward this cache did not serve ran in between)."""
        self._previous = None

    def logits(self, input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor | None,
               attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """fp32 logits ``[batch, 1, vocab]`` of each row's last column (zeros where it is padding),
        as the forward with ``logits_to_keep=1`` returns them, running only what the previous step
        did not; None (and `forget`) for an input the cache does not take: not ``[batch, length]``
        ids or ``[batch, length, hidden]`` embeddings with a mask of their shape, or
        ``position_ids`` other than each row's count of real tokens before (the whole recompute
        honours them). Bad ids raise before anything changes (`flat_batch.check_tokens`)."""
        given = inputs_embeds if inputs_embeds is not None else input_ids
        if given is None or given.dim() != (2 if inputs_embeds is None else 3):
            return self.forget()
        rows, length = given.shape[:2]
        mask = torch.ones(rows, length, dtype=torch.long, device=given.device) if attention_mask is None \
            else attention_mask
        if tuple(mask.shape) != (rows, length):
            return self.forget()
        where = (given.device, self.causal_lm.model.embed_tokens.weight.dtype)  # the K/V's device and dtype
        first = self._continues(given, mask, where)
        new = mask[:, first:].bool()
        # one copy to the host: each row's new tokens, and whether its last column is one (samples)
        counts, sampling = torch.stack([new.sum(1), new[:, -1:].sum(1)]).cpu().numpy().astype(np.int64)
        starts = self.lengths.copy() if first else np.zeros(rows, np.int64)
        step = _StepRows.of(starts, counts, sampling.astype(bool))
        flat_positions = torch.from_numpy(step.positions).to(given.device)
        if position_ids is not None and not self._positions_agree(position_ids, first, new, flat_positions):
            return self.forget()
        tokens = given[:, first:][new]
        ids = tokens if inputs_embeds is None else torch.zeros(len(tokens), dtype=torch.long, device=given.device)
        self.causal_lm.model.rope.ensure(check_tokens(ids if inputs_embeds is None else None, flat_positions,
                                                      self.causal_lm.config.vocab_size))
        self._previous = None  # until the step has run
        out = self._run(rows, step, ids, None if inputs_embeds is None else tokens, flat_positions, where)
        self.lengths = starts + counts
        self._previous = (given, mask)
        return out

    def _continues(self, given: torch.Tensor, mask: torch.Tensor, where: tuple[torch.device, torch.dtype]) -> int:
        """The column where `given`'s new part starts: the previous step's length when `given` and
        `mask` are its input and mask with columns added and the pages hold K/V of `where`'s device
        and dtype, else 0 (a prefill of everything)."""
        if self._previous is None or self._where != where:
            return 0
        before, before_mask = self._previous
        known = before.shape[1]
        if before.shape[0] != given.shape[0] or before.shape[2:] != given.shape[2:] or known >= given.shape[1] \
                or before.dtype != given.dtype or before.device != given.device:
            return 0
        same = (given[:, :known] == before).all() & (mask[:, :known] == before_mask).all()
        return known if bool(same) else 0  # (one host sync for both)

    @staticmethod
    def _positions_agree(position_ids: torch.Tensor, first: int, new: torch.Tensor, positions: torch.Tensor) -> bool:
        """Whether ``position_ids`` give the new real tokens the positions the cache would."""
        if position_ids.dim() != 2 or tuple(position_ids.shape) != (new.shape[0], first + new.shape[1]):
            return False
        return torch.equal(position_ids[:, first:][new].to(torch.int64), positions)

    @torch.no_grad()
    def _run(self, rows: int, step: _StepRows, ids: torch.Tensor, embeds: torch.Tensor | None,
             positions: torch.Tensor, where: tuple[torch.device, torch.dtype]) -> torch.Tensor:
        """The paged forward of `step`'s tokens at `positions` (on the device) over pages of
        `where`'s device and dtype; the logits `logits` returns."""
        head = self.causal_lm.lm_head_weight()
        out = torch.zeros(rows, 1, head.shape[0], dtype=torch.float32, device=positions.device)
        if not len(step.active):
            return out
        base = self.causal_lm.model
        active, counts = step.active, step.counts[step.active]
        lens = step.starts[active] + counts
        self._reserve(rows, int(lens.max()), *where)
        width = -(-int(lens.max()) // self.block_size)
        table = (active[:, None] * self.pages_per_row + np.arange(width)[None, :]).astype(np.int32)
        slots = step.owner * self.pages_per_row * self.block_size + step.positions
        cu_dev, lens_dev, table_dev, order_dev, slots_dev = to_device(
            [step.cu.astype(np.int32), lens.astype(np.int32), table, attention_order(counts, lens), slots],
            positions.device)
        max_q = int(counts.max())
        layout = PagedLayout(cu_dev, lens_dev, table_dev, self.block_size, max_q, order_dev)
        linear = None if self.linear_states is None else LinearStep(self.linear_states, active, step.starts[active],
                                                                    counts, cu_dev, max_q)
        hidden = base.forward_flat(ids, positions, PagedContext(layout, slots_dev, self.kv_caches, linear),
                                   inputs_embeds=embeds)
        self.tokens_run += len(ids)
        last = np.flatnonzero(step.sampling[active])
        if len(last):
            picked = torch.from_numpy(step.cu[1:][last] - 1).to(positions.device)
            out[torch.from_numpy(active[last]).to(positions.device), 0] = self.causal_lm.final_logits(hidden[picked])
        return out

    def _reserve(self, rows: int, tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        """Pages for `rows` rows of `tokens` tokens each: kept when they fit, else grown (at least
        doubled, the cached rows copied into their new runs), or made anew for another batch,
        device or dtype."""
        pages = -(-tokens // self.block_size)
        keep = rows == self.rows and self._where == (device, dtype) and self.kv_caches
        if keep and pages <= self.pages_per_row:
            return
        per_row = max(pages, 2 * self.pages_per_row) if keep else pages
        layers, kv_heads, head_dim_k, head_dim_v = self.spec
        value_in_key = getattr(self.spec, "value_in_key", False)
        gdn = set(() if self.linear_spec is None else self.linear_spec.layers)
        shape = (rows * per_row, self.block_size, kv_heads)
        caches = [None if i in gdn else kv_pair(shape, head_dim_k, head_dim_v, value_in_key, device, dtype)
                  for i in range(layers)]
        if keep:
            for old, grown in zip(self.kv_caches, caches):
                if old is not None:
                    for a, b in zip(old, grown[:1] if value_in_key else grown):
                        b.view(rows, per_row, *b.shape[1:])[:, :self.pages_per_row] = \
                            a.view(rows, self.pages_per_row, *a.shape[1:])
        else:
            self.linear_states = None if self.linear_spec is None else LinearStateCache(self.linear_spec, rows, device,
                                                                                       dtype)
            self.lengths = np.zeros(rows, np.int64)
            self._previous = None
        self.kv_caches, self.rows, self.pages_per_row, self._where = caches, rows, per_row, (device, dtype)
