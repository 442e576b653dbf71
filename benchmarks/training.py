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
and LSE (a gated DeltaNet layer's delta-rule outputs) and recomputes the rest
(``kernels.checkpoint_saving_context``; the table's "ckpt" reads "keep attn");
``--full-recompute`` makes ours recompute whole layers too. Reported: median step time over
``--steps`` timed steps after one warm-up, tokens/s, peak memory, and the ratio vexact / HF (> 1:
vexact is faster).

The gated-DeltaNet hybrids (Qwen3.5, Qwen3.5-MoE, Qwen3-Next; docs/design.md section 6b) have
one stock side per ``--stock-linear-attention`` path (default ``torch,fla``): transformers' torch
path of the gated delta rule, and the ``flash-linear-attention`` kernels that transformers binds
when ``fla`` is importable (`stock_peers.stock_linear_attention`; a path that cannot run here, fla
not installed, is a row saying why). fla 0.6.0's backward refuses to run on Hopper under Triton <
3.7.1: that row reads "refused: ...", and fla's side and ours are also timed forward alone (no
grad, as the RL step's logprob recompute). Their table has a row per side and pass with our rate
of the same pass over the row's ("vexact / this"). Every stock side runs alone on the device, ours
waiting in host memory meanwhile (`stock_peers.stock_alone`). ``--tiny`` runs each config's
architecture at its tiny shape on CPU (tests/test_benchmark_scripts.py).

Usage:
    python benchmarks/training.py                                   # 0.6B, 8B, 30B-A3B (24 layers), 1k-32k
    python benchmarks/training.py --configs qwen3.5-35b-a3b:16 --lengths 4096,16384 --tokens 16384 --steps 2  # torch, fla
    python benchmarks/training.py --configs qwen3-8b --lengths 8192,32768 --steps 5
    python benchmarks/training.py --configs moonlight-16b-a3b:4 --lengths 4096,16384 --set mla_kv_cache=latent
    python benchmarks/training.py --configs qwen3-0.6b --lengths 8192 --profile 12   # + where the GPU time goes
"""

from __future__ import annotations

import argparse
import contextlib
import re
import statistics
import sys
import time
from collections import defaultdict

import torch

from bench_utils import check_overrides, kernel_seconds, stock_attention, subset_arg, synchronize, table, tiny_or_cuda
from stock_peers import LINEAR_ATTENTION_PATHS, StockPathUnavailable, free, is_hybrid, stock_alone, stock_linear_attention

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


def time_steps(model, loss_fn, ids: torch.Tensor, steps: int, backward: bool = True) -> tuple[float, float | None]:
    """(median seconds per step, peak GiB on CUDA else None) after one warm-up step: forward +
    backward of `loss_fn`, or (`backward` False) its forward alone under ``torch.no_grad`` (what
    an RL step's logprob recompute of the old policy runs)."""
    times = []
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for step in range(steps + 1):
        model.zero_grad(set_to_none=True)
        synchronize(ids.device)
        start = time.perf_counter()
        if backward:
            loss_fn(model, ids).backward()
        else:
            with torch.no_grad():
                loss_fn(model, ids)
        synchronize(ids.device)
        if step:  # the first step compiles kernels and allocates
            times.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), torch.cuda.max_memory_allocated() / 2**30 if cuda else None


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
    model.zero_grad(set_to_none=True)
    kernels = kernel_seconds(lambda: loss_fn(model, ids).backward(), ids.device)
    model.zero_grad(set_to_none=True)
    return kernels


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


def stock_sides(arch, args) -> list[tuple[str, str | None]]:
    """Stock's sides of `arch`: ``("hf", None)``, or for a gated-DeltaNet hybrid one side per
    ``--stock-linear-attention`` path, labelled with it."""
    if not is_hybrid(arch):
        return [("hf", None)]
    names = {"torch": "torch delta rule", "fla": "fla kernels"}
    return [(f"HF ({stock_attention(arch)}, {names[path]})", path) for path in args.stock_linear_attention]


def run_side(side: str, model, loss_fn, lengths: list[int], args, params: int, passes: tuple[str, ...],
             refusable: bool = False) -> tuple[list[list], dict[int, dict[str, float]]]:
    """Rows ``[side, pass, length, sequences, checkpointing, seconds, tok/s, peak GiB, note]`` of
    `model` at every length and pass (``fwd+bwd``; ``forward``: no grad), OOM as a row's note, and
    with `refusable` any other error too ("refused: ...": fla's backward on Hopper under Triton <
    3.7.1); and {length: kernel seconds} of one profiled fwd+bwd step per length (``--profile``)."""
    rows, profiles = [], {}
    for length in lengths:
        ckpt = use_checkpointing(args.checkpointing, length, params)
        if ckpt:
            kwargs = {"use_reentrant": False}
            if side == "vexact" and args.full_recompute:
                kwargs["context_fn"] = torch.utils.checkpoint.noop_context_fn
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_disable()
        ids = batch_of(model.config.vocab_size, args.tokens, length, args.seed).to(args.device)
        for mode in passes:
            seconds, peak, note = float("nan"), None, ""
            try:
                seconds, peak = time_steps(model, loss_fn, ids, args.steps, backward=mode == "fwd+bwd")
            except torch.OutOfMemoryError:
                note = "OOM"
            except Exception as error:  # noqa: BLE001 - a stock kernel that refuses to run is the row's result
                if not refusable:
                    raise
                note = f"refused: {type(error).__name__}: {(str(error).splitlines() or [''])[0][:100]}"
            model.zero_grad(set_to_none=True)
            rows.append([side, mode, length, ids.shape[0], ckpt, seconds, ids.numel() / seconds, peak, note])
            if args.profile and mode == "fwd+bwd" and not note:
                profiles[length] = profile_step(model, loss_fn, ids)
            print(f"{side:>32} {mode:>7} L={length:>6} x{ids.shape[0]:<3} checkpointing={ckpt!s:<5} "
                  + (note or f"{seconds * 1e3:9.1f} ms  {ids.numel() / seconds:11,.0f} tok/s"
                     + (f"  peak {peak:6.1f} GiB" if peak is not None else "")), flush=True)
        del ids
        free(args.device)
    model.gradient_checkpointing_disable()
    return rows, profiles


def measure(name: str, layers: int | None, lengths: list[int], args) -> tuple[int, list[list]]:
    """(layers built, rows of `run_side`) of the config `name`: stock's side(s) first, each alone on
    the device (`stock_peers.stock_alone`: ours waits in host memory), then ours. A hybrid's stock
    sides are one per ``--stock-linear-attention`` path (`stock_peers.stock_linear_attention`; a
    path that cannot run here is a row saying why); where fla is among them, fla's side and ours
    are also timed forward alone (fla 0.6's backward refuses to run on Hopper under Triton < 3.7.1)."""
    from vexact_models.conformance.models import architecture_of, build_model, make_config, parse_overrides

    arch = architecture_of(name)
    config = make_config(arch, None if args.tiny else name, layers, None if args.tiny else max(lengths),
                         parse_overrides(args.set))
    ours = build_model(arch, config, args.device, args.dtype, args.seed).train()
    params = sum(p.numel() for p in ours.parameters())
    sides = stock_sides(arch, args)
    forward_too = ("fwd+bwd", "forward") if any(path == "fla" for _, path in sides) else ("fwd+bwd",)
    rows, profiles = [], defaultdict(dict)
    for side, path in sides:
        try:
            with stock_linear_attention(arch, path) if path else contextlib.nullcontext():
                with stock_alone(arch, ours, args.device) as hf:
                    got, kernels = run_side(side, hf.train(), hf_loss, lengths, args, params,
                                            forward_too if path == "fla" else ("fwd+bwd",), refusable=path == "fla")
        except StockPathUnavailable as why:
            got, kernels = [[side, mode, n, "-", "-", float("nan"), float("nan"), None, str(why)]
                            for n in lengths for mode in forward_too], {}
            print(f"{side:>32}: {why}", flush=True)
        rows += got
        for length, k in kernels.items():
            profiles[length][side] = k
    got, kernels = run_side("vexact", ours, vexact_loss, lengths, args, params, forward_too)
    rows += got
    for length, k in kernels.items():
        profiles[length]["vexact"] = k
    for length, sides_kernels in profiles.items():
        print_profiles(f"{name} L={length}", sides_kernels, args.profile)
    layers_built = config.num_hidden_layers
    del ours
    free(args.device)
    return layers_built, rows


def print_pair_table(title: str, rows: list[list], full_recompute: bool) -> None:
    """The table of a config without stock kernel variants: per length, HF's and our tok/s, the
    ratio and both peaks."""
    hf = {r[2]: r for r in rows if r[0] == "hf"}
    out = []
    for _, _, length, seqs, ckpt, _, rate, peak, note in (r for r in rows if r[0] == "vexact"):
        base = hf[length]
        mode = ("on" if full_recompute else "keep attn") if ckpt else "off"
        ratio = "-" if note or base[8] else f"{rate / base[6]:.2f}x"  # (a side out of memory: no ratio)
        out.append([length, seqs, mode, base[8] or f"{base[6]:,.0f}", note or f"{rate:,.0f}", ratio, gib(base[7]),
                    gib(peak)])
    table(title, ["tokens/seq", "seqs", "ckpt", "HF tok/s", "vexact tok/s", "vexact/HF", "HF GiB", "vexact GiB"], out)


def print_sides_table(title: str, rows: list[list]) -> None:
    """The table of a hybrid: every side and pass per length, with our rate of the same pass over
    each row's ("vexact / this")."""
    ours = {(r[1], r[2]): r[6] for r in rows if r[0] == "vexact" and not r[8]}
    out = []
    for side, mode, length, seqs, ckpt, _, rate, peak, note in sorted(rows, key=lambda r: r[2]):
        mine = ours.get((mode, length))
        ratio = f"{mine / rate:.2f}x" if mine and not note else "-"
        out.append([length, seqs, "on" if ckpt is True else "off" if ckpt is False else "-", side, mode,
                    note or f"{rate:,.0f}", gib(peak), ratio])
    table(title, ["tokens/seq", "seqs", "ckpt", "side", "pass", "tok/s", "peak GiB", "vexact / this"], out)


def gib(peak: float | None) -> str:
    return "n/a" if peak is None else f"{peak:.1f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
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
    parser.add_argument("--stock-linear-attention", type=subset_arg(LINEAR_ATTENTION_PATHS), metavar="PATHS",
                        help="gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next): the stock sides to time, comma-separated "
                             "of torch (transformers' torch path), fla (flash-linear-attention's kernels, which "
                             "transformers binds when fla is importable); default torch,fla")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one step per point and print GPU time by kernel group and the N "
                             "largest kernels of each side (default 0: off)")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field of every model (JSON value; repeatable), e.g. "
                             "--set mla_kv_cache=latent")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU, float32, each config's architecture at its tiny shape (tests)")
    args = parser.parse_args(argv)
    try:
        args.configs = parse_configs(args.configs)
        args.lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError as err:
        parser.error(str(err))
    for name, value, low in (("--tokens", args.tokens, 1), ("--steps", args.steps, 1), ("--profile", args.profile, 0)):
        if value < low:
            parser.error(f"{name}={value} must be >= {low}")
    if not args.lengths or min(args.lengths) < 2:
        parser.error(f"--lengths={','.join(map(str, args.lengths))!r}: every length must be >= 2")
    check_configs(parser, args)
    if args.tiny:  # lengths across the tiny hybrids' delta-rule chunks of 16
        args.lengths, args.tokens, args.steps = [24, 40], 80, 1
    tiny_or_cuda(args, "benchmarks/training.py")
    return args


def check_configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Every ``--configs`` name is a bundled config (or config.json) of a registered architecture,
    and ``--stock-linear-attention`` names only hybrids' paths: a usage error naming the value
    otherwise, before anything is built."""
    from vexact_models.conformance.models import architecture_of

    hybrids = []
    for name, _ in args.configs:
        try:
            hybrids.append(is_hybrid(architecture_of(name)))
        except ValueError as err:
            parser.error(f"--configs {name!r}: {err}")
    if args.stock_linear_attention is not None and not all(hybrids):
        plain = [name for (name, _), hybrid in zip(args.configs, hybrids) if not hybrid]
        parser.error(f"--stock-linear-attention={','.join(args.stock_linear_attention)}: {', '.join(plain)} has no "
                     "gated-DeltaNet layers (the option is for Qwen3.5 / Qwen3-Next configs)")
    args.stock_linear_attention = args.stock_linear_attention or list(LINEAR_ATTENTION_PATHS)
    check_overrides(parser, args.set, [name for name, _ in args.configs], args.tiny)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.cuda.get_device_name() if args.device.type == "cuda" else "CPU (--tiny)"
    print(f"{device}, torch {torch.__version__}; {args.tokens} tokens per step")
    for name, layers in args.configs:
        built, rows = measure(name, layers, args.lengths, args)
        title = f"{name}{' tiny' if args.tiny else ''} ({built} layers): forward+backward of token logprobs + loss"
        if any(r[0] == "hf" for r in rows):
            print_pair_table(title, rows, args.full_recompute)
        else:
            print_sides_table(title, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
