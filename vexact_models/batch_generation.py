"""transformers' continuous-batching ``generate_batch`` on our models, run by the rollout engine.

Stock ``generate_batch`` runs transformers' own paged runtime, which calls the forward with a 4-D
paged attention mask and a cache layout our forward does not take: every request came back
FAILED with no tokens (TRL's ``use_transformers_continuous_batching`` read empty completions).
Ours hands the prompts to a `vexact_models.LLM` over the model's own parameters (no copy; the
engine is made for the call and dropped after it, or kept with ``persistent_manager=True`` until
``destroy_cached_continuous_batching_manager``) and returns stock's ``{request_id:
GenerationOutput}`` in stock's order (``req_<i>``, a prompt's extra samples as
``req_<i>__child#<j>`` before it). The tokens are the engine's, so each logprob
(``ContinuousBatchingConfig(return_logprobs=True)``) is bitwise the one ``token_logprobs``
recomputes; stock's are of its processed scores, after top-k / top-p.

The ``GenerationConfig`` is read as stock's continuous batching reads it (no global defaults
merged in): ``do_sample`` (unset: greedy), and when sampling ``temperature``, ``top_k``,
``top_p``, ``min_p``; ``repetition_penalty``, ``min_new_tokens`` / ``min_length``,
``max_new_tokens`` (unset: up to the engine's ``max_model_len``), ``eos_token_id`` (else the
model config's), ``num_return_sequences``. A setting the engine's sampler has no counterpart for
(beams, ``no_repeat_ngram_size``, ``bad_words_ids``, ``suppress_tokens``, ...) is a ValueError
naming it before anything runs; stock drops such processors with a warning or runs them on its
own logits. Of ``ContinuousBatchingConfig``: ``max_memory_percent`` (the KV cache's share of
the free device memory; TRL passes 0.5) or ``num_blocks`` x ``page_size`` tokens size the cache,
``max_batch_tokens`` and ``max_requests_per_batch`` the steps, ``use_cuda_graph`` False runs
eagerly, ``allow_block_sharing`` False turns prefix sharing off, ``seed`` seeds the
requests (without it each call draws one from torch's global generator, so ``torch.manual_seed``
repeats a call), ``return_logprobs``; the rest shapes stock's runtime only.
``VEXACT_GENERATE_BATCH_ENGINE=kept`` keeps every call's engine, as ``persistent_manager=True``
does, for callers that do not pass it (TRL). Keyword arguments
naming ``GenerationConfig`` fields apply to a copy of the config, so HF's
``generate(..., cache_implementation="paged")``, which switches to ``generate_batch`` with them,
runs here too. A model whose parameters are sharded (FSDP2) is refused: the engine runs whole
weights. The streaming
manager (``init_continuous_batching``, ``continuous_batching_context_manager``) is refused, naming
``generate_batch`` and `LLM`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import NoReturn

import torch
from transformers import GenerationConfig
from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

from vexact_models.kernels import KernelSwitch
from vexact_models.runtime import LLM, RequestOutput, SamplingParams
from vexact_models.runtime.llm_args import check_max_model_len, default_block_size, sharded_parameter
from vexact_models.runtime.llm_setup import cache_budget_bytes
from vexact_models.runtime.sampling_params import MAX_SEED

__all__ = ["CALL_GRAPH_SIZES", "ENGINE", "ENGINE_LIFETIME", "BatchEngineSettings", "KeptEngine",
           "drop_engine", "engine_settings", "generate_batch", "refuse_streaming_manager"]

#: the model attribute holding the engine ``generate_batch(persistent_manager=True)`` keeps
ENGINE = "_vexact_batch_engine"

#: the decode batch sizes an engine built for one call captures below its ``max_num_seqs``
#: (`LLM`'s ``cuda_graph_sizes``): a call's build is mostly these captures' host time, so fewer than
#: the default's, each step padded to the next (the same bits); None: `LLM`'s default sizes
CALL_GRAPH_SIZES: tuple[int, ...] | None = (4, 16, 64, 256)

#: ``kept``: every ``generate_batch`` call keeps its engine, as ``persistent_manager=True`` does (for
#: callers that do not pass it, e.g. TRL): its KV cache and CUDA graphs stay allocated between calls,
#: and a call skips the engine's build (0.2-1 s at Qwen3-0.6B and 8B, docs/performance.md section 3)
ENGINE_LIFETIME = KernelSwitch("VEXACT_GENERATE_BATCH_ENGINE", ("call", "kept"), "call", "generate_batch engine's lifetime")

#: ``GenerationConfig`` fields the engine's sampler has no counterpart for, with the values that
#: leave them off (per release a field is None or its neutral value when unset)
UNSUPPORTED = {
    "num_beams": (None, 1), "num_beam_groups": (None, 1), "diversity_penalty": (None, 0.0),
    "penalty_alpha": (None, 0.0), "encoder_repetition_penalty": (None, 1.0), "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0), "bad_words_ids": (None, []), "force_words_ids": (None, []),
    "constraints": (None, []), "sequence_bias": (None, {}), "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []), "forced_bos_token_id": (None,), "forced_eos_token_id": (None,),
    "exponential_decay_length_penalty": (None,), "guidance_scale": (None, 1.0), "watermarking_config": (None,),
    "stop_strings": (None, []), "max_time": (None,), "dola_layers": (None,), "token_healing": (None, False),
    "prompt_lookup_num_tokens": (None,), "assistant_early_exit": (None,), "use_mtp": (None, False),
}

#: sampling-only fields (HF applies them only with ``do_sample``) without a counterpart
UNSUPPORTED_WHEN_SAMPLING = {"typical_p": (None, 1.0), "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
                             "top_h": (None,)}


@dataclass(frozen=True)
class BatchEngineSettings:
    """The engine a ``generate_batch`` call asks for; a kept engine is reused only by a call
    asking for the same. The KV budget is kept as asked (`kv_tokens`, `kv_memory_share`) and
    turned into bytes when the engine is built: the free memory it is a share of changes, not
    least by the kept engine's own cache."""

    max_num_seqs: int
    max_num_batched_tokens: int
    enforce_eager: bool
    enable_prefix_sharing: bool
    kv_tokens: int | None = None  #: ``num_blocks`` x ``page_size`` tokens
    kv_memory_share: float | None = None  #: ``max_memory_percent`` of the device's free memory (CUDA)
    cuda_graph_sizes: tuple[int, ...] | None = None  #: `LLM`'s (None: its default)

    def kv_cache_bytes(self, model: torch.nn.Module) -> int | None:
        """The KV budget in bytes for an engine over `model` now (None: `LLM`'s default)."""
        param = next(model.parameters())
        if self.kv_tokens is not None:
            block = default_block_size(model.kv_cache_spec())
            return cache_budget_bytes(model, param.dtype, block, -(-self.kv_tokens // block), self.max_num_seqs)
        if self.kv_memory_share is not None and param.device.type == "cuda":
            torch.cuda.empty_cache()
            return int(self.kv_memory_share * torch.cuda.mem_get_info(param.device)[0])
        return None

    def build(self, model: torch.nn.Module) -> LLM:
        """A new engine over `model`'s parameters."""
        return LLM(model, max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                   kv_cache_bytes=self.kv_cache_bytes(model), enforce_eager=self.enforce_eager,
                   enable_prefix_sharing=self.enable_prefix_sharing, cuda_graph_sizes=self.cuda_graph_sizes)


def _cb(config, name: str, default):
    """A ``ContinuousBatchingConfig`` field (None where the release or the caller has none)."""
    value = getattr(config, name, None) if config is not None else None
    return default if value is None else value


def engine_settings(cb_config, num_requests: int, persistent: bool) -> BatchEngineSettings:
    """The engine a call runs on: `cb_config`'s (a ``ContinuousBatchingConfig`` or None) sizes,
    sequences per step capped at the call's `num_requests` and decode graphs of
    `CALL_GRAPH_SIZES` unless the engine is kept (`persistent`: `LLM`'s defaults). The KV
    budget: ``num_blocks`` x ``page_size`` (``block_size`` before transformers 5.17) tokens where
    given, else ``max_memory_percent`` of the device's free memory (CUDA), else `LLM`'s default."""
    seqs = int(_cb(cb_config, "max_requests_per_batch", 256))
    num_blocks = _cb(cb_config, "num_blocks", None)
    percent = _cb(cb_config, "max_memory_percent", None)
    graphs = _cb(cb_config, "use_cuda_graph", True)
    return BatchEngineSettings(
        max_num_seqs=seqs if persistent else max(1, min(seqs, num_requests)),
        max_num_batched_tokens=int(_cb(cb_config, "max_batch_tokens", 8192)),
        enforce_eager=not (all(graphs) if isinstance(graphs, (tuple, list)) else bool(graphs)),
        enable_prefix_sharing=bool(_cb(cb_config, "allow_block_sharing", True)),
        kv_tokens=None if num_blocks is None else int(num_blocks) * int(_cb(cb_config, "page_size", None)
                                                                        or _cb(cb_config, "block_size", 256)),
        kv_memory_share=None if num_blocks is not None or percent is None else float(percent),
        cuda_graph_sizes=None if persistent else CALL_GRAPH_SIZES)


def _unsupported(config: GenerationConfig, sampling: bool) -> list[str]:
    """``name=value`` of each setting of `config` the engine's sampler has no counterpart for."""
    checks = {**UNSUPPORTED, **(UNSUPPORTED_WHEN_SAMPLING if sampling else {})}
    return [f"{name}={getattr(config, name)!r}" for name, off in checks.items()
            if getattr(config, name, None) not in off]


def _eos_ids(model: torch.nn.Module, config: GenerationConfig) -> list[int]:
    """The ids that end a sample, as stock's continuous batching reads them: the generation
    config's ``eos_token_id``, else the model config's; -1 (stock's "disabled") is none."""
    eos = config.eos_token_id if config.eos_token_id is not None else getattr(model.config, "eos_token_id", None)
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return [int(i) for i in ids if int(i) != -1]


def _check_generation_config(model: torch.nn.Module, config: GenerationConfig) -> None:
    """ValueError naming a setting of `config` without a counterpart in the engine's sampler, or a
    ``max_new_tokens`` that is not an int >= 1 (or None)."""
    name = type(model).__name__
    max_new_tokens = config.max_new_tokens
    unsupported = _unsupported(config, bool(config.do_sample))
    if unsupported:
        raise ValueError(f"{name}.generate_batch: generation_config {', '.join(unsupported)} has no counterpart in "
                         "the rollout engine's sampler (vexact_models.SamplingParams); unset it, or use generate()")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"{name}.generate_batch: max_new_tokens={max_new_tokens!r} must be an int >= 1")


def _sampling_params(model: torch.nn.Module, config: GenerationConfig, prompts: list[list[int]],
                     max_model_len: int, seed: int) -> list[SamplingParams]:
    """One `SamplingParams` per prompt for `config` (checked by `_check_generation_config`), read
    as stock's continuous batching reads it (the module docstring): without ``max_new_tokens`` a
    sample may run to `max_model_len`; request i gets seed ``seed + i``."""
    sampling = bool(config.do_sample)
    max_new_tokens = config.max_new_tokens
    shared = dict(
        n=int(config.num_return_sequences or 1),
        temperature=float(1.0 if config.temperature is None else config.temperature) if sampling else 0.0,
        top_k=int(config.top_k) if sampling and config.top_k else -1,
        top_p=float(config.top_p) if sampling and config.top_p is not None else 1.0,
        min_p=float(config.min_p) if sampling and config.min_p is not None else 0.0,
        repetition_penalty=float(1.0 if config.repetition_penalty is None else config.repetition_penalty),
        stop_token_ids=_eos_ids(model, config), ignore_eos=True)
    params = []
    for i, prompt in enumerate(prompts):
        room = max_model_len - len(prompt)
        limit = max_new_tokens if max_new_tokens is not None else max(room, 1)
        least = max(int(config.min_new_tokens or 0), int(config.min_length or 0) - len(prompt), 0)
        params.append(SamplingParams(**shared, max_tokens=limit, min_tokens=min(least, limit),
                                     seed=(seed + i) % MAX_SEED))
    return params


def _outputs(outputs: list[RequestOutput], first: int, created: float, logprobs: bool) -> dict[str, GenerationOutput]:
    """Stock's ``{request_id: GenerationOutput}``, in its order: a prompt's samples 1.. as
    ``req_<i>__child#<j>``, then sample 0 as ``req_<i>``."""
    done = time.perf_counter()
    results = {}
    for i, out in enumerate(outputs):
        parent = f"req_{first + i}"
        ids = [f"{parent}__child#{j}" for j in range(len(out.outputs) - 1)] + [parent]
        for request_id, sample in zip(ids, out.outputs[1:] + out.outputs[:1]):
            failed = sample.finish_reason == "error"
            results[request_id] = GenerationOutput(
                request_id=request_id, prompt_ids=list(out.prompt_token_ids), generated_tokens=list(sample.token_ids),
                logprobs=list(sample.logprobs) if logprobs else [], error=sample.error if failed else None,
                status=RequestStatus.FAILED if failed else RequestStatus.FINISHED, created_time=created,
                lifespan=(created, done))
    return results


def _check_call(model: torch.nn.Module, inputs, record_timestamps: bool) -> None:
    """ValueError for what ``generate_batch`` cannot do, before anything runs."""
    name = type(model).__name__
    sharded = sharded_parameter(model)
    if sharded is not None:
        raise ValueError(f"{name}.generate_batch: the parameters are sharded (DTensor, e.g. {sharded}: FSDP2), and "
                         "the rollout engine that runs generate_batch takes whole weights. On the sharded model call "
                         "generate() (its cached steps run there), or roll out with a vexact_models.LLM over an "
                         "unsharded copy fed by stream_full_weights (docs/fsdp.md)")
    if record_timestamps:
        raise ValueError(f"{name}.generate_batch: record_timestamps=True is not supported (the rollout engine keeps no "
                         "per-token times); leave it False")
    if not isinstance(inputs, (list, tuple)) or not all(isinstance(p, (list, tuple)) for p in inputs):
        raise ValueError(f"{name}.generate_batch: inputs must be a list of token-id lists, got "
                         f"{type(inputs).__name__}")


def _config_of(model: torch.nn.Module, generation_config: GenerationConfig | None, kwargs: dict) -> GenerationConfig:
    """The call's ``GenerationConfig``: `generation_config` (else the model's), with the keyword
    arguments that name its fields set on a copy, as ``generate`` takes them (HF's
    ``generate(cache_implementation="paged")`` passes its own here, already merged). An
    ``attention_mask`` of ones (that path passes the tokenizer's) is taken; one with padding, or
    any other argument, is a ValueError: the prompts are the given lists, whole."""
    name = type(model).__name__
    config = generation_config if generation_config is not None else model.generation_config
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(torch.as_tensor(mask).bool().all()):
        raise ValueError(f"{name}.generate_batch: attention_mask has padding; generate_batch takes unpadded prompts "
                         "(a list of token-id lists), so pass them without their padding")
    fields = set(GenerationConfig().__dict__)
    unknown = sorted(set(kwargs) - fields)
    if unknown:
        raise ValueError(f"{name}.generate_batch: unexpected arguments {unknown}; it takes generation_config, "
                         "continuous_batching_config and GenerationConfig fields (max_new_tokens, do_sample, ...)")
    if not kwargs:
        return config
    config = copy.deepcopy(config)
    for field, value in kwargs.items():
        setattr(config, field, value)
    return config


@dataclass
class KeptEngine:
    """The engine ``generate_batch(persistent_manager=True)`` keeps on the model: what it was
    built with, and how many requests it has numbered (ids continue across calls, as stock's)."""

    settings: BatchEngineSettings
    llm: LLM
    requests: int = 0


def _engine(model: torch.nn.Module, settings: BatchEngineSettings) -> KeptEngine:
    """The kept engine if it was built with `settings`, else a new one (replacing it)."""
    kept = model.__dict__.get(ENGINE)
    if kept is not None and kept.settings == settings:
        return kept
    drop_engine(model)
    return KeptEngine(settings, settings.build(model))


def drop_engine(model: torch.nn.Module) -> None:
    """Forget the engine ``generate_batch(persistent_manager=True)`` kept, freeing its KV cache
    and graphs (stock's ``destroy_cached_continuous_batching_manager``)."""
    kept = model.__dict__.pop(ENGINE, None)
    if kept is not None:
        kept.llm.sleep(level=0)


def generate_batch(model: torch.nn.Module, inputs: list[list[int]], generation_config: GenerationConfig | None = None,
                   continuous_batching_config=None, record_timestamps: bool = False, progress_bar: bool = False,
                   persistent_manager: bool = False, warmup: bool = True, **kwargs) -> dict[str, GenerationOutput]:
    """Stock ``generate_batch``'s contract on `model` (ours), run by a `LLM` over its parameters
    (the module docstring). ``warmup`` has nothing to do (the engine captures its graphs as it
    needs them); ``continuous_batching_config`` may also come on ``generation_config``, as
    stock reads it; keyword arguments naming ``GenerationConfig`` fields (``max_new_tokens``,
    ``do_sample``, ...) apply to a copy of the config (`_config_of`). Every argument is checked
    before the engine is built."""
    _check_call(model, inputs, record_timestamps)
    config = _config_of(model, generation_config, kwargs)
    persistent_manager = persistent_manager or ENGINE_LIFETIME.mode() == "kept"
    if not inputs:
        return {}
    cb_config = continuous_batching_config
    if cb_config is None:
        cb_config = getattr(config, "continuous_batching_config", None)
    _check_generation_config(model, config)
    seed = _cb(cb_config, "seed", None)
    seed = int(torch.randint(0, MAX_SEED - 1, ()).item()) if seed is None else int(seed)
    prompts = [list(p) for p in inputs]
    created = time.perf_counter()
    # the engine's max_model_len (LLM's default: the model's positions), checked before it is built
    params = _sampling_params(model, config, prompts, check_max_model_len(None, model.config), seed)
    kept = _engine(model, engine_settings(cb_config, len(prompts), persistent_manager))
    first, kept.requests = kept.requests, kept.requests + len(prompts)
    try:
        outputs = kept.llm.generate(prompts, params, use_tqdm=progress_bar)
    finally:
        model.__dict__[ENGINE] = kept
        if not persistent_manager:
            drop_engine(model)
    return _outputs(outputs, first, created, bool(_cb(cb_config, "return_logprobs", False)))


def refuse_streaming_manager(model: torch.nn.Module, method: str) -> NoReturn:
    """ValueError for stock's streaming continuous-batching manager, which runs transformers'
    paged runtime (the module docstring), naming what to use instead."""
    raise ValueError(f"{type(model).__name__}.{method}: transformers' continuous-batching manager runs its own paged "
                     "attention, which this model's forward does not take. Use generate_batch(), or "
                     "vexact_models.LLM for streaming requests (it shares the model's weights)")
