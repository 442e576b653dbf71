"""Building the rollout engine: `LLM`'s device, model, EOS ids and KV-cache size.

Plain functions of what they are given, which `LLM.__init__` calls in order: what the engine
is built from (a checkpoint folder or a model instance, on one process or as one stage of a
pipeline, `runtime.pipeline`) is decided here, serving requests in `runtime.llm`.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoTokenizer

from vexact_models.loading import from_pretrained_complete
from vexact_models.registry import for_model_type

from .linear_state_cache import linear_state_spec
from .model_runner import kv_bytes_per_block
from .pipeline import PipelineStage, StageModel
from .pipeline_worker import Pipeline
from .pipeline_load import load_stage_model


__all__ = ["cache_budget_bytes", "cache_bytes_per_block", "eos_token_ids", "folder_config", "kv_cache_blocks",
           "linear_state_bytes", "load_folder", "pick_device", "runner_model"]


#: a stage without attention layers: any page count fits (the other stages' decides)
_NO_PAGES = 1 << 62


def pick_device(model, device: torch.device | None, stage: PipelineStage | None) -> torch.device:
    """The engine's device: `device` when given; for a model instance, where its (stage's)
    decoder layers live; else CUDA when available (a pipeline stage: the current CUDA device),
    else CPU."""
    if device is not None:
        return device
    if isinstance(model, torch.nn.Module):  # a model instance: run where its (stage's) layers live
        layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
        return next(layers[0 if stage is None else stage.layers[0]].parameters()).device
    if not torch.cuda.is_available():
        return torch.device("cpu")
    # a stage's tensors and NCCL messages live on the device torch.cuda.set_device chose
    return torch.device("cuda", torch.cuda.current_device()) if stage is not None else torch.device("cuda")


def runner_model(model, pipeline: Pipeline | None, hidden_size: int) -> tuple:
    """What the runner runs: the inference `model`, or this pipeline stage's part of it, with
    the stage's decoder layers (whose KV pages it holds) and the width of the hidden rows it
    takes from the previous stage (0: it takes token ids)."""
    if pipeline is None:
        return model, None, 0
    stage = pipeline.stage
    return StageModel(model, stage), stage.layers, 0 if stage.is_first else hidden_size


def folder_config(path: str):
    """A checkpoint folder's HF config and the registered architecture serving it."""
    config = AutoConfig.from_pretrained(path)
    arch = for_model_type(config.model_type)
    if arch is None:
        raise ValueError(f"LLM: {path} has model_type {config.model_type!r}, which vexact-models does not support")
    return config, arch


def load_folder(path: str, dtype, stage: PipelineStage | None, device: torch.device) -> tuple:
    """The training model of a checkpoint folder on `device` (a pipeline stage: only its
    tensors, `pipeline_load`), and the folder's tokenizer (None when it has none)."""
    config, arch = folder_config(path)
    if dtype == "auto":
        torch_dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    else:
        torch_dtype = dtype
    if isinstance(torch_dtype, str):
        torch_dtype = getattr(torch, torch_dtype)
    if stage is not None:
        model = load_stage_model(path, arch, config, torch_dtype, stage, device)
    else:
        model = from_pretrained_complete(arch.causal_lm_class, path, dtype=torch_dtype).to(device).eval()
    tokenizer = None
    if any(os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def cache_bytes_per_block(model, dtype: torch.dtype, block_size: int, pipeline: Pipeline | None = None) -> int:
    """Bytes of one KV page of the inference `model` over the layers that hold pages: all of them
    (a pipeline stage: its own), less the gated-DeltaNet layers, which keep states instead."""
    spec = model.kv_cache_spec()
    layers = set(range(spec[0]) if pipeline is None else pipeline.stage.layers)
    linear = linear_state_spec(model)
    if linear is not None:
        layers -= set(linear.layers)
    return kv_bytes_per_block(spec, block_size, dtype) // spec[0] * len(layers)


def linear_state_bytes(model, dtype: torch.dtype, slots: int, pipeline: Pipeline | None = None) -> int:
    """Bytes of the gated-DeltaNet state cache of `slots` sequences (0 without such layers;
    `runtime.linear_state_cache`); a pipeline stage's: of its own layers."""
    linear = linear_state_spec(model, None if pipeline is None else pipeline.stage.layers)
    return 0 if linear is None else linear.cache_bytes(slots, dtype)


def cache_budget_bytes(model, dtype: torch.dtype, block_size: int, blocks: int, state_slots: int) -> int:
    """The ``kv_cache_bytes`` that give an engine over `model` (inference or training variant)
    exactly `blocks` KV pages with ``max_num_seqs=state_slots`` (`kv_cache_blocks`'s inverse)."""
    return blocks * cache_bytes_per_block(model, dtype, block_size) + linear_state_bytes(model, dtype, state_slots)


def kv_cache_blocks(model, dtype: torch.dtype, device: torch.device, pipeline: Pipeline | None, block_size: int,
                    utilization: float, kv_cache_bytes: int | None, state_slots: int = 0) -> int:
    """KV pages of the inference `model` that fit the budget (a pipeline stage's budget holds
    its layers' pages; every stage takes the smallest count, since the first stage's page ids
    address them all). The budget holds the gated-DeltaNet state cache of `state_slots`
    sequences (``max_num_seqs``) first, when the model (stage) has such layers; a stage without
    attention layers holds no pages and takes the others' count."""
    per_block = cache_bytes_per_block(model, dtype, block_size, pipeline)
    if kv_cache_bytes is None:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # memory the allocator holds unused is the budget's too
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free - (1 - utilization) * total)
        else:
            kv_cache_bytes = 256 << 20
    states = linear_state_bytes(model, dtype, state_slots, pipeline)
    blocks = (kv_cache_bytes - states) // per_block if per_block else (_NO_PAGES if kv_cache_bytes >= states else 0)
    if pipeline is not None:  # before any raise: every stage must reach this collective
        blocks = pipeline.comm.min_over_stages(blocks)
    if blocks == _NO_PAGES:
        raise ValueError("LLM: the model has no layer that holds KV pages (no attention layer); the rollout engine "
                         "needs one")
    if blocks < 1:
        held = f" after the gated-DeltaNet states of {state_slots} sequences ({states} bytes)" if states else ""
        raise ValueError(f"LLM: the KV cache budget ({kv_cache_bytes} bytes) is smaller than one block "
                         f"({per_block} bytes){held}; raise kv_cache_bytes or gpu_memory_utilization"
                         f"{' or lower max_num_seqs' if states else ''}")
    return int(blocks)


def eos_token_ids(model, config) -> list[int]:
    """The checkpoint's EOS ids: its generation_config.json (which from_pretrained loads into
    the inference `model`'s causal LM, e.g. Qwen3's <|im_end|> and <|endoftext|>), else
    ``config.eos_token_id``."""
    gen = getattr(model.causal_lm, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    vocab = int(config.vocab_size)
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:  # the sampler would index its stop-token mask out of range, mid-step
        raise ValueError(f"LLM: eos_token_id {bad} (generation_config / config.eos_token_id) is outside the "
                         f"vocabulary [0, {vocab}); fix the checkpoint's eos_token_id")
    return ids
