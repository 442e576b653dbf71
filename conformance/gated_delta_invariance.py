"""The gated delta rule's invariance on a GPU (docs/design.md section 6b), for `kernel_invariance`.

- chunk rows: a chunk's rows computed from its first ``n`` rows, for every ``n`` of 1..C and every
  first output row ``p`` of 0..n-1 (all ``n`` splits in one launch, the chunk repeated beside
  itself), equal the rows of the whole chunk;
- fold: a run of chunks folded in one launch, beside other sequences, equals the same chunks
  folded one launch each, in place;
- rollout: sequences rolled out as an engine does (`GatedDeltaRollout`: prefill pieces cut on and
  off chunk boundaries, then single tokens, several sequences a step) equal the packed training
  forward token for token;
- decode: every row ``i`` of a chunk decoded (`gated_delta_decode`) from the rows of ``T`` a rows
  launch of its first ``p`` rows kept (every ``p <= i``, then the decodes of rows ``p..i-1``)
  equals the whole chunk's row, and its fold at the last row the fold launch's state;
- engine: the same rollouts through the engine's state cache (`LinearStateCache` steps: decodes by
  the decode launch, prefill pieces keeping their rows of ``T``, a sibling's slot copied mid-chunk)
  equal the packed training forward token for token.

At the GDN head layouts of the published hybrids (``linear_num_key_heads``,
``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``), bf16 inputs.
"""

from __future__ import annotations

import random

import torch

import numpy as np

from vexact_models.kernels.gated_delta_decode import DecodePlan, launch_decode
from vexact_models.kernels.gated_delta_launch import RowsPlan, Shapes, launch_rows
from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.kernels.gated_delta_rule import gated_delta_chunk_rows, gated_delta_fold, gated_delta_rule
from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStateSpec, LinearStep

#: (name, Hk, Hv, dk, dv): Qwen3.5-35B-A3B, Qwen3.5's default text config and Qwen3-Next-80B-A3B
#: share one layout; a GQA-free one checks the other head mapping
GDN_SHAPES = [("qwen3.5 / qwen3-next", 16, 32, 128, 128), ("equal heads", 4, 4, 128, 128)]


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the reference backend's bits in fp32

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen).to(device) * 0.5 - 0.001
    beta = torch.rand(t, hv, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def check_chunk_rows(result, hk: int, hv: int, dk: int, dv: int, chunk: int = 64, device: str = "cuda") -> None:
    """Every row count and first row of one chunk against the whole chunk."""

    gen = torch.Generator().manual_seed(hv * dk)
    q, k, v, g, beta = _inputs(chunk, hk, hv, dk, dv, gen, device)
    states = torch.randn(1, hv, dk, dv, generator=gen).to(device) * 0.1
    whole = gated_delta_chunk_rows(q, k, v, g, beta, [0, chunk], [0], states, [0], chunk_size=chunk)
    for n in range(1, chunk + 1):
        rows = torch.arange(n, device=device).repeat(n)  # the chunk's first n rows, n times
        q_rows = torch.cat([torch.arange(p, n, device=device) for p in range(n)])
        got = gated_delta_chunk_rows(q[q_rows], k[rows], v[rows], g[rows], beta[rows], [n * i for i in range(n + 1)],
                                     list(range(n)), states, [0] * n, chunk_size=chunk)
        result.compare(got, whole[q_rows], f"Hv={hv} rows 0..{n - 1}, every first row")


def check_fold(result, hk: int, hv: int, dk: int, dv: int, chunk: int = 64, device: str = "cuda") -> None:
    """Eight chunks folded one launch each, in place, against one run beside two others."""

    gen = torch.Generator().manual_seed(hv + dk)
    lengths = [8 * chunk, 3 * chunk, 5 * chunk]
    q, k, v, g, beta = _inputs(sum(lengths), hk, hv, dk, dv, gen, device)
    states = torch.randn(3, hv, dk, dv, generator=gen).to(device) * 0.1
    starts = [0, lengths[0], lengths[0] + lengths[1]]
    together = gated_delta_fold(k, v, g, beta, starts, lengths, states, [0, 1, 2], chunk_size=chunk)
    pool = states.clone()
    for c in range(8):
        gated_delta_fold(k, v, g, beta, [c * chunk], [chunk], pool, [0], out=pool, out_index=[0], chunk_size=chunk)
        result.compare(pool[0], together[c], f"Hv={hv} chunk {c} folded alone")


def _pieces(lengths: list[int], decode: int, chunk: int, rng: random.Random) -> list[list[int]]:
    """Per sequence the tokens it adds a step: prefill pieces on and off chunk boundaries, then its
    last `decode` tokens one a step."""
    pieces = []
    for n in lengths:
        prefill, left = [], max(n - decode, 0)
        while left:
            m = min(left, rng.choice([1, 7, chunk - 1, chunk, chunk + 1, 3 * chunk + 5, 11 * chunk - 4]))
            prefill.append(m)
            left -= m
        pieces.append(prefill + [1] * (n - sum(prefill)))
    return pieces


def check_rollout(result, hk: int, hv: int, dk: int, dv: int, max_len: int, decode: int, chunk: int = 64,
                  device: str = "cuda") -> None:
    """Seven sequences (five of random lengths up to `max_len`, one of a chunk, one of a token)
    rolled out (their last `decode` tokens one a step) against the training forward."""

    rng = random.Random(hv * 7 + dk)
    gen = torch.Generator().manual_seed(hv * 3 + dk)
    lengths = [rng.randint(1, max_len) for _ in range(5)] + [chunk, 1]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    inputs = _inputs(offsets[-1], hk, hv, dk, dv, gen, device)
    state = torch.randn(len(lengths), hv, dk, dv, generator=gen).to(device) * 0.1
    want, _ = gated_delta_rule(*inputs, offsets, initial_state=state, chunk_size=chunk)
    pieces = _pieces(lengths, decode, chunk, rng)
    roll = GatedDeltaRollout(len(lengths), (hk, hv), (dk, dv), chunk_size=chunk, device=device, initial_state=state)
    got, done = torch.zeros_like(want), [0] * len(lengths)
    for step in range(max(len(p) for p in pieces)):
        slots = [s for s in range(len(lengths)) if step < len(pieces[s])]
        rng.shuffle(slots)
        counts = [pieces[s][step] for s in slots]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(slots, counts)])
        rows = rows.to(device)
        got[rows] = roll.step(*(x[rows] for x in inputs), slots, counts)
        for s, m in zip(slots, counts):
            done[s] += m
    result.compare(got, want, f"Hv={hv} rollout of lengths {lengths} == training")


def check_decode(result, hk: int, hv: int, dk: int, dv: int, chunk: int = 64, device: str = "cuda") -> None:
    """Slot ``p`` holds the chunk's first ``p`` rows by a rows launch (keeping their rows of ``T``);
    row ``i`` is then decoded in every slot ``p <= i`` (one decode launch a row): each == the whole
    chunk's row ``i``, and the slots' boundary states are still the chunk's (a decode only reads
    them; the fold launch folds a completed chunk, `check_fold`)."""
    gen = torch.Generator().manual_seed(hv * dv + 1)
    q, k, v, g, beta = _inputs(chunk, hk, hv, dk, dv, gen, device)
    states = torch.randn(1, hv, dk, dv, generator=gen).to(device) * 0.1
    whole = gated_delta_chunk_rows(q, k, v, g, beta, [0, chunk], [0], states, [0], chunk_size=chunk)
    shapes, scale = Shapes(hk, hv, dk, dv), dk ** -0.5
    backend = "triton" if device == "cuda" else "reference"
    rows = torch.arange(chunk, device=device).repeat(chunk)  # slot p's rows at [p * C, (p + 1) * C)
    q, k, v, g, beta = (x[rows] for x in (q, k, v, g, beta))
    pool_t = torch.full((chunk * chunk, hv, chunk), float("nan"), device=device)  # never read before written
    pool_states = states.repeat(chunk, 1, 1, 1)
    base = [p * chunk for p in range(1, chunk)]
    out = torch.empty(chunk * chunk, hv, dv, dtype=q.dtype, device=device)
    launch_rows(backend, q, k, v, g, beta, pool_states, out, RowsPlan(base, list(range(1, chunk)), [0] * (chunk - 1),
                                                                      base, list(range(1, chunk)), base), shapes, chunk,
                scale, True, t_cache=pool_t)
    for i in range(chunk):
        slots = list(range(i + 1))
        at = [p * chunk for p in slots]
        launch_decode(backend, q, k, v, g, beta, pool_t, pool_states, out,
                      DecodePlan(at, [i] * len(at), [a + i for a in at], slots, at), shapes, chunk, scale, True)
        result.compare(out[[a + i for a in at]], whole[i].expand(len(at), -1, -1), f"Hv={hv} row {i} decoded")
    result.compare(pool_states, states.expand_as(pool_states), f"Hv={hv} boundary states after the decodes")


def check_engine_rollout(result, hk: int, hv: int, dk: int, dv: int, max_len: int, decode: int, chunk: int = 64,
                         device: str = "cuda") -> None:
    """Six sequences through `LinearStateCache` steps (random prefill pieces, then their last
    `decode` tokens one a step, several sequences a step in a shuffled order), a seventh the
    sibling of the first (its slot copied mid-chunk, then its own tokens): == the training forward."""
    rng = random.Random(hv * 11 + dk)
    gen = torch.Generator().manual_seed(hv * 5 + dk)
    lengths = [rng.randint(1, max_len) for _ in range(4)] + [chunk, 1, 0]
    share = min(lengths[0], chunk // 2 + 5)
    lengths[6] = share + decode + 3
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    inputs = list(_inputs(int(offsets[-1]), hk, hv, dk, dv, gen, device))
    for x in inputs:  # the sibling shares its leader's first `share` rows
        x[offsets[6]:offsets[6] + share] = x[:share]
    want, _ = gated_delta_rule(*inputs, offsets.tolist(), chunk_size=chunk)
    pieces = _pieces(lengths[:6], decode, chunk, rng)
    pieces[0] = [share] + [1] * (lengths[0] - share)  # the leader stops at the share point after its first step
    spec = LinearStateSpec((0,), (hk, hv), (dk, dv), 1, 2, chunk)
    cache = LinearStateCache(spec, 8, torch.device(device), inputs[1].dtype)
    got, done = torch.zeros_like(want), [0] * 7
    step = 0
    while done != lengths:
        if step == 1:  # the sibling takes the leader's state (slot 0) into slot 6
            cache.copy_slots(torch.tensor([0], device=device), torch.tensor([6], device=device))
            got[offsets[6]:offsets[6] + share], done[6] = got[:share], share
        seqs = [s for s in range(6) if step < len(pieces[s])] + ([6] if step and done[6] < lengths[6] else [])
        rng.shuffle(seqs)
        counts = [pieces[s][step] if s < 6 else 1 for s in seqs]
        rows = torch.cat([torch.arange(offsets[s] + done[s], offsets[s] + done[s] + m) for s, m in zip(seqs, counts)])
        rows = rows.to(device)
        cu = torch.tensor([0, *np.cumsum(counts).tolist()], dtype=torch.int32, device=device)
        plan = LinearStep(cache, np.array(seqs), np.array([done[s] for s in seqs]), np.array(counts), cu, max(counts))
        got[rows] = plan.delta_rule(0, *(x[rows] for x in inputs))
        for s, m in zip(seqs, counts):
            done[s] += m
        step += 1
    result.compare(got, want, f"Hv={hv} engine rollout of lengths {lengths} == training")


def run_gated_delta(results: dict, quick: bool) -> None:
    """Every check above at every shape of `GDN_SHAPES` (`results` keyed by "gated_delta rows",
    "gated_delta fold", "gated_delta rollout", "gated_delta decode" and "gated_delta engine")."""
    for name, hk, hv, dk, dv in GDN_SHAPES:
        check_chunk_rows(results["gated_delta rows"], hk, hv, dk, dv)
        check_fold(results["gated_delta fold"], hk, hv, dk, dv)
        check_rollout(results["gated_delta rollout"], hk, hv, dk, dv, 1200 if quick else 4000, 40 if quick else 130)
        check_decode(results["gated_delta decode"], hk, hv, dk, dv)
        check_engine_rollout(results["gated_delta engine"], hk, hv, dk, dv, 1200 if quick else 4000,
                             40 if quick else 130)
        print(f"{name}: {sum(results[k].mismatches for k in results if k.startswith('gated_delta'))} gated_delta "
              "mismatches so far", flush=True)
