"""vexact_models.flat_batch: HF-style input as the one forward's flat token batch, and back."""

import torch

from vexact_models.flat_batch import flatten_inputs


def test_to_padded_puts_rows_back_with_zeros_at_padding_in_a_tensor_of_its_own():
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    flat = flatten_inputs(torch.tensor([[5, 6, 7], [8, 9, 4]]), attention_mask=mask)
    rows = torch.arange(8.0).reshape(4, 2)
    padded = flat.to_padded(rows)
    assert padded._base is None and padded.shape == (2, 3, 2)
    assert torch.equal(padded, torch.tensor([[[0, 0], [0, 1], [2, 3]], [[4, 5], [6, 7], [0, 0]]], dtype=torch.float32))


def test_kept_selects_the_tokens_at_the_kept_positions_of_each_row():
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    flat = flatten_inputs(torch.ones(2, 4, dtype=torch.long), attention_mask=mask)  # flat tokens 0-2, 3-5
    tokens, kept = flat.kept(2)
    assert tokens.tolist() == [1, 2, 5] and kept.shape == (2, 2)  # row 1's last position is padding
    rows = torch.arange(6.0)[:, None]
    assert kept.to_padded(rows[tokens]).squeeze(-1).tolist() == [[1, 2], [5, 0]]
    tokens, kept = flat.kept(torch.tensor([-1, 0, 0]))  # position 3 of row 1 is padding, as is 0 of row 0
    assert tokens.tolist() == [2, 3, 3] and kept.shape == (2, 3)
    assert kept.to_padded(rows[tokens]).squeeze(-1).tolist() == [[2, 0, 0], [0, 3, 3]]
    assert flat.kept(0) == (None, flat) and flat.kept(4) == (None, flat)
    packed = flatten_inputs(torch.arange(5), cu_seqlens=torch.tensor([0, 2, 5]))  # [T] ids: one row
    tokens, kept = packed.kept(2)
    assert tokens.tolist() == [3, 4] and kept.shape == (2,)


def test_positions_of_one_row_stand_for_every_row_as_stock_broadcasts_them():
    """Without ``position_ids`` a row's positions count its tokens from 0 (HF ``generate``'s
    numbering); ``position_ids`` of one row stand for every row, as stock broadcasts them."""
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 0, 1], [1, 1, 1, 0]])
    flat = flatten_inputs(torch.ones(3, 4, dtype=torch.long), attention_mask=mask)
    assert flat.positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    one_row = torch.tensor([[0, 1, 2, 3]])
    flat = flatten_inputs(torch.ones(3, 4, dtype=torch.long), attention_mask=mask, position_ids=one_row)
    assert flat.positions.tolist() == [1, 2, 3, 0, 1, 3, 0, 1, 2]
    flat = flatten_inputs(torch.ones(2, 4, dtype=torch.long), position_ids=one_row)
    assert flat.positions.tolist() == [0, 1, 2, 3] * 2 and flat.cu_seqlens.tolist() == [0, 4, 8]
