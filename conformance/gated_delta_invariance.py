"""The gated delta rule's invariance on a GPU (docs/design.md section 6b), for `kernel_invariance`.

Training and rollout share one recurrent kernel (`kernels.gated_delta_recurrent`): a token's
output and the state after it depend only on its sequence's state before the segment and on the
tokens so far, bitwise, whatever else shares the launch, how the sequence is cut into steps and
where its segment sits. The checks, each with ``torch.equal`` and zero mismatches allowed:

- batch: sequences of 0 to `max_len` tokens trained in one launch (`gated_delta_rule`, with and
  without initial states) against each sequence alone, the batch reversed, random subsets in
  shuffled orders, and every sequence twice in one launch: outputs and final states;
- rollout: the same kind of batch rolled out as an engine does (`GatedDeltaRollout`: prefill
  pieces of many sizes, then single-token decodes, several sequences a step in a shuffled order,
  in scattered slots, a finished sequence riding along with no tokens now and then) against the
  training forward: outputs, final states, and mid-rollout the states against a training forward
  of the prefixes;
- engine: rollouts through the engine's state cache (`LinearStateCache` steps from plans padded
  to bucket capacities in `LinearStepBuffers`, padding rows NaN, slots scattered and stale
  (NaN), a sequence preempted and re-prefilled from position 0 in another slot, a sibling that
  takes its leader's state by `copy_slots`): before every step a dry run
  (`kernels.gated_delta_step.dry_run`) leaves every slot's state as it was and gives the step's
  outputs; on CUDA the steps replay CUDA graphs captured per bucket (after the dry run's
  warm-up, as the engine captures). Outputs and final states equal the training forward.

At the GDN head layouts of the published hybrids (``linear_num_key_heads``,
``linear_num_value_heads``, ``linear_key_head_dim``, ``linear_value_head_dim``), bf16 inputs (the
CPU tests run the same checks on the reference backend at tiny shapes, fp32 inputs).
"""

from __future__ import annotations

import random

import numpy as np
import torch

from vexact_models.kernels.gated_delta_rollout import GatedDeltaRollout
from vexact_models.kernels.gated_delta_rule import gated_delta_rule
from vexact_models.runtime.linear_state_cache import LinearStateCache, LinearStateSpec, LinearStep, LinearStepBuffers

#: (name, Hk, Hv, dk, dv): Qwen3.5-35B-A3B, Qwen3.5's default text config and Qwen3-Next-80B-A3B
#: share one layout; a GQA-free one checks the other head mapping
GDN_SHAPES = [("qwen3.5 / qwen3-next", 16, 32, 128, 128), ("equal heads", 4, 4, 128, 128)]
#: the `Result`s `run_gated_delta` fills (`kernel_invariance` makes one of each)
GDN_CHECKS = ("gated_delta batch", "gated_delta rollout", "gated_delta engine")
#: prefill piece sizes a rollout draws from (capped at what a sequence has left)
PIECES = (1, 2, 3, 15, 16, 17, 63, 64, 65, 127, 200, 511, 1000, 2049)


def _inputs(t: int, hk: int, hv: int, dk: int, dv: int, gen: torch.Generator, device: str):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the reference backend's bits in fp32

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device, dtype)

    q, k, v = rand(t, hk, dk), rand(t, hk, dk), rand(t, hv, dv)
    g = -torch.rand(t, hv, generator=gen).to(device) * 0.5 - 0.001
    beta = torch.rand(t, hv, generator=gen).to(device, dtype)
    return q, k, v, g, beta


def _offsets(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _rows(offsets: list[int], seqs: list[int], first: list[int], counts: list[int], device: str) -> torch.Tensor:
    """The packed rows of ``counts[i]`` tokens of sequence ``seqs[i]`` from its token ``first[i]``."""
    parts = [torch.arange(offsets[s] + f, offsets[s] + f + m) for s, f, m in zip(seqs, first, counts)]
    return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)


def _bits(x: torch.Tensor) -> torch.Tensor:
    """`x`'s elements as integers of their width: equal where the bits are (NaN included)."""
    return x.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()])


def _lengths(rng: random.Random, max_len: int, count: int) -> list[int]:
    """`count` random lengths up to `max_len`, then one of `max_len`, 65, 64 and 1 tokens."""
    return [rng.randint(1, max_len) for _ in range(count)] + [max_len, 65, 64, 1]


def _pieces(n: int, decode: int, rng: random.Random) -> list[int]:
    """The tokens a sequence of `n` adds a step: prefill pieces of `PIECES` sizes, then its last
    `decode` tokens one a step."""
    prefill, left = [], max(n - decode, 0)
    while left:
        m = min(left, rng.choice(PIECES))
        prefill.append(m)
        left -= m
    return prefill + [1] * (n - sum(prefill))


def check_batch(result, hk: int, hv: int, dk: int, dv: int, max_len: int, device: str = "cuda") -> None:
    """Sequences of 0..`max_len` tokens trained in one launch == each alone, the batch reversed,
    three random subsets in shuffled orders, every sequence twice (outputs and final states), from
    zeros and from initial states."""
    rng = random.Random(hv * 13 + dk)
    gen = torch.Generator().manual_seed(hv * 17 + dk)
    lengths = _lengths(rng, max_len, 4) + [0, 2, 17]
    offsets = _offsets(lengths)
    inputs = _inputs(offsets[-1], hk, hv, dk, dv, gen, device)
    init = torch.randn(len(lengths), hv, dk, dv, generator=gen).to(device) * 0.1
    n = len(lengths)
    shuffled = rng.sample(range(n), n)
    orders = [[s] for s in range(n) if lengths[s]] + [list(range(n))[::-1], shuffled + shuffled[::-1]]
    orders += [rng.sample(range(n), rng.randint(2, n - 1)) for _ in range(3)]
    for label, initial in (("from zeros", None), ("from initial states", init)):
        want, want_final = gated_delta_rule(*inputs, offsets, initial_state=initial, output_final_state=True)
        for order in orders:
            rows = _rows(offsets, order, [0] * len(order), [lengths[s] for s in order], device)
            got, final = gated_delta_rule(*(x[rows] for x in inputs), _offsets([lengths[s] for s in order]),
                                          initial_state=None if initial is None else initial[order],
                                          output_final_state=True)
            what = f"Hv={hv} {label}: sequences {order} of {[lengths[s] for s in order]} tokens"
            result.compare(got, want[rows], f"{what}, outputs")
            result.compare(final, want_final[order], f"{what}, final states")


def check_rollout(result, hk: int, hv: int, dk: int, dv: int, max_len: int, decode: int,
                  device: str = "cuda") -> None:
    """Seven sequences (three of random lengths up to `max_len`, then `_lengths`' fixed ones)
    rolled out through `GatedDeltaRollout` (`_pieces`; slots scattered in a pool of ten; their
    last `decode` tokens one a step) == the training forward: outputs, final states, and halfway
    the states == a training forward of the prefixes. From initial states, then from zeros."""
    rng = random.Random(hv * 7 + dk)
    gen = torch.Generator().manual_seed(hv * 3 + dk)
    lengths = _lengths(rng, max_len, 3)
    n, pool = len(lengths), len(lengths) + 3
    offsets = _offsets(lengths)
    inputs = _inputs(offsets[-1], hk, hv, dk, dv, gen, device)
    init = torch.randn(n, hv, dk, dv, generator=gen).to(device) * 0.1
    for label, initial in (("from initial states", init), ("from zeros", None)):
        want, want_final = gated_delta_rule(*inputs, offsets, initial_state=initial, output_final_state=True)
        slot = rng.sample(range(pool), n)
        pool_init = None
        if initial is not None:
            pool_init = torch.randn(pool, hv, dk, dv, generator=gen).to(device)  # the spare slots' are never read
            pool_init[slot] = initial
        roll = GatedDeltaRollout(pool, (hk, hv), (dk, dv), device=device, initial_state=pool_init)
        pieces = [_pieces(m, decode, rng) for m in lengths]
        steps = max(len(p) for p in pieces)
        got, done = torch.full_like(want, float("nan")), [0] * n
        for step in range(steps):
            if step == steps // 2 and step:  # the states so far == the training forward's final states of the prefixes
                rows = _rows(offsets, list(range(n)), [0] * n, done, device)
                _, prefix = gated_delta_rule(*(x[rows] for x in inputs), _offsets(done), initial_state=initial,
                                             output_final_state=True)
                result.compare(roll.states[slot], prefix, f"Hv={hv} {label}: states after {done} tokens")
            seqs = [s for s in range(n) if step < len(pieces[s])]
            counts = [pieces[s][step] for s in seqs]
            idle = [s for s in range(n) if step >= len(pieces[s])]
            if idle and rng.random() < 0.3:  # a finished sequence rides along with no tokens
                seqs.append(rng.choice(idle))
                counts.append(0)
            order = rng.sample(range(len(seqs)), len(seqs))
            seqs, counts = [seqs[i] for i in order], [counts[i] for i in order]
            rows = _rows(offsets, seqs, [done[s] for s in seqs], counts, device)
            got[rows] = roll.step(*(x[rows] for x in inputs), [slot[s] for s in seqs], counts)
            for s, m in zip(seqs, counts):
                done[s] += m
        result.compare(got, want, f"Hv={hv} {label}: rollout of lengths {lengths} == training, outputs")
        result.compare(roll.states[slot], want_final, f"Hv={hv} {label}: rollout of lengths {lengths} == training, "
                                                      "final states")


def _bucket(n: int, least: int) -> int:
    """The capacity a step of `n` takes: the power of two from `least` up that holds it."""
    cap = least
    while cap < n:
        cap *= 2
    return cap


class _EngineSteps:
    """Steps over a `LinearStateCache` as the engine's runner takes them: the plan staged in
    `LinearStepBuffers` at a bucket's capacity (sequences and tokens), the rows padded to the
    bucket's tokens with NaN; a dry run first (eager: reads the step, writes only the padding
    state), then the step itself: eager, or on CUDA the replay of a graph captured per bucket
    after its first dry run."""

    def __init__(self, result, cache: LinearStateCache, max_tokens: int, max_seqs: int, graphs: bool) -> None:
        self.result, self.cache, self.max_tokens = result, cache, max_tokens
        self.device = next(iter(cache.states.values())).device
        self.buffers = LinearStepBuffers(cache, max_tokens, max_seqs, self.device)
        self.graphs = {} if graphs else None
        self.pool = torch.cuda.graph_pool_handle() if graphs else None
        self.static = None  # the graphs' input rows, `max_tokens` of them

    def _step(self, tokens: int, seqs: int, rows: list[torch.Tensor]) -> torch.Tensor:
        cu = torch.zeros(seqs + 1, dtype=torch.int32, device=self.device)  # read by the conv only
        plan = LinearStep.from_arrays(self.cache, self.buffers.views(tokens, seqs), cu, tokens)
        return plan.delta_rule(0, *rows)

    def __call__(self, rows: list[torch.Tensor], slots: list[int], starts: list[int], counts: list[int],
                 what: str) -> torch.Tensor:
        n = sum(counts)
        tokens, seqs = _bucket(n, 8), _bucket(len(counts), 4)
        self.buffers.fill(np.array(slots), np.array(starts), np.array(counts), tokens, seqs)
        if self.static is None:
            self.static = [torch.full((self.max_tokens, *x.shape[1:]), float("nan"), dtype=x.dtype,
                                      device=x.device) for x in rows]
        padded = [s[:tokens] for s in self.static]
        for p, x in zip(padded, rows):
            p[:n] = x
            p[n:] = float("nan")
        states = self.cache.states[0]
        before = states[:self.cache.slots].clone()
        self.buffers.dry_run()
        dry = self._step(tokens, seqs, padded)[:n].clone()
        self.buffers.restage()
        self.result.compare(_bits(states[:self.cache.slots]), _bits(before), f"{what}: the dry run writes no slot")
        if self.graphs is None:
            out = self._step(tokens, seqs, padded)[:n]
        else:
            if (tokens, seqs) not in self.graphs:  # captured after the dry run's warm-up, as the engine does
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    static_out = self._step(tokens, seqs, padded)
                self.graphs[tokens, seqs] = graph, static_out
            graph, static_out = self.graphs[tokens, seqs]
            graph.replay()
            out = static_out[:n].clone()
        self.result.compare(dry, out, f"{what}: the dry run's outputs == the step's")
        return out


def check_engine_rollout(result, hk: int, hv: int, dk: int, dv: int, max_len: int, decode: int,
                         device: str = "cuda") -> None:
    """Seven sequences (three of random lengths up to `max_len`, then `_lengths`' fixed ones) and
    a sibling of the first through `LinearStateCache` steps (`_EngineSteps`: padded plans, dry
    runs, CUDA graphs on CUDA) in slots scattered over a pool of twelve with stale (NaN) states,
    several sequences a step in a shuffled order; the sibling takes its leader's slot by
    `copy_slots` after the leader's first piece, and the one of `max_len` tokens is preempted after two
    steps and prefilled again from position 0 in a free slot (one a finished sequence left). The
    outputs and final states == the training forward's."""
    rng = random.Random(hv * 11 + dk)
    gen = torch.Generator().manual_seed(hv * 5 + dk)
    lengths = _lengths(rng, max_len, 3)
    sib, lead, victim = len(lengths), 0, 3  # the sibling (last), its leader and the preempted (max_len tokens)
    share = min(lengths[lead], 2 * decode + 5)
    lengths.append(share + decode + 3)
    n, pool = len(lengths), 12
    offsets = _offsets(lengths)
    inputs = list(_inputs(offsets[-1], hk, hv, dk, dv, gen, device))
    for x in inputs:  # the sibling shares its leader's first `share` tokens
        x[offsets[sib]:offsets[sib] + share] = x[offsets[lead]:offsets[lead] + share]
    want, want_final = gated_delta_rule(*inputs, offsets, output_final_state=True)
    queue = [_pieces(m, decode, rng) for m in lengths[:sib]]
    queue[lead] = [share] + _pieces(lengths[lead] - share, decode, rng)
    queue.append([])  # the sibling's: filled when it forks
    spec = LinearStateSpec((0,), (hk, hv), (dk, dv), 1, 2)
    cache = LinearStateCache(spec, pool, torch.device(device), inputs[1].dtype)
    cache.states[0].fill_(float("nan"))  # stale contents: a sequence at position 0 never reads its slot
    steps = _EngineSteps(result, cache, _bucket(offsets[-1], 8), 16, device == "cuda")
    slot = rng.sample(range(pool), n)
    spare = sorted(set(range(pool)) - set(slot))
    got, done, step, preempted = torch.full_like(want, float("nan")), [0] * n, 0, False
    finals = torch.full_like(want_final, float("nan"))  # taken as each finishes: a preempted one may reuse its slot
    while any(queue):
        if step == 1:  # the sibling forks off its leader after the leader's first piece
            cache.copy_slots(torch.tensor([slot[lead]], device=device), torch.tensor([slot[sib]], device=device))
            got[offsets[sib]:offsets[sib] + share], done[sib] = got[offsets[lead]:offsets[lead] + share], share
            queue[sib] = _pieces(lengths[sib] - share, decode, rng)
        if step == 2 and not preempted and queue[victim]:  # preempted: its slot given back, prefilled anew
            free = [slot[s] for s in range(n) if s != victim and done[s] == lengths[s]] + spare
            slot[victim], preempted = free[0], True
            done[victim] = 0
            queue[victim] = _pieces(lengths[victim], decode, rng)
        seqs = [s for s in range(n) if queue[s]]
        rng.shuffle(seqs)
        counts = [queue[s].pop(0) for s in seqs]
        rows = _rows(offsets, seqs, [done[s] for s in seqs], counts, device)
        what = f"Hv={hv} engine step {step} ({len(seqs)} sequences, {sum(counts)} tokens)"
        got[rows] = steps([x[rows] for x in inputs], [slot[s] for s in seqs], [done[s] for s in seqs], counts, what)
        for s, m in zip(seqs, counts):
            done[s] += m
            if done[s] == lengths[s] and not queue[s]:
                finals[s] = cache.states[0][slot[s]]
        step += 1
    result.compare(got, want, f"Hv={hv} engine rollout of lengths {lengths} == training, outputs")
    result.compare(finals, want_final, f"Hv={hv} engine rollout of lengths {lengths} == training, "
                                                      "final states")


def run_gated_delta(results: dict, quick: bool) -> None:
    """Every check above at every shape of `GDN_SHAPES` into ``results[name]`` (`GDN_CHECKS`):
    sequences up to 1,200 tokens with 40 decodes (`quick`) or 4,000 with 130."""
    max_len, decode = (1200, 40) if quick else (4000, 130)
    for name, hk, hv, dk, dv in GDN_SHAPES:
        check_batch(results["gated_delta batch"], hk, hv, dk, dv, max_len)
        check_rollout(results["gated_delta rollout"], hk, hv, dk, dv, max_len, decode)
        check_engine_rollout(results["gated_delta engine"], hk, hv, dk, dv, max_len, decode)
        print(f"{name}: {sum(results[k].mismatches for k in GDN_CHECKS)} gated_delta mismatches so far", flush=True)
