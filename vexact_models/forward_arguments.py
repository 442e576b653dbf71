"""HF ``forward`` arguments the one forward reads, ignores or refuses.

Output switches (``return_dict``, ``output_attentions``) are read from the argument, else the
config, as transformers reads them. What the aligned forward cannot honour is an error, never
ignored (docs/design.md section 8): attention weights, which the attention kernel never
materialises, and a KV cache that holds tokens, a prefix the training forward would not read
(PEFT's prefix tuning passes its virtual tokens that way). An empty cache, or none, is what HF's
``generate`` passes this model (`generation`), and is ignored.
"""

from __future__ import annotations

#: the names transformers has given the KV cache argument (``cache`` from 5.25 on)
CACHE_ARGUMENTS = ("past_key_values", "cache")


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


def cached_tokens(cache) -> int:
    """How many tokens a KV cache holds: a transformers ``Cache`` (``get_seq_length``) or the
    legacy tuple of per-layer ``(key [batch, heads, tokens, dim], value)``; 0 for anything else."""
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and isinstance(cache[0], (tuple, list)) and cache[0]:
        return int(cache[0][0].shape[-2])
    return 0


def refuse_kv_prefix(kwargs: dict, model) -> None:
    """A ValueError where `kwargs` carry a KV cache holding tokens (``past_key_values`` or
    ``cache``): the training forward keeps and reads none, and would compute the logits as if the
    prefix were absent (PEFT's prefix tuning was silently ignored)."""
    for name in CACHE_ARGUMENTS:
        tokens = cached_tokens(kwargs.get(name))
        if tokens:
            raise ValueError(f"{type(model).__name__}.forward: {name} holds {tokens} cached tokens, a prefix the "
                             "training forward does not read (it keeps no KV cache; PEFT's prefix tuning passes its "
                             "virtual tokens this way): pass the whole sequence instead, or use LoRA or prompt "
                             "tuning, whose virtual tokens come as inputs_embeds")
