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
- aligned-top20: the aligned engine with ``SamplingParams(logprobs=20)`` (vLLM's 20 most probable
  tokens beside each sampled one, `runtime.top_logprobs`): what asking for them costs.
- aligned-penalties: the aligned engine with ``repetition_penalty=1.1, frequency_penalty=0.2,
  presence_penalty=0.2`` (`runtime.penalties`: per-sequence token counts on the device): what the
  penalties cost.
- aligned-regex: the aligned engine with ``structured_outputs={"regex": ...}`` on every request, over
  a word-level tokenizer of the model's whole vocabulary (`throughput_engines.word_tokenizer`; the
  regex, ``--regex``, never completes, so every request keeps its length): what xgrammar's masks
  cost, with each step ahead of the host sampling only once the step before is postprocessed;
  aligned-regex-sync: the same one step at a time, what the steps ahead bring it.
- aligned-no-attention: a bound, not an engine: the aligned engine with the attention kernels
  replaced by zero outputs (the K/V are still written). The tokens are garbage, the lengths are
  not (``ignore_eos``), so the run takes the same steps at the same batch sizes: what the run
  costs without attention, i.e. what no attention kernel or KV cache mode can beat.
- fast: the same runtime on the non-aligned fast path (`LLM(aligned=False)`: cuBLAS GEMMs,
  torch norms): what alignment costs.
- HF: ``model.generate`` of the stock transformers class on the same weights (sdpa), all
  requests in one left-padded batch (or ``--hf-batch`` per batch) with ``max_new_tokens`` the
  batch's longest output; only each request's own output length counts as useful tokens.
- generate: HF's ``generate`` on our model (what a stack that calls ``model.generate`` after
  `vexact_models.patch()` gets, e.g. TRL's stock ``GRPOTrainer``), batched as HF's row, its steps
  over our model's own KV cache (`runtime.generate_cache`); generate-whole: the same with
  ``use_cache=False``, each step recomputing the whole sequence (the baseline the cache removes).
- generate-batch: transformers' continuous-batching ``generate_batch`` on our model (TRL's
  ``use_transformers_continuous_batching``), which the rollout engine runs
  (`vexact_models.batch_generation`: the engine built for the call, CUDA graphs captured, dropped
  after it); hf-generate-batch: the same call on the stock class, transformers' own paged runtime
  (its defaults: flash or sdpa paged attention, its CUDA graphs). Both take one ``max_new_tokens``
  for every request, so these two rows run every request to the workload's mean output length
  (all requests in one call, EOS off): like for like with each other, not with the rows above.
  ``--repeat N`` times the N-th call.

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

``--peer-config NAME[:LAYERS]`` measures a second model after the first in the same run (the first
freed before the second is built): the same workload (token ids below both vocabularies), the same
vexact engines, its own tables, then each engine's rate on the first beside the peer's and their
ratio (e.g. Qwen3.5-35B-A3B beside Qwen3-30B-A3B). HF ``generate`` runs with our model in host
memory meanwhile (`stock_peers.stock_alone`: two 35B models do not fit an H200 together); it runs
the same requests as ours, so its ratio is like for like (a big MoE's stock ``generate`` over 256
requests can outlast a 10-minute device call: ``--requests 32 --hf-batch 32`` for both). Its row
names the gated delta rule stock ran for the hybrids (fla's kernels where transformers bound them,
else its torch path).

The gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next; docs/design.md section 6b) hold KV pages in their
attention layers only; the floor and the roofline count those and, per running sequence and GDN
layer, the state a decode step reads and writes back: the fp32 delta-rule state ``Hv x dk x dv``
and the conv state (`decode_floor`). ``--step-breakdown`` needs nothing
model-specific. ``--tiny`` runs each config's architecture at its tiny shape on CPU (a few short
requests, no roofline table; tests/test_benchmark_scripts.py).

Usage: python benchmarks/throughput.py [--config qwen3-0.6b] [--requests 256] [--engines aligned,fast,hf]
       python benchmarks/throughput.py --config qwen3.5-35b-a3b --layers 20 --peer-config qwen3-30b-a3b:24 --engines \\
           aligned --no-roofline --repeat 2
       python benchmarks/throughput.py --config qwen3.5-35b-a3b --layers 20 --engines aligned,hf --requests 32 \\
           --hf-batch 32 --no-roofline
       python benchmarks/throughput.py --config moonlight-16b-a3b --mla-kv-cache expanded,latent --engines aligned
"""

from __future__ import annotations

import random
import sys

import torch

from bench_utils import copy_bandwidth, decode_bytes, table, workload_decode_roofline
from decode_floor import kv_bytes_per_token
from stock_peers import free
from throughput_args import parse_args
from throughput_engines import run_engines


def workload(n: int, vocab: int, seed: int, lo: int = 100, hi: int = 1024):
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(lo, hi) for _ in range(n)]
    return prompts, outputs


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


def model_config(name: str, layers: int | None, args):
    """(architecture, config) of `name` (its tiny shape with ``--tiny``), ``--set`` applied."""
    from vexact_models.conformance.models import architecture_of, make_config, parse_overrides

    arch = architecture_of(name)
    return arch, make_config(arch, None if args.tiny else name, layers, None, parse_overrides(args.set))


def measure_model(label: str, arch, config, prompts, outputs, args, engines: list[str], modes: list) -> list[tuple]:
    """Build `config`'s model, run `engines` on the workload in each KV cache mode, print its
    throughput table, the workload floor and (unless ``--no-roofline``) the decode roofline; free
    the model; return the rows (name, mode, seconds, output tokens)."""
    from vexact_models.conformance.models import build_model

    model = build_model(arch, config, args.device, args.dtype, args.seed)
    rows = []
    for mode in modes:
        set_mode(model, mode)
        rows += run_engines(arch, model, prompts, outputs, args, [e for e in engines if e != "hf" or mode == modes[0]],
                            mode)
    print(f"\n## {label} ({config.num_hidden_layers} layers)")
    print_rates(rows)
    hbm = copy_bandwidth(args.device)
    print_workload_floor(model, modes, rows, [len(p) for p in prompts], outputs, args.max_num_seqs, hbm)
    if not args.no_roofline:
        print(f"\ndecode steps (context 512-640) vs the HBM roofline (copy bandwidth {hbm:.0f} GB/s)")
        print(f"{'engine':<22}{'batch':>7}{'step ms':>10}{'roofline ms':>13}{'% of roofline':>15}")
        for mode in modes:
            set_mode(model, mode)
            for aligned in (True, False) if "fast" in engines else (True,):
                for batch in (128, 256):
                    step, roof = decode_roofline(model, config.vocab_size, batch, hbm, aligned)
                    name = ("aligned" if aligned else "fast") + (f" [{mode}]" if mode else "")
                    print(f"{name:<22}{batch:>7}{step * 1e3:>10.2f}{roof * 1e3:>13.2f}{100 * roof / step:>14.0f}%",
                          flush=True)
    del model
    free(args.device)
    return rows


def print_peer(label: str, rows: list[tuple], peer_label: str, peer_rows: list[tuple]) -> None:
    """Each vexact engine's rate on the first model beside the same engine on the peer, and their ratio."""
    peer = {name: p / s for name, _, s, p in peer_rows}
    out = [[name, f"{p / s:,.0f}", f"{peer[name.split(' [')[0]]:,.0f}", f"{p / s / peer[name.split(' [')[0]]:.2f}x"]
           for name, _, s, p in rows if name.split(" [")[0] in peer]
    table(f"{label} beside {peer_label}: the same workload, the same run", ["engine", f"{label} tok/s",
                                                                             f"{peer_label} tok/s", "ratio"], out)


def main(argv=None) -> int:
    args = parse_args(argv, __doc__)
    arch, config = model_config(args.config, args.layers, args)
    peer = model_config(*args.peer, args) if args.peer else None
    vocab = min(config.vocab_size, peer[1].vocab_size) if peer else config.vocab_size
    lo, hi = (4, 24) if args.tiny else (100, 1024)
    prompts, outputs = workload(args.requests, vocab, args.seed, lo, hi)
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU (--tiny)"
    label = f"{args.config}{' tiny' if args.tiny else ''}"
    peer_label = f"{args.peer[0]}{' tiny' if args.tiny else ''}" if peer else ""
    print(f"{device}, torch {torch.__version__}; {label} ({config.num_hidden_layers} layers)"
          + (f" beside {peer_label} ({peer[1].num_hidden_layers} layers)" if peer else "")
          + f", {args.requests} requests, {sum(map(len, prompts))} prompt tokens, {sum(outputs)} output tokens")
    modes = [m for m in (args.mla_kv_cache or "").split(",") if m] or [None]
    rows = measure_model(label, arch, config, prompts, outputs, args, args.engines, modes)
    if peer:
        peer_rows = measure_model(peer_label, *peer, prompts, outputs, args, [e for e in args.engines if e != "hf"],
                                  [None])
        print_peer(f"{label} ({config.num_hidden_layers} layers)", rows,
                   f"{peer_label} ({peer[1].num_hidden_layers} layers)", peer_rows)
    return 0


def print_workload_floor(model, modes: list, rows: list[tuple], prompt_lens: list[int], outputs: list[int],
                         max_seqs: int, hbm: float) -> None:
    """Per KV cache mode, what the workload's decode steps read at least over the copy bandwidth
    (`workload_decode_roofline`), and each vexact run's seconds against it. With two MLA modes,
    the ratio of their floors is the throughput ratio the two reach when both run at the same
    share of their floor (latent / expanded, docs/mla-kv-cache.md). A gated-DeltaNet hybrid's
    cache column holds its attention layers' KV and its GDN layers' state (`decode_floor`)."""
    from vexact_models.runtime.linear_state_cache import linear_state_spec

    print(f"\nthe workload's decode steps at the copy bandwidth ({hbm:.0f} GB/s; prompt steps not counted): "
          f"a floor for each run")
    cache = "KV + GDN state s" if linear_state_spec(model) is not None else "KV s"
    print(f"{'mode':<10}{'weights s':>11}{cache:>18}{'floor s':>9}   runs: seconds (floor share)")
    floors = {}
    for mode in modes:
        set_mode(model, mode, quiet=True)
        weights, kv = workload_decode_roofline(model, prompt_lens, outputs, max_seqs, hbm)
        floors[mode] = weights + kv
        runs = ", ".join(f"{name} {seconds:.1f} ({100 * floors[mode] / seconds:.0f}%)"
                         for name, row_mode, seconds, _ in rows if row_mode == mode and not name.startswith("HF"))
        print(f"{mode or '-':<10}{weights:>11.2f}{kv:>18.2f}{floors[mode]:>9.2f}   {runs}")
    if set(floors) == {"expanded", "latent"}:
        print(f"expanded / latent floor: {floors['expanded'] / floors['latent']:.2f}x (the latent / expanded throughput "
              f"ratio where both runs reach the same share of their floor)")


def set_mode(model, mode: str | None, quiet: bool = False) -> None:
    """Switch an MLA model's KV cache mode (None: leave the model as built) and print its cache size
    (unless `quiet`): KV bytes per token over the layers that hold pages; for a gated-DeltaNet
    hybrid its GDN layers' state per sequence (docs/design.md section 6b); for a model with
    sliding-window layers a sequence's KV bytes at 32k tokens with and without the pages freed
    behind the windows (docs/design.md section 6)."""
    from vexact_models.runtime.linear_state_cache import linear_state_spec
    from vexact_models.runtime.llm_args import default_block_size
    from vexact_models.runtime.llm_setup import kv_bytes_per_sequence

    if mode is not None:
        model.set_mla_kv_cache(mode)
    if quiet:
        return
    print(f"KV cache{f' ({mode})' if mode else ''}: {kv_bytes_per_token(model, torch.bfloat16):,} bytes per token "
          f"(layers, KV heads, key dim, value dim = {tuple(model.kv_cache_spec())})", flush=True)
    spec = linear_state_spec(model)
    if spec is not None:
        conv, state = spec.part_bytes(torch.bfloat16)
        print(f"gated DeltaNet: {len(spec.layers)} of {model.config.num_hidden_layers} layers hold a state instead of KV "
              f"pages: per sequence and layer {state:,} bytes of fp32 delta-rule state and {conv:,} of conv state; a "
              f"decode step reads and writes them (the floor and roofline count both)", flush=True)
    page = default_block_size(model.kv_cache_spec())
    freed, kept = (kv_bytes_per_sequence(model, 32768, dtype=torch.bfloat16, block_size=page, window_freed=freed)
                   for freed in (True, False))
    if freed != kept:
        print(f"KV bytes per sequence at 32k tokens: {freed:,} with window-freed pages, {kept:,} without "
              f"(bf16, pages of {page})", flush=True)


def print_rates(rows: list[tuple]) -> None:
    """The throughput table: each row against HF (the ``generate_batch`` rows against stock's
    ``generate_batch``, the others against HF ``generate``) and against the fast path of its own
    KV cache mode."""
    hf_rates = {batch: next((p / s for n, _, s, p in rows if n.startswith("HF") and ("generate_batch" in n) == batch),
                            None) for batch in (False, True)}
    fast = {m: p / s for n, m, s, p in rows if n.startswith("vexact fast path")}
    print(f"\n{'engine':<58}{'seconds':>9}{'output tokens':>15}{'output tok/s':>14}{'vs HF':>8}{'vs fast':>9}")
    for name, mode, seconds, produced in rows:
        rate = produced / seconds
        hf_rate = hf_rates["generate_batch" in name]
        vs_hf = f"{rate / hf_rate:.1f}x" if hf_rate else "-"
        vs_fast = f"{rate / fast[mode]:.2f}" if mode in fast and not name.startswith("HF") else "-"
        print(f"{name:<58}{seconds:>9.1f}{produced:>15,}{rate:>14,.0f}{vs_hf:>8}{vs_fast:>9}")


if __name__ == "__main__":
    sys.exit(main())
