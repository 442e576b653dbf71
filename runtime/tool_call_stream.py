"""Tool calls read as a streamed reply is written (`runtime.openai_tools` sends them): each call's
name as soon as it is written, then its arguments as they come, as vLLM's tool parsers stream.

A reader takes the reply's text from where its calls begin (`ToolParser.begins`), a piece at a
time, and returns `CallPiece` s: a call's first piece carries its name, the others more of its
arguments. The arguments are written as the whole reply's parse writes them
(`runtime.tool_calls`): JSON arguments as ``json.dumps`` gives them (`runtime.json_stream`
writes each token so; a string ``arguments`` member as its characters), the arguments written as
tags (qwen3_coder, glm45, minimax_m2: `runtime.tool_call_tags`) one at a time as each closes (its
value's type needs the whole value). So a stream's pieces join
to the whole reply's calls. Where the whole reply cannot read a call (it then answers with text,
as vLLM does) a stream has already sent what came before; vLLM's streams do the same.

- `TaggedCalls`: calls between a start and an end tag, one block reader each (hermes: a JSON
  object, `JsonCall`; deepseek_v3 / v31: `DeepSeekCall`; the tag-written blocks of
  `runtime.tool_call_tags`);
- `SeparatedCalls`: llama3_json's JSON objects separated by ``;``;
- `ArrayCalls`: the JSON array a ``"required"`` reply is held to.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .json_stream import JsonTokens, Token, canonical
from .text_deltas import tag_prefix

__all__ = ["ArrayCalls", "CallPiece", "DeepSeekCall", "JsonCall", "SeparatedCalls", "TaggedCalls"]


@dataclass
class CallPiece:
    """Part of call `index`: its `name` (on its first piece only, else None) and more of its `arguments`."""

    index: int
    name: str | None
    arguments: str


class JsonCall:
    """One call written as a JSON object whose members sit at `depth`: its ``name`` member, and its
    arguments from the first of `keys` that it has (``{}`` when none). `raw_strings`: a string
    given as the arguments is sent as its characters (hermes, llama3_json: the whole reply keeps
    such a string as the arguments' text), else as JSON."""

    def __init__(self, depth: int, keys: tuple[str, ...], raw_strings: bool) -> None:
        self.depth, self.keys, self.raw_strings = depth, keys, raw_strings
        self.name: str | None = None
        self.closed = False  #: the object's closing brace was read
        self._key: str | None = None  # the member's key being read
        self._member: str | None = None  # the key whose value is being read (None: between members)
        self._value_kind: str | None = None  # the value's first token kind ("open", "{", "[")
        self._name_chars: list[str] = []
        self._arguments_key: str | None = None
        self._waiting: list[str] = []  # arguments read before the name

    def read(self, token: Token) -> list[tuple[str | None, str]]:
        """(name or None, arguments) pieces that `token` completes."""
        if token.depth < self.depth:
            self.closed = token.kind == "}" and token.depth == self.depth - 1
            return self._flush("{}" if self._arguments_key is None else "") if self.closed else []
        if self._member is None:
            self._read_key(token)
            return []
        value_ends = self._value_ends(token)
        member, pieces = self._member, []
        if member == "name" and self.name is None:
            if token.kind == "chars":
                self._name_chars.append(token.text)
            elif token.kind == "close" and token.depth == self.depth:
                self.name = "".join(self._name_chars)
                pieces = [(self.name, "")] + [(None, piece) for piece in self._waiting if piece]
                self._waiting = []
        elif member == self._arguments_key:
            raw = self.raw_strings and self._value_kind == "open"
            piece = token.text if raw and token.kind == "chars" else "" if raw else canonical(token)
            pieces = self._flush(piece)
        if value_ends:
            self._member = self._value_kind = None
        return pieces

    def _read_key(self, token: Token) -> None:
        if token.kind == "open":
            self._key = ""
        elif token.kind == "chars" and self._key is not None:
            self._key += token.text
        elif token.kind == ":" and self._key is not None:
            self._member, self._key = self._key, None
            if self._arguments_key is None and self._member in self.keys:
                self._arguments_key = self._member
            elif self._member == self._arguments_key or self._member == "name" and self.name is not None:
                self._member = ""  # (read twice: the first stands)

    def _value_ends(self, token: Token) -> bool:
        if self._value_kind is None and token.depth == self.depth:
            self._value_kind = token.kind
        if token.depth != self.depth:
            return False
        return (token.kind == "scalar" or token.kind == "close" and self._value_kind == "open"
                or token.kind in "}]" and self._value_kind in "{[")

    def _flush(self, piece: str) -> list[tuple[str | None, str]]:
        if self.name is None:
            self._waiting.append(piece)
            return []
        return [(None, piece)] if piece else []


class _Tokens:
    """A block read as one JSON value whose tokens go to a `JsonCall` (`used`: how many characters
    of the last text fed the value took)."""

    def __init__(self, call: JsonCall) -> None:
        self.tokens, self.call, self.used = JsonTokens(), call, 0

    def feed(self, text: str, last: bool) -> list[tuple[str | None, str]]:
        tokens, self.used = self.tokens.feed(text, last)
        return [piece for token in tokens for piece in self.call.read(token)]


class _Numbered:
    """A reply's calls numbered in order: a piece that carries a name opens the next one."""

    calls = 0  #: the calls opened so far

    def _number(self, block_pieces: list[tuple[str | None, str]], pieces: list[CallPiece]) -> None:
        for name, arguments in block_pieces:
            self.calls += name is not None
            pieces.append(CallPiece(self.calls - 1, name, arguments))


def hermes_call() -> _Tokens:
    """A hermes block: ``{"name": ..., "arguments": {...}}``."""
    return _Tokens(JsonCall(1, ("arguments",), raw_strings=True))


class DeepSeekCall:
    """A DeepSeek block: ``NAME<｜tool▁sep｜>ARGUMENTS`` (V3.1), or ``function<｜tool▁sep｜>NAME``
    and the arguments in a JSON code fence (V3); the arguments are JSON."""

    SEP = "<｜tool▁sep｜>"
    _FENCE = re.compile(r"^(.*?)\n```(?:json)?\n", re.DOTALL)

    def __init__(self) -> None:
        self.text, self.name, self.tokens = "", None, JsonTokens()

    def feed(self, text: str, last: bool) -> list[tuple[str | None, str]]:
        self.text += text
        pieces: list[tuple[str | None, str]] = []
        if self.name is None:
            head, sep, rest = self.text.partition(self.SEP)
            if not sep:
                return pieces
            if head.strip() == "function":
                fence = self._FENCE.match(rest)
                if fence is None:
                    return pieces
                head, rest = fence.group(1), rest[fence.end():]
            self.name, self.text = head.strip(), rest
            pieces.append((self.name, ""))
        tokens, _ = self.tokens.feed(self.text, last)
        self.text = ""
        pieces.extend((None, canonical(token)) for token in tokens)
        return pieces


class TaggedCalls(_Numbered):
    """Calls each written between `start` and `end` tags, each block read by a new `block()`
    (which takes the block's text a piece at a time and whether it ended)."""

    def __init__(self, start: str, end: str, block) -> None:
        self.start, self.end, self.block = start, end, block
        self.text, self._current = "", None

    def feed(self, text: str, finished: bool) -> list[CallPiece]:
        """The pieces `text`, the reply's next text, completes (`finished`: the reply ended)."""
        self.text += text
        pieces: list[CallPiece] = []
        while True:
            if self._current is None:
                at = self.text.find(self.start)
                if at < 0:
                    self.text = self.text[len(self.text) - tag_prefix(self.text, self.start):]
                    return pieces
                self.text, self._current = self.text[at + len(self.start):], self.block()
            at = self.text.find(self.end)
            last = at >= 0 or finished
            cut = at if at >= 0 else len(self.text) if finished else len(self.text) - tag_prefix(self.text, self.end)
            self._number(self._current.feed(self.text[:cut], last), pieces)
            self.text = self.text[cut + (len(self.end) if at >= 0 else 0):]
            if not last:
                return pieces
            self._current = None


class SeparatedCalls(_Numbered):
    """llama3_json's calls: JSON objects (``{"name": ..., "parameters": {...}}``) separated by
    ``;``, after an optional `opens` (``<|python_tag|>``); anything else between them ends the
    reading (the whole reply then has no calls)."""

    def __init__(self, opens: str) -> None:
        self.opens, self.text, self.stopped = opens, "", False
        self._current: _Tokens | None = None
        self._expect = "tag"  # what comes next between the objects: the tag, ";" or "{"

    def feed(self, text: str, finished: bool) -> list[CallPiece]:
        """The pieces `text`, the reply's next text, completes (`finished`: the reply ended)."""
        self.text += text
        pieces: list[CallPiece] = []
        while not self.stopped and (self._current is not None or self._between()):
            self._number(self._current.feed(self.text, finished), pieces)
            self.text = self.text[self._current.used:]
            if not self._current.tokens.done:
                self.stopped = self._current.tokens.failed
                break
            self._current, self._expect = None, ";"
        return pieces

    def _between(self) -> bool:
        """Skip what separates the calls; True when the next call's object begins."""
        while True:
            self.text = self.text.lstrip()
            if not self.text:
                return False
            if self._expect == "tag":
                self.text, self._expect = self.text.removeprefix(self.opens), "{"
            elif self.text[0] != self._expect:
                self.stopped = True
                return False
            elif self._expect == ";":
                self.text, self._expect = self.text[1:], "{"
            else:
                self._current = _Tokens(JsonCall(1, ("parameters", "arguments"), raw_strings=True))
                return True


class ArrayCalls(_Numbered):
    """A ``"required"`` reply: a JSON array of ``{"name": ..., "parameters": {...}}`` objects."""

    def __init__(self) -> None:
        self.tokens, self._current = JsonTokens(), None

    def feed(self, text: str, finished: bool) -> list[CallPiece]:
        tokens, _ = self.tokens.feed(text, finished)
        pieces: list[CallPiece] = []
        for token in tokens:
            if self._current is None:
                if token.kind == "{" and token.depth == 1:
                    self._current = JsonCall(2, ("parameters",), raw_strings=False)
                continue
            self._number(self._current.read(token), pieces)
            if self._current.closed:
                self._current = None
        return pieces
