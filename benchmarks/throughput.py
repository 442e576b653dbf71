"""Rollout throughput on the nano-vllm workload, beside stock HF ``generate`` in the same run.

Workload: 256 requests, prompt lengths uniform in [100, 1024], output lengths uniform in
[100, 1024], random token ids, ignore_eos, fixed seed. Model: random weights at a published
shape (default Qwen3-0.6B), bf16, CUDA.

- aligned: `LLM.generate` (aligned kernels, paged KV, continuous batching, chunked prefill,
  CUDA graphs for decode steps and steps with prompt chunks).
- aligned-sync: the aligned engine one step at a time (``async_scheduling=False``): what
  launching each decode step before the last one's tokens are back brings.
- aligned-eager: the aligned engine without CUDA graphs (``enforce_eager=True``): what
  replaying steps brings.
- aligned-decode-graphs: the aligned engine with graphs for decode steps only
  (``cuda_graph_max_tokens=0``): what replaying the steps with prompt chunks brings.
- aligned-fa4: the aligned engine with FlashAttention-4 as the attention forward
  (`use_attention_forward("fa4")`, the optional flash-attn-4 package): what that switch costs or
  brings a rollout (training then runs FA4 too).
- aligned-no-attention: a bound, not an engine: the aligned engine with the attention kernels
  replaced by zero outputs (the K/V are still written). The tokens are garbage, the lengths are
  not (``ignore_eos``), so the run takes the same steps at the same batch sizes: what the run
  costs without attention, i.e. what no attention kernel or KV cache mode can beat.
- fast: the same runtime on the non-aligned fast path (`LLM(aligned=False)`: cuBLAS GEMMs,
  torch norms): what alignment costs.
- HF: ``model.generate`` of the stock transformers class on the same weights (sdpa), all
  requests in one left-padded batch (or ``--hf-batch`` per batch) with ``max_new_tokens`` the
  batch's longest output; only each request's own output length counts as useful tokens.

After the table, the workload's floor per KV cache mode: what its decode steps must read at
least (weights, routed experts as many as each step's batch reaches, every running sequence's
cache) over the measured copy bandwidth, and each run's share of it. For MLA models the ratio of
the two modes' floors is the throughput ratio they reach at equal efficiency: at 256 requests on
an H200 every expanded cache fits and the weights dominate (1.90x for Moonlight); where the
expanded cache limits the batch (``--requests 512 --max-num-seqs 512``) it is 2.56x.

Then decode step time at batch 128 and 256 (contexts ~512-640 tokens) beside the HBM roofline:
bytes of weights and KV read per step over the measured copy bandwidth.

MLA models (DeepSeek-V3, Moonlight) take ``--mla-kv-cache expanded,latent``: the vexact engines
and the decode table run once per KV cache mode, on the same weights, in the same run
(docs/mla-kv-cache.md). ``--set KEY=VALUE`` overrides config fields as in the conformance CLI.
``--step-breakdown`` splits each vexact run's time into decode-only steps and steps with prompt
tokens; ``--repeat N`` runs the workload N times per engine and counts the last (an RL loop's
engine serves many, so the CUDA graphs of steps with prompt chunks are captured by then).

Usage: python benchmarks/throughput.py [--config qwen3-0.6b] [--requests 256] [--engines aligned,fast,hf]
       python benchmarks/throughput.py --config moonlight-16b-a3b --mla-kv-cache expanded,latent --engines aligned
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import random
import sys
import time

import torch

from bench_utils import copy_bandwidth, decode_bytes, positive_int, stock_twin, synchronize, workload_decode_roofline


def workload(n: int, vocab: int, seed: int, lo: int = 100, hi: int = 1024):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


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


# --engines names and their table rows ("hf" is labelled with its batch)
ENGINES = {"aligned": "vexact aligned", "aligned-sync": "vexact aligned, one step at a time",
           "aligned-eager": "vexact aligned, no CUDA graphs",
           "aligned-decode-graphs": "vexact aligned, decode graphs only",
           "aligned-fa4": "vexact aligned, FA4 attention",
           "aligned-no-attention": "bound: aligned, no attention", "fast": "vexact fast path (cuBLAS)",
           "hf": "HF generate"}


def run_vexact(model, prompts, outputs, args, aligned: bool = True, async_scheduling: bool = True,
               enforce_eager: bool = False, mixed_graphs: bool = True) -> tuple[float, int]:
    from vexact_models.runtime import LLM, SamplingParams

    llm = LLM(model, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_model_len=2100, gpu_memory_utilization=args.gpu_memory_utilization, aligned=aligned,
              async_scheduling=async_scheduling, enforce_eager=enforce_eager,
              cuda_graph_max_tokens=None if mixed_graphs else 0, block_size=args.block_size)
    params = [SamplingParams(temperature=0.6, max_tokens=n, ignore_eos=True, seed=i) for i, n in enumerate(outputs)]
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up: compile kernels
    for run in range(args.repeat):  # the last run counts: an RL loop's engine serves many
        torch.cuda.synchronize()
        if args.step_breakdown:
            llm.step_times = []
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
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
    torch.cuda.empty_cache()
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
def run_hf(hf, prompts, outputs, batch: int, temperature: float = 0.6) -> tuple[float, int]:
    """Seconds and useful output tokens of stock ``generate`` by `hf` (a stock model, e.g.
    `stock_twin`) over the requests, `batch` at a time, sorted by output length and left-padded,
    each batch run to its longest output (only each request's own output length counts)."""
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
                    do_sample=True, temperature=temperature, top_k=0, top_p=1.0, pad_token_id=0)
    synchronize(device)
    return time.perf_counter() - t0, sum(outputs)


def decode_roofline(model, vocab: int, batch: int, hbm: float, aligned: bool, context: int = 512,
                    new_tokens: int = 128) -> tuple[float, float]:
    """(median decode step seconds at `batch` sequences, roofline seconds) for contexts
    `context` .. `context + new_tokens`."""
    import random

    from vexact_models.runtime import LLM, SamplingParams

    rng = random.Random(1)
    llm = LLM(model, max_num_seqs=batch, max_num_batched_tokens=8192, max_model_len=context + new_tokens + 1,
              gpu_memory_utilization=0.85, aligned=aligned)
    prompts = [[rng.randrange(vocab) for _ in range(context)] for _ in range(batch)]
    params = SamplingParams(temperature=0.6, max_tokens=new_tokens, ignore_eos=True, seed=0)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    llm.step_times = []
    llm.generate(prompts, params, use_tqdm=False)
    steps = sorted(t for n, decode, t in llm.step_times if decode and n == batch)
    del llm
    torch.cuda.empty_cache()
    return steps[len(steps) // 2], decode_bytes(model, batch, context + new_tokens // 2) / (hbm * 1e9)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--hf-batch", type=int, default=64, help="requests per HF generate call (sorted by output length)")
    parser.add_argument("--engines", default="aligned,fast,hf",
                        help=f"comma-separated subset of {', '.join(ENGINES)} (default: aligned,fast,hf)")
    parser.add_argument("--skip-hf", action="store_true", help="same as leaving hf out of --engines")
    parser.add_argument("--no-roofline", action="store_true", help="skip the decode step / roofline table")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the workload this many times on each vexact engine and count the last (steady "
                             "state: CUDA graphs captured on first use are captured by then); default 1")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="print each vexact run's step count, seconds and median step time, split into "
                             "decode-only steps and steps with prompt tokens")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (JSON value; repeatable), e.g. --set n_routed_experts=8")
    parser.add_argument("--mla-kv-cache", metavar="MODES",
                        help="MLA models: comma-separated KV cache modes to run in turn (expanded, latent)")
    parser.add_argument("--block-size", type=positive_int,
                        help="positions per KV page of the vexact engines (default: LLM's own, `default_block_size`)")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat: {args.repeat} is below the minimum 1")
    if not torch.cuda.is_available():
        print("benchmarks/throughput.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from vexact_models.conformance.models import parse_overrides
    from vexact_models.conformance.models import architecture_of, build_model, make_config

    arch = architecture_of(args.config)
    config_fields = make_config(arch, args.config, args.layers, None, parse_overrides(args.set))
    model = build_model(arch, config_fields, torch.device("cuda"), torch.bfloat16, args.seed)
    modes = [m for m in (args.mla_kv_cache or "").split(",") if m] or [None]
    if modes != [None] and not hasattr(model, "set_mla_kv_cache"):
        parser.error(f"--mla-kv-cache: {args.config} is not an MLA model")
    prompts, outputs = workload(args.requests, config_fields.vocab_size, args.seed)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.config} "
          f"({config_fields.num_hidden_layers} layers), {args.requests} requests, "
          f"{sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens")
    engines = [e for e in args.engines.split(",") if e and not (e == "hf" and args.skip_hf)]
    for engine in engines:
        if engine not in ENGINES:
            parser.error(f"--engines: unknown engine {engine!r}")
    rows = []
    for mode in modes:
        rows += run_engines(arch, model, prompts, outputs, args, [e for e in engines if e != "hf" or mode == modes[0]],
                            mode)
    print_rates(rows)
    hbm = copy_bandwidth()
    print_workload_floor(model, modes, rows, [len(p) for p in prompts], outputs, args.max_num_seqs, hbm)
    if not args.no_roofline:
        print(f"\ndecode steps (context 512-640) vs the HBM roofline (copy bandwidth {hbm:.0f} GB/s)")
        print(f"{'engine':<22}{'batch':>7}{'step ms':>10}{'roofline ms':>13}{'% of roofline':>15}")
        for mode in modes:
            set_mode(model, mode)
            for aligned in (True, False) if "fast" in engines else (True,):
                for batch in (128, 256):
                    step, roof = decode_roofline(model, config_fields.vocab_size, batch, hbm, aligned)
                    name = ("aligned" if aligned else "fast") + (f" [{mode}]" if mode else "")
                    print(f"{name:<22}{batch:>7}{step * 1e3:>10.2f}{roof * 1e3:>13.2f}{100 * roof / step:>14.0f}%",
                          flush=True)
    return 0


def print_workload_floor(model, modes: list, rows: list[tuple], prompt_lens: list[int], outputs: list[int],
                         max_seqs: int, hbm: float) -> None:
    """Per KV cache mode, what the workload's decode steps read at least over the copy bandwidth
    (`workload_decode_roofline`), and each vexact run's seconds against it. With two MLA modes,
    the ratio of their floors is the throughput ratio the two reach when both run at the same
    share of their floor (latent / expanded, docs/mla-kv-cache.md)."""
    print(f"\nthe workload's decode steps at the copy bandwidth ({hbm:.0f} GB/s; prompt steps not counted): "
          f"a floor for each run")
    print(f"{'mode':<10}{'weights s':>11}{'KV s':>8}{'floor s':>9}   runs: seconds (floor share)")
    floors = {}
    for mode in modes:
        set_mode(model, mode, quiet=True)
        weights, kv = workload_decode_roofline(model, prompt_lens, outputs, max_seqs, hbm)
        floors[mode] = weights + kv
        runs = ", ".join(f"{name} {seconds:.1f} ({100 * floors[mode] / seconds:.0f}%)"
                         for name, row_mode, seconds, _ in rows if row_mode == mode and not name.startswith("HF"))
        print(f"{mode or '-':<10}{weights:>11.2f}{kv:>8.2f}{floors[mode]:>9.2f}   {runs}")
    if set(floors) == {"expanded", "latent"}:
        print(f"expanded / latent floor: {floors['expanded'] / floors['latent']:.2f}x (the latent / expanded throughput "
              f"ratio where both runs reach the same share of their floor)")


def set_mode(model, mode: str | None, quiet: bool = False) -> None:
    """Switch an MLA model's KV cache mode (None: leave the model as built) and print its cache size
    (unless `quiet`); for a model with sliding-window layers also a sequence's KV bytes at 32k tokens
    with and without the pages freed behind the windows (docs/design.md section 6)."""
    from vexact_models.runtime.llm_args import default_block_size
    from vexact_models.runtime.llm_setup import kv_bytes_per_sequence
    from vexact_models.runtime.model_runner import kv_bytes_per_block

    if mode is not None:
        model.set_mla_kv_cache(mode)
    if not quiet:
        print(f"KV cache{f' ({mode})' if mode else ''}: {kv_bytes_per_block(model.kv_cache_spec(), 1, torch.bfloat16):,} "
              f"bytes per token (layers, KV heads, key dim, value dim = {tuple(model.kv_cache_spec())})", flush=True)
        page = default_block_size(model.kv_cache_spec())
        freed, kept = (kv_bytes_per_sequence(model, 32768, dtype=torch.bfloat16, block_size=page, window_freed=freed)
                       for freed in (True, False))
        if freed != kept:
            print(f"KV bytes per sequence at 32k tokens: {freed:,} with window-freed pages, {kept:,} without "
                  f"(bf16, pages of {page})", flush=True)


def run_engines(arch, model, prompts, outputs, args, engines: list[str], mode: str | None) -> list[tuple]:
    """Each engine's (name, mode, seconds, output tokens) on the workload, in the KV cache `mode`."""
    from vexact_models.kernels import use_attention_forward

    set_mode(model, mode)
    rows = []
    for engine in engines:
        if engine == "hf":
            hf = stock_twin(arch, model).eval()
            seconds, produced = run_hf(hf, prompts, outputs, args.hf_batch)
            del hf
            torch.cuda.empty_cache()
            name, row_mode = f"{ENGINES['hf']} (batch {args.hf_batch})", None
        else:
            with attention_skipped() if engine == "aligned-no-attention" else contextlib.nullcontext(), \
                    use_attention_forward("fa4" if engine == "aligned-fa4" else None):
                seconds, produced = run_vexact(model, prompts, outputs, args, aligned=engine != "fast",
                                               async_scheduling=engine != "aligned-sync",
                                               enforce_eager=engine == "aligned-eager",
                                               mixed_graphs=engine != "aligned-decode-graphs")
            name, row_mode = ENGINES[engine] + (f" [{mode}]" if mode else ""), mode
        rows.append((name, row_mode, seconds, produced))
        print(f"{name}: {produced} output tokens in {seconds:.1f}s = {produced / seconds:,.0f} tok/s", flush=True)
    return rows


def print_rates(rows: list[tuple]) -> None:
    """The throughput table: each row against HF and against the fast path of its own KV cache mode."""
    hf_rate = next((p / s for n, _, s, p in rows if n.startswith("HF")), None)
    fast = {m: p / s for n, m, s, p in rows if n.startswith("vexact fast path")}
    print(f"\n{'engine':<40}{'seconds':>9}{'output tokens':>15}{'output tok/s':>14}{'vs HF':>8}{'vs fast':>9}")
    for name, mode, seconds, produced in rows:
        rate = produced / seconds
        vs_hf = f"{rate / hf_rate:.1f}x" if hf_rate else "-"
        vs_fast = f"{rate / fast[mode]:.2f}" if mode in fast and not name.startswith("HF") else "-"
        print(f"{name:<40}{seconds:>9.1f}{produced:>15,}{rate:>14,.0f}{vs_hf:>8}{vs_fast:>9}")


if __name__ == "__main__":
    sys.exit(main())
