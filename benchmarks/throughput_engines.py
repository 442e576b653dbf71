"""How throughput.py's engine rows run its workload: our engine in each configuration its
``--engines`` names (`run_engines`), HF's ``generate`` (`run_hf`: stock's, also window_models.py's
peer, and ours), and the bound that skips attention (`attention_skipped`)."""

from __future__ import annotations

import contextlib
import importlib
import time

import torch

from bench_utils import synchronize
from stock_peers import bound_delta_rule, free, is_hybrid, stock_alone
from throughput_args import ENGINES


@contextlib.contextmanager
def attention_skipped():
    """Within: every paged attention forward of the triton backend (GQA and latent MLA: the
    engine's prefill and decode) returns zeros of its output's shape and writes nothing else (the
    `aligned-no-attention` bound). The packed training path is not touched."""
    attention_module = importlib.import_module("vexact_models.kernels.attention")
    real = attention_module.attention_forward_triton

    def zeros(q, k_cache, v_cache, layout, scale, packed=False):
        return (q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1]),
                torch.zeros(q.shape[:2], device=q.device, dtype=torch.float32))

    attention_module.attention_forward_triton = zeros
    try:
        yield
    finally:
        attention_module.attention_forward_triton = real


def run_vexact(model, prompts, outputs, args, aligned: bool = True, async_scheduling: bool = True,
               enforce_eager: bool = False, mixed_graphs: bool = True, sampling: dict | None = None
               ) -> tuple[float, int]:
    """(seconds, output tokens) of the workload on our engine; `sampling`: extra `SamplingParams`
    fields (with ``structured_outputs``, the engine gets `word_tokenizer`)."""
    from vexact_models.runtime import LLM, SamplingParams

    sampling = sampling or {}
    budget = {"kv_cache_bytes": 1 << 22} if args.tiny else {"gpu_memory_utilization": args.gpu_memory_utilization}
    llm = LLM(model, device=args.device, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=64 if args.tiny else 2100, aligned=aligned,
              **budget,
              async_scheduling=async_scheduling, enforce_eager=enforce_eager,
              cuda_graph_max_tokens=None if mixed_graphs else 0, block_size=args.block_size,
              tokenizer=word_tokenizer(model.config) if "structured_outputs" in sampling else None)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=i, **sampling)
              for i, n in enumerate(outputs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, **sampling), use_tqdm=False)  # warm-up: compile
    for run in range(args.repeat):  # the last run counts: an RL loop's engine serves many
        synchronize(args.device)
        if args.step_breakdown:
            llm.step_times = []
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        synchronize(args.device)
        seconds = time.perf_counter() - t0
        if args.repeat > 1:
            print(f"  run {run + 1} of {args.repeat}: {seconds:.1f} s")
        if llm.step_times is not None:
            print(step_breakdown(llm.step_times))
            print(graph_counts(llm.runner.graphs))
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == sum(outputs), (produced, sum(outputs))
    print(f"vexact ({'aligned' if aligned else 'fast path'}{'' if async_scheduling else ', one step at a time'}): "
          f"{llm.runner.num_blocks} KV blocks, "
          f"{llm.num_preemptions} preemptions")
    del llm
    free(args.device)
    return seconds, produced


def step_breakdown(step_times: list[tuple[int, bool, float]]) -> str:
    """Where a run's time went, from ``LLM.step_times`` (sequences, decode-only, seconds between
    step completions): steps, seconds and median ms of the decode-only steps (the ones CUDA
    graphs replay) and of the steps with prompt tokens."""
    lines = []
    for label, decode in (("decode-only steps", True), ("steps with prompt tokens", False)):
        times = sorted(t for _, d, t in step_times if d == decode)
        median = times[len(times) // 2] * 1e3 if times else 0.0
        lines.append(f"  {label:<26}{len(times):>6} steps {sum(times):>8.2f} s  median {median:6.2f} ms")
    return "\n".join(lines)


def graph_counts(graphs) -> str:
    """The mixed-step CUDA graphs of an engine's `StepGraphs` (None: eager): captured, their
    capture time, replays."""
    if graphs is None:
        return "  no CUDA graphs"
    return (f"  {graphs.num_mixed} CUDA graphs of steps with prompt tokens captured in "
            f"{graphs.mixed_capture_seconds:.2f} s (all runs so far), {graphs.mixed_replays} replays")


@torch.no_grad()
def run_hf(hf, prompts, outputs, batch: int, temperature: float = 0.6, use_cache: bool = True) -> tuple[float, int]:
    """Seconds and useful output tokens of HF's ``generate`` by `hf` (a stock model, e.g.
    `stock_peers.stock_alone`'s, or ours) over the requests, `batch` at a time, sorted by output length and
    left-padded, each batch run to its longest output (only each request's own output length counts)."""
    device = next(hf.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: outputs[i])
    synchronize(device)
    t0 = time.perf_counter()
    for start in range(0, len(order), batch):
        idx = order[start:start + batch]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.zeros(len(idx), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(idx):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        new = max(outputs[i] for i in idx)
        hf.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new, min_new_tokens=new,
                    do_sample=True, temperature=temperature, top_k=0, top_p=1.0, pad_token_id=0, use_cache=use_cache)
    synchronize(device)
    return time.perf_counter() - t0, sum(outputs)


@torch.no_grad()
def timed_generate_batch(model, prompts, new_tokens: int, temperature: float, **call) -> tuple[float, dict]:
    """(seconds, results) of one transformers ``generate_batch`` call on `model` (a stock model:
    transformers' paged runtime; ours: the rollout engine, `vexact_models.batch_generation`):
    `new_tokens` each (it takes one ``max_new_tokens`` for all; EOS off), sampled at `temperature`;
    `call`: its other arguments (``continuous_batching_config``, ``persistent_manager``). A failed
    request is a RuntimeError: stock's call reports failures in its results only."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=new_tokens,
                              eos_token_id=-1)
    device = next(model.parameters()).device
    synchronize(device)
    t0 = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config, **call)
    synchronize(device)
    seconds = time.perf_counter() - t0
    failed = [r.error for r in out.values() if r.error is not None]
    if failed or len(out) != len(prompts):
        raise RuntimeError(f"generate_batch: {len(failed)} of {len(prompts)} requests failed ({failed[:1]}), "
                           f"{len(out)} results")
    return seconds, out


def cpu_cache_fields(device: torch.device) -> dict:
    """``ContinuousBatchingConfig`` fields of a small KV cache on the CPU (``--tiny``): there stock's
    ``generate_batch`` sizes its cache from the machine's RAM (90% of it by default), which two
    processes at once cannot hold. None on CUDA, where the defaults are the measured ones."""
    return {} if device.type == "cuda" else dict(num_blocks=64, max_batch_tokens=256)


def run_generate_batch(model, prompts, new_tokens: int, temperature: float = 0.6) -> tuple[float, int]:
    """Seconds and output tokens of all requests in one `timed_generate_batch` call, stock's
    default ``ContinuousBatchingConfig`` (a small cache on the CPU: `cpu_cache_fields`)."""
    from transformers.generation import ContinuousBatchingConfig

    small = cpu_cache_fields(next(model.parameters()).device)
    call = dict(continuous_batching_config=ContinuousBatchingConfig(**small)) if small else {}
    seconds, out = timed_generate_batch(model, prompts, new_tokens, temperature, **call)
    return seconds, sum(len(r.generated_tokens) for r in out.values())


#: the `SamplingParams` fields an engine row adds to the workload's
#: the `aligned-regex` row's constraint over `word_tokenizer`'s words: words of letters, a space
#: after each, then a digit, which no token holds: it never completes, so every request runs to its
#: length, masked at every step. Each token is wholly inside or outside the grammar at each state,
#: so xgrammar's masks are all precomputed (a bound on a word's length, ``[a-z]{1,6}``, would make
#: it check thousands of tokens per row and step instead)
STRUCTURED_REGEX = "([a-z]+ )+[0-9]"
ENGINE_SAMPLING = {"aligned-top20": dict(logprobs=20),
                   "aligned-penalties": dict(repetition_penalty=1.1, frequency_penalty=0.2, presence_penalty=0.2),
                   "aligned-regex": dict(structured_outputs={"regex": STRUCTURED_REGEX}),
                   "aligned-regex-sync": dict(structured_outputs={"regex": STRUCTURED_REGEX})}


def engine_sampling(engine: str, args) -> dict | None:
    """The extra `SamplingParams` fields of an ``--engines`` row (``--regex`` for the regex rows)."""
    if engine in ("aligned-regex", "aligned-regex-sync") and args.regex:
        return dict(structured_outputs={"regex": args.regex})
    return ENGINE_SAMPLING.get(engine)


def word_tokenizer(config):
    """A word-level tokenizer over the model's whole vocabulary (no hub here): id i is the i-th
    lowercase word in shortlex order (a .. z, aa, ...), the first id a space, EOS ``<eos>``."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    eos = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
    words, letters = [" "], [chr(c) for c in range(ord("a"), ord("z") + 1)]
    level = letters
    while len(words) < config.vocab_size:
        words += level[:config.vocab_size - len(words)]
        level = [w + c for w in level for c in letters] if len(words) < config.vocab_size else []
    if eos is not None and eos < config.vocab_size:
        words[eos] = "<eos>"
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>" if eos is not None else None)


def run_engines(arch, model, prompts, outputs, args, engines: list[str], mode: str | None) -> list[tuple]:
    """Each engine's (name, mode, seconds, output tokens) on the workload, the model in the KV cache
    `mode` (set by the caller)."""
    from vexact_models.kernels import use_attention_forward

    rows = []
    for engine in engines:
        if engine == "hf":
            with stock_alone(arch, model, args.device) as hf:  # ours waits in host memory
                seconds, produced = run_hf(hf.eval(), prompts, outputs, args.hf_batch)
            name, row_mode = f"{ENGINES['hf']} ({hf_label(arch, args.hf_batch)})", None
        elif engine in ("generate-batch", "hf-generate-batch"):
            new = round(sum(outputs) / len(outputs))  # one max_new_tokens for every request
            with stock_alone(arch, model, args.device) if engine.startswith("hf") else contextlib.nullcontext(model) as m:
                for _ in range(args.repeat):
                    seconds, produced = run_generate_batch(m.eval(), prompts, new)
            name, row_mode = f"{ENGINES[engine]} (one call, {new} each)", None
        elif engine in ("generate", "generate-whole"):
            seconds, produced = run_hf(model, prompts, outputs, args.hf_batch, use_cache=engine == "generate")
            name, row_mode = f"{ENGINES[engine]} (batch {args.hf_batch})" + (f" [{mode}]" if mode else ""), mode
        else:
            with attention_skipped() if engine == "aligned-no-attention" else contextlib.nullcontext(), \
                    use_attention_forward("fa4" if engine == "aligned-fa4" else None):
                seconds, produced = run_vexact(model, prompts, outputs, args, aligned=engine != "fast",
                                               async_scheduling=engine not in ("aligned-sync", "aligned-regex-sync"),
                                               enforce_eager=engine == "aligned-eager",
                                               mixed_graphs=engine != "aligned-decode-graphs",
                                               sampling=engine_sampling(engine, args))
            name, row_mode = ENGINES[engine] + (f" [{mode}]" if mode else ""), mode
        rows.append((name, row_mode, seconds, produced))
        print(f"{name}: {produced} output tokens in {seconds:.1f}s = {produced / seconds:,.0f} tok/s", flush=True)
    return rows


def hf_label(arch, batch: int) -> str:
    """What HF's row ran: its batch and, for a hybrid, the gated delta rule stock runs (fla's
    kernels where transformers bound them at import)."""
    label = f"batch {batch}"
    if is_hybrid(arch):
        label += ", fla kernels" if bound_delta_rule(arch).startswith("fla.") else ", torch delta rule"
    return label
