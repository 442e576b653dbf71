"""The conformance suite (docs/design.md section 7): rollout logprobs == training logprobs, bitwise.

For one architecture, backend and model: roll out a fixed pool of requests (greedy, sampled,
top-k, top-p, min_tokens, stop tokens; each with its own seed) under adversarial engine
settings (batch sizes 1, 7, 64; chunked-prefill budgets 16 and 128 and no chunking; a KV cache
so small that sequences are preempted; n = 4; each conversation's next turn in a second call over
the pages (and gated-DeltaNet prompt states) the first kept; CUDA graphs off; one step at a time instead of
async scheduling; pages of 4 positions, and on CUDA the engine's default page size), then recompute every sampled token's logprob
with the training variant, packed in shuffled order and padded (left and right), and packed
once more with autograd on, as a training step runs it, and require ``torch.equal``. A request
must also produce identical tokens and logprobs in every scenario it appears in. HF parity
compares the training variant's logits with stock transformers on the same weights.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from vexact_models.registry import Architecture
from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.linear_state_cache import linear_state_spec

from .models import hf_twin
from .recompute import RECOMPUTE_TOKENS, recompute_and_compare

@dataclass
class ScenarioResult:
    name: str
    sequences: int
    generated: int  # tokens sampled by the rollouts
    tokens: int  # token logprobs compared (each generated token, once per recompute layout)
    mismatches: int
    max_abs_diff: float
    seconds: float


@dataclass
class Report:
    """One conformance run: an architecture at one shape, on one backend, device and dtype.
    `shape` is the `Shape` the model was built at (the name of the file for a config.json that
    no shape lists; None when the caller did not say)."""

    arch: str
    backend: str
    device: str
    dtype: str
    scenarios: list[ScenarioResult] = field(default_factory=list)
    reproducibility_mismatches: int = 0
    reproducibility_checked: int = 0
    hf_parity: "Parity | None" = None
    shape: str | None = None

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.scenarios)

    @property
    def generated(self) -> int:
        return sum(s.generated for s in self.scenarios)

    @property
    def mismatches(self) -> int:
        return sum(s.mismatches for s in self.scenarios) + self.reproducibility_mismatches

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.scenarios), default=0.0)

    @property
    def ok(self) -> bool:
        checked = self.tokens > 0 or not self.scenarios
        return self.mismatches == 0 and checked and (self.hf_parity is None or self.hf_parity.ok())


def request_pool(vocab: int, n: int, max_tokens: int, prompt_len: int, seed: int = 0, stop_ids=()) -> list:
    """`n` (prompt ids, SamplingParams) pairs covering every sampling mode, deterministic."""
    rng = random.Random(seed)
    pool = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, prompt_len))]
        mode = i % 6
        common = dict(max_tokens=rng.randint(1, max_tokens), seed=1000 + i)
        if mode == 0:
            params = SamplingParams(temperature=0.0, **common)
        elif mode == 1:
            params = SamplingParams(temperature=1.0, logit_bias={(7 * i) % vocab: 3.0}, **common)
        elif mode == 2:
            params = SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.1, **common)
        elif mode == 3:
            params = SamplingParams(temperature=1.3, top_p=0.9, min_p=0.02, **common)
        elif mode == 4:
            params = SamplingParams(temperature=0.9, top_k=50, top_p=0.8, min_tokens=min(3, common["max_tokens"]),
                                    stop_token_ids=list(stop_ids), **common)
        else:
            params = SamplingParams(temperature=1.0, ignore_eos=True, stop_token_ids=list(stop_ids), frequency_penalty=0.3,
                                    presence_penalty=0.2, **common)
        pool.append((prompt, params))
    return pool


#: the tokens a conversation's next turn appends after the sample (scenario "next turn")
NEXT_TURN = [5, 6, 7, 8, 9]


def _scenarios(pool_size: int) -> list[dict]:
    small = min(7, pool_size)
    return [
        dict(name="batch 1", requests=min(6, pool_size), batch=1, engine={}),
        dict(name="batch 7, chunk 16", requests=small, batch=small, engine=dict(max_num_batched_tokens=16)),
        dict(name=f"batch {pool_size}, chunk 128", requests=pool_size, batch=pool_size,
             engine=dict(max_num_batched_tokens=128)),
        dict(name=f"batch {pool_size}, no chunking", requests=pool_size, batch=pool_size,
             engine=dict(enable_chunked_prefill=False, max_num_batched_tokens=4096)),
        dict(name=f"batch {pool_size}, preemption", requests=pool_size, batch=pool_size,
             engine=dict(max_num_batched_tokens=64, preempt=True)),
        dict(name="batch 7, n=4", requests=small, batch=small, engine=dict(max_num_batched_tokens=32), n=4),
        # each conversation's next turn in a second call, over pages (and, for the gated-DeltaNet
        # hybrids, prompt states) the first call kept: an engine that owns its weights
        dict(name="batch 7, next turn", requests=small, batch=small, turns=2,
             engine=dict(max_num_batched_tokens=32, owns_weights=True)),
        dict(name=f"batch {pool_size}, CUDA graphs off", requests=pool_size, batch=pool_size,
             engine=dict(max_num_batched_tokens=256, enforce_eager=True), cuda_only=True),
        dict(name=f"batch {pool_size}, one step at a time", requests=pool_size, batch=pool_size,
             engine=dict(max_num_batched_tokens=256, async_scheduling=False)),
        # the engine's own page size (`default_block_size`: latent MLA caches take 64, whose whole
        # key blocks decode by TMA on Hopper); the others take pages of 4 to cross page edges often
        dict(name=f"batch {pool_size}, default page size", requests=pool_size, batch=pool_size,
             engine=dict(max_num_batched_tokens=256, block_size=None), cuda_only=True),
    ]


def scenario_names(pool_size: int) -> list[str]:
    """The names of the suite's scenarios at `pool_size` requests, in the order they run."""
    return [sc["name"] for sc in _scenarios(pool_size)]


def select_scenarios(pool_size: int, only: Sequence[str] | None = None) -> list[dict]:
    """The suite's scenarios at `pool_size` whose names contain one of the strings of `only` (all
    when None). Raises ValueError naming a string that matches no scenario, and the names."""
    scenarios = _scenarios(pool_size)
    if only is None:
        return scenarios
    names = [sc["name"] for sc in scenarios]
    for part in only:
        if not any(part in name for name in names):
            raise ValueError(f"scenario {part!r} matches none of the scenarios at pool {pool_size}: {names}")
    return [sc for sc in scenarios if any(part in sc["name"] for part in only)]


def run_conformance(arch: Architecture, model, *, device: torch.device, pool_size: int = 64, max_tokens: int = 24,
                    prompt_len: int = 40, check_parity: bool = True, seed: int = 0, log=print,
                    scenarios: bool = True, gpu_memory_utilization: float = 0.5, shape: str | None = None,
                    only: Sequence[str] | None = None, progress: bool = False,
                    recompute_tokens: int = RECOMPUTE_TOKENS) -> Report:
    """Run every scenario for `model` (a training-variant instance on `device`, built at `arch`'s
    `shape`, which the report records). The engines' KV caches take `gpu_memory_utilization` of
    a GPU; a scenario's engine is freed before its recompute (as an RL loop's engine sleeps while
    the trainer runs), which takes forwards of at most `recompute_tokens` tokens
    (`recompute.recompute_groups`). `only`: run just the scenarios whose
    names contain one of these strings (`select_scenarios`), e.g. the full-pool ones of a long run.
    `progress`: the engine's progress bar while a scenario rolls out (stderr) and a `log` line when
    its rollout ends and the recompute begins and one with the recompute's time and peak memory,
    for runs of minutes."""
    from vexact_models.kernels import current_backend

    dtype = next(model.parameters()).dtype
    report = Report(arch.name, current_backend(device), str(device), str(dtype).replace("torch.", ""), shape=shape)
    vocab = model.config.vocab_size
    pool = request_pool(vocab, pool_size, max_tokens, prompt_len, seed, stop_ids=(vocab - 1, vocab - 2))
    rng = random.Random(seed)
    seen: dict[tuple[int, int, int], tuple[list[int], list[int], list[float]]] = {}
    max_model_len = min(int(model.config.max_position_embeddings), prompt_len + max_tokens + 1)
    for sc in (select_scenarios(pool_size, only) if scenarios else []):
        if sc.get("cuda_only") and device.type != "cuda":
            continue
        t0 = time.time()
        block_size, engine = _engine_options(sc, model, pool, dtype, max_model_len, gpu_memory_utilization,
                                             max(64, pool_size))
        llm = LLM(model, device=device, block_size=block_size, max_num_seqs=max(64, pool_size), **engine)
        requests, outputs = _roll_out(llm, _scenario_requests(pool, sc), sc, progress)
        if progress:
            log(f"  {sc['name']}: rolled out {sum(len(c.token_ids) for o in outputs for c in o.outputs)} tokens "
                f"({time.time() - t0:.1f}s); recomputing")
        preempted = llm.num_preemptions
        replays = _mixed_replays(llm.runner.graphs)  # (no reference kept: `del llm` frees the cache)
        samples, reported, temps = _collect_samples(requests, outputs, sc, seen, report, log)
        del llm
        _free_cuda_cache(device)
        if progress and device.type == "cuda":
            log(f"  {sc['name']}: engine freed, {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated, "
                f"{_module_bytes(model) / 2**30:.1f} GiB of it the model's parameters and buffers")
        t_recompute = time.time()
        mismatches, max_diff, tokens = recompute_and_compare(model, samples, reported, temps, device, rng,
                                                             recompute_tokens)
        if progress:
            peak = f", peak {torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB" if device.type == "cuda" else ""
            log(f"  {sc['name']}: recomputed in {time.time() - t_recompute:.1f}s{peak}")
        generated = sum(len(tokens_) for _, tokens_ in samples)
        result = ScenarioResult(sc["name"] + (f" ({preempted} preemptions)" if preempted else ""), len(samples),
                                generated, tokens, mismatches, max_diff, time.time() - t0)
        report.scenarios.append(result)
        log(f"  {result.name}: {result.sequences} sequences, {generated} tokens generated, {tokens} token "
            f"logprobs checked, {mismatches} mismatches{replays} ({result.seconds:.1f}s)")
    if check_parity:
        report.hf_parity = hf_parity(arch, model, device)
    return report


def _module_bytes(model: torch.nn.Module) -> int:
    """Bytes of the storages behind `model`'s parameters and buffers, each storage once."""
    storages = {}
    for t in [*model.parameters(), *model.buffers()]:
        storage = t.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _free_cuda_cache(device: torch.device) -> None:
    """On CUDA, the memory of an engine just deleted back to the allocator (its CUDA graphs and
    cache may sit in reference cycles) and the peak-memory counter reset."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def _engine_options(sc: dict, model, pool: list, dtype: torch.dtype, max_model_len: int,
                    gpu_memory_utilization: float, max_num_seqs: int) -> tuple[int, dict]:
    """(block size, the other `LLM` keyword arguments) of scenario `sc`."""
    engine = dict(sc["engine"])
    block_size = engine.pop("block_size", 4)
    if engine.pop("preempt", False):  # room for a sixth of the pool's sequences: forces preemption
        # (a quarter, or three times the longest, preempted once or not at all with async
        # scheduling, whose admissions see the pages free now, not those the step in flight frees)
        need = [-(-(len(p) + sp.max_tokens) // block_size) for p, sp in pool]
        engine["kv_cache_bytes"] = _cache_bytes(model, block_size, dtype, max(2 * max(need), sum(need) // 6),
                                              max_num_seqs)
    if sc.get("turns", 1) > 1:  # the next turns' prompts hold the turns before
        turns = sc["turns"]
        longest = max(len(p) for p, _ in pool) + turns * (max(sp.max_tokens for _, sp in pool) + len(NEXT_TURN))
        engine["max_model_len"] = min(int(model.config.max_position_embeddings), longest + 1)
        if linear_state_spec(model) is not None:  # the hybrids keep their prompts' states
            engine["prefix_states"] = max_num_seqs
    engine.setdefault("max_model_len", max_model_len)
    if "kv_cache_bytes" not in engine:
        engine["gpu_memory_utilization"] = gpu_memory_utilization
    if engine.get("enable_chunked_prefill") is False:
        engine["max_num_batched_tokens"] = max(engine["max_num_batched_tokens"], max_model_len)
    return block_size, engine


def _roll_out(llm: LLM, requests: list, sc: dict, progress: bool) -> tuple[list, list]:
    """(requests, outputs) of scenario `sc` on `llm`: its requests in calls of ``sc["batch"]``;
    with ``sc["turns"]`` = 2, then each conversation's next turn (the prompt, the sample and
    `NEXT_TURN` tokens) in calls of the same size."""
    outputs, turn_requests = [], requests
    for turn in range(sc.get("turns", 1)):
        if turn:  # (the turn before's requests and outputs: the last len(turn_requests) of each)
            turn_requests = [(p + out.outputs[0].token_ids + NEXT_TURN, sp)
                             for (p, sp), out in zip(turn_requests, outputs[-len(turn_requests):])]
            requests = requests + turn_requests
        for start in range(0, len(turn_requests), sc["batch"]):
            chunk = turn_requests[start:start + sc["batch"]]
            outputs += llm.generate([p for p, _ in chunk], [sp for _, sp in chunk], use_tqdm=progress)
    return requests, outputs


def _scenario_requests(pool: list, sc: dict) -> list:
    """The first ``sc["requests"]`` (prompt, params) pairs of the pool, asking ``sc["n"]`` samples each."""
    requests = pool[:sc["requests"]]
    n = sc.get("n", 1)
    if n > 1:
        from dataclasses import replace

        requests = [(p, replace(sp, n=n)) for p, sp in requests]
    return requests


def _collect_samples(requests: list, outputs: list, sc: dict, seen: dict, report: Report, log) -> tuple[list, list, list]:
    """([(prompt, tokens)], [reported logprobs], [temperatures]) of every sample, and each sample
    checked against what an earlier scenario produced for the same (prompt, n, index), counted in
    `report` (`seen` holds those)."""
    samples, reported, temps = [], [], []
    n = sc.get("n", 1)
    for (prompt, sp), out in zip(requests, outputs):
        for comp in out.outputs:
            samples.append((prompt, comp.token_ids))
            reported.append(torch.tensor(comp.logprobs, dtype=torch.float32))
            temps.append(sp.temperature if sp.temperature > 0 else 1.0)
            key = (id(prompt), n, comp.index)
            if key in seen and seen[key][0] is prompt:  # (the same request: a next turn's prompt is new)
                report.reproducibility_checked += 1
                if seen[key][1:] != (comp.token_ids, comp.logprobs):
                    report.reproducibility_mismatches += 1
                    log(f"  reproducibility: request {out.request_id} sample {comp.index} differs in {sc['name']}")
            else:
                seen[key] = (prompt, comp.token_ids, comp.logprobs)
    return samples, reported, temps


def _mixed_replays(graphs) -> str:
    """How many steps with prompt tokens an engine's CUDA graphs replayed (empty: eager)."""
    if graphs is None:
        return ""
    return f", {graphs.mixed_replays} steps with prompt tokens replayed by {graphs.num_mixed} CUDA graphs"


def _cache_bytes(model, block_size: int, dtype: torch.dtype, blocks: int, max_num_seqs: int) -> int:
    from vexact_models.runtime.llm_setup import cache_budget_bytes

    return cache_budget_bytes(model, dtype, block_size, blocks, max_num_seqs)


@dataclass
class Parity:
    """Logit agreement with stock transformers on the same weights and input.

    ``vs_hf`` is ``max |ours - hf| / max |hf|`` in the model's dtype. Below fp32 the two
    implementations round at different points, so the test is against HF's own rounding: with
    an fp32 HF reference, ``ours_vs_fp32`` must not exceed ``hf_vs_fp32`` (HF's error in the same
    low precision) by more than `LOW_PRECISION_SLACK`.
    """

    vs_hf: float
    ours_vs_fp32: float | None = None
    hf_vs_fp32: float | None = None

    def ok(self, fp32_tolerance: float = 1e-5) -> bool:
        if self.ours_vs_fp32 is None:
            return self.vs_hf <= fp32_tolerance
        return self.ours_vs_fp32 <= LOW_PRECISION_SLACK * self.hf_vs_fp32

    def __str__(self) -> str:
        if self.ours_vs_fp32 is None:
            return f"{self.vs_hf:.2e}"
        return f"{self.vs_hf:.2e} (vs fp32: ours {self.ours_vs_fp32:.2e}, HF {self.hf_vs_fp32:.2e})"


LOW_PRECISION_SLACK = 1.25


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@torch.no_grad()
def _hf_logits(arch: Architecture, model, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    hf = hf_twin(arch, model, ids.device, dtype).eval()
    logits = hf(ids).logits.float()
    del hf
    if ids.device.type == "cuda":
        torch.cuda.empty_cache()
    return logits


@torch.no_grad()
def hf_parity(arch: Architecture, model, device: torch.device, batch: int = 3, length: int = 48) -> Parity:
    """Compare the training variant's logits with stock transformers' (see `Parity`)."""
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (batch, length), generator=gen).to(device)
    ours = model(ids).logits.float()
    same = _hf_logits(arch, model, ids, dtype)
    if dtype in (torch.float32, torch.float64):
        return Parity(_rel(ours, same))
    reference = _hf_logits(arch, model, ids, torch.float32)
    return Parity(_rel(ours, same), _rel(ours, reference), _rel(same, reference))


def format_table(reports: list[Report]) -> str:
    """The conformance table: one row per report (architecture, shape, backend, device, dtype,
    tokens generated and checked, mismatches, max |diff|, reproducibility, HF parity)."""
    header = ["architecture", "shape", "backend", "device", "dtype", "generated", "logprobs checked", "mismatches",
              "max |diff|", "reproducible", "HF parity (rel)"]
    rows = [[r.arch, r.shape or "-", r.backend, r.device, r.dtype, f"{r.generated:,}", f"{r.tokens:,}",
             str(r.mismatches), f"{r.max_abs_diff:.3g}",
             f"{r.reproducibility_checked - r.reproducibility_mismatches}/{r.reproducibility_checked}",
             "-" if r.hf_parity is None else str(r.hf_parity)] for r in reports]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


def print_table(reports: list[Report]) -> None:
    """Print `format_table`."""
    print(format_table(reports))
