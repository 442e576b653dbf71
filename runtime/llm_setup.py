"""Building the rollout engine: `LLM`'s device, model, EOS ids, KV-cache size and `EngineConfig`.

Plain functions of what they are given, which `LLM.__init__` calls in order: what the engine
is built from (a checkpoint folder or a model instance, on one process or as one stage of a
pipeline, `runtime.pipeline`) is decided here, serving requests in `runtime.llm`.
"""

from __future__ import annotations

import os

import torch
from transformers import AutoConfig, AutoTokenizer

from vexact_models.adapters import expert_lora_b
from vexact_models.kernels import EXPERT_B
from vexact_models.kernels.attention_window import window_block_start
from vexact_models.layers import cache_window, window_layers
from vexact_models.loading import from_pretrained_complete
from vexact_models.multimodal import text_config_of
from vexact_models.registry import for_model_type

from .cuda_graphs import DEFAULT_BUCKETS, DEFAULT_MAX_TOKENS
from .engine_config import EngineConfig
from .linear_state_cache import linear_state_spec
from .llm_args import default_block_size
from .model_runner import kv_bytes_per_block
from .page_groups import WindowGroup, window_pages_cap
from .pipeline import PipelineStage, StageModel
from .pipeline_worker import Pipeline
from .pipeline_load import load_stage_model


__all__ = ["cache_budget_bytes", "cache_bytes_per_block", "engine_config", "eos_token_ids", "folder_config",
           "kept_b_budget", "kv_bytes_per_sequence", "kv_cache_blocks", "kv_cache_pages", "linear_state_bytes",
           "load_folder", "pick_device", "runner_model"]


#: a stage without attention layers: any page count fits (the other stages' decides)
_NO_PAGES = 1 << 62


def pick_device(model, device: torch.device | None, stage: PipelineStage | None) -> torch.device:
    """The engine's device: `device` when given; for a model instance, where its (stage's)
    decoder layers live; else CUDA when available, else CPU. A CUDA device always carries its
    index ("cuda" alone: the current device), since the engine's threads (`runtime.engine_thread`)
    and a pipeline stage's NCCL messages need it, and a new thread does not inherit the current device."""
    if device is None and isinstance(model, torch.nn.Module):  # a model instance: run where its (stage's) layers live
        layers = model.get_base_model().model.layers if hasattr(model, "get_base_model") else model.model.layers
        device = next(layers[0 if stage is None else stage.layers[0]].parameters()).device
    elif device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    return torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" and device.index is None else device


def runner_model(model, pipeline: Pipeline | None, hidden_size: int) -> tuple:
    """What the runner runs: the inference `model`, or this pipeline stage's part of it, with
    the stage's decoder layers (whose KV pages it holds) and the width of the hidden rows it
    takes from the previous stage (0: it takes token ids)."""
    if pipeline is None:
        return model, None, 0
    stage = pipeline.stage
    return StageModel(model, stage), stage.layers, 0 if stage.is_first else hidden_size


def folder_config(path: str):
    """A checkpoint folder's HF config and the registered architecture serving it; of a published
    multimodal checkpoint, its text model's (`vexact_models.multimodal`; stored in the
    checkpoint's dtype)."""
    config = AutoConfig.from_pretrained(path)
    text = text_config_of(config)
    if text is not config and getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    arch = for_model_type(text.model_type)
    if arch is None:
        raise ValueError(f"LLM: {path} has model_type {config.model_type!r}, which vexact-models does not support")
    return text, arch


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


def cache_bytes_per_block(model, dtype: torch.dtype, block_size: int, pipeline: Pipeline | None = None,
                          layers: tuple[int, ...] | None = None) -> int:
    """Bytes of one KV page of the inference `model` over the layers that hold pages: all of them
    (a pipeline stage: its own; `layers`: those among them, a page group's), less the
    gated-DeltaNet layers, which keep states instead."""
    spec = model.kv_cache_spec()
    held = set(range(spec[0]) if pipeline is None else pipeline.stage.layers)
    if layers is not None:
        held &= set(layers)
    linear = linear_state_spec(model)
    if linear is not None:
        held -= set(linear.layers)
    return kv_bytes_per_block(spec, block_size, dtype) // spec[0] * len(held)


def linear_state_bytes(model, dtype: torch.dtype, slots: int, pipeline: Pipeline | None = None,
                       snapshots: int = 0) -> int:
    """Bytes of the gated-DeltaNet state cache of `slots` sequences (0 without such layers;
    `runtime.linear_state_cache`); a pipeline stage's: of its own layers."""
    linear = linear_state_spec(model, None if pipeline is None else pipeline.stage.layers)
    return 0 if linear is None else linear.cache_bytes(slots, dtype, snapshots)


def cache_budget_bytes(model, dtype: torch.dtype, block_size: int, blocks: int, state_slots: int,
                       state_snapshots: int = 0) -> int:
    """The ``kv_cache_bytes`` that give an engine over `model` (inference or training variant)
    exactly `blocks` KV pages with ``max_num_seqs=state_slots`` and ``prefix_states=state_snapshots``
    (`kv_cache_blocks`'s inverse; a
    model mixing windowed and full attention layers gets `blocks` pages in each of its page groups
    while its window group's cap, `page_groups.window_pages_cap`, is not below them, else more
    global pages)."""
    return (blocks * cache_bytes_per_block(model, dtype, block_size)
            + linear_state_bytes(model, dtype, state_slots, snapshots=state_snapshots))


def kv_cache_blocks(model, dtype: torch.dtype, device: torch.device, pipeline: Pipeline | None, block_size: int,
                    utilization: float, kv_cache_bytes: int | None, state_slots: int = 0) -> int:
    """KV pages of the inference `model` that fit the budget, all layers in one page group
    (`kv_cache_pages` without a window group)."""
    return kv_cache_pages(model, dtype, device, pipeline, block_size, utilization, kv_cache_bytes, state_slots)[0]


def kept_b_budget(model, device: torch.device, kv_cache_bytes: int | None) -> int | None:
    """The bytes an engine over `model` sets aside for its adapted expert tensors' B copied by
    expert (`ModelRunner.kept_b`): where its budget is measured on a CUDA device (no
    `kv_cache_bytes`), every such B the model holds now under ``VEXACT_EXPERT_B=kept`` (0 under
    ``call``), which `kv_cache_pages` leaves out of the KV cache and the runner's copies stay
    within; None (no limit) where the cache's size is given or the device is not CUDA."""
    if kv_cache_bytes is not None or device.type != "cuda":
        return None
    return sum(b.numel() * b.element_size() for b, _ in expert_lora_b(model)) if EXPERT_B.mode() == "kept" else 0


def kv_cache_pages(model, dtype: torch.dtype, device: torch.device, pipeline: Pipeline | None, block_size: int,
                   utilization: float, kv_cache_bytes: int | None, state_slots: int = 0,
                   window_group: tuple[tuple[int, ...], int] | None = None, state_snapshots: int = 0
                   ) -> tuple[int, int]:
    """(global pages, window-group pages) of the inference `model` that fit the budget (a pipeline
    stage's budget holds its layers' pages; every stage takes the smallest count, since the first
    stage's page ids address them all). The budget holds the gated-DeltaNet state cache of
    `state_slots` sequences (``max_num_seqs``) and `state_snapshots` kept prompt states first,
    when the model (stage) has such layers; a budget measured on the device (no
    `kv_cache_bytes`) also holds the adapted expert tensors' B copied by expert, which the runner
    keeps (`kept_b_budget`). A stage without attention layers
    holds no pages and takes the others' count.

    `window_group`: ``(its layers, its cap)`` for a model whose windowed layers keep their pages
    apart (`runtime.page_groups`): each group's page costs its own layers' bytes, the window group
    takes as many pages as the global group up to its cap (`page_groups.window_pages_cap`: what
    the running sequences can hold there), the global group the rest. Without one: (pages, 0).
    A pipeline stage prices each group's page at its own layers' bytes (none for a group it holds
    no layer of); every stage takes the smallest global count, and the window group's follows
    from it and the cap alike on every stage (a stage of windowed layers only whose budget fits
    the cap takes the others' global count; one whose budget does not fit it bounds both)."""
    window_layers_, cap = window_group if window_group is not None else ((), 0)
    per_block = cache_bytes_per_block(model, dtype, block_size, pipeline)
    per_window = cache_bytes_per_block(model, dtype, block_size, pipeline, window_layers_) if window_group else 0
    if kv_cache_bytes is None:
        if device.type == "cuda":
            torch.cuda.empty_cache()  # memory the allocator holds unused is the budget's too
            free, total = torch.cuda.mem_get_info(device)
            kv_cache_bytes = int(free - (1 - utilization) * total) - kept_b_budget(model, device, None)
        else:
            kv_cache_bytes = 256 << 20
    states = linear_state_bytes(model, dtype, state_slots, pipeline, state_snapshots)
    pages = kv_cache_bytes - states
    blocks = pages // per_block if per_block else (_NO_PAGES if kv_cache_bytes >= states else 0)
    if window_group is not None and blocks > cap:  # the window group capped: the rest of the budget is global
        per_global = per_block - per_window  # 0: a stage of windowed layers only, whose capped group fits
        blocks = (pages - cap * per_window) // per_global if per_global else _NO_PAGES
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
    return int(blocks), (min(int(blocks), cap) if window_group is not None else 0)


def kv_bytes_per_sequence(model, num_tokens: int, *, dtype: torch.dtype, block_size: int,
                          window_freed: bool = True) -> int:
    """KV-cache bytes one sequence of `num_tokens` computed tokens holds in an engine over `model`
    (an inference or training variant of ours, on any device, the meta device included) with
    pages of `block_size` in `dtype`: every layer's pages, or (`window_freed`) the windowed layers'
    only from their window on, as the engine keeps them after a step (`BlockManager.
    release_behind_window`, `runtime.page_groups`; docs/design.md section 6): the pages from the
    next position's `window_block_start`, and at least the last. Gated-DeltaNet layers keep
    states, not pages, and count nothing here. `LLM.kv_bytes_per_sequence` is this at the
    engine's dtype and page size."""
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ValueError(f"kv_bytes_per_sequence: num_tokens={num_tokens!r} must be an int >= 0")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"kv_bytes_per_sequence: block_size={block_size!r} must be an int >= 1")
    spec = model.kv_cache_spec()
    per_layer = kv_bytes_per_block(spec, block_size, dtype) // spec[0]
    paged = cache_bytes_per_block(model, dtype, block_size) // per_layer
    pages = -(-num_tokens // block_size)
    group = window_layers(model)
    window, windowed = (group[0], len(group[1])) if group is not None else (cache_window(model), paged)
    if not window_freed or window is None or pages == 0:
        return paged * pages * per_layer
    kept = pages - min(window_block_start(num_tokens, window) // block_size, pages - 1)
    return ((paged - windowed) * pages + windowed * kept) * per_layer


def engine_config(model, dtype: torch.dtype, device: torch.device, pipeline: Pipeline | None, *,
                  block_size: int | None, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                  eos_token_id: int | None, gpu_memory_utilization: float, kv_cache_bytes: int | None,
                  enable_chunked_prefill: bool, enable_prefix_sharing: bool, linear_states: bool, enforce_eager: bool,
                  cuda_graph_max_tokens: int | None, cuda_graph_sizes: tuple[int, ...] | None = None,
                  prefix_states: int = 0) -> EngineConfig:
    """The `EngineConfig` of an engine over the inference `model` (a pipeline stage's: its
    `pipeline`), from `LLM`'s checked arguments: the page size (`block_size`, or the model's
    default), the KV pages that fit the budget (`kv_cache_pages`; windowed layers beside full
    ones keep a page group of their own, capped by `page_groups.window_pages_cap`), and the
    scheduling settings. A model with gated-DeltaNet layers (`linear_states`) shares no pages:
    its samples of one request share their prompt with a copy of its state instead
    (`runtime.scheduler_siblings`), since a shared page would skip tokens a state must see, and
    later requests the `prefix_states` prompt states kept for them
    (`runtime.scheduler_prefix_states`; their slots counted in the budget; a ValueError for a model
    without such layers)."""
    if prefix_states and not linear_states:
        raise ValueError(f"LLM: prefix_states={prefix_states} keeps gated-DeltaNet states, and this "
                         f"{type(model.causal_lm).__name__} has no such layers (its prompts share pages by content: "
                         "enable_prefix_sharing)")
    if block_size is None:
        block_size = default_block_size(model.kv_cache_spec())
    windowed = window_layers(model)  # (a pipeline stage's too: the plan carries both groups' tables)
    cap = None if windowed is None else window_pages_cap(windowed[0], block_size, max_num_seqs, max_num_batched_tokens)
    num_blocks, window_blocks = kv_cache_pages(model, dtype, device, pipeline, block_size, gpu_memory_utilization,
                                               kv_cache_bytes, max_num_seqs,
                                               None if windowed is None else (windowed[1], cap), prefix_states)
    return EngineConfig(
        num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len, eos_token_id=eos_token_id,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_sharing=enable_prefix_sharing and not linear_states,
        kv_window=cache_window(model),  # a stage's model holds every layer's module (meta elsewhere)
        window_group=None if windowed is None else WindowGroup(windowed[0], windowed[1], window_blocks),
        share_prompt_state=enable_prefix_sharing and linear_states, prefix_states=prefix_states,
        cuda_graph_batch=0 if enforce_eager else max_num_seqs,
        cuda_graph_tokens=(min(max_num_batched_tokens, DEFAULT_MAX_TOKENS) if cuda_graph_max_tokens is None
                           else cuda_graph_max_tokens),
        cuda_graph_sizes=DEFAULT_BUCKETS if cuda_graph_sizes is None else tuple(cuda_graph_sizes),
        kept_b_limit=kept_b_budget(model, device, kv_cache_bytes))


def eos_token_ids(model, config, tokenizer=None) -> list[int]:
    """The checkpoint's EOS ids: its generation_config.json (which from_pretrained loads into
    the inference `model`'s causal LM, e.g. Qwen3's <|im_end|> and <|endoftext|>), else
    ``config.eos_token_id``; the `tokenizer`'s EOS first where it is one of them: the model's own
    EOS, as vLLM takes it (no ``stop_reason``; the others are stop tokens, reported)."""
    gen = getattr(model.causal_lm, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    own = getattr(tokenizer, "eos_token_id", None)
    if own in ids:
        ids = [own] + [i for i in ids if i != own]
    vocab = int(config.vocab_size)
    bad = [i for i in ids if not 0 <= int(i) < vocab]
    if bad:  # the sampler would index its stop-token mask out of range, mid-step
        raise ValueError(f"LLM: eos_token_id {bad} (generation_config / config.eos_token_id) is outside the "
                         f"vocabulary [0, {vocab}); fix the checkpoint's eos_token_id")
    return ids
