"""What `LLM.generate` returns, shaped like vLLM's outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from .top_logprobs import PositionLogprobs


@dataclass
class CompletionOutput:
    """One sample of one prompt.

    ``logprobs[i]`` is ``log_softmax(logits / T)[token_ids[i]]`` over the full vocabulary at the
    request's temperature (1.0 for greedy), before top-k/top-p/min_tokens filtering: the number
    the training forward recomputes bitwise with ``token_logprobs``. With
    ``SamplingParams(logprobs=k)`` it is vLLM's shape instead: ``logprobs[i]`` a dict
    ``{token_id: Logprob}`` of that token and the k most probable ones (`runtime.top_logprobs`),
    ``logprobs[i][token_ids[i]].logprob`` the same float; the sequence of dicts reads as a list
    and builds each dict when first read (`PositionLogprobs`, as vLLM's ``FlatLogprobs``).
    """

    index: int
    token_ids: list[int]
    logprobs: list[float] | PositionLogprobs
    finish_reason: str | None  # "stop", "length" or "error"; None while it runs (`LLM.step`)
    text: str | None = None
    error: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token id that finished it, as vLLM's
    # (None for the model's own EOS: the tokenizer's, `llm_setup.eos_token_ids`)
    cumulative_logprob: float | None = None  # the sum of ``logprobs`` (exactly rounded), as vLLM's


@dataclass
class RequestOutput:
    """One prompt's result, as vLLM's: its id (``generate``'s: the engine numbers requests in the
    order it gets them, across calls, and returns them in prompt order; `LLM.add_request`'s: the
    caller's string), its text (None when given
    as token ids) and token ids, and its samples (``n`` of them)."""

    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    #: with ``SamplingParams(prompt_logprobs=k)``: None for the first prompt token, then a dict
    #: ``{token_id: Logprob}`` per prompt token (`runtime.top_logprobs`); None otherwise, and for a
    #: request that never ran (its completions' ``finish_reason`` "error")
    prompt_logprobs: PositionLogprobs | None = None
    #: False for an output `LLM.step` returns while the request still runs (vLLM's field)
    finished: bool = True
