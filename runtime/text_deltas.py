"""A sample's text as its tokens arrive, for `LLM.step`'s DELTA outputs (and so for a server's
streamed chunks): each call returns only the text new since the last one.

Decoding every output token again at every step costs the whole sample a step. As vLLM's and
transformers' streamers do, `TextDeltas` decodes a window instead: the tokens since the last
emitted text plus the tokens before them that one decode call saw (``prefix_offset``), so that a
tokenizer that drops or adds a leading space at the start of a decode (SentencePiece's) still
spaces words as a whole decode does. Text that ends in the replacement character (a multi-byte
character cut between tokens) waits for the next token.

With stop strings a finished sample's text is cut before the first stop string, which may begin
in text already decoded. So the last ``holdback`` characters (the longest stop string's length
less one) are returned only at the end: a stop string completed by the next token starts after
everything returned so far. `finish` returns the rest of the finished text (`LLM`'s, the stop
string cut), so the deltas add up to it.
"""

from __future__ import annotations

__all__ = ["TextDeltas", "tag_prefix"]


def tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the beginning of `tag` (a streamed reply
    holds them back until the next text says: `runtime.reasoning`, `runtime.openai_tools`)."""
    for length in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


class TextDeltas:
    """The text of one sample, returned a delta at a time."""

    def __init__(self, tokenizer, decode: dict | None = None, holdback: int = 0) -> None:
        self.tokenizer, self.holdback = tokenizer, holdback
        self.decode = {"skip_special_tokens": True} if decode is None else dict(decode)  # `SamplingParams.decode_options`
        self.text = ""  # decoded so far
        self.emitted = 0  # characters of it returned so far
        self._prefix_offset = self._read_offset = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, **self.decode)

    def feed(self, token_ids: list[int]) -> str:
        """The text new since the last call, from the sample's output tokens so far (all of them)."""
        if len(token_ids) > self._read_offset:
            window = self._decode(token_ids[self._prefix_offset:])
            before = self._decode(token_ids[self._prefix_offset:self._read_offset])
            if len(window) > len(before) and not window.endswith("\ufffd"):
                self.text += window[len(before):]
                self._prefix_offset, self._read_offset = self._read_offset, len(token_ids)
        end = max(self.emitted, len(self.text) - self.holdback)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta

    def finish(self, final_text: str) -> str:
        """What is left of `final_text`, the finished sample's text, after the text returned so far."""
        delta, self.emitted = final_text[self.emitted:], max(self.emitted, len(final_text))
        return delta
