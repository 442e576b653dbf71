"""The tile configs of the grouped MoE kernels (`moe.py`) and the rule that picks one per launch.

Every config gives bitwise the same rows (docs/design.md rule 4): the tiles, warps, stages, K
tile and TMA loads change where and when a row is computed, never the order of its additions.
Which config is fastest depends on the average rows per expert, a host-side shape (`pick_config`).
"""

from __future__ import annotations

from dataclasses import dataclass

BLOCK_K = 64  # the K tile of every config unless it names another


@dataclass(frozen=True)
class MoeConfig:
    """Tiles of the gate/up kernel (block_n, num_warps, num_stages, block_k) and of the down
    kernel (down_*); both share block_m, the expert segment padding. The K tile leaves a row's
    bits alone like the others: a dot over a K tile is a chain of 16-wide MMA steps into one fp32
    accumulator, so 64- and 128-wide tiles add the same products in the same order (checked on
    the GPU by `benchmarks/moe.py --decode`'s "same bits" and ``kernel_invariance --only moe``)."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    down_block_n: int
    down_num_warps: int
    down_num_stages: int
    block_k: int = BLOCK_K
    down_block_k: int = BLOCK_K
    tma: bool = False  # expert weights (and down's rows) through TMA tensor descriptors (Hopper)


def k_tile(block_k: int, k: int) -> int:
    """The K tile a launch runs: `block_k` where it divides `k`, else `BLOCK_K`. A wider tile over
    a ragged K would add extra masked zero products, and +0.0 added to a sum of exactly -0.0 turns
    it into +0.0, a bit the 64-wide tiles of training do not flip."""
    return block_k if k % block_k == 0 else BLOCK_K


# From `benchmarks/moe.py --sweep` on an H100 at 16384 tokens (2026-11-22): down has a
# short K (the expert intermediate size), so it wants a wide N tile. On the H200 (2026-11-27)
# TMA descriptors for the weights (and down's rows) took LARGE's gate/up 1883 -> 1811 us
# and down 987 -> 899 us (with 4 stages), the same bits; at decode sizes they gained <= 1%.
SMALL = MoeConfig(64, 64, 4, 3, 64, 4, 3)
LARGE = MoeConfig(128, 128, 8, 4, 256, 8, 4, tma=True)
# Decode batches, where an expert gets a few rows (`benchmarks/moe.py --decode` on the H200,
# 2026-11-27): 32-row blocks let more down-projection programs share an SM, 1.06-1.13x
# the 64-row tiles alone at 8-16 rows an expert; gate/up is as fast either way. In a decode step
# Qwen3-30B-A3B at 256 sequences (16 rows an expert) went 22.63 -> 21.84 ms; Moonlight at 256
# (24 rows) did not move, so it keeps the 64-row tiles there. 16-row blocks were faster alone
# at 6-12 rows (down 1.07x, gate/up 1.02x) but lost at 24, where experts span two blocks that each
# read the weights: they take the batches of at most 12 rows an expert (2026-11-27).
# Both take 128-wide K tiles (2026-11-27): fewer, larger loads per program, alone
# 1.02-1.07x on gate/up and 1.04-1.06x on down; decode steps of Qwen3-30B-A3B 1.03-1.04x at 128
# and 256 sequences, Moonlight 1.03x at 128. Moonlight's 24 rows an expert gained nothing in its
# step with them, so it keeps the 64-row tiles.
DECODE = MoeConfig(32, 64, 4, 3, 64, 4, 4, block_k=128, down_block_k=128)
FEW_ROWS = MoeConfig(16, 64, 4, 3, 128, 4, 3, block_k=128, down_block_k=128)


def pick_config(tokens: int, top_k: int, experts: int) -> MoeConfig:
    """Tiles by the average rows per expert (a host-side shape, no sync). Every config gives
    bitwise the same rows (conformance/kernel_invariance.py, "moe": one token vs 16384;
    `benchmarks/moe.py --decode`'s "same bits")."""
    pairs = tokens * top_k
    if pairs <= 12 * experts:
        return FEW_ROWS
    if pairs <= 16 * experts:
        return DECODE
    return LARGE if pairs >= 256 * experts else SMALL
