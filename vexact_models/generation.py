"""HF's ``generate`` on the training variant, which keeps no KV cache.

Each step recomputes the sequences through the training forward (``use_cache=False``), so
greedy output equals `vexact_models.LLM`'s token for token. Every decoding mode that works
without a cache runs as HF runs it. A cache given to ``generate`` (``past_key_values``, or
``cache`` from transformers 5.25) is left out of the steps, which see the whole sequence anyway,
and is marked as left empty: given to a forward later, it is refused (`forward_arguments`).
Assisted decoding (an ``assistant_model``, prompt lookup, early exit, multi-token prediction)
checks its candidates against the main model's cache: it is refused up front, naming the
argument, instead of failing inside HF's loop. The first ``generate`` of a process logs where
fast rollouts are (`tell_once_about_rollouts`).
"""

from __future__ import annotations

import copy
import logging

from transformers import GenerationConfig

from vexact_models.forward_arguments import CACHE_ARGUMENTS, mark_left_empty

#: what asks HF's ``generate`` for assisted decoding, by ``generate``'s argument or the
#: ``GenerationConfig`` field of that name (``use_mtp``: transformers releases that have it)
ASSISTED_DECODING = ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit", "use_mtp")

logger = logging.getLogger("vexact_models")
_told_about_rollouts = False


def tell_once_about_rollouts(model) -> None:
    """Log once per process that ``generate`` recomputes every sequence each step: right for
    checks, slow for rollouts (a trainer that generates through it after `patch()`, e.g. TRL's
    stock ``GRPOTrainer``), and where the fast path is."""
    global _told_about_rollouts
    if _told_about_rollouts:
        return
    _told_about_rollouts = True
    logger.warning("vexact-models: %s.generate keeps no KV cache: each step recomputes every sequence through the "
                   "training forward (quadratic in the output length). For rollouts use vexact_models.LLM, which "
                   "shares the model's weights (TRL: vexact_models.integrations.trl.VexactGRPOTrainer; verl: "
                   "rollout.name=vexact)", type(model).__name__)


def cacheless_generate_arguments(model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``generate``'s ``(args, kwargs)`` with the cache turned off: in a copy of the caller's
    ``generation_config`` where one is given (HF warns when one comes with loose generation
    arguments), else as ``use_cache=False``, and without a cache argument (the cache given is
    marked as left empty, `forward_arguments.mark_left_empty`). A ValueError names an argument (or
    config field) that asks for assisted decoding, before anything is generated or marked."""
    positional = len(args) > 1  # generate(inputs, generation_config, ...)
    given = args[1] if positional else kwargs.get("generation_config")
    config = given if given is not None else model.generation_config
    for name in ASSISTED_DECODING:
        value = kwargs[name] if name in kwargs else getattr(config, name, None)
        if value is not None and value is not False:
            shown = type(value).__name__ if name == "assistant_model" else repr(value)
            raise ValueError(f"{type(model).__name__}.generate: {name}={shown} asks for assisted decoding, which "
                             "checks candidates against a KV cache, and this model generates without one (each "
                             "step recomputes the sequences through the training forward). Leave it unset, or "
                             "roll out with vexact_models.LLM")
    tell_once_about_rollouts(model)
    for name in CACHE_ARGUMENTS:
        mark_left_empty(kwargs.get(name), "generate")
    kwargs = {key: value for key, value in kwargs.items() if key not in CACHE_ARGUMENTS}
    if not isinstance(given, GenerationConfig):
        return args, {**kwargs, "use_cache": False}
    unset = copy.deepcopy(given)
    unset.use_cache = False
    if positional:
        return (args[0], unset, *args[2:]), kwargs
    return args, {**kwargs, "generation_config": unset}
