"""Per-request sampling parameters, validated once at construction.

The runtime trusts these values everywhere else (scheduler, sampler, runner), so every field is
checked here and a bad value fails loudly with a message that names the field, the value and
the limit, instead of surfacing later as a shape error or a silent clamp inside a kernel.
"""

from __future__ import annotations

import enum
import sys
import functools
import math
from dataclasses import dataclass, field

from .structured_outputs import StructuredOutputsParams

__all__ = ["SamplingParams", "RequestOutputKind", "MAX_SEED", "MAX_LOGPROBS", "UNBOUNDED_TOKENS", "GREEDY_BELOW"]

#: Seeds live in [0, MAX_SEED): they must fit a signed 64-bit integer so they can be handed to
#: a counter-based RNG (Philox) as a tensor without wrapping.
MAX_SEED = 2**63

#: The most alternatives ``SamplingParams.logprobs`` / ``prompt_logprobs`` may ask for a position by
#: default: an engine's ``LLM(max_logprobs=...)`` (vLLM's default ``max_logprobs``).
MAX_LOGPROBS = 20

#: Temperatures below this are greedy, as vLLM's (its ``_SAMPLING_EPS``): stored as 0.
GREEDY_BELOW = 1e-5

#: ``max_tokens`` of ``SamplingParams(max_tokens=None)``: the engine's ``max_model_len`` bounds the sample
UNBOUNDED_TOKENS = sys.maxsize


class RequestOutputKind(enum.IntEnum):
    """What `LLM.step` returns of a request added by `LLM.add_request` (vLLM's enum, its values):
    CUMULATIVE, after each step that gave it tokens, everything so far; DELTA only the tokens (and
    text) new since its last output; FINAL_ONLY one output, when it finishes. ``generate`` always
    returns finished requests whole."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _is_int(value: object) -> bool:
    # bool is a subclass of int, but True/False as a token count or seed is almost always a bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(name: str, value: object) -> int:
    if not _is_int(value):
        raise ValueError(
            f"SamplingParams.{name}={value!r} must be an int, got {type(value).__name__}"
        )
    return value  # type: ignore[return-value]


def _require_float(name: str, value: object) -> float:
    # Ints are accepted for convenience (temperature=1) and stored as float so downstream code
    # sees one type; NaN/inf are rejected because every comparison with them is meaningless.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(
            f"SamplingParams.{name}={value!r} must be a float, got {type(value).__name__}"
        )
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"SamplingParams.{name}={value!r} must be a finite number")
    return value


def _require_at_least(name: str, value: object, minimum: int) -> int:
    value = _require_int(name, value)
    if value < minimum:
        raise ValueError(f"SamplingParams.{name}={value} is below the minimum {minimum}")
    return value


@dataclass
class SamplingParams:
    """How to sample the continuation(s) of one prompt.

    Attributes:
        n: samples per prompt, >= 1. Each sample is its own sequence with its own seed.
        temperature: >= 0; 0 means greedy (argmax), as does anything below `GREEDY_BELOW` (1e-5, as
            vLLM's; stored as 0).
        top_p: nucleus mass in (0, 1]; 1 disables it.
        top_k: -1 disables it, else the number of candidates kept, >= 1.
        min_p: in [0, 1]; 0 disables it. Keeps the tokens whose probability under
            ``softmax(logits / T)`` is at least ``min_p`` times the most probable one's (as vLLM:
            applied before top-k and top-p, which then act on what it kept).
        repetition_penalty: > 0; 1 disables it. Divides the positive logits, and multiplies the
            others, of the tokens in the prompt or generated so far (vLLM's and transformers'
            repetition penalty; `runtime.penalties`).
        frequency_penalty: in [-2, 2]; 0 disables it. Subtracted from a token's logit once for
            every time the sequence generated it (OpenAI's and vLLM's definition).
        presence_penalty: in [-2, 2]; 0 disables it. Subtracted from the logit of every token the
            sequence generated at least once.
            The three penalties steer sampling only, as top-k/top-p do: the reported logprobs
            stay the unpenalised ones training recomputes (``logprobs`` below).
            Not available on pipeline stages.
        allowed_token_ids: None, or the only token ids that may be sampled (a non-empty list).
        logit_bias: None, or ``{token_id: bias}``: each bias (a finite float) is added to that
            token's logit before sampling. Both act before the penalties and filters, as vLLM's
            (`runtime.logit_bias`); they steer sampling only, the reported logprobs stay the
            unedited ones. Token ids must lie in the vocabulary (``LLM.generate`` checks). Not
            available on pipeline stages.
        min_tokens: >= 0. Stop tokens and EOS are banned while fewer than this many tokens
            have been generated, so a stop token only finishes a sequence once at least
            ``min_tokens`` outputs precede it. Where these bans, ``allowed_token_ids`` and
            ``structured_outputs`` together exclude every token, the token drawn (token 0) ends
            the sequence with finish_reason "error" and ``CompletionOutput.error`` saying why.
        max_tokens: >= 1, upper bound on generated tokens (the stop token included); None: up to
            the engine's ``max_model_len``, as vLLM's (stored as `UNBOUNDED_TOKENS`).
        stop_token_ids: extra token ids that finish a sequence (each >= 0; None: none), reported
            as the sample's ``stop_reason``, as vLLM's.
        ignore_eos: when True the model's EOS token does not finish a sequence.
        seed: None lets the engine derive one; else a signed 64-bit int, [-2**63, 2**63), as vLLM's
            (a negative one counts modulo 2**63). The sampled token
            depends only on (logits row, seed, token index), which is what makes rollouts
            reproducible under any batching.
        stop: strings that finish a sequence at the token whose text completes one (a str is
            one string; None: none), as in vLLM (`runtime.stop_strings`; needs the engine's tokenizer).
        include_stop_str_in_output: keep the stop string, or the text of the stop token (EOS or
            one of ``stop_token_ids``) that finished the sample, at the end of the returned text;
            by default it is left out, as vLLM's.
        logprobs: None (the default) returns each sampled token's logprob as a float
            (``CompletionOutput.logprobs``). An int k in [0, the engine's ``max_logprobs``, default
            MAX_LOGPROBS = 20] returns vLLM's shape
            instead: per sampled position a dict ``{token_id: Logprob}`` holding the sampled token
            and the k most probable tokens, at the same temperature and by the same kernel
            (`runtime.top_logprobs`), so the sampled token's entry is the float's bits.
            Every reported logprob is the model's at the request's temperature (1 for greedy),
            before a structured output's mask, the logit edits, the penalties and the filters:
            what training's ``token_logprobs(temperature=...)`` recomputes. vLLM's default
            (``logprobs_mode="raw_logprobs"``) is also before the edits, penalties and filters,
            but differs twice: before the temperature, and after a structured output's mask.
        prompt_logprobs: None (the default), or an int k in [0, the engine's ``max_logprobs``]: vLLM's
            ``RequestOutput.prompt_logprobs``, per prompt token after the first a dict of that token
            and the k most probable ones at its position, at the request's temperature (1 for
            greedy): the training forward's ``token_logprobs`` of the prompt, bitwise. Steps that
            hold such positions run eagerly, one at a time (`runtime.top_logprobs`); their fp32
            logits are made ``PROMPT_ROWS_AT_ONCE`` (512) positions at a time, 311 MB at a
            vocabulary of 151,936, whatever the step's size.
        skip_special_tokens: leave special tokens out of the returned text (and of the text stop
            strings are matched on), as vLLM's default; False keeps them.
        spaces_between_special_tokens: vLLM's, passed to the tokenizer's ``decode`` where False
            (transformers 5's tokenizers accept and ignore it, as vLLM's fast detokenizer does; a
            tokenizer of your own may honour it).
        truncate_prompt_tokens: None, or keep only the prompt's last k tokens (k >= 1; -1: as many
            as the engine takes, ``max_model_len`` - 1), as vLLM's; the request's ``prompt_token_ids``
            are the kept ones. A k above ``max_model_len`` is refused.
        detokenize: False returns no text (``CompletionOutput.text`` None, no ``decoded_token``)
            and needs no stop strings, as vLLM's.
        structured_outputs: None, or a `StructuredOutputsParams` (vLLM's, or a dict of its
            fields): the generated text follows a JSON schema, a regex, a choice or an EBNF
            grammar (`runtime.structured_outputs`; needs the engine's tokenizer and xgrammar).
            It steers sampling only: the reported logprobs stay the unmasked ones. A sequence
            ends ("stop") when its grammar accepts a stop token after a complete output; one whose
            other settings (``allowed_token_ids``, ``min_tokens``) leave it no token the grammar
            allows ends with finish_reason "error". While such a sequence runs, a step launched
            ahead of the host runs its forward at once and samples once the step before is
            postprocessed (its mask needs that step's token). Not available on pipeline stages.
        bad_words: words the output may not contain, tokenized as vLLM does (as written, and after
            a space), matched on the generated tokens (`runtime.bad_words`; needs the engine's
            tokenizer). While a sequence with a word of several tokens runs, a step launched ahead
            of the host samples once the step before is postprocessed, as with
            ``structured_outputs``. Not available on pipeline stages.
        output_kind: what `LLM.step` returns of the request (`RequestOutputKind`; default
            CUMULATIVE, as vLLM's); ``generate`` ignores it.

    ``__post_init__`` validates every field and raises ``ValueError`` naming the field, the bad
    value and the limit. Because ``dataclasses.replace`` re-runs ``__post_init__``, copies are
    validated too, and ``stop_token_ids`` is copied into a fresh list so that a copy never
    aliases the original's list.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # (0: -1, as vLLM's)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = field(default_factory=list)
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    bad_words: list[str] = field(default_factory=list)
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE

    def __post_init__(self) -> None:
        self.n = _require_at_least("n", self.n, 1)
        if isinstance(self.output_kind, bool) or self.output_kind not in set(RequestOutputKind):
            raise ValueError(f"SamplingParams.output_kind={self.output_kind!r} must be a RequestOutputKind "
                             f"({', '.join(f'{k.name} = {k.value}' for k in RequestOutputKind)})")
        self.output_kind = RequestOutputKind(self.output_kind)
        # vLLM's spellings of "none" and "all": normalised before the checks
        self.stop = [] if self.stop is None else self.stop
        self.stop_token_ids = [] if self.stop_token_ids is None else self.stop_token_ids
        self.max_tokens = UNBOUNDED_TOKENS if self.max_tokens is None else self.max_tokens
        self.top_k = -1 if _is_int(self.top_k) and self.top_k == 0 else self.top_k
        self._validate_sampling()
        self._validate_lengths()
        self._validate_stops()
        self._validate_stop_strings()
        self._validate_token_edits()
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.of(self.structured_outputs)
        k = self.truncate_prompt_tokens
        if k is not None and (not _is_int(k) or not (k == -1 or k >= 1)):
            raise ValueError(f"SamplingParams.truncate_prompt_tokens={k!r} must be None, -1 (all the engine takes) "
                             "or an int >= 1")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None:
                _require_at_least(name, getattr(self, name), 0)  # the engine checks its max_logprobs
        if self.seed is not None:
            seed = _require_int("seed", self.seed)
            if not -MAX_SEED <= seed < MAX_SEED:
                raise ValueError(f"SamplingParams.seed={seed} is outside [-2**63, 2**63) (a signed 64-bit integer)")

    def _validate_sampling(self) -> None:
        self.temperature = _require_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(
                f"SamplingParams.temperature={self.temperature} is below the minimum 0 "
                "(0 = greedy)"
            )
        if self.temperature < GREEDY_BELOW:  # logits divided by it would overflow fp32
            self.temperature = 0.0
        self.top_p = _require_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p={self.top_p} is outside (0, 1]")
        top_k = _require_int("top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise ValueError(f"SamplingParams.top_k={top_k} must be -1 or 0 (off) or >= 1")
        self.min_p = _require_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"SamplingParams.min_p={self.min_p} is outside [0, 1] (0: off)")
        self.repetition_penalty = _require_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0:
            raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty} must be > 0 (1: off)")
        for name in ("frequency_penalty", "presence_penalty"):
            value = _require_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"SamplingParams.{name}={value} is outside [-2, 2] (0: off)")
            setattr(self, name, value)

    @property
    def decode_options(self) -> dict:
        """The tokenizer ``decode`` options of this request's text (``spaces_between_special_tokens``
        only where it is not the default, so that a tokenizer without it still decodes)."""
        options = {"skip_special_tokens": self.skip_special_tokens}
        if not self.spaces_between_special_tokens:
            options["spaces_between_special_tokens"] = False
        return options

    @property
    def uses_penalties(self) -> bool:
        """Whether a repetition, frequency or presence penalty is set."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def _validate_lengths(self) -> None:
        min_tokens = _require_at_least("min_tokens", self.min_tokens, 0)
        max_tokens = _require_at_least("max_tokens", self.max_tokens, 1)
        if min_tokens > max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens={min_tokens} exceeds max_tokens={max_tokens}"
            )

    def _validate_stop_strings(self) -> None:
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"SamplingParams.stop={stop!r} must be a string or a list of strings, "
                             f"got {type(stop).__name__}")
        for i, text in enumerate(stop):
            if not isinstance(text, str) or not text:
                raise ValueError(f"SamplingParams.stop[{i}]={text!r} must be a non-empty string")
        self.stop = list(stop)
        for name in ("include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r} must be a bool")
        if self.stop and not self.detokenize:
            raise ValueError(f"SamplingParams.stop={self.stop!r} needs detokenize=True (stop strings are matched on "
                             "the detokenized output)")

    def _validate_token_edits(self) -> None:
        words = [] if self.bad_words is None else self.bad_words  # (vLLM's default)
        if not isinstance(words, (list, tuple)):
            raise ValueError(f"SamplingParams.bad_words={words!r} must be a list of strings, got {type(words).__name__}")
        for i, word in enumerate(words):
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"SamplingParams.bad_words[{i}]={word!r} must be a string with a non-space character")
        self.bad_words = list(words)
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"SamplingParams.allowed_token_ids={ids!r} must be None or a non-empty list of ints")
            for i, token in enumerate(ids):
                if not _is_int(token) or token < 0:
                    raise ValueError(f"SamplingParams.allowed_token_ids[{i}]={token!r} must be an int >= 0")
            self.allowed_token_ids = list(ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"SamplingParams.logit_bias={self.logit_bias!r} must be None or a dict "
                                 "{token_id: bias}")
            for token in self.logit_bias:
                if not _is_int(token) or token < 0:
                    raise ValueError(f"SamplingParams.logit_bias key {token!r} must be a token id (an int >= 0)")
            self.logit_bias = {token: _require_float(f"logit_bias[{token}]", value)
                               for token, value in self.logit_bias.items()}

    @functools.cached_property
    def allowed_token_set(self) -> frozenset[int] | None:
        """``allowed_token_ids`` as a set (None when unset), for membership tests."""
        return None if self.allowed_token_ids is None else frozenset(self.allowed_token_ids)

    @property
    def edits_logits(self) -> bool:
        """Whether ``allowed_token_ids`` or ``logit_bias`` is set."""
        return self.allowed_token_ids is not None or bool(self.logit_bias)

    def _validate_stops(self) -> None:
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(
                f"SamplingParams.stop_token_ids={ids!r} must be a list of ints, "
                f"got {type(ids).__name__}"
            )
        for i, token in enumerate(ids):
            if not _is_int(token):
                raise ValueError(
                    f"SamplingParams.stop_token_ids[{i}]={token!r} must be an int, "
                    f"got {type(token).__name__}"
                )
            if token < 0:
                raise ValueError(
                    f"SamplingParams.stop_token_ids[{i}]={token} is below the minimum 0"
                )
        self.stop_token_ids = list(ids)
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(
                f"SamplingParams.ignore_eos={self.ignore_eos!r} must be a bool, "
                f"got {type(self.ignore_eos).__name__}"
            )
