"""The fixed-order row sum of the attention kernels' softmax denominators, and the tile choices
it makes possible (16-row decode tiles that give the training tiles' bits, docs/design.md rule 2).
The Triton helper itself is checked against `row_sum_reference` by
tests/triton_checks/check_row_sum.py (interpreter in CI, bitwise over tile shapes on a GPU)."""

import pytest
import torch

from vexact_models.kernels.attention import AttentionConfig
from vexact_models.kernels.attention import pick_config as attention_pick_config
from vexact_models.kernels.latent_attention import LatentConfig, key_block
from vexact_models.kernels.latent_attention import pick_config as latent_pick_config
from vexact_models.kernels.row_sum import lane_sums, row_sum_levels, row_sum_reference


def test_row_sum_reference_adds_halves_in_order():
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])
    # (1+5, 2+6, 3+7, 4+8) -> (6+10, 8+12) -> 16+20
    assert row_sum_reference(x).tolist() == [36.0]
    # the order shows in fp32: halves give (1e8 - 1e8) + (1 + 1) = 2, left to right ((1e8 + 1) - 1e8) + 1 = 1
    y = torch.tensor([[1e8, 1.0, -1e8, 1.0]])
    assert row_sum_reference(y).item() == 2.0
    assert ((y[0, 0] + y[0, 1]) + y[0, 2] + y[0, 3]).item() == 1.0


def test_row_sum_reference_matches_float64_sum():
    x = torch.randn(37, 64, dtype=torch.float64)
    assert torch.allclose(row_sum_reference(x), x.sum(-1), rtol=1e-12)
    assert row_sum_reference(torch.ones(3, 1)).tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("width", [0, 3, 48])
def test_row_sum_levels_rejects_widths_that_are_not_powers_of_two(width):
    with pytest.raises(ValueError, match=f"width={width} must be a power of two"):
        row_sum_levels(width)


def test_row_sum_levels():
    assert [row_sum_levels(w) for w in (1, 2, 16, 64)] == [0, 1, 4, 6]


def test_lane_sums_only_where_each_row_lives_in_one_warp():
    # wgmma tiles: 16 rows or more per warp; decode's 16-row tiles and the 8-warp latent tile split rows
    assert lane_sums(128, 4) and lane_sums(64, 4) and lane_sums(128, 8) and lane_sums(16, 1)
    assert not lane_sums(16, 4) and not lane_sums(32, 4) and not lane_sums(64, 8)


def test_gqa_decode_takes_16_row_tiles_and_training_128():
    bf16 = torch.bfloat16
    assert attention_pick_config(128, 4, bf16) == AttentionConfig(16, 64, 4, 3, heads_fastest=True)  # Qwen3-8B decode
    assert attention_pick_config(128, 4, bf16, 128 * 8, 132, True) == AttentionConfig(16, 64, 2, 3, heads_fastest=True)
    assert attention_pick_config(192, 1, bf16) == AttentionConfig(16, 64, 2, 1)  # MLA expanded decode
    assert attention_pick_config(128, 40, bf16) == AttentionConfig(64, 64, 4, 2)
    assert attention_pick_config(128, 8192, bf16) == AttentionConfig(128, 64, 4, 2)  # training, D <= 128
    assert attention_pick_config(192, 8192, bf16) == AttentionConfig(128, 64, 8, 2)  # training, MLA expanded
    assert attention_pick_config(128, 4, torch.float32).block_m == 64


def test_latent_decode_takes_16_row_tiles_with_warps_by_program_count():
    bf16, blk = torch.bfloat16, key_block(torch.bfloat16)
    assert latent_pick_config(bf16, 16, 256, 132) == LatentConfig(16, blk, 4, 2)  # Moonlight, 256 sequences
    assert latent_pick_config(bf16, 16, 64, 132) == LatentConfig(16, blk, 8, 2)  # fewer programs than SMs
    assert latent_pick_config(bf16, 128, 16, 132) == LatentConfig(16, blk, 8, 2)  # DeepSeek-V3: 8 tiles x 16
    assert latent_pick_config(bf16, 129, 1, 132) == LatentConfig(64, blk, 8, 2)  # prefill and training
    assert latent_pick_config(torch.float32, 16, 1, 132) == LatentConfig(16, key_block(torch.float32), 4, 1)
    # whole key blocks by TMA: 8 warps, three stages (two TMA buffers); with at most a quarter as
    # many programs as SMs (a rollout's last sequences) the value dims split over four 4-warp
    # programs each (tests/kernels/test_latent_attention.py proves them bitwise on a GPU)
    for rows, seqs in ((16, 256), (16, 34), (128, 16), (128, 5)):
        assert latent_pick_config(bf16, rows, seqs, 132, kv_descriptors=True) == LatentConfig(16, blk, 8, 3)
    for rows, seqs in ((16, 33), (16, 1), (128, 4)):  # 33 x 4 <= 132; DeepSeek-V3: 8 tiles a sequence
        assert latent_pick_config(bf16, rows, seqs, 132, kv_descriptors=True) == LatentConfig(16, blk, 4, 3, 4)
    assert latent_pick_config(torch.float32, 16, 8, 132, kv_descriptors=True).value_chunks == 1
    assert latent_pick_config(bf16, 129, 1, 132, kv_descriptors=True) == LatentConfig(64, blk, 8, 2)
