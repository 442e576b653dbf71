"""vexact-conformance: run the conformance suite and print one row per architecture x backend.

Examples:
    vexact-conformance                                    # every architecture, tiny configs, CPU
    vexact-conformance --arch qwen3 --device cuda --dtype bfloat16 --config qwen3-0.6b --pool 64 --max-tokens 256
    vexact-conformance --arch deepseek_v3 --config deepseek-v3 --layers 2 --set first_k_dense_replace=1 \
        --set n_routed_experts=64 --device cuda --dtype bfloat16
    python -m vexact_models.conformance --config path/to/config.json --layers 4
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import transformers

from vexact_models.registry import Architecture, architectures, for_model_type, get

CONFIG_DIR = Path(__file__).parent / "configs"


def published_config(name_or_path: str) -> dict:
    """A config dict from a bundled published config name (``qwen3-0.6b``) or a JSON path."""
    path = Path(name_or_path)
    if not path.exists():
        path = CONFIG_DIR / f"{name_or_path}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
        raise ValueError(f"--config {name_or_path!r}: no such file, and not one of the bundled configs {known}")
    return json.loads(path.read_text())


def build_model(arch: Architecture, config, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A random-weight training-variant model, built as users build it (`vexact_models.patch()`,
    then ``AutoModelForCausalLM.from_config``) directly on `device` in `dtype`. Leaves the Auto
    classes patched only if they were before."""
    from transformers import AutoModelForCausalLM

    from vexact_models import is_patched, patch, unpatch

    from .suite import construct

    was_patched = is_patched()
    patch()
    try:
        torch.manual_seed(seed)
        model = construct(lambda c: AutoModelForCausalLM.from_config(c, dtype=dtype), config, device, dtype).eval()
    finally:
        if not was_patched:
            unpatch()
    if type(model) is not arch.causal_lm_class:
        raise RuntimeError(f"vexact_models.patch() did not route model_type {config.model_type!r}: "
                           f"AutoModelForCausalLM.from_config returned {type(model).__module__}.{type(model).__name__}")
    if arch.init_for_conformance is not None:
        with torch.no_grad():
            arch.init_for_conformance(model, seed)
    return model


def parse_overrides(items: list[str] | None) -> dict:
    """``["n_routed_experts=64", "q_lora_rank=null"]`` -> config fields (values parsed as JSON,
    else kept as strings)."""
    overrides = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set {item!r}: expected KEY=VALUE")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def make_config(arch: Architecture, config_name: str | None, layers: int | None, max_positions: int | None,
                overrides: dict | None = None):
    """The config to build: `arch`'s tiny one, or a published one (checked to be `arch`'s
    model_type), with ``num_hidden_layers`` / ``max_position_embeddings`` / any other fields
    overridden."""
    fields = dict(overrides or {})
    if layers:
        fields["num_hidden_layers"] = layers
    if config_name is None or config_name == "tiny":
        return arch.tiny_config(**fields)
    published = published_config(config_name)
    if published.get("model_type") not in arch.model_types:
        raise ValueError(f"--config {config_name}: model_type {published.get('model_type')!r} is not {arch.name}")
    published = {k: v for k, v in published.items() if k not in ("architectures", "torch_dtype")}
    if max_positions:
        fields["max_position_embeddings"] = max_positions
    return arch.config_class(**{**published, **fields})


def architecture_of(config_name: str) -> Architecture:
    """The registered architecture serving a published config's model_type."""
    model_type = published_config(config_name).get("model_type")
    arch = for_model_type(model_type)
    if arch is None:
        raise ValueError(f"--config {config_name}: no registered architecture serves model_type {model_type!r}")
    return arch


def print_table(reports) -> None:
    header = ["architecture", "backend", "device", "dtype", "generated", "logprobs checked", "mismatches", "max |diff|",
              "reproducible", "HF parity (rel)"]
    rows = [[r.arch, r.backend, r.device, r.dtype, f"{r.generated:,}", f"{r.tokens:,}", str(r.mismatches),
             f"{r.max_abs_diff:.3g}",
             f"{r.reproducibility_checked - r.reproducibility_mismatches}/{r.reproducibility_checked}",
             "-" if r.hf_parity is None else str(r.hf_parity)] for r in reports]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vexact-conformance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", action="append", help="architecture name (repeatable; default: all registered)")
    parser.add_argument("--backend", choices=["reference", "triton"], help="kernel backend (default: by device)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--config", help="'tiny' (default), a bundled config name (e.g. qwen3-0.6b) or a config.json path")
    parser.add_argument("--layers", type=int, help="override num_hidden_layers")
    parser.add_argument("--max-positions", type=int, help="override max_position_embeddings")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override a config field (JSON value; repeatable), e.g. --set n_routed_experts=64")
    parser.add_argument("--pool", type=int, default=64, help="requests in the pool (the largest batch); default 64")
    parser.add_argument("--max-tokens", type=int, default=24, help="largest max_tokens of a request; default 24")
    parser.add_argument("--prompt-len", type=int, default=40, help="longest prompt; default 40")
    parser.add_argument("--no-hf-parity", action="store_true", help="skip the comparison with stock transformers")
    parser.add_argument("--parity-only", action="store_true", help="only the comparison with stock transformers")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="wrap the model with random PEFT LoRA adapters of this rank on every linear layer "
                             "(and the MoE experts) and check rollouts with adapters; skips HF parity")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9, metavar="F",
                        help="fraction of the GPU the engines' KV caches may fill (default 0.9); lower it when the "
                             "autograd recompute needs room (e.g. --lora at 8B)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.gpu_memory_utilization <= 1:
        parser.error(f"--gpu-memory-utilization={args.gpu_memory_utilization} must be in (0, 1]")
    if args.lora < 0:
        parser.error(f"--lora={args.lora} must be >= 0")
    for name, value in (("--pool", args.pool), ("--max-tokens", args.max_tokens), ("--prompt-len", args.prompt_len)):
        if value < 1:
            parser.error(f"{name}={value} must be >= 1")
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    from vexact_models.kernels import use_backend

    from .suite import add_random_lora, run_conformance

    archs = [get(a) for a in args.arch] if args.arch else architectures()
    reports, failed = [], False
    with use_backend(args.backend):
        for arch in archs:
            config = make_config(arch, args.config, args.layers, args.max_positions, parse_overrides(args.set))
            print(f"{arch.name}: building {args.config or 'tiny'} model ({config.num_hidden_layers} layers) "
                  f"on {device} in {args.dtype}", flush=True)
            model = build_model(arch, config, device, dtype, args.seed)
            print(f"  patch() + AutoModelForCausalLM.from_config -> {type(model).__module__}.{type(model).__name__}"
                  f" (transformers {transformers.__version__})", flush=True)
            if args.lora:
                model = add_random_lora(model, args.lora, args.seed)
            report = run_conformance(arch, model, device=device, pool_size=args.pool, max_tokens=args.max_tokens,
                                     prompt_len=args.prompt_len, check_parity=not (args.no_hf_parity or args.lora),
                                     seed=args.seed, scenarios=not args.parity_only,
                                     gpu_memory_utilization=args.gpu_memory_utilization)
            reports.append(report)
            failed |= not report.ok
            del model
    print()
    print_table(reports)
    print("RESULT:", "FAIL" if failed else "PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
