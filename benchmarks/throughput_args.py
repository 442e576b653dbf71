"""throughput.py's command line: its engines and options, checked before anything is built (a bad
``--config``, ``--peer-config``, engine or ``--mla-kv-cache`` is a usage error naming the option and
the value)."""

from __future__ import annotations

import argparse

from bench_utils import check_overrides, positive_int, tiny_or_cuda
from training import parse_configs

# --engines names and their table rows ("hf" is labelled with its batch)
ENGINES = {"aligned": "vexact aligned", "aligned-sync": "vexact aligned, one step at a time",
           "aligned-eager": "vexact aligned, no CUDA graphs",
           "aligned-decode-graphs": "vexact aligned, decode graphs only",
           "aligned-fa4": "vexact aligned, FA4 attention",
           "aligned-top20": "vexact aligned, logprobs=20",
           "aligned-penalties": "vexact aligned, penalties",
           "aligned-regex": "vexact aligned, structured outputs (regex)",
           "aligned-regex-sync": "vexact aligned, structured outputs (regex), sync",
           "aligned-no-attention": "bound: aligned, no attention", "fast": "vexact fast path (cuBLAS)",
           "hf": "HF generate", "generate": "vexact model, HF's generate",
           "generate-whole": "vexact model, HF's generate, use_cache=False",
           "generate-batch": "vexact model, generate_batch", "hf-generate-batch": "HF generate_batch"}
#: engines that run on CUDA only (the cuBLAS fast path, FlashAttention-4)
CUDA_ENGINES = ("fast", "aligned-fa4")


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """throughput.py's options (`description`: its --help text); ``args.device`` and ``args.dtype``
    set (``--tiny``: CPU), ``args.peer`` the ``(name, layers)`` of ``--peer-config`` or None."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="qwen3-0.6b", help="bundled config name or config.json path")
    parser.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    parser.add_argument("--peer-config", metavar="NAME[:LAYERS]",
                        help="a second model measured after the first in the same run, on the same workload (token "
                             "ids below both vocabularies), by the same vexact engines, e.g. qwen3-30b-a3b; the first "
                             "is freed before it is built. Printed with the ratio of the two")
    parser.add_argument("--requests", type=positive_int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=positive_int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=8192)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument("--hf-batch", type=positive_int, default=64,
                        help="requests per HF generate call (sorted by output length)")
    parser.add_argument("--engines",
                        help=f"comma-separated subset of {', '.join(ENGINES)} (default: aligned,fast,hf; with --tiny "
                             f"aligned,hf: {', '.join(CUDA_ENGINES)} need a CUDA GPU)")
    parser.add_argument("--skip-hf", action="store_true", help="same as leaving hf out of --engines")
    parser.add_argument("--no-roofline", action="store_true", help="skip the decode step / roofline table")
    parser.add_argument("--repeat", type=positive_int, default=1,
                        help="run the workload this many times on each vexact engine and count the last (steady "
                             "state: CUDA graphs captured on first use are captured by then); default 1")
    parser.add_argument("--step-breakdown", action="store_true",
                        help="print each vexact run's step count, seconds and median step time, split into "
                             "decode-only steps and steps with prompt tokens")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (JSON value; repeatable), e.g. --set n_routed_experts=8")
    parser.add_argument("--mla-kv-cache", metavar="MODES",
                        help="MLA models: comma-separated KV cache modes to run in turn (expanded, latent)")
    parser.add_argument("--regex", metavar="REGEX",
                        help="the aligned-regex row's constraint over the word tokenizer's lowercase words and space "
                             "(default: throughput_engines.STRUCTURED_REGEX); it must never complete (the rows' "
                             "lengths are compared), e.g. '([a-z]{1,6} )+[0-9]' bounds each word's length")
    parser.add_argument("--block-size", type=positive_int,
                        help="positions per KV page of the vexact engines (default: LLM's own, `default_block_size`)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, float32, each config's architecture at its tiny shape, a few short requests, no "
                             "roofline table (tests)")
    args = parser.parse_args(argv)
    engines = args.engines or ("aligned,hf" if args.tiny else "aligned,fast,hf")
    args.engines = [e for e in engines.split(",") if e and not (e == "hf" and args.skip_hf)]
    for engine in args.engines:
        if engine not in ENGINES:
            parser.error(f"--engines: unknown engine {engine!r} (known: {', '.join(ENGINES)})")
        if args.tiny and engine in CUDA_ENGINES:
            parser.error(f"--engines: {engine} needs a CUDA GPU, and --tiny runs on CPU")
    check_models(parser, args)
    check_overrides(parser, args.set, [args.config, *([args.peer[0]] if args.peer else [])], args.tiny)
    if args.peer and not [e for e in args.engines if e != "hf"]:
        parser.error(f"--peer-config {args.peer_config!r}: the peer runs the vexact engines of --engines, and "
                     f"--engines={','.join(args.engines)} has none")
    if args.tiny:
        args.requests, args.max_num_seqs, args.no_roofline = min(args.requests, 6), min(args.max_num_seqs, 4), True
    tiny_or_cuda(args, "benchmarks/throughput.py")
    return args


def check_models(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--config`` and ``--peer-config`` name configs of registered architectures (a usage error
    naming the option and the value otherwise); sets ``args.peer`` to ``(name, layers)`` or None."""
    from vexact_models.conformance.models import architecture_of

    try:
        arch = architecture_of(args.config)
    except ValueError as err:
        parser.error(f"--config {args.config!r}: {err}")
    if args.mla_kv_cache and not hasattr(arch.causal_lm_class, "set_mla_kv_cache"):
        parser.error(f"--mla-kv-cache: {args.config} is not an MLA model")
    args.peer = None
    if args.peer_config is None:
        return
    try:
        [args.peer] = parse_configs(args.peer_config) or [None]
        if args.peer is None:
            raise ValueError("expected NAME[:LAYERS], e.g. qwen3-30b-a3b")
        architecture_of(args.peer[0])
    except ValueError as err:
        parser.error(f"--peer-config {args.peer_config!r}: {err}")
