"""argparse types shared by the command lines (``vexact``, ``vexact-conformance``, examples/,
benchmarks/): each refuses a bad value with an ``ArgumentTypeError``, which argparse prints after
the option's name (``argument --pool: must be >= 1, got 0``) and exits 2, before anything is
built or written."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from vexact_models.conformance.models import published_shape
from vexact_models.registry import Architecture, for_model_type, get
from vexact_models.runtime.structured_outputs import StructuredOutputsConfig

__all__ = ["architecture_arg", "checkpoint_arg", "config_arg", "device_arg", "dotted_json_args", "non_negative_float",
           "non_negative_int", "port_arg", "positive_float", "positive_int", "structured_outputs_config_arg"]


def positive_int(text: str) -> int:
    """A count that must be >= 1 (requests, tokens, layers, page sizes)."""
    value = _number(text, int)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """A count where 0 means none or off (a LoRA rank, a micro-batch of "all")."""
    value = _number(text, int)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


#: the largest TCP port
MAX_PORT = 65535


def port_arg(text: str) -> int:
    """A TCP port, 0 (a free one) to 65535 (``vexact serve --port``)."""
    value = non_negative_int(text)
    if value > MAX_PORT:
        raise argparse.ArgumentTypeError(f"must be <= {MAX_PORT} (0: a free one), got {value}")
    return value


def positive_float(text: str) -> float:
    """A finite number that must be > 0 (a temperature, a size in GB)."""
    value = _number(text, float)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number that must be >= 0 (a learning rate, a clip range)."""
    value = _number(text, float)
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def device_arg(text: str) -> torch.device:
    """``cpu``, ``cuda`` or ``cuda:N``, and only a CUDA device this machine has: a CPU-only torch
    or machine is told so here rather than by a traceback from deep inside torch."""
    try:
        device = torch.device(text)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: no CUDA device here (torch {torch.__version__}, "
                                             "torch.cuda.is_available() is False); use cpu")
        if device.index is not None and device.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), "
                                             f"cuda:0 to cuda:{count - 1}")
    return device


def chat_template_arg(text: str) -> str:
    """A Jinja chat template (``vllm serve --chat-template``): a file's text, or the template
    itself (text with a Jinja tag or expression); else refused, naming the value."""
    path = Path(text).expanduser()
    if path.is_file():
        return path.read_text()
    if "{%" in text or "{{" in text:
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is neither a file nor a Jinja template (no '{{%' or '{{{{' in it)")


def structured_outputs_config_arg(text: str) -> StructuredOutputsConfig:
    """``vllm serve --structured-outputs-config``'s JSON object (``{"disable_any_whitespace":
    true}``), checked; else refused, naming the field or the JSON error."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object: {err}") from None
    try:
        return StructuredOutputsConfig.of(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def dotted_json_args(argv: list[str], option: str) -> list[str]:
    """`argv` with vLLM's dotted form of the JSON `option` (``OPTION.KEY VALUE``,
    ``OPTION.KEY=VALUE``, ``OPTION.A.B VALUE`` for a nested key; VALUE read as JSON where it
    reads, else as text; a KEY followed by no value: true) merged into one ``OPTION JSON``
    argument, over the keys of an ``OPTION JSON`` given whole (which the option's type still
    checks where it is no JSON object). `argv` without the dotted form comes back as it is.
    ValueError naming an empty key."""
    whole, dotted, rest, tail, i = None, {}, [], [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            tail = argv[i:]
            break
        if arg.startswith(option + "."):
            path, has_value, value = arg[len(option) + 1:].partition("=")
            if not has_value:
                follows = i + 1 < len(argv) and not argv[i + 1].startswith("--")
                value, i = (argv[i + 1], i + 1) if follows else ("true", i)
            keys = path.split(".")
            if not all(keys):
                raise ValueError(f"{arg}: {option}.KEY needs a key after each '.', got {path!r}")
            node = dotted
            for key in keys[:-1]:
                node = node.setdefault(key, {})
                if not isinstance(node, dict):
                    raise ValueError(f"{arg}: {option}.{key} was given a value, so it has no keys")
            node[keys[-1]] = _json_or_text(value)
        elif arg == option and i + 1 < len(argv) or arg.startswith(option + "="):
            whole, i = (argv[i + 1], i + 1) if arg == option else (arg[len(option) + 1:], i)
        else:
            rest.append(arg)
        i += 1
    if not dotted:
        return list(argv)
    try:
        base = json.loads(whole) if whole is not None else {}
    except json.JSONDecodeError:
        base = None
    if not isinstance(base, dict):  # (left for the option's type to refuse)
        return rest + [option, whole, option, json.dumps(dotted)] + tail
    return rest + [option, json.dumps({**base, **dotted})] + tail


def _json_or_text(value: str) -> object:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def checkpoint_arg(text: str) -> str:
    """What ``from_pretrained`` takes: a checkpoint folder (one holding a config.json) or a hub
    repo id. A path that exists and is no such folder is refused, and so is one that is plainly a
    path (absolute, or starting with ``.`` or ``~``) and does not exist; anything else is left to
    the hub."""
    path = Path(text).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder (it holds no config.json)")
        return str(path)
    if path.is_absolute() or text.startswith((".", "~")):
        raise argparse.ArgumentTypeError(f"{text!r}: no such folder")
    return text


def config_arg(text: str) -> str:
    """``tiny``, a bundled published config's name (``qwen3-0.6b``) or a config.json path, of a
    model_type a registered architecture serves (`conformance.models.published_shape`)."""
    if text != "tiny":
        try:
            published_shape(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    return text


def architecture_arg(text: str) -> Architecture:
    """A registered architecture, by its name or an HF ``model_type`` it serves (``gemma3_text`` is
    ``gemma3``). Refused with `registry.get`'s reason: an unknown name (listing the registered
    ones), or one the installed transformers is too old for (naming the release it needs)."""
    try:
        return get(text)
    except ValueError as error:
        arch = for_model_type(text)
        if arch is None:
            raise argparse.ArgumentTypeError(str(error)) from None
        return arch


def _number(text: str, kind: type) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                         f"got {text!r}") from None
