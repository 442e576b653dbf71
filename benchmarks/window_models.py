"""GPT-OSS, Gemma 3 and OLMo 3 (sliding-window layers beside global ones, GPT-OSS's sinks) beside
stock HF in one run: rollout, training, KV cache.

One model at a published shape (random weights, bf16, CUDA; default gpt-oss-20b, whole at 24
layers, ``--layers`` to trim; ``--config gemma3-text-default`` or ``olmo3-default``), three tables (``--parts``):

1. rollout: output tok/s of the engine (`LLM.generate`, CUDA graphs) beside stock HF
   ``generate`` on the same weights (``throughput_engines.run_hf``, every request in one left-padded batch
   or ``--hf-batch`` a batch, each run to its longest output), the same requests (``--samples``,
   prompts of ``--prompt-len / 2`` to ``--prompt-len`` tokens, outputs of ``--max-tokens / 2`` to
   ``--max-tokens``, ``ignore_eos``), one warm-up call first; then every sample's logprobs
   recomputed by ``token_logprobs`` (want 0 mismatches).
2. training: forward + backward of `token_logprobs` + a loss (training.py's) at ``--train-shape``
   (default 1 x 8192 tokens) beside stock HF's logits + log-softmax, activation checkpointing by
   training.py's rule on both sides. Stock's attention is `bench_utils.stock_attention`'s: sdpa
   for Gemma 3 and OLMo 3; eager for GPT-OSS, whose sinks transformers runs only in eager, flex attention
   (``torch.compile``) or the kernels hub's FlashAttention-3 (a download), not sdpa.
   While stock's side runs, our model waits in host memory (two 21B models and one set of
   gradients would not fit an H200 together).
3. kv: KV cache bytes per sequence at ``--kv-tokens`` (default 32k), every layer's pages kept
   beside the local layers' pages behind their window freed (`kv_bytes_per_sequence`: the
   engine's own count where it reports one, else computed from the config, labelled so).

Usage (one H200; each part fits a 10-minute device call at gpt-oss-20b's 24 layers):
    cd benchmarks && python3 window_models.py --config gpt-oss-20b --parts rollout
    cd benchmarks && python3 window_models.py --config gpt-oss-20b --parts training,kv
    cd benchmarks && python3 window_models.py --config gemma3-text-default --layers 16
    cd benchmarks && python3 window_models.py --tiny --config gemma3-text-default   # CPU smoke run (tests)
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from bench_models import build_published, recompute_mismatches
from bench_utils import (gpu_share, positive_int, shape_arg, stock_attention, subset_arg, synchronize, table,
                         tiny_or_cuda)
from lora import point, requests
from stock_peers import free, stock_alone
from throughput_engines import run_hf
from training import hf_loss, use_checkpointing, vexact_loss

from vexact_models.runtime import llm_setup

PARTS = ("rollout", "training", "kv")
CONFIGS = ("gpt-oss-20b", "gpt-oss-120b", "gemma3-text-default", "olmo3-default")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="gpt-oss-20b", choices=CONFIGS, help="bundled published config")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    p.add_argument("--parts", type=subset_arg(PARTS), default=list(PARTS),
                   help=f"comma-separated tables to measure, of {','.join(PARTS)} (default all)")
    p.add_argument("--samples", type=positive_int, default=64, help="rollout requests (default 64)")
    p.add_argument("--prompt-len", type=positive_int, default=1024, help="longest prompt (shortest: half)")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="longest output (shortest: half)")
    p.add_argument("--hf-batch", type=positive_int, help="requests per HF generate call (default: all at once)")
    p.add_argument("--gpu-memory-utilization", type=gpu_share, default=0.85, help="the engine's share of the GPU (0.85)")
    p.add_argument("--train-shape", type=shape_arg, default=(1, 8192), help="training batch SEQSxTOKENS (1x8192)")
    p.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="activation checkpointing in the training table (training.py's rule; default auto)")
    p.add_argument("--steps", type=positive_int, default=2, help="timed training steps after one warm-up")
    p.add_argument("--kv-tokens", type=positive_int, default=32768, help="sequence length of the KV table (32768)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the architecture's tiny config (tests)")
    args = p.parse_args(argv)
    if args.tiny:
        args.samples, args.prompt_len, args.max_tokens, args.train_shape, args.steps = 3, 24, 8, (2, 24), 1
        args.kv_tokens = min(args.kv_tokens, 256)
    args.hf_batch = args.hf_batch or args.samples
    tiny_or_cuda(args, "benchmarks/window_models.py")
    args.recompute_checkpointing = False  # (lora.point's namespace)
    return args


def build(args):
    """(architecture, config, model): the published config (``--layers``), or in ``--tiny`` the
    architecture's tiny config, random weights (sinks and expert biases too)."""
    return build_published(args, max(args.kv_tokens, args.train_shape[1], 4096))


# -- KV cache -------------------------------------------------------------------------------------

def kv_bytes_per_sequence(model, tokens: int, block_size: int, dtype: torch.dtype) -> tuple[int, int, str]:
    """KV cache bytes one sequence of `tokens` tokens holds: (every layer's pages kept, the pages
    behind each sliding-window layer's window freed, where the numbers come from), the engine's
    own count (`runtime.llm_setup.kv_bytes_per_sequence`, what `LLM.kv_bytes_per_sequence`
    reports: the window page group, docs/design.md section 6)."""
    kept = llm_setup.kv_bytes_per_sequence(model, tokens, dtype=dtype, block_size=block_size, window_freed=False)
    freed = llm_setup.kv_bytes_per_sequence(model, tokens, dtype=dtype, block_size=block_size, window_freed=True)
    return kept, freed, "the engine's count"


def kv_rows(model, args) -> list[list]:
    from vexact_models.runtime.llm_args import default_block_size

    block = default_block_size(model.kv_cache_spec())
    kept, freed, source = kv_bytes_per_sequence(model, args.kv_tokens, block, torch.bfloat16)
    windows = sorted({getattr(layer.self_attn, "sliding_window", None) or 0 for layer in model.model.layers})
    return [[f"{args.kv_tokens:,}", block, ", ".join(str(w) if w else "full" for w in windows),
             f"{kept / 2**20:,.2f}", f"{freed / 2**20:,.2f}", f"{kept / freed:.2f}x", source]]


# -- rollout and training --------------------------------------------------------------------------

def rollout(arch, model, args) -> dict:
    """HF generate first (`stock_alone`), then the engine on the same requests, then the recompute."""
    from vexact_models.runtime import LLM, SamplingParams

    prompts, params = requests(args.samples, model.config.vocab_size, args)
    outputs = [sp.max_tokens for sp in params]
    with stock_alone(arch, model, args.device) as hf:
        hf_seconds, hf_tokens = run_hf(hf.eval(), prompts, outputs, args.hf_batch, temperature=1.0)
    budget = {"kv_cache_bytes": 1 << 22} if args.tiny else {"gpu_memory_utilization": args.gpu_memory_utilization}
    llm = LLM(model, device=args.device, max_num_seqs=args.samples, max_model_len=args.prompt_len + args.max_tokens + 1,
              **budget)
    llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # compile, capture
    synchronize(args.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    synchronize(args.device)
    seconds = time.perf_counter() - t0
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    samples = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    del llm
    free(args.device)
    checked, bad, worst = recompute_mismatches(model, samples, 16384, args.device)
    return {"hf": (hf_seconds, hf_tokens), "ours": (seconds, produced), "mismatches": (checked, bad, worst)}


def training(arch, model, args) -> tuple[list, list]:
    """(stock row, our row) of lora.point at ``--train-shape``: stock first (`stock_alone`), then ours."""
    params = sum(p.numel() for p in model.parameters())
    ckpt = use_checkpointing(args.checkpointing, args.train_shape[1], params)
    with stock_alone(arch, model, args.device) as hf:
        stock = point(f"HF ({stock_attention(arch)})", hf, hf_loss, args.train_shape, 1, args, ckpt)
    ours = point("vexact", model, vexact_loss, args.train_shape, 1, args, ckpt)
    return stock, ours


def report(arch, config, out: dict, args) -> bool:
    """Print the tables; True when the rollout check passed (0 mismatches) or was not run."""
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    label = f"{config.model_type} tiny" if args.tiny else args.config
    print(f"\n{device}, torch {torch.__version__}; {label} ({config.num_hidden_layers} layers), {args.dtype}")
    ok = True
    if "rollout" in out:
        (hs, ht), (s, n), (checked, bad, worst) = out["rollout"]["hf"], out["rollout"]["ours"], out["rollout"]["mismatches"]
        table(f"rollout: {args.samples} requests, {args.prompt_len // 2}-{args.prompt_len} prompt tokens, "
              f"{args.max_tokens // 2}-{args.max_tokens} output tokens each, the same requests on both",
              ["side", "output tokens", "seconds", "tok/s", "vs HF"],
              [[f"HF generate ({stock_attention(arch)}, batch {args.hf_batch})", ht, f"{hs:.1f}", f"{ht / hs:,.0f}",
                "1.00x"], ["vexact LLM", n, f"{s:.1f}", f"{n / s:,.0f}", f"{(n / s) / (ht / hs):.2f}x"]])
        print(f"rollout recomputed: {checked:,} tokens, {bad} mismatches (max |diff| {worst:.3g})")
        ok &= checked > 0 and bad == 0
    if "training" in out:
        stock, ours = out["training"]
        seqs, length = args.train_shape
        rows = [[name, tokens, fits, f"{rate:,.0f}", "n/a (CPU)" if peak is None else f"{peak:.1f}",
                 f"{rate / stock[3]:.2f}x" if fits == stock[5] == "fits" else "-"]
                for name, tokens, _, rate, peak, fits in (stock, ours)]
        table(f"training: forward + backward of token logprobs + loss, {seqs} x {length} tokens",
              ["side", "tokens", "fits", "tok/s", "peak GiB", "vs HF"], rows)
    if "kv" in out:
        table("KV cache per sequence (bf16): every layer's pages kept vs the pages behind the local layers' "
              "windows freed", ["tokens", "page", "windows", "kept MiB", "freed MiB", "kept/freed", "source"],
              out["kv"])
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    arch, config, model = build(args)
    out = {}
    if "kv" in args.parts:
        out["kv"] = kv_rows(model, args)
    if "training" in args.parts:
        out["training"] = training(arch, model.train(), args)
        model.eval()
    if "rollout" in args.parts:
        with torch.no_grad():
            out["rollout"] = rollout(arch, model, args)
    ok = report(arch, config, out, args)
    print("\nOK" if ok else "\nFAILED: rollout logprobs that differ from the recompute")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
