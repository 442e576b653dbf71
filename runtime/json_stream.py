"""JSON read as its text arrives, for tool calls streamed as they are written
(`runtime.tool_call_stream`).

`JsonTokens` splits one JSON value, fed a piece at a time, into its tokens as each completes: the
brackets, ``,`` and ``:``, strings as an opening quote, their decoded characters (a piece at a time)
and a closing quote, and scalars (numbers, ``true``, ``false``, ``null``) once their end is seen.
Each token carries its depth. `canonical` writes a token as ``json.dumps(json.loads(text),
ensure_ascii=False)`` writes it, so the canonical pieces of a value's tokens join to the text
``json.dumps`` gives the whole value (the form a whole reply's tool call arguments take, vLLM's),
provided no object repeats a key (``json.loads`` keeps the last; the pieces keep both).

The tokenizer checks only what it must to split: a character no JSON token can hold, a scalar
``json.loads`` refuses, a raw control character in a string, or a bracket closing below depth 0
stops it (`failed`); what it passed stays as it was read. The caller's whole-reply parse decides
whether the text was JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["JsonTokens", "Token", "canonical"]

_SCALAR_CHARS = frozenset("0123456789+-.eEabcdefghijklmnopqrstuvwxyzINaf")
_SPACE = frozenset(" \t\n\r")


@dataclass(frozen=True)
class Token:
    """One token: `kind` is the bracket, ``,`` or ``:`` itself, ``"open"`` / ``"close"`` (a
    string's quotes), ``"chars"`` (a string's decoded characters) or ``"scalar"`` (`text`: its
    ``json.dumps`` form); `depth` is how many brackets enclose it (an opening bracket's own
    depth is the one outside it)."""

    kind: str
    text: str
    depth: int


def canonical(token: Token) -> str:
    """The token as ``json.dumps(..., ensure_ascii=False)`` writes it."""
    if token.kind == "chars":
        return json.dumps(token.text, ensure_ascii=False)[1:-1]
    return {",": ", ", ":": ": ", "open": '"', "close": '"'}.get(token.kind, token.text)


class JsonTokens:
    """The tokens of one JSON value whose text arrives in pieces (the module docstring)."""

    def __init__(self) -> None:
        self.depth = 0
        self.done = False  #: the value ended (its last token returned)
        self.failed = False  #: the text is no JSON value: nothing more is read
        self._string: str | None = None  # a string's raw characters not yet decoded (None: outside strings)
        self._scalar = ""

    def feed(self, text: str, finished: bool = False) -> tuple[list[Token], int]:
        """(the tokens completed by `text`, how many of its characters the value took: all of
        them unless it ended inside `text`). `finished`: no text follows (a scalar ends)."""
        tokens: list[Token] = []
        i = 0
        while i < len(text) and not (self.done or self.failed):
            if self._string is not None:
                i = self._read_string(text, i, tokens)
            else:
                self._read(text[i], tokens)
                i += 1
        if self._string is not None and not self.failed:
            self._decode(tokens, closing=False)
        if finished and self._scalar and not self.failed:
            self._end_scalar(tokens)
        return tokens, i

    def _read_string(self, text: str, i: int, tokens: list[Token]) -> int:
        """Take a string's characters from ``text[i]`` on, through its closing quote (its
        ``close`` token) or to the end of `text`; where they end. A run without a quote is taken
        at once (the characters of a long argument cost no Python step each)."""
        while True:
            quote = text.find('"', i)
            if quote < 0:
                self._string += text[i:]
                return len(text)
            self._string += text[i:quote]
            i = quote + 1
            if not _escaping(self._string):
                self._decode(tokens, closing=True)
                return i
            self._string += '"'

    def _read(self, ch: str, tokens: list[Token]) -> None:
        if ch in _SCALAR_CHARS:
            self._scalar += ch
            return
        if self._scalar:
            self._end_scalar(tokens)
            if self.done or self.failed:
                return
        if ch in _SPACE:
            return
        if ch in "{[":
            tokens.append(Token(ch, ch, self.depth))
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
            if self.depth < 0:
                self.failed = True
                return
            tokens.append(Token(ch, ch, self.depth))
            self.done = self.depth == 0
        elif ch in ",:":
            tokens.append(Token(ch, ch, self.depth))
        elif ch == '"':
            tokens.append(Token("open", '"', self.depth))
            self._string = ""
        else:
            self.failed = True

    def _decode(self, tokens: list[Token], closing: bool) -> None:
        """Decode the string's raw characters up to where an escape may still be open (all of
        them when `closing`) into a ``chars`` token (and the ``close`` token when `closing`)."""
        raw = self._string
        cut = len(raw) if closing else _complete(raw)
        if cut:
            try:
                chars = json.loads(f'"{raw[:cut]}"')
            except ValueError:
                self.failed = True
                return
            tokens.append(Token("chars", chars, self.depth))
        self._string = raw[cut:]
        if closing:
            tokens.append(Token("close", '"', self.depth))
            self._string = None
            self.done = self.depth == 0

    def _end_scalar(self, tokens: list[Token]) -> None:
        try:
            value = json.loads(self._scalar)
        except ValueError:
            self.failed = True
            return
        tokens.append(Token("scalar", json.dumps(value), self.depth))
        self._scalar = ""
        self.done = self.depth == 0


def _escaping(raw: str) -> bool:
    """Whether a string's raw characters end inside a backslash escape's first character (an odd
    run of backslashes)."""
    end = len(raw)
    while end and raw[end - 1] == "\\":
        end -= 1
    return (len(raw) - end) % 2 == 1


def _complete(raw: str) -> int:
    """How many of a string's raw characters (starting outside an escape) decode on their own:
    not an open escape at the end (``\\``, ``\\u12``), nor a ``\\uD8xx`` high surrogate whose low
    half may still follow (``json.loads`` joins the pair into one character)."""
    i, high = 0, -1  # high: where a high surrogate's escape that ends at i began
    while i < len(raw):
        if raw[i] != "\\":
            i, high = i + 1, -1
            continue
        kind, digits = raw[i + 1:i + 2], raw[i + 2:i + 6]
        if kind == "" or kind == "u" and len(digits) < 4:
            return high if high >= 0 else i
        if kind != "u":
            i, high = i + 2, -1
            continue
        high = i if digits[:2].upper() in ("D8", "D9", "DA", "DB") else -1
        i += 6
    return high if high >= 0 else len(raw)
