"""A request's prompts against the engine's context, as vLLM's server reads them:
``truncate_prompt_tokens`` keeps each prompt's last tokens (`truncate_prompts`), and a prompt with
its ``max_tokens`` must fit ``max_model_len`` (`check_context`), so that no reply is cut short
silently."""

from __future__ import annotations

from .openai_errors import ProtocolError

__all__ = ["check_context", "truncate_prompts"]


def truncate_prompts(body: dict, prompts: list[list[int]], max_model_len: int | None) -> list[list[int]]:
    """`prompts` with the body's ``truncate_prompt_tokens`` applied (k: each prompt's last k tokens;
    -1: as many as the engine takes, ``max_model_len`` - 1; absent or null: whole), a
    `ProtocolError` naming the field for a k that is not an int >= 1 or -1, or above `max_model_len`
    (vLLM's check; None: unknown here, the engine checks)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return prompts
    if not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1):
        raise ProtocolError(f"'truncate_prompt_tokens' must be -1 or an integer >= 1, got {k!r}", "truncate_prompt_tokens")
    if max_model_len is None:
        return prompts
    if k > max_model_len:
        raise ProtocolError(f"'truncate_prompt_tokens' value ({k}) is greater than max_model_len ({max_model_len}). "
                            "Please, select a smaller truncation size.", "truncate_prompt_tokens")
    keep = max_model_len - 1 if k == -1 else k
    return [p[-keep:] for p in prompts]


def check_context(prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """A `ProtocolError` where the prompt and `max_tokens` cannot fit the engine's `max_model_len`
    together (vLLM's check and message: the reply is not cut short silently)."""
    if prompt_tokens + max_tokens > max_model_len:
        raise ProtocolError(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's maximum "
                            f"context length is {max_model_len} tokens and your request has {prompt_tokens} input "
                            f"tokens ({max_tokens} > {max_model_len} - {prompt_tokens})", "max_tokens")
