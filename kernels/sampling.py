"""sample_tokens: Gumbel-max sampling with a counter-based RNG, one row per request.

For row i: ``argmax_j (logits[i, j] / T_i + g(seed_i, step_i, j))`` over the tokens with
``logits[i, j] >= threshold_i``, where ``g = -log(-log(u))`` and ``u`` comes from Philox4x32-10
keyed by the request's seed: column j takes output word ``j % 4`` of counter ``(j // 4, step)``,
so one evaluation of the ten rounds serves four columns (the sampler is bound by that integer
arithmetic: one word per counter made it ~4x slower). Temperature 0 means greedy (argmax of the
logits, lowest index on ties). The threshold carries top-k/top-p filtering (`runtime.sampler`).
A block filter skips the exact scores (two correctly rounded logarithms per column) of blocks
that cannot beat the running best, and the random numbers of greedy rows' blocks: the same
tokens, 1.5-1.7x faster at 128-256 rows of 151,936 columns, 2.3-2.8x for greedy rows
(`benchmarks/sampler.py`, H200, 2026-11-26).

Invariance contract (docs/design.md rule 7): the token depends only on (logits row, seed, step,
temperature, threshold): no shared generator and no cross-row state, so the same request
samples the same token whatever else is in the batch. The logprob the sampler reports is not
computed here but by `gather_logprobs`, the kernel training calls.
"""

from __future__ import annotations

import torch

from . import exact_math
from ._triton import next_power_of_2, require_triton, tl, triton
from .backend import select
from .dependent_launch import dependent_launch_kwargs, wait_for_inputs

_BLOCK_V = 512  # the blocks the filter decides on (`_sample_kernel`): 1.5x the 2048 of before, 256 lost
#: blocks of `_BLOCK_V` columns per program: a row is split over several programs (a 151,936-token
#: vocabulary over 10), whose best scores a second launch compares. A maximum and the first column
#: that reaches it do not depend on the split, so neither does the token. One program per row left
#: a decode step's sampler at ~2 programs per SM (0.18-0.26 ms at batch 128-256 on the H200).
_CHUNK_BLOCKS = 32
Word = int | torch.Tensor  #: a Philox word: an int, or int64 tensors broadcast against the counters
_SAMPLE_ELEMENTS = 1 << 20  #: logits `sample_tokens_reference` scores at once (memory)
U_MAX = 1.0 - 2.0 ** -24  #: the largest uniform the sampler draws: the largest fp32 below 1 (`_philox_uniform`)
_U_MAX = tl.constexpr(U_MAX)
_PHILOX_ROUND_A = 0xD2511F53
_PHILOX_ROUND_B = 0xCD9E8D57
_PHILOX_KEY_A = 0x9E3779B9
_PHILOX_KEY_B = 0xBB67AE85
_MASK32 = 0xFFFFFFFF


@triton.jit
def _philox4(ctr, step_lo, step_hi, key0, key1):
    """The four 32-bit output words of Philox4x32-10 for counters (ctr, step_lo, step_hi, 0) under
    key (key0, key1)."""
    c0 = ctr.to(tl.uint32)
    c1 = (ctr * 0).to(tl.uint32) + step_lo
    c2 = (ctr * 0).to(tl.uint32) + step_hi
    c3 = (ctr * 0).to(tl.uint32)
    k0 = key0
    k1 = key1
    for _ in tl.static_range(10):
        prev0 = c0
        prev2 = c2
        c0 = tl.umulhi(prev2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.umulhi(prev0, 0xD2511F53) ^ c3 ^ k1
        c1 = prev2 * 0xCD9E8D57
        c3 = prev0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _philox_uniform(start, step_lo, step_hi, key0, key1, BLOCK: tl.constexpr):
    """Uniform (0, 1) floats for the `BLOCK` columns from `start` (a multiple of 4): column j is
    word ``j % 4`` of counter ``j // 4``."""
    w0, w1, w2, w3 = _philox4(start // 4 + tl.arange(0, BLOCK // 4), step_lo, step_hi, key0, key1)
    # join(join(w0, w2), join(w1, w3))[n, i, k] is word 2i + k of counter n: row-major, the columns' order
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (BLOCK,))
    # top 24 bits, centred in their interval; the top interval's centre, 1 - 2^-25, rounds to 1.0
    # in fp32 (whose noise would be +inf), so it is held at the largest float below 1
    return tl.minimum((words >> 8).to(tl.float32) * (1.0 / 16777216.0) + (0.5 / 16777216.0), _U_MAX)


#: above the largest noise ``-log(-log(u))`` a uniform of `_philox_uniform` can give (u <= 1 - 2^-24: 16.64)
_NOISE_MAX = tl.constexpr(17.34)


@triton.jit
def _margin(best):
    """How far below `best` a score may be computed to lie and still be kept by the filters:
    far above their fast exponentials' error and the scores' rounding (1e-3 plus 2^-12 of |best|)."""
    return 1e-3 + tl.abs(best) * (1.0 / 4096.0)


@triton.jit
def _may_beat(x, u, ok, best, inv_t):
    """Whether some column of a sampled block may score above `best`: a column with
    ``x/T - log(-log u) > best`` has ``u > exp(-exp(x/T - best))``, checked here with two fast
    exponentials against a threshold lowered by `_margin`, so every column that could win, or
    tie, passes. best = -inf makes the threshold 0: every column passes."""
    t = best - x * (1.0 / inv_t) - _margin(best)
    floor = tl.exp2(-1.4426950408889634 * tl.exp2(-1.4426950408889634 * t))
    return tl.max(((u >= floor) & ok).to(tl.int32), axis=0) > 0


@triton.jit
def _sample_kernel(logits_ptr, temp_ptr, seed_ptr, step_ptr, threshold_ptr, best_ptr, best_idx_ptr, V, stride,
                   n_chunks, BLOCK_V: tl.constexpr, CHUNK_BLOCKS: tl.constexpr, FILTER: tl.constexpr = True,
                   PDL: tl.constexpr = False):
    """Program (row, chunk): the best score and its first column over ``CHUNK_BLOCKS`` blocks of
    the row, written to slot ``row * n_chunks + chunk``.

    With `FILTER`, a block's exact scores (two correctly rounded logarithms per column, most of
    the arithmetic) are computed only where some column may beat the running best: not when even
    the block's best logit with the largest possible noise falls short (no random numbers drawn:
    greedy rows, and the far tail of a peaked row), nor when `_may_beat` finds no column whose
    uniform is high enough. A block without such a column cannot change (best, column): the
    comparison is strict, so no later tie takes. The tokens are the same either way."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temp_ptr + row)
    threshold = tl.load(threshold_ptr + row)
    seed = tl.load(seed_ptr + row)
    step = tl.load(step_ptr + row)
    key0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    key1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    step_lo = (step & 0xFFFFFFFF).to(tl.uint32)
    step_hi = ((step >> 32) & 0xFFFFFFFF).to(tl.uint32)
    greedy = temperature == 0.0
    inv_t = tl.where(greedy, 1.0, temperature)
    cols = tl.arange(0, BLOCK_V)
    best = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    first = chunk * CHUNK_BLOCKS * BLOCK_V
    for block in range(CHUNK_BLOCKS):
        start = first + block * BLOCK_V
        col = start + cols
        x = tl.load(logits_ptr + row * stride + col, mask=col < V, other=float("-inf")).to(tl.float32)
        ok = (x >= threshold) & (col < V)
        if FILTER:
            x_top = tl.max(tl.where(ok, x, float("-inf")), axis=0)
            reach = tl.where(greedy, x_top, x_top * (1.0 / inv_t) + _NOISE_MAX) + _margin(best)
            compute = reach > best
            u = tl.zeros((BLOCK_V,), tl.float32)  # greedy rows never read it: their score is x
            if compute & ~greedy:
                u = _philox_uniform(start, step_lo, step_hi, key0, key1, BLOCK_V)
                compute = _may_beat(x, u, ok, best, inv_t)
        else:
            compute = True
            u = _philox_uniform(start, step_lo, step_hi, key0, key1, BLOCK_V)
        if compute:
            noise = -tl.log(-tl.log(u))
            score = tl.where(greedy, x, x / inv_t + noise)
            score = tl.where(ok, score, float("-inf"))
            block_best = tl.max(score, axis=0)
            block_idx = start + tl.argmax(score, axis=0)
            take = block_best > best  # strict: an earlier block keeps a tie
            best_idx = tl.where(take, block_idx, best_idx)
            best = tl.where(take, block_best, best)
    tl.store(best_ptr + row * n_chunks + chunk, best)
    tl.store(best_idx_ptr + row * n_chunks + chunk, best_idx)


@triton.jit
def _sample_pick_kernel(best_ptr, best_idx_ptr, out_ptr, n_chunks, CHUNKS: tl.constexpr, PDL: tl.constexpr = False):
    """Per row: the column of the best chunk, the first chunk among equal bests (so the first
    column of the row's maximum, as one pass over the row would find it)."""
    wait_for_inputs(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNKS)
    ok = offs < n_chunks
    best = tl.load(best_ptr + row * n_chunks + offs, mask=ok, other=float("-inf"))
    idx = tl.load(best_idx_ptr + row * n_chunks + offs, mask=ok, other=0)
    top = tl.max(best, axis=0)
    chunk = tl.min(tl.where(ok & (best == top), offs, CHUNKS), axis=0)
    tl.store(out_ptr + row, tl.sum(tl.where(offs == chunk, idx, 0), axis=0).to(tl.int64))


def _mulhi_lo(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * b for uint32 values held in int64 (no int64 overflow)."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    t_lo = a_lo * b
    t_hi = a_hi * b
    high = (t_hi + (t_lo >> 16)) >> 16
    low = (((t_hi & 0xFFFF) << 16) + t_lo) & _MASK32
    return high & _MASK32, low


def philox4x32_reference(counters: torch.Tensor, counter_words: tuple[Word, Word, Word],
                         key: tuple[Word, Word]) -> torch.Tensor:
    """``[4, *shape]`` output words (int64 holding uint32) of Philox4x32-10, in plain torch, for the
    counters ``(counters[i], *counter_words)`` under the two key words `key`. A word may be an int
    or an int64 tensor broadcast against `counters` (one per row, say); ``shape`` is theirs."""
    c0 = counters.to(torch.int64) & _MASK32
    c1, c2, c3 = (w & _MASK32 for w in counter_words)
    k0, k1 = key[0] & _MASK32, key[1] & _MASK32
    for _ in range(10):
        hi_b, lo_b = _mulhi_lo(c2, _PHILOX_ROUND_B)
        hi_a, lo_a = _mulhi_lo(c0, _PHILOX_ROUND_A)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_A) & _MASK32, (k1 + _PHILOX_KEY_B) & _MASK32
    return torch.stack(torch.broadcast_tensors(c0, c1, c2, c3))  # (tensors all from the second round on)


def philox_uniform_reference(cols: torch.Tensor, step: Word, seed: Word) -> torch.Tensor:
    """The kernel's uniforms in plain torch, float32: column j is word ``j % 4`` of counter
    ``(j // 4, step low word, step high word, 0)`` under the key ``(seed low, seed high)``; its
    top 24 bits k give ``(k + 1/2) / 2^24``, rounded to fp32, at most 1 - 2^-24 (k = 2^24 - 1
    would round to 1.0, whose noise ``-log(-log(1))`` is +inf: that column would win whatever its
    logit, in about 1% of the steps over a 152k vocabulary). `step` and `seed` may be int64
    tensors broadcast against `cols` (``[rows, 1]``: a row each, ``[rows, n]`` out)."""
    cols = cols.to(torch.int64)
    words = philox4x32_reference(cols // 4, (step, step >> 32, 0), (seed, seed >> 32))
    words = words.gather(0, (cols % 4).expand(words.shape[1:])[None])[0]
    u = (words >> 8).to(torch.float32) * (1.0 / 16777216.0) + (0.5 / 16777216.0)
    return torch.clamp(u, max=U_MAX)


def sample_tokens_reference(logits, temperatures, seeds, steps, thresholds) -> torch.Tensor:
    """`sample_tokens` in plain torch on the CPU: per row the first column of the highest
    ``x / T + gumbel(u)`` (``x`` for a greedy row, T = 0) among logits at or above its threshold,
    with the kernel's uniforms and `exact_math`'s logarithms (element-wise: a row's token does
    not depend on the others), rows taken `_SAMPLE_ELEMENTS` logits at a time."""
    n_rows, vocab = logits.shape
    out = torch.empty(n_rows, dtype=torch.int64)
    cols = torch.arange(vocab)
    step_rows = max(1, _SAMPLE_ELEMENTS // max(vocab, 1))
    for r0 in range(0, n_rows, step_rows):
        rows = slice(r0, r0 + step_rows)
        x = logits[rows].float()
        t = temperatures[rows].float()[:, None]
        u = philox_uniform_reference(cols, steps[rows].to(torch.int64)[:, None], seeds[rows].to(torch.int64)[:, None])
        score = torch.where(t == 0.0, x, x / t - exact_math.log(-exact_math.log(u)))
        score = score.masked_fill(x < thresholds[rows].float()[:, None], float("-inf"))
        out[rows] = torch.argmax(score, dim=1)  # first index of each row's maximum
    return out


def filter_thresholds(logits: torch.Tensor, temperatures: torch.Tensor, top_k: torch.Tensor,
                      top_p: torch.Tensor, rows: torch.Tensor | None = None,
                      log_min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row lowest admissible logit for min-p, then top-k, then top-p filtering (``[rows]`` fp32).

    min-p keeps the logits ``x >= max(x) + T * log(min_p)`` (the tokens at least ``min_p`` times
    as probable as the most probable one; `log_min_p` fp32 ``[rows]``, ``-inf``: off; None when
    no row uses it, which skips its pass over the rows);
    top-k keeps the k largest of those (ties at the k-th value are kept); top-p then keeps the
    smallest set of those, by decreasing probability under ``softmax(logits / T)``, whose mass
    reaches ``top_p``. ``top_k <= 0`` and ``top_p >= 1`` disable each filter; greedy rows
    (T = 0) are not filtered. Row-wise ops only (max, sort, cumsum, the invariant `log_softmax`),
    so a row's threshold does not depend on the batch.

    `rows`: the indices (int64, on the logits' device) of the rows that filter, when the caller
    knows them (the sampler does, from the host's parameters); otherwise they are found on the
    device, which waits for it (``nonzero``). Rows outside `rows` get ``-inf`` (no filter).
    """
    from .log_softmax import log_softmax

    n_rows, vocab = logits.shape
    thresholds = torch.full((n_rows,), float("-inf"), device=logits.device)
    idx = rows
    if idx is None:
        active = (top_k > 0) | (top_p < 1) | (False if log_min_p is None else log_min_p > float("-inf"))
        idx = (active & (temperatures > 0)).nonzero().squeeze(1)  # empty when no row filters: no-ops below
    x = logits[idx].float()
    min_p_floor = None
    if log_min_p is not None:
        # (an off row: max + T * -inf = -inf, which keeps every logit; rounded mul, then add, alike on every device)
        min_p_floor = x.max(dim=1).values + temperatures[idx].float() * log_min_p[idx].float()
        x = torch.where(x >= min_p_floor[:, None], x, float("-inf"))
    k = torch.where(top_k[idx] > 0, top_k[idx].clamp(max=vocab), torch.full_like(top_k[idx], vocab)).long()
    sorted_x, _ = torch.sort(x, dim=1, descending=True)
    kth = sorted_x.gather(1, (k - 1)[:, None])[:, 0]
    x = torch.where(x >= kth[:, None], x, float("-inf"))  # a Python scalar: no host->device copy (a sync)
    logp = log_softmax(x, temperatures[idx])
    exp = exact_math.exp if logp.device.type == "cpu" else torch.exp  # CPU torch.exp is not position-invariant
    probs_sorted, order = torch.sort(exp(logp), dim=1, descending=True)
    before = torch.cumsum(probs_sorted, dim=1) - probs_sorted  # mass strictly before each token
    n_keep = (before < top_p[idx, None].float()).sum(1).clamp(min=1)
    last = order.gather(1, (n_keep - 1)[:, None])[:, 0]
    threshold = torch.maximum(kth, x.gather(1, last[:, None])[:, 0])
    thresholds[idx] = threshold if min_p_floor is None else torch.maximum(threshold, min_p_floor)
    return thresholds


def sample_tokens(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                  thresholds: torch.Tensor | None = None) -> torch.Tensor:
    """Sample one token per row of ``[rows, vocab]`` logits.

    Args:
        logits: ``[rows, vocab]`` (fp32 from the LM head).
        temperatures: ``[rows]`` fp32, 0 = greedy.
        seeds: ``[rows]`` int64 request seeds.
        steps: ``[rows]`` int64 counters (the index of the token being generated).
        thresholds: ``[rows]`` fp32 lowest admissible logit (top-k/top-p); None = no filter.
    Returns: ``[rows]`` int64 token ids.
    """
    if logits.dim() != 2:
        raise ValueError(f"sample_tokens: logits must be [rows, vocab], got {tuple(logits.shape)}")
    rows = logits.shape[0]
    if thresholds is None:
        thresholds = torch.full((rows,), float("-inf"), device=logits.device)
    if select("sample_tokens", logits) == "reference":
        return sample_tokens_reference(logits, temperatures, seeds, steps, thresholds)
    return sample_tokens_triton(logits, temperatures, seeds, steps, thresholds)


def sample_tokens_triton(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor, steps: torch.Tensor,
                         thresholds: torch.Tensor, filter_blocks: bool = True, block_v: int = _BLOCK_V) -> torch.Tensor:
    """`sample_tokens` by the Triton kernels. `filter_blocks=False` computes every column's exact
    score instead of only those of blocks that may beat the running best (`_may_beat`); `block_v`
    (a power of two dividing ``_BLOCK_V * _CHUNK_BLOCKS``, the columns of one program) sets the
    blocks the filter decides on. The same tokens for every choice: for `benchmarks/sampler.py`
    and the tests to compare."""
    require_triton("sample_tokens")
    chunk_columns = _BLOCK_V * _CHUNK_BLOCKS
    if block_v < 16 or block_v & (block_v - 1) or chunk_columns % block_v:
        raise ValueError(f"sample_tokens_triton: block_v={block_v} must be a power of two >= 16 dividing "
                         f"the {chunk_columns} columns of a program")
    rows = logits.shape[0]
    out = torch.empty(rows, device=logits.device, dtype=torch.int64)
    if rows:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        vocab = logits.shape[1]
        n_chunks = triton.cdiv(vocab, chunk_columns)
        best = torch.empty(rows, n_chunks, device=logits.device, dtype=torch.float32)
        best_idx = torch.empty(rows, n_chunks, device=logits.device, dtype=torch.int32)
        _sample_kernel[(rows, n_chunks)](logits, temperatures.float().contiguous(), seeds.to(torch.int64).contiguous(),
                                         steps.to(torch.int64).contiguous(), thresholds.float().contiguous(), best,
                                         best_idx, vocab, logits.stride(0), n_chunks, BLOCK_V=block_v,
                                         CHUNK_BLOCKS=chunk_columns // block_v, FILTER=filter_blocks, num_warps=4,
                                         **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
        _sample_pick_kernel[(rows,)](best, best_idx, out, n_chunks, CHUNKS=next_power_of_2(n_chunks), num_warps=1,
                                     **dependent_launch_kwargs(logits.device), enable_fp_fusion=True)
    return out
