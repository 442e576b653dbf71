"""The ``vexact`` command.

    vexact demo [--arch NAME]
                         build a small random checkpoint (Qwen3 unless --arch names another registered
                         architecture), patch transformers, roll out with the paged runtime, recompute
                         with the training variant, print the conformance table
    vexact conformance   the full conformance suite (same as ``vexact-conformance``)
    vexact env           what a bug report needs: versions, platform, device, kernel backend and
                         every VEXACT_* switch with its value, default and modes
    vexact export-text SOURCE TARGET
                         the text model of a published multimodal checkpoint (Qwen3.5, Gemma 3
                         4B+) as a text checkpoint of its own, for loaders that build the
                         multimodal class
    vexact dequantize-fp8 SOURCE TARGET
                         a block-FP8 checkpoint (DeepSeek-V3, Qwen3 -FP8) dequantized to bf16
    vexact serve MODEL [--port 8000]
                         an OpenAI-compatible HTTP server over the engine, as ``vllm serve``
                         (/v1/completions, /v1/chat/completions, streamed or not)
    vexact new-architecture NAME --from qwen3
                         a new architecture folder copied from a registered one, with its test
                         (docs/adding-an-architecture.md)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from vexact_models.cli_args import architecture_arg, device_arg, dotted_json_args, positive_int
from vexact_models.conformance.models import MIN_GPU_HEAD_DIM
from vexact_models.kernels import current_backend
from vexact_models.layers import head_dim_of
from vexact_models.registry import architectures, get, unavailable
from vexact_models.serve_cli import add_serve_parser, serve


def demo_config(arch_name: str, device: torch.device):
    """The demo's random model config: Qwen3 at 2 layers of 128 wide (the default), or another
    architecture's tiny test config, with head dims the GPU attention takes on CUDA. A ValueError
    on CUDA for a tiny config whose attention the GPU kernels do not take (MLA's latent and rope
    dims, a head dim derived from the hidden size): such an architecture's demo runs on CPU."""
    arch = get(arch_name)
    if arch.name == "qwen3":
        return arch, arch.tiny_config(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, vocab_size=2048)
    config = arch.tiny_config()
    if device.type != "cuda":
        return arch, config
    if getattr(config, "head_dim", None) and config.head_dim < MIN_GPU_HEAD_DIM:
        config = arch.tiny_config(head_dim=MIN_GPU_HEAD_DIM)
    if getattr(config, "kv_lora_rank", None) or head_dim_of(config) < MIN_GPU_HEAD_DIM:
        raise ValueError(f"--arch {arch.name} on {device}: its tiny test config's attention dims are below what the "
                         f"GPU kernels take ({MIN_GPU_HEAD_DIM} and up); run the demo with --device cpu, or a "
                         f"published shape on the GPU: vexact-conformance --arch {arch.name} --config NAME --layers 2 "
                         "--device cuda --dtype bfloat16")
    return arch, config


def demo(args: argparse.Namespace) -> int:
    """``vexact demo``: `args.config` (from `demo_config`) saved by stock transformers, loaded through
    ``patch()``, rolled out and recomputed on `args.device`; 0 when every logprob is bitwise equal."""
    from transformers import AutoModelForCausalLM

    import vexact_models
    from vexact_models.conformance.suite import print_table, run_conformance

    arch, config, device = args.arch, args.config, args.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
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


DEMO_HELP = """Build a small random checkpoint with stock transformers (save_pretrained, safetensors), call
vexact_models.patch(), load it with AutoModelForCausalLM.from_pretrained (our class comes back),
roll out with the paged runtime LLM under several schedules (batch sizes, chunked prefill,
preemption; CUDA graphs on a GPU), recompute every sampled token's logprob with the training
forward and print the conformance table. Exits 0 when every logprob is bitwise equal, 1 otherwise.
CPU is fine (float32, the reference kernels); a CUDA GPU runs the Triton kernels in bfloat16.

Example:
    vexact demo
    vexact demo --arch qwen3_5 --pool 8 --max-tokens 32
    vexact demo --checkpoint ./tiny-qwen3          # keep the checkpoint (a new or empty folder)
"""


def _demo_checkpoint(text: str) -> Path:
    """``--checkpoint``: a folder to write into that does not exist yet or is empty."""
    path = Path(text)
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not an empty folder; the demo writes a new "
                                         "checkpoint there and never overwrites")
    return path


NEW_ARCHITECTURE_HELP = """Copy a registered architecture's folder into a new one, renamed: the classes the
template defines (Qwen3Attention -> MistralAttention), its HF config class, the architecture
name, model_types and the stock HF class used for parity; names imported from shared code stay.
Writes vexact_models/NAME/ (discovered by the registry: no list to edit) and
tests/models/test_NAME.py, or with --dest DIR an out-of-tree package DIR/NAME/ with
DIR/tests/test_NAME.py that registers through the vexact_models.architectures entry point
(the pyproject.toml lines are printed). Then prints the edits left to make (fields the new
config class lacks or adds, tiny-config fields it dropped, head classes stock transformers lacks,
prose naming the template), as docs/adding-an-architecture.md describes them.

Refused, before anything is written: NAME not a lowercase identifier, NAME or the model type
already served, the target folder or test existing (never overwritten), an unknown --from,
a config or HF class transformers does not have.

Example (Mistral is Llama's architecture with its own config class):
    vexact new-architecture mistral --from llama
    vexact new-architecture mistral --from llama --dest ../vexact-mistral      # a package of your own
"""


def new_architecture(args: argparse.Namespace) -> int:
    """``vexact new-architecture``: plan the copy of a template architecture (`scaffold.plan`),
    write it unless ``--dry-run``, print the steps left; 2 for a bad argument."""
    from vexact_models import scaffold

    try:
        plan = scaffold.plan(args.name, args.template, class_prefix=args.class_prefix, model_type=args.model_type,
                             config_class=args.config_class, hf_class=args.hf_class, dest=args.dest)
        if not args.dry_run:
            scaffold.write(plan)
    except ValueError as error:
        print(f"vexact new-architecture: error: {error}", file=sys.stderr)
        return 2
    print(scaffold.next_steps(plan, written=not args.dry_run))
    return 0


def _add_new_architecture_parser(sub) -> None:
    p = sub.add_parser("new-architecture", help="copy a registered architecture into a new one (a scaffold with its test)",
                       description=NEW_ARCHITECTURE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name", metavar="NAME", help="the new architecture's name and folder (lowercase, e.g. mistral)")
    p.add_argument("--from", dest="template", default="qwen3", metavar="ARCH",
                   help="the registered architecture to copy (default qwen3; dense: qwen3, llama, qwen2)")
    p.add_argument("--class-prefix", help="class-name prefix (default from NAME: my_model -> MyModel)")
    p.add_argument("--model-type", help="the HF config.model_type it serves (default NAME)")
    p.add_argument("--config-class", help="the transformers config class (default: transformers' class for the model type)")
    p.add_argument("--hf-class", help="the stock transformers causal-LM class, for HF parity (default: transformers' "
                                      "class for the model type)")
    p.add_argument("--dest", metavar="DIR", help="write an out-of-tree package DIR/NAME (default: vexact_models/NAME)")
    p.add_argument("--dry-run", action="store_true", help="check and print what would be written; write nothing")


ENV_HELP = """Print what a bug report needs; paste it into the issue. The versions of Python, torch, Triton,
transformers, peft and every optional extra (accelerate, trl, verl, quack-kernels, flash-attn-4,
nvidia-cudnn-frontend, ...: "not installed" when absent), the platform, the device (each CUDA
device's name and compute capability, or cpu), the kernel backend ops would run on it
(VEXACT_BACKEND, set_backend) and every VEXACT_* switch: its value now, whether the environment
sets it, its default and its accepted modes (docs/switches.md explains each). A switch set to a
value it does not accept is printed as invalid, not raised.

Example:
    vexact env
    vexact env --json > env.json
"""


def env(args: argparse.Namespace) -> int:
    """``vexact env``: the environment report (`env_report.main`), as text or ``--json``."""
    from vexact_models import env_report

    return env_report.main(as_json=args.json)


EXPORT_TEXT_HELP = """Write the text model of a published multimodal checkpoint (Qwen3.5, Qwen3.5-MoE, Gemma 3 4B,
12B, 27B) as a text checkpoint of its own: the text config (architectures naming stock's text
causal LM, e.g. Gemma3ForCausalLM), the text model's tensors under the text class's names in
their stored dtype (the vision tower, its projector and Qwen3.5's MTP layers left out), sharded
safetensors, the tokenizer and generation files copied.

vexact-models' own loaders read such a checkpoint's text part directly (LLM(path), our classes'
from_pretrained, VexactGRPOTrainer(model=path)); export it for loaders that build the class the
checkpoint names instead: stock AutoModelForCausalLM of Gemma 3 4B+, verl's actor
(AutoModelForImageTextToText for a multimodal config) and critic, TRL's trainers given a path.
Point them at TARGET after vexact_models.patch().

SOURCE is a local folder or a hub model id (its configs, safetensors and tokenizer files fetched
into the hub cache first, as LLM(id) does). TARGET must not exist or be an empty folder; it is
written beside, then renamed into place, so a failed export leaves nothing there.

Example:
    vexact export-text google/gemma-3-12b-it ./gemma-3-12b-it-text
    vexact export-text ./Qwen3.5-35B-A3B ./Qwen3.5-35B-A3B-text
"""


def export_text(args: argparse.Namespace) -> int:
    """``vexact export-text``: `text_export.export_text_model`; 2 for a bad argument."""
    from vexact_models.text_export import export_text_model

    return _rewrite("export-text", "the text model", export_text_model, args)


DEQUANTIZE_FP8_HELP = """Write a block-FP8 checkpoint (published DeepSeek-V3 / R1 / V3.1, Qwen3's -FP8 releases:
quantization_config quant_method 'fp8', each linear weight in float8 with a float32
weight_scale_inv per block of 128 x 128) dequantized to bf16, as a checkpoint of its own: each
weight is its FP8 values times its block's scale in fp32, rounded once to bf16 (transformers'
arithmetic), every other tensor as stored, sharded safetensors, the config without its
quantization_config, the tokenizer and other files copied. vexact-models' classes run bf16
weights and refuse an FP8 checkpoint; load TARGET instead.

SOURCE is a local folder or a hub model id (its configs, safetensors and tokenizer files fetched
into the hub cache first). TARGET must not exist or be an empty folder; it is written beside,
then renamed into place, so a failed run leaves nothing there.

Example:
    vexact dequantize-fp8 deepseek-ai/DeepSeek-V3 ./DeepSeek-V3-bf16
"""


def dequantize_fp8(args: argparse.Namespace) -> int:
    """``vexact dequantize-fp8``: `fp8.dequantize_fp8_checkpoint`; 2 for a bad argument."""
    from vexact_models.fp8 import dequantize_fp8_checkpoint

    return _rewrite("dequantize-fp8", "the bf16 checkpoint", dequantize_fp8_checkpoint, args)


def _rewrite(command: str, what: str, write, args: argparse.Namespace) -> int:
    """Run a checkpoint-rewriting command's `write(source, target, ...)`; 2 for a bad argument."""
    try:
        target = write(args.source, args.target, max_shard_size=args.max_shard_size, progress=not args.no_progress)
    except ValueError as error:
        print(f"vexact {command}: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {what} to {target}: {', '.join(sorted(p.name for p in target.iterdir()))}")
    return 0


def _add_rewrite_parser(sub, command: str, summary: str, description: str, source_help: str) -> None:
    p = sub.add_parser(command, help=summary, description=description,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", metavar="SOURCE", help=source_help)
    p.add_argument("target", metavar="TARGET", help="the new folder to write (not existing, or empty)")
    p.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="the largest safetensors file, in bytes or as 5GB / 500MB (default 5GB)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _arch_help() -> str:
    names = ", ".join(sorted(a.name for a in architectures()))
    too_old = "".join(f"; {name} needs transformers >= {floor}" for name, floor in sorted(unavailable().items()))
    return f"the registered architecture to build: {names} (default qwen3; another's tiny test config){too_old}"


def main(argv: list[str] | None = None) -> int:
    """The ``vexact`` command: parse `argv` (default ``sys.argv[1:]``) and run the sub-command;
    returns its exit status."""
    parser = argparse.ArgumentParser(prog="vexact", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_demo = sub.add_parser("demo", help="end-to-end rollout + recompute on a small random checkpoint (Qwen3 or --arch)",
                            description=DEMO_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_demo.add_argument("--arch", default="qwen3", type=architecture_arg, metavar="NAME", help=_arch_help())
    p_demo.add_argument("--device", type=device_arg, help="cpu, cuda or cuda:N (default: cuda when available)")
    p_demo.add_argument("--pool", type=positive_int, default=16, help="requests (the largest batch); default 16")
    p_demo.add_argument("--max-tokens", type=positive_int, default=16, help="largest max_tokens of a request; default 16")
    p_demo.add_argument("--checkpoint", type=_demo_checkpoint, metavar="DIR",
                        help="keep the generated checkpoint in this folder (new or empty; default: a temporary one)")
    p_demo.add_argument("--seed", type=int, default=0, help="seed of the random weights, requests and sampling (default 0)")
    sub.add_parser("conformance", help="the conformance suite (see vexact-conformance --help)", add_help=False)
    _add_new_architecture_parser(sub)
    _add_rewrite_parser(sub, "export-text", "the text model of a multimodal checkpoint (Qwen3.5, Gemma 3 4B+) as a "
                        "text checkpoint", EXPORT_TEXT_HELP, "the multimodal checkpoint: a folder or a hub model id")
    _add_rewrite_parser(sub, "dequantize-fp8", "a block-FP8 checkpoint (DeepSeek-V3, Qwen3 -FP8) dequantized to bf16",
                        DEQUANTIZE_FP8_HELP, "the FP8 checkpoint: a folder or a hub model id")
    p_env = sub.add_parser("env", help="versions, device, backend and VEXACT_* switches, for a bug report",
                           description=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p_env.add_argument("--json", action="store_true", help="print the report as JSON")
    add_serve_parser(sub)
    try:
        argv = dotted_json_args(sys.argv[1:] if argv is None else argv, "--structured-outputs-config")
    except ValueError as err:
        parser.error(str(err))
    args, rest = parser.parse_known_args(argv)
    if args.command == "conformance":
        from vexact_models.conformance.cli import main as conformance_main

        return conformance_main(rest, prog="vexact conformance")
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "new-architecture":
        return new_architecture(args)
    if args.command == "env":
        return env(args)
    if args.command == "serve":
        return serve(args)
    if args.command == "export-text":
        return export_text(args)
    if args.command == "dequantize-fp8":
        return dequantize_fp8(args)
    args.device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        current_backend(args.device)  # (a VEXACT_BACKEND it does not take, before the checkpoint is written)
        args.arch, args.config = demo_config(args.arch.name, args.device)
    except ValueError as error:
        p_demo.error(str(error))  # a usage error (exit 2), before anything is written
    return demo(args)


if __name__ == "__main__":
    sys.exit(main())
