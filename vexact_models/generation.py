"""HF's ``generate`` on the training variant, over a KV cache of its own.

HF's loop runs with its cache turned off (``use_cache=False``), so each step hands the forward the
whole sequence; inside ``generate`` the forward keeps a `runtime.generate_cache.GenerateCache`
and runs only the tokens each step adds, through the paged forward the rollouts run: the logits,
and so greedy output, equal the whole recompute's and `vexact_models.LLM`'s, bit for bit. With
``use_cache=False`` (an argument or the ``generation_config``'s) or a beam search, whose steps
reorder the rows, every step is the whole recompute. A cache given to ``generate``
(``past_key_values``, or ``cache`` from transformers 5.25) is left out of the steps and marked as
left empty: given to a forward later, it is refused (`forward_arguments`). Assisted decoding (an
``assistant_model``, prompt lookup, early exit, multi-token prediction) checks its candidates
against HF's cache: it is refused up front, naming the argument, instead of failing inside HF's
loop. The first ``generate`` of a process logs where fast rollouts are
(`tell_once_about_rollouts`).
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn
from transformers import GenerationConfig

from vexact_models.forward_arguments import CACHE_ARGUMENTS, mark_left_empty
from vexact_models.runtime.generate_cache import GenerateCache

#: what asks HF's ``generate`` for assisted decoding, by ``generate``'s argument or the
#: ``GenerationConfig`` field of that name (``use_mtp``: transformers releases that have it)
ASSISTED_DECODING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")

#: the attribute holding the `GenerateCache` of each ``generate`` call in progress on a model, by thread
ACTIVE_CACHE = "_vexact_generate_cache"

logger = logging.getLogger("vexact_models")
_told_about_rollouts = False


def tell_once_about_rollouts(model) -> None:
    """Log once per process that ``generate`` runs one eager forward per step: right for checks
    and evaluation, slow for rollouts (a trainer that generates through it after `patch()`, e.g.
    TRL's stock ``GRPOTrainer``), and where the fast path is."""
    global _told_about_rollouts
    if _told_about_rollouts:
        return
    _told_about_rollouts = True
    logger.warning("vexact-models: %s.generate runs HF's loop, one eager forward of the whole batch per step. For "
                   "rollouts use vexact_models.LLM (continuous batching, CUDA graphs, the same logprobs), which "
                   "shares the model's weights (TRL: vexact_models.integrations.trl.VexactGRPOTrainer; verl: "
                   "rollout.name=vexact)", type(model).__name__)


def generate_arguments(model, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """``generate``'s ``(args, kwargs)`` with HF's cache turned off, and whether the steps run over
    a `GenerateCache` (`cached_steps`): unless ``use_cache=False`` (the argument, else the
    config's) or ``num_beams > 1``. The cache is turned off in a copy of the caller's
    ``generation_config`` where one is given (HF warns when one comes with loose generation
    arguments), else as ``use_cache=False``, and the cache argument is taken out (the cache given
    is marked as left empty, `forward_arguments.mark_left_empty`). A ValueError names an argument
    (or config field) that asks for assisted decoding, before anything is generated or marked."""
    positional = len(args) > 1  # generate(inputs, generation_config, ...)
    given = args[1] if positional else kwargs.get("generation_config")
    config = given if given is not None else model.generation_config
    for name in ASSISTED_DECODING:
        value = kwargs[name] if name in kwargs else getattr(config, name, None)
        if value is not None and value is not False:
            shown = type(value).__name__ if name == "assistant_model" else repr(value)
            raise ValueError(f"{type(model).__name__}.generate: {name}={shown} asks for assisted decoding, which "
                             "checks candidates against HF's KV cache, and this model's forward fills none (its "
                             "generate keeps a cache of its own). Leave it unset, or roll out with "
                             "vexact_models.LLM")
    tell_once_about_rollouts(model)
    beams = _setting(kwargs, config, "num_beams", 1) or 1
    cached = _setting(kwargs, config, "use_cache", True) is not False and beams <= 1
    for name in CACHE_ARGUMENTS:
        mark_left_empty(kwargs.get(name), "generate")
    kwargs = {key: value for key, value in kwargs.items() if key not in CACHE_ARGUMENTS}
    if not isinstance(given, GenerationConfig):
        return args, {**kwargs, "use_cache": False}, cached
    unset = copy.deepcopy(given)
    unset.use_cache = False
    if positional:
        return (args[0], unset, *args[2:]), kwargs, cached
    return args, {**kwargs, "generation_config": unset}, cached


def _setting(kwargs: dict, config, name: str, default):
    """A generation setting as HF reads it: the argument, else the config's field, else `default`."""
    return kwargs[name] if name in kwargs else getattr(config, name, default)


@contextmanager
def cached_steps(model: nn.Module, cached: bool) -> Iterator[None]:
    """Within: `model`'s forwards in this thread serve ``generate``'s steps from a new
    `GenerateCache` (`active_cache`) when `cached`; the cache is dropped (its memory freed) at
    the end. Per thread, so that ``generate`` calls on one model from several threads each keep
    their own (a forward in another thread runs without one: the whole recompute)."""
    if not cached:
        yield
        return
    caches = model.__dict__.setdefault(ACTIVE_CACHE, {})
    thread = threading.get_ident()
    caches[thread] = GenerateCache(model)
    try:
        yield
    finally:
        caches.pop(thread, None)


def active_cache(model: nn.Module) -> GenerateCache | None:
    """The `GenerateCache` of the ``generate`` call in progress on `model` in this thread, or None."""
    caches = model.__dict__.get(ACTIVE_CACHE)
    return None if not caches else caches.get(threading.get_ident())
