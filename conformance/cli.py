"""vexact-conformance: run the conformance suite and print one row per architecture x shape x backend.

Examples:
    vexact-conformance                                    # every architecture at every shape, tiny configs, CPU
    vexact-conformance --arch deepseek_v3 --shape moonlight
    vexact-conformance --config qwen3-0.6b --device cuda --dtype bfloat16 --pool 64 --max-tokens 256
    vexact-conformance --config moonlight-16b-a3b --layers 2 --device cuda --dtype bfloat16   # deepseek_v3, shape moonlight
    vexact-conformance --config deepseek-v3 --layers 2 --set first_k_dense_replace=1 \\
        --set n_routed_experts=64 --device cuda --dtype bfloat16
    python -m vexact_models.conformance --config path/to/config.json --layers 4

A bundled config (``--config NAME``) picks its architecture and shape; a config.json path picks
the architecture serving its model_type. The library behind it: `vexact_models.conformance.models`
(configs, models) and `vexact_models.conformance.suite` (the scenarios, the report and its table).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import transformers

from vexact_models.cli_args import architecture_arg, device_arg, non_negative_int, positive_int
from vexact_models.kernels.backend import interpreting
from vexact_models.registry import Architecture, Shape, architectures, shapes

from .models import (MIN_GPU_HEAD_DIM, add_random_lora, build_model, lora_targets, make_config, parse_overrides,
                     published_shape)
from .recompute import RECOMPUTE_TOKENS
from .suite import print_table, run_conformance, select_scenarios


def _architecture(parser: argparse.ArgumentParser, name: str) -> Architecture:
    """``--arch NAME``: `architecture_arg` (a name or an HF ``model_type`` it serves); a shape's
    name is an error saying which architecture and --shape to use."""
    try:
        return architecture_arg(name)
    except argparse.ArgumentTypeError as error:
        owners = [arch.name for arch, shape in shapes() if shape.name == name and arch.name != name]
        if owners:
            parser.error(f"--arch {name}: {name!r} is a shape of architecture {owners[0]!r}, not an architecture; "
                         f"use --arch {owners[0]} --shape {name}")
        parser.error(f"--arch {name}: {error}")


def _rows(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[Architecture, Shape | None, str]]:
    """(architecture, shape, shape label) for each table row, from --arch, --shape and --config."""
    archs = [_architecture(parser, name) for name in args.arch or []]
    if args.config not in (None, "tiny"):
        try:
            arch, shape = published_shape(args.config)
        except ValueError as error:
            parser.error(f"--config {args.config}: {error}")
        if archs and [a.name for a in archs] != [arch.name]:
            parser.error(f"--config {args.config} is a config of architecture {arch.name!r}, not --arch "
                         f"{' '.join(a.name for a in archs)}")
        if args.shape and (shape is None or args.shape != [shape.name]):
            parser.error(f"--config {args.config} sets the shape ({shape.name if shape else 'its own'}); "
                         "leave out --shape")
        return [(arch, shape, shape.name if shape else Path(args.config).stem)]
    rows = [(arch, shape, shape.name) for arch in archs or architectures() for shape in arch.shapes]
    for name in args.shape or []:
        if not any(shape.name == name for _, shape, _ in rows):
            parser.error(f"--shape {name}: no such shape; the shapes: "
                         f"{[f'{arch.name}/{shape.name}' for arch, shape, _ in rows]}")
    return [row for row in rows if not args.shape or row[1].name in args.shape]


def _parser(prog: str = "vexact-conformance") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", action="append", help="architecture name (repeatable; default: all registered)")
    parser.add_argument("--shape", action="append",
                        help="shape name, e.g. moonlight (repeatable; default: every shape of the architectures)")
    parser.add_argument("--backend", choices=["reference", "triton"], help="kernel backend (default: by device)")
    parser.add_argument("--attention-forward", choices=["triton", "fa4"],
                        help="attention forward of the triton backend, for training and rollout alike: ours or "
                             "FlashAttention-4 (the flash-attn-4 package, Hopper GPUs); default: "
                             "VEXACT_ATTENTION_FORWARD, else triton")
    parser.add_argument("--device", type=device_arg, default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--config", help="'tiny' (default: each shape's tiny config), a bundled config name (e.g. "
                        "qwen3-0.6b; picks the architecture and shape) or a config.json path")
    parser.add_argument("--layers", type=positive_int, help="override num_hidden_layers")
    parser.add_argument("--max-positions", type=positive_int, help="override max_position_embeddings")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a field the config class has (JSON value; repeatable), e.g. --set "
                             "n_routed_experts=64")
    parser.add_argument("--pool", type=positive_int, default=64, help="requests in the pool (the largest batch); default 64")
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="largest max_tokens of a request; default 24")
    parser.add_argument("--prompt-len", type=positive_int, default=40, help="longest prompt; default 40")
    parser.add_argument("--no-hf-parity", action="store_true", help="skip the comparison with stock transformers")
    parser.add_argument("--parity-only", action="store_true", help="only the comparison with stock transformers")
    parser.add_argument("--lora", type=non_negative_int, default=0, metavar="RANK",
                        help="wrap the model with random PEFT LoRA adapters of this rank on every linear layer "
                             "(and both fused expert tensors of MoE models: PEFT's target_parameters) and check "
                             "rollouts with adapters; skips HF parity")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, metavar="F",
                        help="fraction of the GPU the engines' KV caches may fill (default 0.5; each scenario's "
                             "engine is freed before its recompute, whose memory --recompute-tokens bounds)")
    parser.add_argument("--scenario", action="append", metavar="NAME",
                        help="run only the scenarios whose names contain NAME (repeatable; default: all), "
                             "e.g. --scenario 'chunk 128' --scenario preemption for a long run")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=sys.stderr.isatty(),
                        help="a progress bar while each scenario rolls out (stderr) and a line when its recompute "
                             "begins (default: when stderr is a terminal)")
    parser.add_argument("--recompute-tokens", type=positive_int, default=RECOMPUTE_TOKENS, metavar="N",
                        help="tokens of one recompute forward, a trainer's micro-batch (default "
                             f"{RECOMPUTE_TOKENS}; a longer sample runs alone): lower it where a big model's "
                             "recompute runs out of memory")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the random weights, the requests and the sampling (default 0)")
    return parser


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The checks between options argparse cannot make alone (a usage error naming them)."""
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    if args.parity_only:  # (it runs no scenario; these would leave nothing to check and a PASS)
        if args.no_hf_parity:
            parser.error("--parity-only and --no-hf-parity contradict each other: together they check nothing")
        if args.lora:
            parser.error(f"--parity-only and --lora {args.lora} contradict each other: --lora skips HF parity, "
                         "--parity-only runs only it")
        if args.scenario:
            parser.error("--parity-only and --scenario contradict each other: --parity-only runs no scenario")
    if args.scenario:
        try:
            select_scenarios(args.pool, args.scenario)
        except ValueError as e:
            parser.error(f"--scenario: {e}")
    if args.attention_forward == "fa4" and args.device.type != "cuda":
        parser.error(f"--attention-forward fa4 needs --device cuda (got --device {args.device}): FA4 runs on Hopper GPUs")
    if args.backend == "triton" and args.device.type != "cuda" and not interpreting():
        parser.error(f"--backend triton needs --device cuda (got --device {args.device}), or TRITON_INTERPRET=1 to "
                     "run the kernels under Triton's CPU interpreter")
    if args.device.type == "cuda" and args.config in (None, "tiny"):
        parser.error(f"--device {args.device} runs the GPU kernels, whose attention takes head dims of "
                     f"{MIN_GPU_HEAD_DIM} and up, and the tiny test configs' are smaller: pass --config NAME (a bundled "
                     "published config, e.g. --config qwen3-0.6b --layers 2) or a config.json")
    if args.backend == "reference" and args.device.type != "cpu":
        parser.error(f"--backend reference runs on CPU only (got --device {args.device})")


def _configs(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[tuple[Architecture, str, object]]:
    """(architecture, shape label, config) of every table row, all made before any model is built:
    a bad --set or --config is a usage error before anything runs."""
    rows = _rows(parser, args)
    try:
        overrides = parse_overrides(args.set)
        return [(arch, label, make_config(arch, args.config, args.layers, args.max_positions, overrides,
                                          shape=shape.name if shape is not None and args.config in (None, "tiny")
                                          else None))
                for arch, shape, label in rows]
    except ValueError as error:
        parser.error(str(error))


def main(argv: list[str] | None = None, prog: str = "vexact-conformance") -> int:
    """Run the suite for every selected (architecture, shape); print the table; 0 when all pass.
    `prog`: the command's name in usage and errors (``vexact conformance`` runs it too)."""
    parser = _parser(prog)
    args = parser.parse_args(argv)
    _check(parser, args)
    rows = _configs(parser, args)
    device, dtype = args.device, getattr(torch, args.dtype)
    from vexact_models.kernels import attention_forward_mode, use_attention_forward, use_backend

    reports, failed = [], False
    with use_backend(args.backend), use_attention_forward(args.attention_forward):
        if device.type == "cuda":
            print(f"attention forward: {attention_forward_mode()}", flush=True)
        for arch, label, config in rows:
            print(f"{arch.name} ({label}): building {args.config or 'tiny'} model ({config.num_hidden_layers} layers) "
                  f"on {device} in {args.dtype}", flush=True)
            model = build_model(arch, config, device, dtype, args.seed)
            print(f"  patch() + AutoModelForCausalLM.from_config -> {type(model).__module__}.{type(model).__name__}"
                  f" (transformers {transformers.__version__})", flush=True)
            if args.lora:
                model = add_random_lora(model, args.lora, args.seed)
                print(f"  PEFT LoRA r {args.lora} (random adapters) on {lora_targets(model)}", flush=True)
            report = run_conformance(arch, model, device=device, pool_size=args.pool, max_tokens=args.max_tokens,
                                     prompt_len=args.prompt_len, check_parity=not (args.no_hf_parity or args.lora),
                                     seed=args.seed, scenarios=not args.parity_only,
                                     gpu_memory_utilization=args.gpu_memory_utilization, shape=label,
                                     only=args.scenario, progress=args.progress,
                                     recompute_tokens=args.recompute_tokens)
            reports.append(report)
            failed |= not report.ok
            del model
    print()
    print_table(reports)
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
