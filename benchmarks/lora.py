"""LoRA at full speed? The RL loop with `LLM(peft_model)` beside its peers, in one run.

One model at a published shape (random weights, bf16, CUDA; default Qwen3-8B, ``--layers`` to
trim), LoRA on every linear layer and on MoE models both fused expert tensors (``--rank`` 16,
alpha twice that, random A and B so the adapters change every output; adapter weights fp32 as
PEFT makes them, ``--adapter-dtype bf16`` to keep them in the base dtype). Four tables:

1. rollout: tok/s of the engine over the LoRA model beside the engine over the same base model
   without adapters: the same prompts and sampling (``--samples`` requests, prompts of
   ``--prompt-len / 2`` to ``--prompt-len`` tokens, ``--max-tokens / 2`` to ``--max-tokens``
   output tokens each, ``ignore_eos``), one warm-up call first; then every LoRA sample's
   logprobs recomputed with ``token_logprobs`` (want 0 mismatches).
2. training: forward + backward of `token_logprobs` + a loss (benchmarks/training.py's) at
   ``--train-shape`` (sequences x tokens, default 4 x 2048 = 8k tokens): ours with LoRA, stock
   transformers (sdpa) + PEFT with the same LoRA config, and ours without adapters (every
   parameter trained) as the base reference.
3. recompute: the RL step's forward + backward over micro-batches of ``--recompute-shape``
   (default 8 x 2048 tokens, ``--recompute-micro-batches`` of them accumulated) with the LoRA
   engine asleep (level 1: KV cache and graphs freed, weights shared), beside HF + PEFT at the
   same micro-batches: peak memory, fits or OOM, tok/s.
4. adapter-only weight sync: an FSDP2 trainer (world size 1, the LoRA model under `shard`) with
   other adapters streams them into the engine (``stream_full_weights(..., adapters_only=True)``
   -> ``LLM.update_weights``), beside the same from a state dict of full tensors and beside
   streaming the full weights; then the engine's adapters must equal the trainer's and a short
   rollout must equal the trainer's recompute (0 mismatches).

Usage (one H200; current figures in docs/performance.md):
    cd benchmarks && python3 lora.py --config qwen3-8b
    cd benchmarks && python3 lora.py --config qwen3-0.6b --samples 32,256
    cd benchmarks && python3 lora.py --config qwen3-30b-a3b --layers 24 --parts rollout   # experts adapted
    cd benchmarks && python3 lora.py --tiny               # CPU smoke run (tests/test_benchmark_scripts.py)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
import torch.distributed as dist

from bench_models import recompute_mismatches
from bench_utils import (positive_int, positive_ints, shape_arg, stock_twin, subset_arg, synchronize, table, timed,
                         tiny_or_cuda)
from stock_peers import free
from training import batch_of, hf_loss, use_checkpointing, vexact_loss

PARTS = ("rollout", "training", "recompute", "sync")
parts_arg = subset_arg(PARTS)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="qwen3-8b", help="bundled config name or config.json path (conformance/configs)")
    p.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    p.add_argument("--rank", type=positive_int, default=16, help="LoRA rank r (alpha = 2r); default 16")
    p.add_argument("--adapter-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="adapter weights' dtype (default fp32, PEFT's own: it upcasts bf16 adapters)")
    p.add_argument("--samples", type=positive_ints, default=[32, 256], help="rollout requests, comma-separated")
    p.add_argument("--prompt-len", type=positive_int, default=256, help="longest prompt (shortest: half)")
    p.add_argument("--max-tokens", type=positive_int, default=512, help="longest output (shortest: half)")
    p.add_argument("--repeat", type=positive_int, default=1,
                   help="rollout runs per sample count on each engine, the last counted (default 1)")
    p.add_argument("--kv-cache-gib", type=float, default=32.0, help="each engine's KV cache (GiB)")
    p.add_argument("--train-shape", type=shape_arg, default=(4, 2048), help="training batch SEQSxTOKENS (4x2048)")
    p.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                   help="activation checkpointing in the training table (training.py's rule; default auto)")
    p.add_argument("--recompute-shape", type=shape_arg, default=(8, 2048), help="recompute micro-batch (8x2048)")
    p.add_argument("--recompute-micro-batches", type=positive_int, default=2)
    p.add_argument("--recompute-checkpointing", action="store_true", help="activation checkpointing in the recompute")
    p.add_argument("--steps", type=positive_int, default=2, help="timed steps per point after one warm-up")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parts", type=parts_arg, default=list(PARTS),
                   help=f"comma-separated tables to measure, of {','.join(PARTS)} (default all; each fits a "
                        "10-minute device call at 8B alone)")
    p.add_argument("--tiny", action="store_true", help="CPU, float32, the tiny Qwen3 config, a few tokens (tests)")
    args = p.parse_args(argv)
    if args.kv_cache_gib <= 0:
        p.error(f"--kv-cache-gib={args.kv_cache_gib} must be > 0")
    if args.tiny:
        args.config, args.samples, args.prompt_len, args.max_tokens, args.kv_cache_gib = "tiny", [2, 4], 8, 8, 1 / 64
        args.train_shape, args.recompute_shape, args.steps = (2, 16), (2, 16), 1
    tiny_or_cuda(args, "benchmarks/lora.py")
    return args


# -- shared -------------------------------------------------------------------------------------

def build(args, seed: int):
    from vexact_models.conformance.models import architecture_of, build_model, make_config
    from vexact_models.registry import get

    arch = get("qwen3") if args.config == "tiny" else architecture_of(args.config)
    config = make_config(arch, None if args.config == "tiny" else args.config, args.layers, None,
                         {"initializer_range": 0.3} if args.config == "tiny" else None)
    return arch, build_model(arch, config, args.device, args.dtype, seed)


def with_lora(model, args, seed: int):
    """`model` under LoRA on every linear layer and, on MoE models, both fused expert tensors
    (r = ``--rank``, alpha 2r), random A and B drawn with `seed`, adapters in ``--adapter-dtype``
    (PEFT upcasts them to fp32 unless told not to)."""
    from peft import LoraConfig, get_peft_model

    from vexact_models.adapters import expert_target_parameters

    torch.manual_seed(seed)
    config = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules="all-linear", lora_dropout=0.0,
                        init_lora_weights=False, target_parameters=expert_target_parameters(model))
    return get_peft_model(model, config, autocast_adapter_dtype=args.adapter_dtype == "fp32")


def make_llm(model, args, max_num_seqs: int):
    from vexact_models.runtime import LLM

    return LLM(model, device=args.device, kv_cache_bytes=int(args.kv_cache_gib * 2**30), max_num_seqs=max_num_seqs,
               max_model_len=args.prompt_len + args.max_tokens + 1)


def requests(n: int, vocab: int, args):
    """`n` prompts and their sampling parameters, the same for every engine (seeded by `n`)."""
    from vexact_models.runtime import SamplingParams

    rng = random.Random(1000 + n)
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(max(1, args.prompt_len // 2), args.prompt_len))]
               for _ in range(n)]
    params = [SamplingParams(temperature=1.0, max_tokens=rng.randint(max(1, args.max_tokens // 2), args.max_tokens),
                             ignore_eos=True, seed=i) for i in range(n)]
    return prompts, params


def rollouts(llm, args) -> tuple[dict[int, tuple[float, int]], list]:
    """{samples: (seconds, output tokens)} of the last of ``--repeat`` runs of each ``--samples``
    count (CUDA graphs captured on first use are captured by then), after one warm-up call; and
    the (prompt, completion, logprobs) samples of the last count."""
    from vexact_models.runtime import SamplingParams

    llm.generate([[1, 2, 3]] * 2, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # compile, capture
    rates, samples = {}, []
    for n in args.samples:
        prompts, params = requests(n, llm.config.vocab_size, args)
        for _ in range(args.repeat):  # the last run counts
            synchronize(args.device)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            synchronize(args.device)
            rates[n] = (time.perf_counter() - t0, sum(len(o.outputs[0].token_ids) for o in outs))
        samples = [(o.prompt_token_ids, o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]
    return rates, samples


# -- forward + backward --------------------------------------------------------------------------

def fwd_bwd(model, loss_fn, batches: list[torch.Tensor], args, checkpointing: bool) -> tuple[float, float | None]:
    """(median seconds of a step: forward + backward of every micro-batch of `batches`, gradients
    accumulated; peak GiB on CUDA, else None) over ``--steps`` steps after one warm-up. Raises
    torch.OutOfMemoryError when it does not fit."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    model.train()
    cuda = args.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    try:
        for step in range(args.steps + 1):
            model.zero_grad(set_to_none=True)
            synchronize(args.device)
            t0 = time.perf_counter()
            for ids in batches:
                loss_fn(model, ids).backward()
            synchronize(args.device)
            if step:  # the first step compiles kernels and allocates
                times.append(time.perf_counter() - t0)
    finally:
        model.zero_grad(set_to_none=True)
        model.gradient_checkpointing_disable()
        model.eval()
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30 if cuda else None


def point(name: str, model, loss_fn, shape, micro_batches: int, args, checkpointing: bool) -> list:
    """[side, tokens, seconds, tok/s, peak GiB, fits] of `fwd_bwd` at `shape`, OOM as a row."""
    seqs, length = shape
    vocab = model.config.vocab_size
    batches = [batch_of(vocab, seqs * length, length, args.seed + i).to(args.device) for i in range(micro_batches)]
    tokens = seqs * length * micro_batches
    try:
        seconds, peak = fwd_bwd(model, loss_fn, batches, args, checkpointing)
        row = [name, tokens, seconds, tokens / seconds, peak, "fits"]
    except torch.OutOfMemoryError:
        row = [name, tokens, float("nan"), float("nan"), None, "OOM"]
    del batches
    free(args.device)
    print(f"{name}: {tokens} tokens, {row[5]}, {row[3]:,.0f} tok/s", flush=True)
    return row


def hf_peft_points(arch, model, args, parts: set[str]) -> tuple[list | None, list | None]:
    """Stock transformers (sdpa) + PEFT on `model`'s weights: (training row, recompute row), each
    None when its part is not asked for."""
    hf = with_lora(stock_twin(arch, model), args, args.seed + 1)
    params = sum(p.numel() for p in hf.parameters())
    train = recompute = None
    if "training" in parts:
        train = point("HF + PEFT (sdpa)", hf, hf_loss, args.train_shape, 1, args,
                      use_checkpointing(args.checkpointing, args.train_shape[1], params))
    if "recompute" in parts:
        recompute = point("HF + PEFT (sdpa)", hf, hf_loss, args.recompute_shape, args.recompute_micro_batches, args,
                          args.recompute_checkpointing)
    del hf
    free(args.device)
    return train, recompute


# -- adapter-only weight sync ----------------------------------------------------------------------

def adapter_sync(llm, engine_model, args) -> tuple[list[list], bool, tuple[int, int]]:
    """Rows (method, tensors, bytes, seconds, GB/s, vs full) of weight syncs from an FSDP2 trainer
    into the (asleep) engine; whether the engine's adapters equal the trainer's after them; and
    (tokens checked, mismatches) of a short rollout against the trainer's recompute."""
    from vexact_models.adapter_weights import adapter_tensors
    from vexact_models.distributed import shard, stream_full_weights

    _, trainer_base = build(args, args.seed)  # the engine's base weights
    trainer = with_lora(trainer_base, args, args.seed + 2)  # other adapters: the sync must bring them
    shard(trainer)  # the model under PEFT
    adapters = {t.name: t.param.full_tensor() for t in adapter_tensors(trainer)}
    syncs = {
        "stream_full_weights(adapters_only=True) -> update_weights":
            lambda: llm.update_weights(stream_full_weights(trainer, adapters_only=True)),
        "update_weights(adapter state dict on the device)": lambda: llm.update_weights(adapters),
        "stream_full_weights (full weights) -> update_weights": lambda: llm.update_weights(stream_full_weights(trainer)),
    }
    full_bytes = sum(p.numel() * p.element_size() for p in trainer.parameters())
    adapter_bytes = sum(v.numel() * v.element_size() for v in adapters.values())
    rows = []
    for method, fn in syncs.items():
        full = "full weights" in method
        n, nbytes = (sum(1 for _ in trainer.parameters()), full_bytes) if full else (len(adapters), adapter_bytes)
        rows.append([method, n, nbytes, timed(fn, args.device)])
    engine = {t.name: t.param for t in adapter_tensors(engine_model)}
    same = len(engine) == len(adapters) and all(torch.equal(engine[n], v) for n, v in adapters.items())
    full_seconds = rows[-1][3]
    llm.wake_up()
    _, samples = rollouts(llm, argparse.Namespace(**{**vars(args), "samples": [16], "repeat": 1}))
    checked, bad, _ = recompute_mismatches(trainer, samples, 16384, args.device)
    size = [f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.3f} MB" for *_, b, _ in rows]
    return ([[m, n, s, f"{sec * 1e3:.2f}", f"{b / sec / 1e9:.2f}", f"{full_seconds / sec:.1f}x"]
             for (m, n, b, sec), s in zip(rows, size)], same, (checked, bad))


# -- the run -------------------------------------------------------------------------------------

def fmt_row(row: list, peers: list[list | None]) -> list:
    """A forward + backward row for the table, with its rate against each of `peers`."""
    name, tokens, seconds, rate, peak, fits = row
    ratios = [f"{rate / p[3]:.2f}x" if p is not None and fits == "fits" and p[5] == "fits" else "-" for p in peers]
    return [name, tokens, fits, f"{rate:,.0f}", "n/a (CPU)" if peak is None else f"{peak:.1f}", *ratios]


def measure(args) -> dict:
    """Every ``--parts`` table's rows, in the order that keeps memory low: HF + PEFT first (its
    twin freed), the base engine, ours without adapters, then the LoRA model and its engine."""
    parts, out = set(args.parts), {}
    arch, model = build(args, args.seed)
    out["layers"] = model.config.num_hidden_layers
    params = sum(p.numel() for p in model.parameters())
    train_ckpt = use_checkpointing(args.checkpointing, args.train_shape[1], params)
    if parts & {"training", "recompute"}:
        out["hf_train"], out["hf_recompute"] = hf_peft_points(arch, model, args, parts)
    if "rollout" in parts:
        llm = make_llm(model, args, max(args.samples))
        out["base_rates"], _ = rollouts(llm, args)
        del llm
        free(args.device)
    if "training" in parts:
        model.requires_grad_(True)
        out["base_train"] = point("vexact, no adapters (full fine-tune)", model, vexact_loss, args.train_shape, 1,
                                  args, train_ckpt)
    peft = with_lora(model, args, args.seed + 1)
    llm = make_llm(peft, args, max(args.samples))
    if "rollout" in parts:
        out["lora_rates"], samples = rollouts(llm, args)
        out["mismatches"] = recompute_mismatches(peft, samples, 16384, args.device)
    llm.sleep(level=1)  # the RL step runs with the engine asleep: KV cache and graphs freed
    if "recompute" in parts:
        out["recompute"] = point("vexact + LoRA, engine asleep", peft, vexact_loss, args.recompute_shape,
                                 args.recompute_micro_batches, args, args.recompute_checkpointing)
    if "training" in parts:
        out["lora_train"] = point("vexact + LoRA", peft, vexact_loss, args.train_shape, 1, args, train_ckpt)
    if "sync" in parts:
        out["sync"] = adapter_sync(llm, peft, args)  # its trainer is freed on return
        free(args.device)
    return out


def report(out: dict, args) -> bool:
    """Print the tables; True when every check passed (0 mismatches, the synced adapters equal)."""
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU"
    print(f"\n{device}, torch {torch.__version__}; {args.config} ({out['layers']} layers), {args.dtype} base, "
          f"LoRA r={args.rank} on every linear layer, {args.adapter_dtype} adapters")
    ok = True
    if "lora_rates" in out:
        base, lora = out["base_rates"], out["lora_rates"]
        table(f"rollout: {args.prompt_len // 2}-{args.prompt_len} prompt tokens, {args.max_tokens // 2}-"
              f"{args.max_tokens} output tokens per sample, the same requests on both",
              ["samples", "output tokens", "base tok/s", "LoRA tok/s", "LoRA/base"],
              [[n, base[n][1], f"{base[n][1] / base[n][0]:,.0f}", f"{lora[n][1] / lora[n][0]:,.0f}",
                f"{(lora[n][1] / lora[n][0]) / (base[n][1] / base[n][0]):.2f}x"] for n in args.samples])
        checked, bad, worst = out["mismatches"]
        print(f"LoRA rollout of {args.samples[-1]} samples recomputed: {checked:,} tokens, {bad} mismatches "
              f"(max |diff| {worst:.3g})")
        ok &= checked > 0 and bad == 0
    header = ["side", "tokens", "fits", "tok/s", "peak GiB", "vs HF + PEFT"]
    if "lora_train" in out:
        seqs, length = args.train_shape
        rows = (out["hf_train"], out["lora_train"], out["base_train"])
        table(f"training: forward + backward of token logprobs + loss, {seqs} x {length} tokens",
              header + ["vs no adapters"], [fmt_row(r, [out["hf_train"], out["base_train"]]) for r in rows])
    if "recompute" in out:
        seqs, length = args.recompute_shape
        table(f"recompute: forward + backward, {args.recompute_micro_batches} micro-batches of {seqs} x {length} "
              f"tokens{', checkpointing' if args.recompute_checkpointing else ''}", header,
              [fmt_row(r, [out["hf_recompute"]]) for r in (out["hf_recompute"], out["recompute"])])
    if "sync" in out:
        rows, same, (checked, bad) = out["sync"]
        table(f"weight sync from an FSDP2 trainer (world size 1) into the asleep engine, LoRA r={args.rank}",
              ["method", "tensors", "bytes", "ms", "GB/s", "full sync / this"], rows)
        print(f"after the syncs: the engine's adapters {'equal' if same else 'DIFFER FROM'} the trainer's; "
              f"rollout recomputed: {checked:,} tokens, {bad} mismatches")
        ok &= same and checked > 0 and bad == 0
    return ok


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("nccl" if args.device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    ok = report(measure(args), args)
    dist.destroy_process_group()
    print("\nOK" if ok else "\nFAILED: mismatches, or adapters that differ after the sync")
    return 0 if ok else 1


if __name__ == "__main__":
    from vexact_models.distributed import exit_rank

    exit_rank(main())  # not sys.exit: interpreter teardown with gloo threads alive can abort a rank
