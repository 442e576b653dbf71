"""A chat request's tools (``tools``, ``tool_choice``, ``parallel_tool_calls``) and its reply's
tool calls, as vLLM's server answers them (`runtime.openai_protocol` reads them, the handlers of
`runtime.openai_http` write the replies).

The tools always go to the chat template. Then, by ``tool_choice``:

- ``"none"``: the reply is text. Without a tool parser on the server (``vexact serve
  --tool-call-parser``), a request with tools and no ``tool_choice`` is answered so too.
- ``"auto"`` (the default with tools, where the server has a parser): the server's parser
  (`runtime.tool_calls`) reads the reply: the text before the first call is the message's content,
  the calls its ``tool_calls``, and ``finish_reason`` is ``"tool_calls"`` when there are any.
  Streamed, the content streams until a call's tag begins; then each call's id and name go out
  once its name is written and its arguments as they are written (`runtime.tool_call_stream`).
  ``"auto"`` asked of a server without a parser is refused, naming the option.
- ``"required"``: the reply is held to a JSON array of one or more ``{"name", "parameters"}``
  objects, one of the tools' names and its parameters' schema each (structured outputs); each item
  is a call (streamed as "auto"'s are), and ``finish_reason`` is ``"tool_calls"``. The message's
  content is empty.
- a named function, ``{"type": "function", "function": {"name": N}}``: the reply is held to N's
  parameters' schema and is that call's arguments (streamed as they come); ``finish_reason`` is
  ``"stop"``, as OpenAI and vLLM answer a named call.

``parallel_tool_calls: false`` keeps the first call (``"required"``: the array holds one). The calls' tokens and logprobs are the
reply's, as without tools: a training forward recomputes them from ``token_ids``. With a reasoning
parser on the server, the reasoning comes first, free, and the grammar holds the answer after it
(``StructuredOutputsParams.after_reasoning``), as vLLM starts its grammar after the reasoning.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .structured_outputs import StructuredOutputsParams
from .openai_errors import ProtocolError
from .harmony import HarmonyReader
from .reasoning import HARMONY, reasoning_split
from .tool_call_stream import ArrayCalls, CallPiece
from .tool_calls import PARSERS, HarmonyParser, ToolCall, ToolParser, new_call_id

__all__ = ["ChatStream", "ToolReply", "ToolStream", "chat_message", "read_tools", "server_parsers"]


@dataclass
class ToolReply:
    """What a request's tools ask of its reply: `mode` ``"auto"``, ``"required"`` or ``"named"``
    (function `name`), with the request's `tools`, the server's `parser` (auto) and whether more
    than one call is kept (`parallel`)."""

    mode: str
    tools: list[dict]
    parser: ToolParser | None = None
    name: str | None = None
    parallel: bool = True

    def structured(self) -> StructuredOutputsParams | None:
        """The structured output that holds the reply to its calls (required and named)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=_schema(self.tools, self.name))
        if self.mode == "required":
            calls = [{"type": "object", "required": ["name", "parameters"],
                      "properties": {"name": {"type": "string", "enum": [tool["function"]["name"]]},
                                     "parameters": _schema(self.tools, tool["function"]["name"])}} for tool in self.tools]
            array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            return StructuredOutputsParams(json=array if self.parallel else {**array, "maxItems": 1})
        return None

    def calls(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply; (text, []) when it has no readable calls."""
        if self.mode == "named":
            return "", [ToolCall(self.name, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
                calls = [ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
            except (ValueError, TypeError, KeyError):  # cut short (max_tokens): not a whole array
                return text, []
            content = ""
        else:
            content, calls = self.parser.extract(text, self.tools)
        return content, calls if self.parallel else calls[:1]

    def message(self, text: str) -> tuple[dict, bool]:
        """(the assistant message of a whole reply, whether ``finish_reason`` is ``"tool_calls"``)."""
        return self.message_of(*self.calls(text))

    def message_of(self, content: str | None, calls: list[ToolCall]) -> tuple[dict, bool]:
        """`message`'s answer for a reply read as `content` and `calls`."""
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.message_item() for call in calls]
        return message, bool(calls) and self.mode != "named"

    def harmony_calls(self, reader: HarmonyReader) -> list[ToolCall]:
        """The calls a harmony reply's `reader` read ("auto": a grammar holds the others' final message)."""
        calls = [ToolCall(name, arguments) for name, arguments in reader.calls]
        return calls if self.parallel else calls[:1]

    def stream(self) -> ToolStream:
        """The state of one streamed choice."""
        return ToolStream(self)


class ToolStream:
    """Turns one choice's text deltas into its stream's delta messages under the request's tools:
    content until the calls begin, then each call's id and name once its name is written and its
    arguments as they come (`runtime.tool_call_stream`), as vLLM streams them. The pieces join to
    the whole reply's message; where the whole reply cannot read its calls and answers with text,
    a stream that sent none sends that text. A stream cannot take back a call it sent: where the
    reply breaks after one (``max_tokens`` cuts "required"'s array, an "auto" call's JSON is not
    valid), the stream has that call and its arguments so far, and the whole reply is text, as in
    vLLM."""

    def __init__(self, reply: ToolReply) -> None:
        self.reply, self.text, self.sent = reply, "", 0  # the reply so far, and how much went out as content
        self.call_id = new_call_id()  #: a named function's call id
        self._reader = ArrayCalls() if reply.mode == "required" else None
        self._ids: list[str] = []  # the ids of the calls sent so far

    @property
    def calls(self) -> int:
        """The calls sent so far."""
        return len(self._ids)

    @property
    def called(self) -> bool:
        """Whether "auto" or "required" calls went out (``finish_reason`` ``"tool_calls"``)."""
        return self.calls > 0 and self.reply.mode != "named"

    def delta(self, text: str, finished: bool) -> dict:
        """The delta message for the next `text` of the reply (`finished`: its last)."""
        self.text += text
        if self.reply.mode == "named":
            item = {"index": 0, "function": {"arguments": text}}
            if not self._ids:
                item.update(id=self.call_id, type="function", function={"name": self.reply.name, "arguments": text})
                self._ids.append(self.call_id)
            return {"tool_calls": [item]}
        delta = {}
        if self._reader is None:  # ("auto": content until the calls begin)
            parser = self.reply.parser
            begun = parser.begins(self.text, self.sent)  # (what went out held no beginning of a call)
            delta = self._content(begun if begun >= 0 else len(self.text) - (0 if finished else parser.held(self.text)))
            if begun < 0:
                return delta
            self._reader, text = parser.stream_reader(self.reply.tools), self.text[begun:]
        delta.update(self._calls(self._reader.feed(text, finished)))
        if finished and not self.calls:  # (no call could be read: the reply is text, as the whole one's)
            delta.update(self._content(len(self.text)))
        return delta

    def _calls(self, pieces: list[CallPiece]) -> dict:
        items: dict[int, dict] = {}
        for piece in pieces:
            if piece.index > 0 and not self.reply.parallel or piece.name is None and not piece.arguments:
                continue
            if piece.name is not None:
                self._ids.append(new_call_id())
                items[piece.index] = {"index": piece.index, "id": self._ids[piece.index], "type": "function",
                                      "function": {"name": piece.name, "arguments": ""}}
            item = items.setdefault(piece.index, {"index": piece.index, "function": {"arguments": ""}})
            item["function"]["arguments"] += piece.arguments
        return {"tool_calls": list(items.values())} if items else {}

    def _content(self, end: int) -> dict:
        if end <= self.sent:
            return {}
        piece, self.sent = self.text[self.sent:end], end
        return {"content": piece}


class ChatStream:
    """One streamed chat choice's delta messages: its reasoning split off by the server's
    reasoning parser (`runtime.reasoning`; sent as ``reasoning`` when `include_reasoning`), the
    answer read under the request's tools (`ToolStream`) or sent as it comes. A harmony reply's
    calls are read by its split (`runtime.harmony`), each sent whole once its message ends."""

    def __init__(self, tools: ToolReply | None, reasoning: str | None, include_reasoning: bool = True) -> None:
        self.split = None if reasoning is None else reasoning_split(reasoning)
        self.harmony = tools if _reads_calls(self.split, tools) else None
        self.tools = None if tools is None or self.harmony is not None else tools.stream()
        self.include_reasoning = include_reasoning
        self._harmony_sent = 0  # the harmony calls sent

    @property
    def called(self) -> bool:
        """Whether "auto" or "required" tool calls went out (``finish_reason`` "tool_calls")."""
        return self._harmony_sent > 0 or self.tools is not None and self.tools.called

    def delta(self, text: str, finished: bool) -> dict:
        reasoning, answer = ("", text) if self.split is None else self.split.feed(text, finished)
        delta = {"reasoning": reasoning} if reasoning and self.include_reasoning else {}
        if self.tools is not None:
            return {**delta, **self.tools.delta(answer, finished)}
        if answer:
            delta["content"] = answer
        ended = self.harmony is not None and len(self.split.calls) > self._harmony_sent  # (a call's message ended)
        calls = self.harmony.harmony_calls(self.split)[self._harmony_sent:] if ended else []
        if calls:
            delta["tool_calls"] = [{"index": self._harmony_sent + i, **call.message_item()} for i, call in enumerate(calls)]
            self._harmony_sent += len(calls)
        return delta


def chat_message(text: str, tools: ToolReply | None, reasoning: str | None,
                 include_reasoning: bool = True) -> tuple[dict, bool]:
    """(the assistant message of a whole reply, whether ``finish_reason`` is ``"tool_calls"``):
    its reasoning split off (`reasoning`: the server's parser, or None) and its answer read under
    `tools` (None: text)."""
    split = None if reasoning is None else reasoning_split(reasoning)
    thought, answer = (None, text) if split is None else split.feed(text, True)
    answer = answer or None if split is not None else answer
    if _reads_calls(split, tools):
        message, called = tools.message_of(answer, tools.harmony_calls(split))
    elif tools is not None:
        message, called = tools.message(answer or "")
    else:
        message, called = {"role": "assistant", "content": answer}, False
    if thought and include_reasoning:
        message["reasoning"] = thought
    return message, called


def _reads_calls(split, tools: ToolReply | None) -> bool:
    """Whether the reply's calls are read by its harmony split ("auto"; "required" and a named
    function hold the final message to their JSON, which `ToolReply` reads)."""
    return isinstance(split, HarmonyReader) and tools is not None and tools.mode == "auto"


def server_parsers(tool_parser: str | None, reasoning_parser: str | None) -> tuple[str | None, str | None]:
    """The server's (tool call, reasoning) parsers, checked: GPT-OSS's ``openai`` tool parser
    reads its calls beside the ``openai_gptoss`` reasoning parser, which it brings when none is
    named; ValueError naming the pair where they cannot go together."""
    harmony_tools = tool_parser == HarmonyParser.name
    if harmony_tools and reasoning_parser is None:
        return tool_parser, HARMONY
    if harmony_tools != (reasoning_parser == HARMONY) and (tool_parser is not None and reasoning_parser is not None):
        raise ValueError(f"tool_call_parser={tool_parser!r} and reasoning_parser={reasoning_parser!r} read different "
                         f"formats: GPT-OSS's harmony replies take tool_call_parser='openai' with reasoning_parser="
                         f"'{HARMONY}' (or none)")
    return tool_parser, reasoning_parser


def _schema(tools: list[dict], name: str) -> dict:
    return _by_name(tools)[name].get("parameters") or {"type": "object", "properties": {}}


def _by_name(tools: list[dict]) -> dict[str, dict]:
    return {tool["function"]["name"]: tool["function"] for tool in tools}


def read_tools(body: dict, parser: str | None) -> ToolReply | None:
    """The request's `ToolReply` (None: a text reply), a `ProtocolError` naming a bad field.
    `parser`: the server's ``--tool-call-parser`` (or None)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is not None:
        if not isinstance(tools, list) or not all(
                isinstance(t, dict) and t.get("type", "function") == "function" and isinstance(t.get("function"), dict)
                and isinstance(t["function"].get("name"), str)
                and isinstance(t["function"].get("parameters", {}) or {}, dict) for t in tools):
            raise ProtocolError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ..., "
                                "\"parameters\": {...}}} (parameters: a JSON schema object)", "tools")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ProtocolError(f"'parallel_tool_calls' must be a boolean, got {parallel!r}", "parallel_tool_calls")
    if choice is None:
        choice = "auto" if tools and parser is not None else "none"
    if choice == "none":
        return None
    if not tools:
        raise ProtocolError(f"'tool_choice'={choice!r} needs 'tools'", "tool_choice")
    if choice == "auto":
        if parser is None:
            raise ProtocolError("'tool_choice'='auto' needs a tool parser on the server: start it with "
                                f"--tool-call-parser ({' or '.join(PARSERS)})", "tool_choice")
        return ToolReply("auto", tools, PARSERS[parser](), parallel=parallel)
    fmt = body.get("response_format")
    if body.get("structured_outputs") is not None or not (fmt is None or isinstance(fmt, dict) and fmt.get("type") == "text"):
        raise ProtocolError(f"'tool_choice'={choice!r} holds the reply to its calls: it cannot be combined with "
                            "'response_format' or 'structured_outputs'", "tool_choice")
    if choice == "required":
        return ToolReply("required", tools, parallel=parallel)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ProtocolError("'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                            f"\"function\": {{\"name\": ...}}}}, got {choice!r}", "tool_choice")
    if name not in _by_name(tools):
        raise ProtocolError(f"'tool_choice' names the function {name!r}, which is not among 'tools' "
                            f"({sorted(_by_name(tools))})", "tool_choice")
    return ToolReply("named", tools, name=name)
