"""The ``vexact`` command.

    vexact demo          build a small random Qwen3 checkpoint, patch transformers, roll out with the
                         paged runtime, recompute with the training variant, print the conformance table
    vexact conformance   the full conformance suite (same as ``vexact-conformance``)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch


def demo(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    import vexact_models
    from vexact_models.conformance.cli import print_table
    from vexact_models.conformance.suite import run_conformance
    from vexact_models.registry import get

    arch = get("qwen3")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = arch.tiny_config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=2048)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.checkpoint or tmp)
        torch.manual_seed(args.seed)
        arch.hf_class()(config).save_pretrained(path)  # a stock transformers checkpoint (safetensors)
        print(f"wrote a random {config.model_type} checkpoint to {path}: "
              f"{', '.join(sorted(p.name for p in path.iterdir()))}")
        vexact_models.patch()
        try:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        finally:
            vexact_models.unpatch()
        print(f"AutoModelForCausalLM.from_pretrained -> {type(model).__module__}.{type(model).__name__} "
              f"on {device} ({dtype})")
        report = run_conformance(arch, model, device=device, pool_size=args.pool, max_tokens=args.max_tokens,
                                 prompt_len=32, seed=args.seed)
    print()
    print_table([report])
    print("RESULT:", "PASS" if report.ok else "FAIL")
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vexact", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="end-to-end rollout + recompute on a small random Qwen3 checkpoint")
    p_demo.add_argument("--device", help="cpu or cuda (default: cuda when available)")
    p_demo.add_argument("--pool", type=int, default=16, help="requests (the largest batch); default 16")
    p_demo.add_argument("--max-tokens", type=int, default=16, help="largest max_tokens of a request; default 16")
    p_demo.add_argument("--checkpoint", help="keep the generated checkpoint in this folder")
    p_demo.add_argument("--seed", type=int, default=0)
    sub.add_parser("conformance", help="the conformance suite (see vexact-conformance --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command == "conformance":
        from vexact_models.conformance.cli import main as conformance_main

        return conformance_main(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
