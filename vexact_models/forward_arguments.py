"""HF ``forward`` arguments the one forward reads, ignores or refuses.

Output switches (``return_dict``, ``output_attentions``) are read from the argument, else the
config, as transformers reads them. What the aligned forward cannot honour is an error, never
ignored (docs/design.md section 8): attention weights, which the attention kernel never
materialises, and a KV cache that holds tokens, a prefix the training forward would not read
(PEFT's prefix tuning passes its virtual tokens that way). An empty cache is read as none, and the
forward returns it in its output (``past_key_values``; ``cache`` from transformers 5.25 on), still
empty and marked (`unfilled_cache`): given
again, as a cached decode loop's next step would give it with only the new tokens, it is a
ValueError instead of logits computed without the prefix. HF's ``generate`` passes this model no
cache (`generation`).
"""

from __future__ import annotations

from transformers import DynamicCache

#: the names transformers has given the KV cache argument (``cache`` from 5.25 on)
CACHE_ARGUMENTS = ("past_key_values", "cache")

#: the attribute a cache that a forward (or ``generate``) was given and left empty carries: what it
#: was given to, for the error when it comes back (`refuse_kv_prefix`)
LEFT_EMPTY = "_vexact_left_empty"


def hf_flag(value: bool | None, config, name: str, default: bool) -> bool:
    """An HF output switch: the argument when given, else the config's field, else `default`."""
    if value is not None:
        return bool(value)
    return bool(getattr(config, name, default))


def refuse_output_attentions(value: bool | None, model) -> None:
    """``output_attentions`` (the argument, else the config's) cannot be honoured: the aligned
    attention kernel never materialises attention weights (docs/design.md section 8)."""
    if hf_flag(value, model.config, "output_attentions", False):
        raise ValueError(f"{type(model).__name__}.forward: output_attentions=True is not supported: the aligned "
                         "attention kernel never materialises attention weights (it keeps only each row's output "
                         "and log-sum-exp); pass output_attentions=False")


def cache_field(output_class: type) -> str:
    """The KV cache field of an HF output class: ``cache`` from transformers 5.25 on (where
    ``past_key_values`` is an alias that logs a deprecation warning), else ``past_key_values``."""
    return "cache" if "cache" in getattr(output_class, "__dataclass_fields__", {}) else "past_key_values"


def cached_tokens(cache) -> int:
    """How many tokens a KV cache holds: a transformers ``Cache`` (``get_seq_length``) or the
    legacy tuple of per-layer ``(key [batch, heads, tokens, dim], value)``; 0 for anything else."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0]:
        return int(cache[0][0].shape[-2])
    return 0


def refuse_kv_prefix(kwargs: dict, model) -> None:
    """A ValueError where `kwargs` carry a KV cache (``past_key_values`` or ``cache``) holding
    tokens, or one an earlier forward left empty (`unfilled_cache`): the training forward keeps
    and reads none, and would compute the logits as if the prefix were absent (PEFT's prefix
    tuning was silently ignored; so was the prompt of a cached decode loop)."""
    for name in CACHE_ARGUMENTS:
        cache = kwargs.get(name)
        tokens = cached_tokens(cache)
        if tokens:
            raise ValueError(f"{type(model).__name__}.forward: {name} holds {tokens} cached tokens, a prefix the "
                             "training forward does not read (it keeps no KV cache; PEFT's prefix tuning passes its "
                             "virtual tokens this way): pass the whole sequence instead, or use LoRA or prompt "
                             "tuning, whose virtual tokens come as inputs_embeds")
        earlier = getattr(cache, LEFT_EMPTY, None)
        if earlier is not None:
            raise ValueError(f"{type(model).__name__}.forward: {name} is a cache that {earlier} left empty (this "
                             "model keeps no KV cache), so the tokens seen then are not in it and this forward would "
                             "run without them: pass the whole sequence each call, without a cache, or roll out with "
                             "vexact_models.LLM")


def take_cache_arguments(kwargs: dict, output_attentions: bool | None, model) -> dict:
    """What both HF ``forward`` entry points do first: refuse what the one forward cannot honour
    (`refuse_output_attentions`, `refuse_kv_prefix`), then take ``use_cache`` and the cache
    arguments out of `kwargs` and return them, for `unfilled_cache` after the forward."""
    refuse_output_attentions(output_attentions, model)
    refuse_kv_prefix(kwargs, model)
    taken = {name: kwargs.pop(name, None) for name in ("use_cache", *CACHE_ARGUMENTS)}
    # ``use_cache`` from the config as stock reads it (on by default), so that a manual decode loop gets the
    # marked cache back and fails at its second step, and a tuple output has stock's layout
    taken["use_cache"] = hf_flag(taken["use_cache"], model.config, "use_cache", True)
    return taken


def mark_left_empty(cache, given_to: str) -> None:
    """Mark a transformers ``Cache`` that `given_to` (``"an earlier forward of 7 tokens"``)
    leaves empty, so that `refuse_kv_prefix` refuses it when it comes back; anything else
    (None, a legacy tuple) is left as it is."""
    if hasattr(cache, "get_seq_length"):
        setattr(cache, LEFT_EMPTY, given_to)


def unfilled_cache(cache_arguments: dict, tokens: int):
    """The cache a forward of `tokens` tokens returns (its output's `cache_field`), from its
    cache arguments (``use_cache``, as `take_cache_arguments` resolves it, and `CACHE_ARGUMENTS`):
    the ``Cache`` it was given, or, for ``use_cache`` without one, a new ``DynamicCache``; either
    empty and marked (`mark_left_empty`), so that a cached decode loop fails at its second step
    with a ValueError rather than computing without its prompt. None otherwise."""
    given = [cache_arguments.get(name) for name in CACHE_ARGUMENTS]
    cache = next((c for c in given if hasattr(c, "get_seq_length")), None)
    if cache is None and cache_arguments.get("use_cache") is True:
        cache = DynamicCache()
    mark_left_empty(cache, f"an earlier forward of {tokens} tokens")
    return cache
