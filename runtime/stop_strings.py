"""Stop strings (``SamplingParams.stop``), as vLLM applies them: a sequence finishes ("stop") at
the token whose text completes one of its stop strings, checked on the detokenized output
(as `LLM.generate` returns it: ``SamplingParams.skip_special_tokens``, True by default); the token ids keep that token,
and the returned text ends before the stop string (or after it with
``include_stop_str_in_output``). ``min_tokens`` holds stop strings back as it holds stop tokens.

Stop strings decide only where a sample ends: the sampled tokens and their logprobs are those of
the same request without them, cut at the same token (tests/runtime/test_stop_strings.py).

Each step decodes a window of the output's last tokens, wide enough for the longest stop string
(`StopStrings.window`), twice: with and without the new token. A stop string counts when it ends
inside the new token's text, so a match is found at the first token that completes it and never
again later. The tokenizer's own decode is the reference: the window's first tokens may decode
differently alone (a partial byte sequence), which is why the window is wider than the strings.
"""

from __future__ import annotations

import os

__all__ = ["StopStrings", "truncate_at_stop", "stop_holdback"]

#: tokens of context decoded before the characters a stop string can span
_CONTEXT_TOKENS = 8


class StopStrings:
    """The stop strings of one request, over `tokenizer` (a transformers tokenizer)."""

    def __init__(self, tokenizer, stop: list[str], decode: dict | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.decode = {"skip_special_tokens": True} if decode is None else dict(decode)  # `SamplingParams.decode_options`
        # a token decodes to at least one character, or joins bytes into one: a string of c
        # characters spans at most c tokens after the ones that complete a character
        self.window = max(len(s) for s in self.stop) + _CONTEXT_TOKENS

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, **self.decode)

    def matched(self, token_ids: list[int], num_prompt_tokens: int) -> str | None:
        """The first stop string (in the request's order) that ends inside the text of the last
        of `token_ids` (a sequence's prompt and outputs), else None; the outputs' text only."""
        window = token_ids[max(num_prompt_tokens, len(token_ids) - self.window):]
        before, text = self._decode(window[:-1]), self._decode(window)
        return next((stop for stop in self.stop if _ending_in_last(before, text, stop) >= 0), None)


def _ending_in_last(before: str, text: str, stop: str) -> int:
    """Where `stop` starts in `text` (the decoded tokens) at an occurrence ending inside the
    last token's text (what `text` adds to `before`, the tokens without the last: decoding the
    last may complete a character of `before`'s end), or -1."""
    kept = len(os.path.commonprefix([before, text]))
    if kept == len(text):
        return -1  # the last token added no text (a special token, a partial character)
    return text.find(stop, max(0, kept - len(stop) + 1))


def stop_holdback(params) -> int:
    """The characters at the end of a running sample's text that a stop string of `params` (a
    `SamplingParams`) may still be forming in: the longest one's length less one (0: none, and
    with ``include_stop_str_in_output``, whose text keeps what it matched), which a sample's text
    holds back until more tokens come, as vLLM's."""
    if params.include_stop_str_in_output:
        return 0
    return max((len(s) for s in params.stop), default=1) - 1


def truncate_at_stop(tokenizer, output_ids: list[int], stop: str, include: bool, decode: dict | None = None) -> str:
    """The text of `output_ids`, whose last token completed `stop`, cut before `stop` (after it
    when `include`): at its occurrence ending inside the last token's text (`decode`: the
    tokenizer's ``decode`` options, `SamplingParams.decode_options`; default: special tokens skipped)."""
    decode = {"skip_special_tokens": True} if decode is None else decode
    text = tokenizer.decode(output_ids, **decode)
    start = _ending_in_last(tokenizer.decode(output_ids[:-1], **decode), text, stop)
    if start < 0:  # decoded differently in full than in the window: keep the whole text
        return text
    return text[:start + len(stop)] if include else text[:start]
