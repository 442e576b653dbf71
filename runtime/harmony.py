"""A GPT-OSS reply read in OpenAI's harmony format: its reasoning, its answer and its tool calls,
as vLLM's server reads them (``--reasoning-parser openai_gptoss``, ``--tool-call-parser openai``).

GPT-OSS writes its reply as messages, each a header and a body between special tokens::

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Oslo"}<|call|>

The prompt ends with ``<|start|>assistant``, so the reply begins inside its first header. A header
names the message's channel (``<|channel|>NAME``), may name a recipient (``to=NAME``, before or
after the channel) and a content type (``<|constrain|>json``, or a word after the channel). A body
ends at ``<|end|>`` (another message follows), ``<|return|>`` or ``<|call|>`` (the model's stop
tokens). By channel and recipient a message is:

- ``analysis``: reasoning (vLLM's ``reasoning`` field);
- ``final``, or ``commentary`` with no recipient (a preamble shown to the user), or no channel:
  answer (the message's ``content``);
- a recipient ``functions.NAME``: a call of NAME, its body the arguments (JSON text, re-written
  compactly when it is JSON); only a message that ended (``<|call|>``, ``<|end|>``) is a call;
- any other recipient (the built-in ``browser``, ``python``) or channel: none of these.

Several messages of one kind are joined by a newline (vLLM's join); text between messages (not
whitespace, its special tokens dropped) is answer too. A reply that does not begin like a header
is read as the body of an answer message (a prompt that opened the final channel; a model that
never learned the format). The markers are read in the decoded text, so the reply is decoded
with its special tokens (the server asks for that).

`HarmonyReader` reads a reply as it streams, holding back only what may still begin a marker; a
whole reply is read the same way, so a stream's pieces always add up to the whole reply's.
"""

from __future__ import annotations

import json
import re

from .text_deltas import tag_prefix

__all__ = ["HarmonyReader", "read_harmony"]

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
ENDS = (END, RETURN, CALL)
FUNCTIONS = "functions."
#: what a reply (inside its first header) may begin with: a channel, a recipient, a new message
OPENINGS = (CHANNEL, "to=", " to=", START)
_RECIPIENT = re.compile(r"(?:^|\s)to=(\S+)")
_MARKER = re.compile(r"<\|[^<>|]*\|>")  # a special token's text


class HarmonyReader:
    """One reply's reading, fed its text as it comes: `feed` returns each new piece of reasoning
    and of answer; `calls` holds the ``(name, arguments)`` of each call ended so far."""

    def __init__(self) -> None:
        self.state = "start"  # then "header", "body" or "between"
        self.held = ""  # text not read yet
        self.header = ""  # the current message's header so far
        self.kind: str | None = None  # the current body's: "reasoning", "answer", "call" or None (dropped)
        self.call: tuple[str, str | None] | None = None  # the current call's (name, content type)
        self.body = ""  # the current call's arguments so far
        self.calls: list[tuple[str, str]] = []
        self._wrote = {"reasoning": False, "answer": False}  # a message of the kind wrote text (a newline joins the next)
        self._opened = False  # the current body wrote text
        self._stray = False  # text between messages was written

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        """(reasoning, answer) pieces of the reply's next `text` (`finished`: its last)."""
        self.held += text
        out = {"reasoning": [], "answer": []}
        while self.held and self._step(finished, out):
            pass
        return "".join(out["reasoning"]), "".join(out["answer"])

    def _step(self, finished: bool, out: dict) -> bool:
        """Read what the state allows from `held`; whether there may be more to read now."""
        if self.state == "start":
            if self.held.startswith(OPENINGS):
                self.state = "header"
            elif any(o.startswith(self.held) for o in OPENINGS) and not finished:
                return False  # may still begin a header
            else:  # no header: the body of an answer (a prompt that opened the final channel)
                self.state, self.kind = "body", "answer"
        if self.state == "between":
            return self._between(finished, out)
        if self.state == "header":
            return self._header()
        return self._body(finished, out)

    def _between(self, finished: bool, out: dict) -> bool:
        """After a message's ``<|end|>``: the next ``<|start|>``. Stray text is answer, from its
        first character that is not whitespace (whitespace alone is dropped), without the special
        tokens in it (``<|endoftext|>``, an EOS token the reply may end with)."""
        at = self.held.find(START)
        limit = at if at >= 0 else len(self.held) - (0 if finished else _open_marker(self.held))
        stray = _MARKER.sub("", self.held[:limit])
        if self._stray or stray.strip():
            if not self._stray:  # (stray text is a message of its own: joined by a newline too)
                self._opened = False
            self._write("answer", stray if self._stray else stray.lstrip(), out)
            self._stray, self.held = True, self.held[limit:]
        elif at < 0 and not finished:
            return False  # whitespace (and special tokens) so far: held until the next text says
        if at < 0:
            return False
        self.held, self.state, self.header, self._stray = self.held[at + len(START):], "header", "", False
        return True

    def _header(self) -> bool:
        looked = max(0, len(self.header) - len(MESSAGE) + 1)  # (the marker may have begun in the text before)
        self.header, self.held = self.header + self.held, ""
        at = self.header.find(MESSAGE, looked)
        if at < 0:  # (a reply that ends in a header wrote no body)
            return False
        self.header, self.held, self.state = self.header[:at], self.header[at + len(MESSAGE):], "body"
        self._begin(self.header)
        return True

    def _begin(self, header: str) -> None:
        """The message of `header` begins: what its body is."""
        channel, recipient, content_type = parse_header(header)
        self.call, self.body, self._opened = None, "", False
        if recipient is not None:
            is_function = recipient.startswith(FUNCTIONS)
            self.kind = "call" if is_function else None
            self.call = (recipient[len(FUNCTIONS):], content_type) if is_function else None
        elif channel == "analysis":
            self.kind = "reasoning"
        elif channel in (None, "final", "commentary"):
            self.kind = "answer"
        else:
            self.kind = None

    def _body(self, finished: bool, out: dict) -> bool:
        ends = [(at, marker) for marker in ENDS if (at := self.held.find(marker)) >= 0]
        if ends:
            at, marker = min(ends)
            self._take(self.held[:at], out)
            self.held, self.state = self.held[at + len(marker):], "between"
            if self.call is not None:
                self.calls.append((self.call[0], arguments(self.body, self.call[1])))
            return True
        keep = 0 if finished else max(tag_prefix(self.held, marker) for marker in ENDS)
        self._take(self.held[:len(self.held) - keep], out)
        self.held = self.held[len(self.held) - keep:]
        return False

    def _take(self, piece: str, out: dict) -> None:
        if self.kind == "call":
            self.body += piece
        elif self.kind is not None:
            self._write(self.kind, piece, out)

    def _write(self, kind: str, piece: str, out: dict) -> None:
        if not piece:
            return
        if not self._opened and self._wrote[kind]:
            out[kind].append("\n")  # the messages of a kind are joined by a newline
        out[kind].append(piece)
        self._wrote[kind] = self._opened = True


def _open_marker(text: str) -> int:
    """How many characters at the end of `text` may be a special token still being written."""
    opened = text.rfind("<|")
    if opened >= 0 and "|>" not in text[opened:]:
        return len(text) - opened
    return tag_prefix(text, "<|")


def parse_header(header: str) -> tuple[str | None, str | None, str | None]:
    """(channel, recipient, content type) of a message's header (None where it names none)."""
    recipient = _RECIPIENT.search(header.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
    recipient = recipient.group(1) if recipient else None
    channel_part, _, constraint = header.partition(CONSTRAIN)
    words = [w for w in channel_part.partition(CHANNEL)[2].split() if not w.startswith("to=")]
    channel = words[0] if words else None
    content_type = constraint.split()[0] if constraint.split() else (words[1] if len(words) > 1 else None)
    return channel, recipient, content_type


def arguments(body: str, content_type: str | None) -> str:
    """A call's arguments as OpenAI's JSON text: a JSON body (no content type, or a JSON one)
    written compactly, any other as it is."""
    if content_type is None or "json" in content_type:
        try:
            return json.dumps(json.loads(body), ensure_ascii=False)
        except ValueError:
            pass
    return body


def read_harmony(text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    """(reasoning, answer, calls) of a whole reply (None where empty)."""
    reader = HarmonyReader()
    reasoning, answer = reader.feed(text, True)
    return reasoning or None, answer or None, reader.calls
