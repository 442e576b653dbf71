"""HF-style inputs (padded with an attention mask, or packed with ``cu_seqlens``) as the one
forward's flat token batch (docs/design.md section 3): ``input_ids[T]``, ``positions[T]``, the
sequences' offsets, and the way back to the input's shape."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass
class FlatBatch:
    """HF-style input flattened to the one forward's token batch.

    ``index`` maps each flat token back to its place in the flattened ``input_ids``;
    ``cu_seqlens`` delimits the sequences.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    cu_seqlens: torch.Tensor
    max_seqlen: int
    index: torch.Tensor
    shape: torch.Size

    def to_padded(self, rows: torch.Tensor) -> torch.Tensor:
        """Per-token ``rows [T, ...]`` back in the input's shape ``[*shape, ...]``, zeros at padding.
        Not a view (copied into a tensor of that shape): a causal LM's logits are this, and FSDP2's
        pre-backward hook on a sharded module's output is lost to an in-place op on a view."""
        out = rows.new_zeros(*self.shape, *rows.shape[1:])
        out.view(-1, *rows.shape[1:]).index_copy_(0, self.index, rows)
        return out

    def kept(self, logits_to_keep: int | torch.Tensor) -> tuple[torch.Tensor | None, FlatBatch]:
        """HF's ``logits_to_keep`` on the flat batch: ``(tokens, kept)``, the flat tokens at the
        kept positions of each row (row order, repeated where the positions repeat; None for
        all) and a batch whose `to_padded` puts their rows in the shape ``[*shape[:-1], K]``,
        as HF's ``hidden_states[:, keep]``. `logits_to_keep`: 0 (every position), the last K
        positions (an int), or the K positions a 1-D integer tensor lists (negative from the
        end). A ValueError names a bad value and the row length."""
        length = self.shape[-1]
        if isinstance(logits_to_keep, torch.Tensor):
            if logits_to_keep.dim() != 1 or logits_to_keep.dtype.is_floating_point or logits_to_keep.dtype == torch.bool:
                raise ValueError(f"logits_to_keep must be an int or a 1-D integer tensor of positions, got a "
                                 f"{logits_to_keep.dtype} tensor of shape {tuple(logits_to_keep.shape)}")
            positions = logits_to_keep.to(self.index.device, torch.int64)
            if positions.numel():
                low, high = torch.stack([positions.min(), positions.max()]).tolist()  # one host sync
                if not -length <= low <= high < length:
                    raise ValueError(f"logits_to_keep lists positions outside [-{length}, {length}) (rows of {length})")
            positions = positions % max(length, 1)
        elif isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep={logits_to_keep!r} must be an int >= 0 (0 keeps every position) or a "
                             "1-D integer tensor of positions")
        elif logits_to_keep == 0 or logits_to_keep >= length:
            return None, self
        else:
            positions = torch.arange(length - logits_to_keep, length, device=self.index.device)
        token_at = torch.full((self.shape.numel(),), -1, dtype=torch.int64, device=self.index.device)
        token_at[self.index] = torch.arange(self.index.shape[0], device=self.index.device)  # -1: padding
        rows = self.shape.numel() // max(length, 1)
        grid = token_at.view(rows, length)[:, positions].reshape(-1)  # [rows * K] flat token or -1
        slots = (grid >= 0).nonzero().squeeze(1)
        return grid[slots], replace(self, index=slots, shape=torch.Size((*self.shape[:-1], positions.shape[0])))


def _packed_lengths(cu_seqlens, num_tokens: int, device: torch.device) -> torch.Tensor:
    """Sequence lengths from ``cu_seqlens``: a 1-D integer tensor (or list) running from 0 to
    `num_tokens`, never decreasing (equal neighbours: an empty sequence). One host sync."""
    cu = torch.as_tensor(cu_seqlens)
    if cu.dim() != 1 or cu.shape[0] < 2 or cu.dtype.is_floating_point or cu.dtype.is_complex or cu.dtype == torch.bool:
        raise ValueError(f"cu_seqlens must be a 1-D integer tensor of at least 2 offsets, got dtype {cu.dtype} "
                         f"and shape {tuple(cu.shape)}")
    offsets = cu.tolist()
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to the {num_tokens} tokens, got {offsets}")
    for i in range(1, len(offsets)):
        if offsets[i] < offsets[i - 1]:
            raise ValueError(f"cu_seqlens must be non-decreasing: cu_seqlens[{i}]={offsets[i]} is below "
                             f"cu_seqlens[{i - 1}]={offsets[i - 1]}")
    cu = cu.to(device=device, dtype=torch.int64)
    return cu[1:] - cu[:-1]


def flatten_inputs(input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   position_ids: torch.Tensor | None = None, cu_seqlens: torch.Tensor | None = None) -> FlatBatch:
    """Turn padded or packed HF input into sequences packed back to back.

    - ``attention_mask`` (``[B, L]``, 1 = token): each row's tokens form one sequence (left or
      right padding); positions count the row's tokens from 0 (as HF's ``generate`` numbers
      them) unless ``position_ids`` say otherwise (``[1, L]`` ones stand for every row, as stock
      broadcasts them).
    - ``cu_seqlens``: ``input_ids`` (``[T]`` or ``[1, T]``) already packed.
    - ``position_ids`` without a mask: a new sequence starts at every row and wherever the
      positions restart at 0 (HF's packed-sequence convention).
    - neither: each row is one sequence at positions 0..L-1.
    """
    shape = input_ids.shape
    ids = input_ids.reshape(-1)
    device = ids.device
    if input_ids.dim() not in (1, 2):
        raise ValueError(f"input_ids must be [batch, seq] or [tokens], got shape {tuple(shape)}")
    rows, length = (1, ids.shape[0]) if input_ids.dim() == 1 else shape
    if position_ids is not None and position_ids.dim() == 2 and position_ids.shape == (1, length) and rows > 1:
        position_ids = position_ids.expand(rows, length)  # one row for every row, as stock broadcasts it
    if attention_mask is not None:
        if cu_seqlens is not None:
            raise ValueError("pass either attention_mask (padded input) or cu_seqlens (packed input), not both")
        if attention_mask.shape != shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(shape)}")
        mask = attention_mask.reshape(rows, length).bool()
        index = mask.reshape(-1).nonzero().squeeze(1)
        lens = mask.sum(1)
        keep = lens > 0
        positions = (position_ids.reshape(-1)[index] if position_ids is not None
                     else (mask.cumsum(1) - 1).reshape(-1)[index])
        lens = lens[keep]
    else:
        index = torch.arange(ids.shape[0], device=device)
        if cu_seqlens is not None:
            lens = _packed_lengths(cu_seqlens, ids.shape[0], device)
        else:
            starts = torch.zeros(rows, length, dtype=torch.bool, device=device)
            starts[:, 0] = True
            if position_ids is not None:
                starts |= position_ids.reshape(rows, length) == 0
            start_idx = starts.reshape(-1).nonzero().squeeze(1)
            lens = torch.diff(torch.cat([start_idx, torch.tensor([ids.shape[0]], device=device)]))
        seq_of = torch.repeat_interleave(torch.arange(lens.shape[0], device=device), lens)
        first = torch.cumsum(lens, 0) - lens
        positions = (position_ids.reshape(-1) if position_ids is not None
                     else torch.arange(ids.shape[0], device=device) - first[seq_of])
    cu = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(lens, 0)
    max_seqlen = int(lens.max()) if lens.numel() else 0
    return FlatBatch(ids[index], positions.to(torch.int64), cu, max_seqlen, index, shape)


def check_tokens(input_ids: torch.Tensor | None, positions: torch.Tensor, vocab_size: int) -> int:
    """Clear errors for token ids or positions the model cannot take (one host sync); returns
    the number of positions the RoPE tables must cover (the largest position + 1)."""
    if positions.numel() == 0:
        return 0
    bounds = [positions.min(), positions.max()]
    if input_ids is not None:
        bounds += [input_ids.min(), input_ids.max()]
    lo_pos, hi_pos, *ids = torch.stack(bounds).tolist()  # one host sync
    if ids and (ids[0] < 0 or ids[1] >= vocab_size):
        bad = ids[0] if ids[0] < 0 else ids[1]
        raise ValueError(f"input_ids contains token id {bad}, outside the vocabulary [0, {vocab_size})")
    if lo_pos < 0:
        raise ValueError(f"position_ids contains {lo_pos}; positions must be >= 0")
    return hi_pos + 1
