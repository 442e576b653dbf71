"""The attention forward's launch parameters (`attention.py`): the key block that fixes the
reduction order (docs/design.md rule 2), and the tiles, warps and stages that follow a launch's
shape without changing a bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK_M = 64  # query rows (token, head) per program of prefill chunks (decode: 16, training: 128; `pick_config`)
DECODE_BLOCK_M = 16
BLOCK_N = 64  # keys per block: the absolute-position alignment of the KV reduction
NUM_STAGES = 2
# Query/key head dims (the value head dim is one of these too). 192 is MLA's 128 nope + 64 rope
# dims: the kernel pads a head dim to the next power of two with masked (zero) lanes, which add
# exact zeros to every dot product. 256 is Qwen3-Next's and Qwen3.5's gated attention.
HEAD_DIMS = (64, 128, 192, 256)
VALUE_HEAD_DIMS = (64, 128, 256)
# Head dims whose K/V blocks may come by TMA (packed training K/V, decode pages): the ones measured
# on the H200 (`attention.kv_descriptors_fit`); 256 keeps the pointer loads (the same bits, rule 2).
TMA_HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class AttentionConfig:
    """Launch parameters of the forward. ``block_n`` is the key block, the absolute-position
    alignment of the KV reduction (rule 2: always `BLOCK_N`; the field lets GPU sweeps try
    others). Rows per program, warps and stages may follow the launch's shape (`pick_config`):
    they move work between programs, not a row's arithmetic; `conformance/kernel_invariance.py`
    ("attention configs") checks on the GPU that every candidate gives bitwise the same output.
    ``heads_fastest`` orders the programs with a sequence's KV heads next to each other instead
    of one KV head's sequences: the order in which blocks are read, not what a program computes."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    heads_fastest: bool = False


def pick_config(head_dim: int, rows_per_seq: int, dtype: torch.dtype, programs: int = 0,
                sm_count: int = 0, deep_pipeline: bool = False, page_descriptors: bool = False) -> AttentionConfig:
    """The launch parameters for a head dim and dtype, for a launch whose longest sequence has
    `rows_per_seq` (query token, head) rows. Chosen by `benchmarks/attention_configs.py` on the
    H200 (figures in docs/performance.md); every choice gives the same bits (the module docstring). Decode
    (<= 16 rows per sequence: one token times a GQA group) takes 16-row tiles: three stages at
    head dim <= 128 (1.5x the 64-row tiles), 2 warps on Hopper (rather than four since the paged
    addressing became a shift and 32-bit offsets, 1.0-2.0% less attention time in decode steps of
    Qwen3-0.6B and 8B at 128-256 sequences, 2026-11-28), 2 warps and one stage at MLA's
    192 (1.5x, 64-74%); prefill chunks of <= 64 rows take
    64-row tiles with 4 warps (one stage for the 256-wide padded tile of head dim 192); training
    and longer prefill take 128-row tiles with two stages, 4 warps at head dim <= 128 (1.2-1.3x
    the 8-warp tile with pointer loads and with TMA; a 64-row, three-stage tile was up to 11%
    faster with TMA at <= 8k tokens and 1.3x slower with pointer loads) and 8 at 192 (2.1x).
    A decode launch of at most two (sequence, KV head) `programs` per SM (of `sm_count`) takes four
    warps and five stages where `deep_pipeline` says the GPU's shared memory holds them (Hopper):
    with that few programs the loads must overlap within one, 1.13-1.16x at 32 sequences of
    Qwen3-8B over 1k-8k tokens (2026-11-24), while more programs hide the latency among
    themselves and five stages cost them 1.1-1.3x. Where such a launch reads whole key blocks by
    TMA from pages of 64 (`page_descriptors`, `attention.page_descriptors_fit`), three stages give
    the copies two buffers: 1.16-1.20x the five-stage pointer loads at 32 sequences of 1k-8k tokens
    (2026-11-26). Launches of more programs keep pointer loads: TMA pages lost at 3-8
    programs per SM (0.87-0.99x) and, with the shift-and-mask addressing, at 15 (0.97x) and tied at
    31 (2026-11-28). Decode
    programs run a sequence's KV heads side by side (``heads_fastest``), which read neighbouring
    bytes of each cache row: 0-2% faster at 128-256 sequences of 544 tokens and 32-128 of 4-8k
    (2026-11-26), never slower beyond noise.
    fp32: a padded 256-wide fp32 K tile does not fit two stages in shared memory. Head dim 256
    (Qwen3.5, Qwen3-Next; not timed yet) takes the tiles that compile for sm_90 without spills
    (`benchmarks/sm90_compile.py`, `tests/test_kernel_resources.py`): 64-row training and prefill
    tiles of 8 warps and two stages (233 registers, 161 KB; 4 warps spill, and a 128 x 256 fp32
    accumulator does not stay in registers) and 16-row decode tiles of 4 warps and two stages
    (159 registers; the 192's 2-warp tile spills ~1 KB)."""
    wide = head_dim > 128
    if dtype == torch.float32:
        return AttentionConfig(BLOCK_M, BLOCK_N, 8 if wide else 4, 1 if wide else NUM_STAGES)
    if head_dim > 192:
        if rows_per_seq <= DECODE_BLOCK_M:
            return AttentionConfig(DECODE_BLOCK_M, BLOCK_N, 4, NUM_STAGES, heads_fastest=True)
        return AttentionConfig(BLOCK_M, BLOCK_N, 8, NUM_STAGES)
    if rows_per_seq <= DECODE_BLOCK_M:
        if wide:
            return AttentionConfig(DECODE_BLOCK_M, BLOCK_N, 2, 1)
        if few_decode_programs(programs, sm_count, deep_pipeline):
            return AttentionConfig(DECODE_BLOCK_M, BLOCK_N, 4, 3 if page_descriptors else 5, heads_fastest=True)
        # two warps where the GPU has Hopper's shared memory (`deep_pipeline`; measured on the
        # H200); smaller GPUs keep the four that were tuned on them
        return AttentionConfig(DECODE_BLOCK_M, BLOCK_N, 2 if deep_pipeline else 4, 3, heads_fastest=True)
    if rows_per_seq <= BLOCK_M:
        return AttentionConfig(BLOCK_M, BLOCK_N, 4, 1 if wide else NUM_STAGES)
    return AttentionConfig(2 * BLOCK_M, BLOCK_N, 8 if wide else 4, NUM_STAGES)


def few_decode_programs(programs: int, sm_count: int, deep_pipeline: bool) -> bool:
    """Whether a decode launch of `programs` (sequence, KV head) tiles has at most two per SM of a
    GPU whose shared memory holds a deep pipeline (Hopper): each program must then overlap its
    own loads, which pointer loads do at five stages and TMA page copies at three (`pick_config`)."""
    return deep_pipeline and 0 < programs <= 2 * sm_count


def split_mask(config: AttentionConfig) -> bool:
    """Whether the unmasked key blocks get a loop of their own (`_attention_fwd_kernel`): for
    training and prefill tiles. Decode tiles keep one masked loop: on the H200 the second
    pipelined loop cost decode steps over 1-2k-token contexts ~15% (2026-11-24); the bits are
    the same either way (`_attend_block`)."""
    return config.block_m > DECODE_BLOCK_M
