"""log_softmax over rows of logits at a temperature, and its gather at target tokens.

``log_softmax(logits / T)`` in fp32, where T is a per-row temperature. `gather_logprobs` returns
``log_softmax(logits / T)[row, target]`` without writing the row: it is the op that both the
sampler (the logprob reported for a sampled token) and training (`token_logprobs`) call, which
is what makes those two numbers bitwise equal (docs/design.md rule 7).

Invariance contract: a row is cut into chunks of `CHUNK_COLUMNS` columns, one program each
(`_lse_partial_kernel`). A chunk is scanned in blocks of `BLOCK_V` columns with a per-lane
running max/sum (`_lse_update`), and its lanes are combined into one (max, sum) pair in a fixed
order (`_combine`: the max, then `row_sum_halves`, whose order is the lanes' logical positions,
not the register layout); a second launch combines the chunks' pairs the same way and gathers or
writes the row, a chunk per program (`_logprob_kernel`). The cut depends on the vocabulary size alone, so a row's bits
do not depend on the batch (rule 3), and how a launch schedules the chunks (warps, the sums'
lowering) does not change them either. One program per row had read a decode step's 128 rows of
logits at a third of the copy bandwidth (H200, 2026-11-27). The same kernels compute the full
row and the gathered entry, with the same ``x / T - lse`` expression, so
``log_softmax(x, T)[i, t] == gather_logprobs(x, t, T)[i]`` bitwise. The reference uses `exact_math`
(its own exp/log and block reduction).
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs
from .row_sum import row_sum_halves, row_sum_levels

# From a sweep on the H200 (`benchmarks/kernel_peers.py --sweep-log-softmax`, 2026-11-27): lanes of 512-2048, chunks
# of 16,384 or 32,768 columns, 4 or 8 warps, one chunk or a whole row per program. Per chunk one
# program of 4 warps is the fastest up to 1,024 rows (a decode step's 128 rows: 53 -> 28 us);
# at 4,096 rows (training) it is 13% slower than one program per row.
BLOCK_V = 1024  #: lanes of the running max/sum: the columns of one block of a chunk
CHUNK_COLUMNS = 16 * BLOCK_V  #: columns of one program (a 151,936-token vocabulary: 10 chunks)
_NUM_WARPS = 4


@triton.jit
def _lse_update(m_lane, s_lane, x):
    """One block of a chunk into the per-lane running (max, sum of exp(x - max)) pairs."""
    m_new = tl.maximum(m_lane, x)
    alive = m_new != float("-inf")
    s_lane = tl.where(alive, s_lane * tl.exp(m_lane - m_new) + tl.exp(x - m_new), 0.0)
    return m_new, s_lane


@triton.jit
def _combine(m_part, s_part, LEVELS: tl.constexpr):
    """(max, sum) of ``[2**LEVELS]`` (max, sum) pairs (a chunk's lanes, or a row's chunks padded
    with max -inf), the sums added in `row_sum_halves`'s fixed order; pairs of max -inf add nothing."""
    m = tl.max(m_part, axis=0)
    terms = tl.where(m_part != float("-inf"), s_part * tl.exp(m_part - m), 0.0)
    # (the lane-sum lowering: the same bits as the split one, 1.06-1.18x faster at 4 warps)
    s = row_sum_halves(tl.reshape(terms, (1, terms.shape[0])), LEVELS, True)
    return m, tl.sum(s, axis=0)  # (a sum over one element: the value itself)


@triton.jit
def _lse_partial_kernel(x_ptr, temp_ptr, m_ptr, s_ptr, V, stride_x, n_chunks, BLOCK_V: tl.constexpr,
                        CHUNK_BLOCKS: tl.constexpr, LEVELS: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, chunk): the chunk's (max, sum) pair of ``x / T``, at slot ``row * n_chunks + chunk``."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    x_row = x_ptr + row * stride_x
    cols = tl.arange(0, BLOCK_V)
    m_lane = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s_lane = tl.zeros((BLOCK_V,), tl.float32)
    first = chunk * CHUNK_BLOCKS * BLOCK_V
    for block in range(CHUNK_BLOCKS):
        col = first + block * BLOCK_V + cols
        x = tl.load(x_row + col, mask=col < V, other=float("-inf")).to(tl.float32)
        m_lane, s_lane = _lse_update(m_lane, s_lane, x / temperature)
    m, s = _combine(m_lane, s_lane, LEVELS)
    tl.store(m_ptr + row * n_chunks + chunk, m)
    tl.store(s_ptr + row * n_chunks + chunk, s)


@triton.jit
def _logprob_kernel(x_ptr, temp_ptr, target_ptr, m_ptr, s_ptr, out_ptr, logprob_ptr, lse_ptr, V, stride_x,
                    stride_out, n_chunks, WRITE_ROW: tl.constexpr, GATHER: tl.constexpr, CHUNKS: tl.constexpr,
                    CHUNK_LEVELS: tl.constexpr, BLOCK_V: tl.constexpr, CHUNK_BLOCKS: tl.constexpr,
                    TARGETS: tl.constexpr = 1, TARGET_SLOTS: tl.constexpr = 1, PDL: tl.constexpr = False):
    """Program (row, part): the row's logsumexp from its chunks' pairs (each program the same
    numbers); part 0 stores it and ``x[target] / T - lse`` for each of the row's `TARGETS`
    targets (the same expression for one or several; `TARGET_SLOTS`: TARGETS rounded up to a
    power of 2); with `WRITE_ROW` each part writes one
    chunk of the row (the grid has a part per chunk), so a few rows still spread over the SMs."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    offs = tl.arange(0, CHUNKS)
    ok = offs < n_chunks
    m_chunk = tl.load(m_ptr + row * n_chunks + offs, mask=ok, other=float("-inf"))
    s_chunk = tl.load(s_ptr + row * n_chunks + offs, mask=ok, other=0.0)
    m, s = _combine(m_chunk, s_chunk, CHUNK_LEVELS)
    lse = m + tl.log(s)
    temperature = tl.load(temp_ptr + row)
    x_row = x_ptr + row * stride_x
    if part == 0:
        tl.store(lse_ptr + row, lse)
        if GATHER:
            if TARGETS == 1:
                target = tl.load(target_ptr + row)
                x_t = tl.load(x_row + target).to(tl.float32) / temperature
                tl.store(logprob_ptr + row, x_t - lse)
            else:
                slots = tl.arange(0, TARGET_SLOTS)
                used = slots < TARGETS
                targets = tl.load(target_ptr + row * TARGETS + slots, mask=used, other=0)
                x_t = tl.load(x_row + targets, mask=used, other=0.0).to(tl.float32) / temperature
                tl.store(logprob_ptr + row * TARGETS + slots, x_t - lse, mask=used)
    if WRITE_ROW:
        cols = tl.arange(0, BLOCK_V)
        out_row = out_ptr + row * stride_out
        first = part * CHUNK_BLOCKS * BLOCK_V
        for block in range(CHUNK_BLOCKS):
            col = first + block * BLOCK_V + cols
            mask = col < V
            x = tl.load(x_row + col, mask=mask, other=0.0).to(tl.float32) / temperature
            tl.store(out_row + col, x - lse, mask=mask)


def _temperatures(temperature: float | torch.Tensor, rows: int, device: torch.device) -> torch.Tensor:
    """A per-row fp32 temperature tensor (one code path for scalar and per-row temperatures)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.shape != (rows,):
            raise ValueError(f"temperature tensor must have shape ({rows},), got {tuple(temperature.shape)}")
        t = temperature.to(device=device, dtype=torch.float32)
    else:
        t = torch.full((rows,), float(temperature), device=device, dtype=torch.float32)
    if rows and device.type == "cpu" and bool((t <= 0).any()):
        raise ValueError(f"temperature must be > 0 for log-probabilities (use 1.0 for greedy), got {t.min().item()}")
    return t


def _launch(logits, temps, targets, write_row):
    require_triton("log_softmax")
    rows, vocab = logits.shape
    lse = torch.empty(rows, device=logits.device, dtype=torch.float32)
    logprobs = torch.empty(targets.shape, device=logits.device, dtype=torch.float32) if targets is not None else lse
    per_row = targets.shape[1] if targets is not None and targets.dim() == 2 else 1
    out = torch.empty((rows, vocab), device=logits.device, dtype=torch.float32) if write_row else lse
    if rows:
        n_chunks = max(triton.cdiv(vocab, CHUNK_COLUMNS), 1)  # (an empty row: one chunk of nothing, lse -inf)
        m_chunk = torch.empty(rows, n_chunks, device=logits.device, dtype=torch.float32)
        s_chunk = torch.empty_like(m_chunk)
        chunk_blocks = CHUNK_COLUMNS // BLOCK_V  # (read at launch: benchmarks/kernel_peers.py sweeps both)
        _lse_partial_kernel[(rows, n_chunks)](
            logits, temps, m_chunk, s_chunk, vocab, logits.stride(0), n_chunks, BLOCK_V=BLOCK_V,
            CHUNK_BLOCKS=chunk_blocks, LEVELS=row_sum_levels(BLOCK_V), num_warps=_NUM_WARPS,
            **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
        chunks = next_power_of_2(n_chunks)
        _logprob_kernel[(rows, n_chunks if write_row else 1)](
            logits, temps, targets if targets is not None else temps, m_chunk, s_chunk, out, logprobs, lse, vocab,
            logits.stride(0), out.stride(0) if write_row else 0, n_chunks, WRITE_ROW=write_row,
            GATHER=targets is not None, CHUNKS=chunks, CHUNK_LEVELS=row_sum_levels(chunks), BLOCK_V=BLOCK_V,
            CHUNK_BLOCKS=chunk_blocks, TARGETS=per_row, TARGET_SLOTS=next_power_of_2(per_row),
            num_warps=_NUM_WARPS if write_row else 1, **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
    return out, logprobs, lse


def _scaled(logits: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    compute = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return logits.to(compute) / temps.to(compute)[:, None]


def log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)`` over the last dim of ``[rows, vocab]`` logits, fp32.

    `temperature` is a positive float or a ``[rows]`` tensor. Not differentiable (training
    uses `token_logprobs`).
    """
    logits = _rows(logits)
    temps = _temperatures(temperature, logits.shape[0], logits.device)
    if select("log_softmax", logits) == "triton":
        return _launch(logits, temps, None, True)[0]
    x = _scaled(logits, temps)
    return x - exact_math.logsumexp(x)[:, None]


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0,
                    return_lse: bool = False):
    """``log_softmax(logits / temperature)[row, targets[row]]`` for each row, fp32 ``[rows]``;
    for ``[rows, k]`` targets (k tokens of each row, e.g. a sampled token and its most probable
    alternatives) the ``[rows, k]`` entries.

    Bitwise equal to indexing `log_softmax`, so an entry does not depend on how many targets its
    row has nor on which column it is in. With ``return_lse`` also returns the row
    ``logsumexp(logits / temperature)`` ``[rows]``.
    """
    logits = _rows(logits)
    if targets.dim() not in (1, 2) or targets.shape[0] != logits.shape[0] or targets.dim() == 2 and not targets.shape[1]:
        raise ValueError(f"gather_logprobs: targets must have shape ({logits.shape[0]},) or ({logits.shape[0]}, k) "
                         f"with k >= 1, got {tuple(targets.shape)}")
    temps = _temperatures(temperature, logits.shape[0], logits.device)
    if select("log_softmax", logits) == "triton":
        _, logprobs, lse = _launch(logits, temps, targets.to(torch.int64).contiguous(), False)
    else:
        x = _scaled(logits, temps)
        lse = exact_math.logsumexp(x)
        columns = targets.long() if targets.dim() == 2 else targets.long()[:, None]
        logprobs = x.gather(1, columns) - lse[:, None]
        logprobs = logprobs if targets.dim() == 2 else logprobs[:, 0]
    return (logprobs, lse) if return_lse else logprobs


def _rows(logits: torch.Tensor) -> torch.Tensor:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    return logits if logits.stride(-1) == 1 else logits.contiguous()
