"""Checks of `LLM`'s constructor arguments and model, run before the engine changes anything.

Every bad value raises ValueError naming the argument, the value and the limit. The engine
calls these first: the only in-place change it makes to a model it is handed (fusing the q/k/v
and gate/up weights into one buffer each) comes after every check has passed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping

import torch
from torch.distributed.tensor import DTensor

from vexact_models.multimodal import refuse_multimodal_model
from vexact_models.registry import architectures, for_model_type, import_path

from ..kernels.attention_tiles import TMA_HEAD_DIMS
from ..kernels.top_tokens import BLOCK as TOP_TOKENS_CHUNK
from .sampling_params import MAX_LOGPROBS, MAX_SEED

#: the largest ``LLM(max_logprobs=...)``: `kernels.top_tokens` keeps at most a chunk's columns from each chunk
MAX_LOGPROBS_LIMIT = TOP_TOKENS_CHUNK

#: Floating dtypes the kernels take (the reference backend also takes float64).
_DTYPE_NAMES = ("bfloat16", "float16", "float32", "float64")


def check_int(name: str, value: object, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int in ``[minimum, maximum)`` (no upper limit when `maximum` is None)."""
    if isinstance(value, bool) or not isinstance(value, int):  # True as a size is a bug, not 1
        raise ValueError(f"LLM: {name}={value!r} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"LLM: {name}={value} is below the minimum {minimum}")
    if maximum is not None and value >= maximum:
        raise ValueError(f"LLM: {name}={value} must be below {maximum}")
    return value


def check_bool(name: str, value: object) -> bool:
    """`value` when it is a bool; a ValueError naming the argument and the value otherwise (1 and
    "yes" are not taken for True)."""
    if not isinstance(value, bool):
        raise ValueError(f"LLM: {name}={value!r} must be a bool, got {type(value).__name__}")
    return value


def resolve_dtype(dtype: object) -> torch.dtype | None:
    """``"auto"`` -> None (the checkpoint's or the model's own dtype), else a floating
    ``torch.dtype`` from a dtype or its name (``"bfloat16"``)."""
    if dtype == "auto":
        return None
    if isinstance(dtype, str) and dtype in _DTYPE_NAMES:
        return getattr(torch, dtype)
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    raise ValueError(f"LLM: dtype={dtype!r} is not a floating dtype; use 'auto', a torch.dtype or one of "
                     f"{_DTYPE_NAMES}")


def resolve_device(device: object) -> torch.device | None:
    """`device` as a ``torch.device`` (None stays None), or ValueError for what is not one."""
    if device is None:
        return None
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"LLM: device={device!r} is not a torch device ({e})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"LLM: device={device!r} but CUDA is not available here")
    return resolved


DEFAULT_BLOCK_SIZE = 16
TMA_BLOCK_SIZE = 64  # a page of whole 64-key blocks: decode reads each block by one TMA copy


def default_block_size(kv_cache_spec) -> int:
    """`LLM`'s page size when none is given: 64 positions where the decode kernel reads whole
    key blocks by TMA from pages of whole blocks (on Hopper): a latent MLA cache (the value a view
    of the key, `KVCacheSpec.value_in_key`; `kernels/latent_attention.py`, 1.2-1.6x; vLLM's
    FlashMLA takes pages of 64 as well) and GQA caches of head dims 64 or 128
    (`kernels/attention.py: page_descriptors_fit`); else 16 (MLA's expanded 192-wide keys). A page
    size never changes a bit (docs/design.md rule 2)."""
    _, _, head_dim_k, head_dim_v = kv_cache_spec
    by_tma = getattr(kv_cache_spec, "value_in_key", False) or (head_dim_k in TMA_HEAD_DIMS
                                                                and head_dim_v in TMA_HEAD_DIMS)
    return TMA_BLOCK_SIZE if by_tma else DEFAULT_BLOCK_SIZE


def check_engine_args(*, block_size: object, max_num_seqs: object, max_num_batched_tokens: object,
                      max_model_len: object, gpu_memory_utilization: object, kv_cache_bytes: object, seed: object,
                      flags: dict[str, object], pipeline_parallel_size: object = 1,
                      cuda_graph_max_tokens: object = None, max_logprobs: object = MAX_LOGPROBS,
                      cuda_graph_sizes: object = None, prefix_states: object = 0) -> None:
    """The scalar arguments (`flags`: the boolean switches by name). `max_model_len`'s and
    `pipeline_parallel_size`'s upper limits need the model's config: `check_max_model_len`,
    `runtime.pipeline.join_pipeline`."""
    if block_size is not None:  # None: `default_block_size`
        check_int("block_size", block_size, 1)
    check_int("pipeline_parallel_size", pipeline_parallel_size, 1)
    check_int("max_num_seqs", max_num_seqs, 1)
    check_int("max_num_batched_tokens", max_num_batched_tokens, 1)
    if max_model_len is not None:
        check_int("max_model_len", max_model_len, 1)
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not math.isfinite(gpu_memory_utilization) or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"LLM: gpu_memory_utilization={gpu_memory_utilization!r} is outside (0, 1]")
    if kv_cache_bytes is not None:
        check_int("kv_cache_bytes", kv_cache_bytes, 1)
    if cuda_graph_max_tokens is not None:
        check_int("cuda_graph_max_tokens", cuda_graph_max_tokens, 0)
    check_int("seed", seed, 0, MAX_SEED)
    check_int("max_logprobs", max_logprobs, 0, MAX_LOGPROBS_LIMIT + 1)
    check_int("prefix_states", prefix_states, 0)
    if prefix_states and flags.get("enable_prefix_sharing") is False:
        raise ValueError(f"LLM: prefix_states={prefix_states} keeps prompt states to share, which "
                         "enable_prefix_sharing=False turns off; pass prefix_states=0")
    if cuda_graph_sizes is not None:
        if isinstance(cuda_graph_sizes, (str, bytes)) or not isinstance(cuda_graph_sizes, (list, tuple)) \
                or not cuda_graph_sizes:
            raise ValueError(f"LLM: cuda_graph_sizes={cuda_graph_sizes!r} must be a non-empty list of batch sizes")
        for size in cuda_graph_sizes:
            check_int("cuda_graph_sizes entry", size, 1)
    for name, value in flags.items():
        check_bool(name, value)


def check_max_model_len(max_model_len: int | None, config) -> int:
    """`max_model_len` within ``[1, max_position_embeddings]``; None -> that limit."""
    limit = int(config.max_position_embeddings)
    if max_model_len is None:
        return limit
    if not 1 <= max_model_len <= limit:
        raise ValueError(f"LLM: max_model_len={max_model_len} is outside [1, max_position_embeddings={limit}]")
    return int(max_model_len)


#: the prompt dicts `LLM.generate` takes as vLLM does: its TokensPrompt's and TextPrompt's field
PROMPT_DICT_KEYS = ("prompt_token_ids", "prompt")


def prompt_of(prompt: object) -> object:
    """The token ids or text of a vLLM-style prompt dict (`PROMPT_DICT_KEYS`: exactly one of them,
    nothing else; a ValueError naming the keys otherwise); any other `prompt` unchanged."""
    if not isinstance(prompt, Mapping):
        return prompt
    keys = sorted(prompt)
    if len(set(keys) & set(PROMPT_DICT_KEYS)) != 1 or set(keys) - set(PROMPT_DICT_KEYS):
        raise ValueError(f"LLM.generate: a prompt dict holds 'prompt_token_ids' (vLLM's TokensPrompt) or 'prompt' "
                         f"(its TextPrompt), one of them and nothing else (no multimodal data); got keys {keys}")
    return prompt.get("prompt_token_ids", prompt.get("prompt"))


def resolve_tokenizer(tokenizer: object):
    """``LLM(tokenizer=...)``: None, a tokenizer (anything with ``decode`` and ``__call__``), or a
    folder / hub id loaded with ``AutoTokenizer``; a ValueError naming it otherwise."""
    if tokenizer is None or (callable(tokenizer) and hasattr(tokenizer, "decode")):
        return tokenizer
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise ValueError(f"LLM: tokenizer must be a transformers tokenizer or a folder or hub id to load one from, "
                         f"got a {type(tokenizer).__name__}")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    except (OSError, ValueError) as error:
        raise ValueError(f"LLM: tokenizer={os.fspath(tokenizer)!r} could not be loaded ({type(error).__name__}: "
                         f"{error})") from None


def check_model_argument(model: object) -> None:
    """`model` is a checkpoint folder or hub model id (str or ``os.PathLike``) or a ``torch.nn.Module``."""
    if not isinstance(model, (str, os.PathLike, torch.nn.Module)):
        raise ValueError(f"LLM: model must be a checkpoint folder or hub model id (str or os.PathLike) or a "
                         f"vexact-models causal LM "
                         f"(e.g. from AutoModelForCausalLM after vexact_models.patch()), got a {type(model).__name__}")


def architecture_of(model: torch.nn.Module):
    """The registered `Architecture` whose training class `model` is; ValueError otherwise,
    saying what to do (stock transformers model: ``vexact_models.patch()`` before loading)."""
    if type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model"):
        return architecture_of(model.get_base_model())  # a PeftModel over ours: the engine runs its adapters
    kind = f"{type(model).__module__}.{type(model).__qualname__}"
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"LLM: model is a {kind} without an HF config (model.config.model_type); pass a "
                         "vexact-models causal LM or a checkpoint folder")
    refuse_multimodal_model("LLM", model)
    arch = for_model_type(model_type)
    if arch is None:
        served = sorted(t for a in architectures() for t in a.model_types)
        raise ValueError(f"LLM: model_type {model_type!r} is not supported; supported: {served}")
    if isinstance(model, arch.causal_lm_class):
        return arch
    ours = import_path(arch.causal_lm_class)
    if isinstance(model, arch.base_model_class):
        raise ValueError(f"LLM: model is the base model {kind} (no lm_head); pass the causal LM {ours} "
                         "(AutoModelForCausalLM)")
    if type(model).__module__.startswith("transformers."):
        raise ValueError(f"LLM: model is transformers' stock {kind}, not vexact-models' {ours}: call "
                         "vexact_models.patch() before loading it with AutoModelForCausalLM, or load it with "
                         f"{ours}.from_pretrained(path)")
    raise ValueError(f"LLM: model is a {kind}; model_type {model_type!r} needs {ours}")


def sharded_parameter(model: torch.nn.Module) -> str | None:
    """The name of `model`'s first sharded parameter (a DTensor: FSDP2, tensor parallelism), None
    when every parameter is whole."""
    return next((name for name, p in model.named_parameters() if isinstance(p, DTensor)), None)


def check_model_placement(model: torch.nn.Module, device: torch.device | None, dtype: torch.dtype | None) -> None:
    """A model instance runs where it lives, in its own dtype: a different explicit `device` or
    `dtype` would be silently ignored (or fail at the first step), so it is an error; so are
    sharded (DTensor) parameters, which the engine's kernels do not run."""
    # the first parameter off the meta device (a pipeline stage's model holds only its own)
    param = next((p for p in model.parameters() if not p.is_meta), None)
    if param is None:
        raise ValueError(f"LLM: every parameter of the {type(model).__name__} is on the meta device; load or "
                         "materialise its weights first")
    sharded = sharded_parameter(model)
    if sharded is not None:
        raise ValueError(f"LLM: the {type(model).__name__}'s parameters are sharded (DTensor, e.g. {sharded}: FSDP2 or "
                         "tensor parallelism), and the engine runs whole weights. Build it over an unsharded copy "
                         "(LLM(path), or a model instance with owns_weights=True) and send it the trainer's weights "
                         "with vexact_models.distributed.stream_full_weights -> LLM.update_weights (docs/fsdp.md)")
    if device is not None and (param.device.type != device.type
                               or (device.index is not None and param.device.index not in (None, device.index))):
        raise ValueError(f"LLM: device={str(device)!r} but the model's parameters are on {param.device}; move the "
                         "model first (model.to(device)) or leave device=None")
    if dtype is not None and dtype != param.dtype:
        raise ValueError(f"LLM: dtype={dtype} but the model's parameters are {param.dtype}; dtype applies when "
                         "loading a checkpoint folder (cast the model first, or leave dtype='auto')")
