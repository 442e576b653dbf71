"""Tool-call blocks whose arguments are written as tags, read as a streamed reply is written
(`runtime.tool_call_stream.TaggedCalls` feeds each block; `runtime.tool_calls` reads whole replies
the same way): one argument per tag pair, its value typed by the tool's schema once it closes, and
sent as ``json.dumps`` writes it (`argument_piece`), so a stream's pieces join to the whole reply's.

- `CoderCall`: qwen3_coder's ``<function=NAME>`` and ``<parameter=KEY>`` blocks;
- `GlmCall`: glm45's ``NAME`` then ``<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>``;
- `MiniMaxCall`: minimax_m2's ``<invoke name="NAME">`` and ``<parameter name="KEY">`` blocks.
"""

from __future__ import annotations

import json
import re

__all__ = ["CoderCall", "GlmCall", "MiniMaxCall", "argument_piece", "glm_name", "minimax_name"]


def argument_piece(count: int, key: str, value: object) -> str:
    """The arguments' next piece in ``json.dumps``'s form: ``"KEY": VALUE`` after ``{`` (the first,
    `count` 0) or ``, ``."""
    return ("{" if count == 0 else ", ") + f"{json.dumps(key, ensure_ascii=False)}: {json.dumps(value, ensure_ascii=False)}"


class _TaggedArguments:
    """A block that writes the tool's name, then its arguments as tagged key/value pairs, each value
    typed by `typed` (``(function name, key, text) -> value``) and sent as ``"KEY": VALUE`` once it
    ends (at its closing tag or the block's end). A subclass reads the name (`_read_name`) and one
    argument's key or value end at a time (`_step`)."""

    def __init__(self, typed) -> None:
        self.typed, self.text, self.name, self.count, self.ended = typed, "", None, 0, False
        self._key: str | None = None

    def feed(self, text: str, last: bool) -> list[tuple[str | None, str]]:
        self.text += text
        pieces: list[tuple[str | None, str]] = []
        if self.ended:  # (a block whose name is no name: nothing read, as the whole reply reads it)
            return pieces
        if self.name is None:
            name = self._read_name(last)
            if not name:  # (None: not written yet)
                self.ended = name is not None
                return pieces
            self.name = name
            pieces.append((name, ""))
        while not self.ended and self._step(pieces, last):
            pass
        if last and not self.ended:
            self._close(pieces)
        return pieces

    def _read_name(self, last: bool) -> str | None:
        """The name, taken off the text once written (None: not yet; "": the block has none)."""
        raise NotImplementedError

    def _step(self, pieces: list, last: bool) -> bool:
        """Read one argument's key, or its value's end; False when the text says no more yet."""
        raise NotImplementedError

    def _rest(self) -> str:
        """The value the block ended inside: the rest of its text."""
        return self.text

    def _close(self, pieces: list) -> None:
        if self._key is not None:  # (the block ended inside a value)
            self._pair(pieces, self._rest())
        pieces.append((None, "{}" if self.count == 0 else "}"))
        self.ended = True

    def _pair(self, pieces: list, value: str) -> None:
        pieces.append((None, argument_piece(self.count, self._key, self.typed(self.name, self._key, value))))
        self.count, self._key = self.count + 1, None


class CoderCall(_TaggedArguments):
    """A qwen3_coder block: ``<function=NAME>``, then each ``<parameter=KEY>`` value (ending at
    ``</parameter>``, the next ``<parameter=``, ``</function>`` or the block's end; one newline
    trimmed at each side)."""

    _FUNCTION = re.compile(r"<function=([^>\n]+)>")
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>")

    def _read_name(self, last: bool) -> str | None:
        found = self._FUNCTION.search(self.text)
        if found is None:
            return None
        self.text = self.text[found.end():]
        return found.group(1).strip()

    def _body(self) -> str:
        function_end = self.text.find("</function>")
        return self.text if function_end < 0 else self.text[:function_end]

    def _step(self, pieces: list, last: bool) -> bool:
        function_ends = "</function>" in self.text
        body = self._body()
        if self._key is None:
            found = self._PARAMETER.search(body)
            if found is None:
                if function_ends:
                    self._close(pieces)
                return False
            self._key, self.text = found.group(1).strip(), self.text[found.end():]
            return True
        ends = [at for at in (body.find("</parameter>"), body.find("<parameter=")) if at >= 0]
        if not ends and not function_ends and not last:
            return False
        at = min(ends) if ends else len(body)
        value = self.text[:at].removeprefix("\n").removesuffix("\n")
        self.text = self.text[at + (len("</parameter>") if self.text.startswith("</parameter>", at) else 0):]
        self._pair(pieces, value)
        return True

    def _rest(self) -> str:
        return self._body().removeprefix("\n").removesuffix("\n")


def glm_name(name: str) -> bool:
    """Whether the text before a glm45 block's first argument is a tool's name: one line, no tag."""
    return bool(name) and "\n" not in name and "<" not in name


class GlmCall(_TaggedArguments):
    """A glm45 block: ``NAME``, then per argument ``<arg_key>KEY</arg_key>`` and
    ``<arg_value>VALUE</arg_value>`` (a value ends at ``</arg_value>`` or the block's end)."""

    def _read_name(self, last: bool) -> str | None:
        at = self.text.find("<arg_key>")
        if at < 0 and not last:
            return None
        name = (self.text if at < 0 else self.text[:at]).strip()
        self.text = "" if at < 0 else self.text[at:]
        return name if glm_name(name) else ""

    def _step(self, pieces: list, last: bool) -> bool:
        if self._key is None:
            start, end = self.text.find("<arg_key>"), self.text.find("</arg_key>")
            value = self.text.find("<arg_value>", max(end, 0))
            if start < 0 or end < 0 or value < 0:
                return False
            self._key, self.text = self.text[start + len("<arg_key>"):end].strip(), self.text[value + len("<arg_value>"):]
            return True
        end = self.text.find("</arg_value>")
        if end < 0:
            return False
        self._pair(pieces, self.text[:end])
        self.text = self.text[end + len("</arg_value>"):]
        return True


def minimax_name(text: str) -> str:
    """The name in a minimax_m2 ``<invoke name=...>`` or ``<parameter name=...>`` tag: the text
    between ``name=`` and ``>``, stripped, its quotes (double or single) taken off."""
    text = text.strip()
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'" else text


class MiniMaxCall(_TaggedArguments):
    """A minimax_m2 block (after ``<invoke name=``): the tool's quoted name and ``>``, then per
    argument ``<parameter name="KEY">VALUE</parameter>`` (a value ends at ``</parameter>`` or the
    block's end)."""

    PARAMETER, PARAMETER_END = "<parameter name=", "</parameter>"

    def _read_name(self, last: bool) -> str | None:
        at = self.text.find(">")
        if at < 0 and not last:
            return None
        name = minimax_name(self.text if at < 0 else self.text[:at])
        self.text = "" if at < 0 else self.text[at + 1:]
        return name

    def _step(self, pieces: list, last: bool) -> bool:
        if self._key is None:
            start = self.text.find(self.PARAMETER)
            end = self.text.find(">", start + len(self.PARAMETER)) if start >= 0 else -1
            if end < 0:
                return False
            self._key, self.text = minimax_name(self.text[start + len(self.PARAMETER):end]), self.text[end + 1:]
            return True
        end = self.text.find(self.PARAMETER_END)
        if end < 0:
            return False
        self._pair(pieces, self.text[:end])
        self.text = self.text[end + len(self.PARAMETER_END):]
        return True
