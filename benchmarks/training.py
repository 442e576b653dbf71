"""Training step speed: forward + backward of `token_logprobs` + a loss, beside stock HF (sdpa).

What RL trains on: every step recomputes the logprobs of sampled sequences with autograd on and
backpropagates a policy-gradient loss through them. For each published shape and sequence
length, both sides get the same weights (random, bf16, CUDA) and the same batch of
``--tokens`` tokens split into equal sequences of that length:

- vexact: ``model.token_logprobs(ids, cu_seqlens=...)`` over the packed batch (the aligned
  kernels; logits never materialised in fp32 for the whole batch), loss ``-mean(logprobs)``.
- HF: the stock transformers class (``attn_implementation="sdpa"``) on a ``[B, L]`` batch,
  ``log_softmax(logits.float())`` gathered at the next tokens (what TRL's
  ``selective_log_softmax`` computes), the same loss.

Activation checkpointing (``--checkpointing``) is enabled the same way on both sides
(``gradient_checkpointing_enable``): ``auto`` turns it on where the batch's activations would not
fit otherwise (>= 16k tokens per sequence, or any model over 4B parameters). Each side then does
what its model does: stock HF recomputes whole layers, ours keeps each layer's attention output
and LSE and recomputes the rest (``kernels.attention_saving_context``; the table's "ckpt" reads
"keep attn"); ``--full-recompute`` makes ours recompute whole layers too. Reported: median step
time over ``--steps`` timed steps after one warm-up, tokens/s, peak memory, and the ratio
vexact / HF (> 1: vexact is faster).

Usage:
    python benchmarks/training.py                                   # 0.6B, 8B, 30B-A3B (24 layers), 1k-32k
    python benchmarks/training.py --configs qwen3-8b --lengths 8192,32768 --steps 5
    python benchmarks/training.py --configs moonlight-16b-a3b:4 --lengths 4096,16384 --set mla_kv_cache=latent
    python benchmarks/training.py --configs qwen3-0.6b --lengths 8192 --profile 12   # + where the GPU time goes
"""

from __future__ import annotations

import argparse
import gc
import re
import statistics
import sys
import time
from collections import defaultdict

import torch

from bench_utils import stock_twin, table

DEFAULT_CONFIGS = "qwen3-0.6b,qwen3-8b,qwen3-30b-a3b:24"
DEFAULT_LENGTHS = "1024,4096,8192,16384,32768"


def parse_configs(text: str) -> list[tuple[str, int | None]]:
    """``"qwen3-8b,qwen3-30b-a3b:24"`` -> ``[("qwen3-8b", None), ("qwen3-30b-a3b", 24)]`` (name:layers)."""
    out = []
    for item in filter(None, text.split(",")):
        name, _, layers = item.partition(":")
        if layers and (not layers.isdigit() or int(layers) < 1):
            raise ValueError(f"--configs {item!r}: the layer count after ':' must be a positive integer")
        out.append((name, int(layers) if layers else None))
    return out


def batch_of(vocab: int, tokens: int, length: int, seed: int) -> torch.Tensor:
    """``[tokens // length, length]`` random token ids (at least one sequence)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (max(1, tokens // length), length), generator=gen)


def vexact_loss(model, ids: torch.Tensor) -> torch.Tensor:
    rows, length = ids.shape
    cu = torch.arange(0, rows + 1, device=ids.device, dtype=torch.int32) * length
    # a sequence's first token has no logprob (0): average over the others, as HF's side does
    return -model.token_logprobs(ids.reshape(-1), cu_seqlens=cu).sum() / (rows * (length - 1))


def hf_loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return -logprobs.mean()


def time_steps(model, loss_fn, ids: torch.Tensor, steps: int) -> tuple[float, float]:
    """(median seconds per forward+backward step, peak GiB) after one warm-up step."""
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss_fn(model, ids).backward()
        torch.cuda.synchronize()
        if step:  # the first step compiles kernels and allocates
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30


# Kernel name patterns -> the part of the step they belong to, first match wins (`--profile`).
KERNEL_GROUPS = (
    ("attention backward", r"flash_bwd|_dkdv_kernel|_dq_kernel|_latent_dkv|_latent_dq|dot_product_.*bwd|cudnn.*bprop|convert_dq"),
    ("attention forward", r"_attention_fwd|_latent_fwd|flash_fwd|fmha|cudnn|pytorch_flash"),
    ("GEMM (Triton linear)", r"_linear_kernel|_linear_tma_kernel|_head_linear"),
    ("GEMM (cuBLAS)", r"gemm|nvjet|xmma|cutlass|cublas"),
    ("MoE", r"moe|_softmax_topk|grouped_topk"),
    ("softmax / log-softmax", r"softmax"),
    ("norm, rotary, SiLU (Triton)", r"_rms_norm|_rotary|_silu_and_mul"),
    ("reductions", r"reduce"),
    ("copies, casts, elementwise", r"elementwise|copy|Memcpy|Memset|fill|index|scatter|gather|cat"),
)


def kernel_group(name: str) -> str:
    """The `KERNEL_GROUPS` label of a CUDA kernel name ("other" when none matches)."""
    for label, pattern in KERNEL_GROUPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label
    return "other"


def profile_step(model, loss_fn, ids: torch.Tensor) -> dict[str, float]:
    """GPU seconds per kernel name of one forward+backward step (torch profiler)."""
    from torch.profiler import ProfilerActivity, profile

    model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        loss_fn(model, ids).backward()
        torch.cuda.synchronize()
    model.zero_grad(set_to_none=True)
    kernels: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] += event.device_time_total * 1e-6
    return dict(kernels)


def print_profiles(title: str, profiles: dict[str, dict[str, float]], top: int) -> None:
    """Each side's GPU time by `kernel_group`, side by side, then each side's `top` kernels."""
    groups = {side: defaultdict(float) for side in profiles}
    for side, kernels in profiles.items():
        for name, seconds in kernels.items():
            groups[side][kernel_group(name)] += seconds
    labels = sorted({g for side in groups.values() for g in side}, key=lambda g: -max(s.get(g, 0) for s in groups.values()))
    rows = [[label] + [f"{groups[side].get(label, 0.0) * 1e3:.2f}" for side in profiles] for label in labels]
    rows.append(["total"] + [f"{sum(groups[side].values()) * 1e3:.2f}" for side in profiles])
    table(f"{title}: GPU ms per step by kernel group", ["group"] + list(profiles), rows)
    for side, kernels in profiles.items():
        ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
        table(f"{title}, {side}: top {top} kernels", ["ms", "group", "kernel"],
              [[f"{s * 1e3:.2f}", kernel_group(n), n[:90]] for n, s in ranked])


def use_checkpointing(mode: str, length: int, params: int) -> bool:
    if mode == "auto":
        return length >= 16384 or params > 4e9
    return mode == "on"


def measure(name: str, layers: int | None, lengths: list[int], args) -> list[list]:
    from vexact_models.conformance.models import parse_overrides
    from vexact_models.conformance.models import architecture_of, build_model, make_config

    arch = architecture_of(name)
    config = make_config(arch, name, layers, max(lengths), parse_overrides(args.set))
    ours = build_model(arch, config, torch.device("cuda"), torch.bfloat16, args.seed).train()
    params = sum(p.numel() for p in ours.parameters())
    rows = []
    profiles: dict[int, dict[str, dict[str, float]]] = {}
    for side in ("hf", "vexact"):
        model = stock_twin(arch, ours).train() if side == "hf" else ours
        loss_fn = hf_loss if side == "hf" else vexact_loss
        for length in lengths:
            ckpt = use_checkpointing(args.checkpointing, length, params)
            if ckpt:
                kwargs = {"use_reentrant": False}
                if side == "vexact" and args.full_recompute:
                    kwargs["context_fn"] = torch.utils.checkpoint.noop_context_fn
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            else:
                model.gradient_checkpointing_disable()
            ids = batch_of(config.vocab_size, args.tokens, length, args.seed).cuda()
            try:
                seconds, peak = time_steps(model, loss_fn, ids, args.steps)
            except torch.OutOfMemoryError:
                seconds, peak = float("nan"), float("nan")
            rows.append([side, length, ids.shape[0], ckpt, seconds, ids.numel() / seconds, peak])
            if args.profile:
                profiles.setdefault(length, {})[side] = profile_step(model, loss_fn, ids)
            print(f"{name} {side:>6} L={length:>6} x{ids.shape[0]:<3} checkpointing={ckpt!s:<5} "
                  f"{seconds * 1e3:9.1f} ms  {ids.numel() / seconds:11,.0f} tok/s  peak {peak:6.1f} GiB", flush=True)
            del ids
            gc.collect()
            torch.cuda.empty_cache()
        if side == "hf":
            del model
            gc.collect()
            torch.cuda.empty_cache()
    for length, sides in profiles.items():
        print_profiles(f"{name} L={length}", sides, args.profile)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS,
                        help=f"comma-separated bundled config names, each optionally NAME:LAYERS (default {DEFAULT_CONFIGS})")
    parser.add_argument("--lengths", default=DEFAULT_LENGTHS, help=f"tokens per sequence (default {DEFAULT_LENGTHS})")
    parser.add_argument("--tokens", type=int, default=32768,
                        help="tokens per step, split into sequences of each length (default 32768)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point after one warm-up (default 3)")
    parser.add_argument("--checkpointing", choices=["auto", "on", "off"], default="auto",
                        help="activation checkpointing on both sides (default auto: >= 16k tokens or > 4B parameters)")
    parser.add_argument("--full-recompute", action="store_true",
                        help="under checkpointing, make our side recompute whole layers as stock HF does "
                             "(default: ours keeps each layer's attention output and LSE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one step per point and print GPU time by kernel group and the N "
                             "largest kernels of each side (default 0: off)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field of every model (JSON value; repeatable), e.g. "
                             "--set mla_kv_cache=latent")
    args = parser.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
        lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError as err:
        parser.error(str(err))
    for name, value, low in (("--tokens", args.tokens, 1), ("--steps", args.steps, 1), ("--profile", args.profile, 0)):
        if value < low:
            parser.error(f"{name}={value} must be >= {low}")
    if not lengths or min(lengths) < 2:
        parser.error(f"--lengths={args.lengths!r}: every length must be >= 2")
    if not torch.cuda.is_available():
        print("benchmarks/training.py needs a CUDA GPU", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.tokens} tokens per step")
    for name, layers in configs:
        rows = measure(name, layers, lengths, args)
        hf = {r[1]: r for r in rows if r[0] == "hf"}
        out = []
        for side, length, seqs, ckpt, seconds, rate, peak in (r for r in rows if r[0] == "vexact"):
            base = hf[length]
            mode = ("on" if args.full_recompute else "keep attn") if ckpt else "off"
            out.append([length, seqs, mode, f"{base[5]:,.0f}", f"{rate:,.0f}",
                        f"{rate / base[5]:.2f}x", f"{base[6]:.1f}", f"{peak:.1f}"])
        title = f"{name}{f' ({layers} layers)' if layers else ''}: forward+backward of token logprobs + loss"
        table(title, ["tokens/seq", "seqs", "ckpt", "HF tok/s", "vexact tok/s", "vexact/HF", "HF GiB", "vexact GiB"],
              out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
