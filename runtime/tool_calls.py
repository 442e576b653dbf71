"""Tool calls read out of a chat reply's text, as vLLM's ``--tool-call-parser`` reads them
(`runtime.openai_tools` applies them to the server's chat replies).

A model asked to call tools writes each call in its own format:

- ``hermes`` (Qwen2.5, Qwen3, Qwen3-Next, QwQ, Hermes): between ``<tool_call>`` and
  ``</tool_call>``, a JSON object, ``{"name": ..., "arguments": {...}}``;
- ``qwen3_coder`` (Qwen3-Coder, Qwen3.5): between the same tags, XML-like, ``<function=NAME>``
  then one ``<parameter=KEY>`` ... ``</parameter>`` block per argument, then ``</function>``; each
  value is text, converted by the type its tool's JSON schema gives that parameter (integer,
  number, boolean, object or array read as JSON; anything else kept as text);
- ``deepseek_v3`` (also ``deepseek_v31``: DeepSeek-V3, V3.1): after ``<｜tool▁calls▁begin｜>``,
  each call between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``, its name and its JSON
  arguments around ``<｜tool▁sep｜>`` (V3: ``function<｜tool▁sep｜>NAME`` and the arguments in a
  JSON code fence);
- ``glm45`` (GLM-4.5, GLM-4.6): between ``<tool_call>`` and ``</tool_call>``, the name, then per
  argument ``<arg_key>KEY</arg_key>`` and ``<arg_value>VALUE</arg_value>``; a value whose schema type
  is string is its text, any other read as JSON (else as a Python literal, else kept as text), as
  vLLM's parser reads them;
- ``minimax_m2`` (MiniMax-M2, M2.1, M2.5): after ``<minimax:tool_call>``, each call between
  ``<invoke name="NAME">`` and ``</invoke>``, one ``<parameter name="KEY">VALUE</parameter>`` per
  argument; each value is typed by the types its schema allows (its ``type``, ``enum`` values and
  ``anyOf`` / ``oneOf`` / ``allOf`` choices), integer first, then number, boolean, object or array,
  then text, as vLLM's parser types it;
- ``llama3_json`` (Llama 3.1, 3.2): the reply itself is the calls, JSON objects
  ``{"name": ..., "parameters": {...}}`` separated by ``;``;
- ``openai`` (GPT-OSS): harmony messages to ``functions.NAME`` (`runtime.harmony`), read with the
  reasoning parser ``openai_gptoss``.

`ToolParser.extract` reads a whole reply: the text before the first call is the message's content
and each block one call; a block the reply ended inside (no closing tag) is read too. If any block
cannot be read, the reply has no tool calls and its whole text is the content, as vLLM's parsers
answer a reply they cannot read. The tags are read in the decoded text: where a tokenizer marks
them special, the request needs ``skip_special_tokens: false`` (Qwen's ``<tool_call>`` is not
special; Llama's ``<|python_tag|>`` is, and the parser reads its calls without it).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from .harmony import read_harmony
from .tool_arguments import coder_value, glm_value, minimax_value, tool_parameters
from .text_deltas import tag_prefix
from .tool_call_stream import DeepSeekCall, SeparatedCalls, TaggedCalls, hermes_call
from .tool_call_tags import CoderCall, GlmCall, MiniMaxCall, glm_name, minimax_name

__all__ = ["PARSERS", "ToolCall", "ToolParser", "new_call_id"]

START, END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    """A fresh tool call id, in vLLM's form."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call: the function's `name` and its `arguments` as JSON text (OpenAI's form)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        self.id = self.id or new_call_id()

    def message_item(self) -> dict:
        """The call as an item of an assistant message's ``tool_calls``."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class ToolParser:
    """Reads the tool calls out of a reply, given the request's ``tools`` (OpenAI's list of
    ``{"type": "function", "function": {"name", "parameters"}}``). Subclasses read one block."""

    name = ""
    start, end = START, END  #: the tags around each call
    opens = START  #: where the calls begin (the content ends)

    def begins(self, text: str, start: int = 0) -> int:
        """Where the calls begin in `text` (-1: nowhere yet), looking from `start` (a stream's
        text before it cannot begin them)."""
        return text.find(self.opens, start)

    def held(self, text: str) -> int:
        """How many characters at the end of a streamed reply's `text` (no call begun yet) may
        still begin one: held back until the next text says."""
        return tag_prefix(text, self.opens)

    def extract(self, text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) of a whole reply: the content before the first call (None when
        empty) and the calls; (text, []) when it has none or one cannot be read."""
        first = self.begins(text)
        if first < 0:
            return text, []
        try:
            calls = [self.read_block(block, tools) for block in self.blocks(text[first:])]
        except (ValueError, TypeError, KeyError, SyntaxError):
            return text, []
        return (text[:first] or None, calls) if calls else (text, [])

    def blocks(self, calls: str) -> list[str]:
        """The text of each call in `calls` (the reply from where they begin): what is between
        each pair of tags (the last may be cut short)."""
        return re.findall(f"{re.escape(self.start)}(.*?)(?:{re.escape(self.end)}|$)", calls, re.DOTALL)

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        """The call written between the tags; ValueError (or TypeError, KeyError) when unreadable."""
        raise NotImplementedError

    def stream_reader(self, tools: list[dict]):
        """A reader of a streamed reply's calls as they are written (`runtime.tool_call_stream`),
        fed the reply from where `begins` finds them."""
        raise NotImplementedError


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        call = json.loads(block)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"a hermes tool call is a JSON object with a 'name', got {block!r}")
        arguments = call.get("arguments", {})
        return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> TaggedCalls:
        return TaggedCalls(self.start, self.end, hermes_call)


class Qwen3CoderParser(ToolParser):
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``."""

    name = "qwen3_coder"
    _FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        function = self._FUNCTION.search(block)
        if function is None:
            raise ValueError(f"a qwen3_coder tool call has a <function=...> element, got {block!r}")
        name = function.group(1).strip()
        schema = tool_parameters(tools, name)
        arguments = {}
        for key, value in self._PARAMETER.findall(function.group(2)):
            value = value.removeprefix("\n").removesuffix("\n")
            arguments[key.strip()] = coder_value(value, schema.get(key.strip()))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> TaggedCalls:
        def typed(name: str, key: str, value: str) -> object:
            return coder_value(value, tool_parameters(tools, name).get(key))
        return TaggedCalls(self.start, self.end, lambda: CoderCall(typed))


class Glm45Parser(ToolParser):
    """``<tool_call>NAME<arg_key>KEY</arg_key><arg_value>VALUE</arg_value>...</tool_call>``."""

    name = "glm45"
    _ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>|$)", re.DOTALL)

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        at = block.find("<arg_key>")
        name = (block if at < 0 else block[:at]).strip()
        if not glm_name(name):
            raise ValueError(f"a glm45 tool call begins with the tool's name, got {block!r}")
        schema = tool_parameters(tools, name)
        arguments = {key.strip(): glm_value(value, schema.get(key.strip()))
                     for key, value in self._ARGUMENT.findall(block[max(at, 0):])}
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> TaggedCalls:
        def typed(name: str, key: str, value: str) -> object:
            return glm_value(value, tool_parameters(tools, name).get(key))
        return TaggedCalls(self.start, self.end, lambda: GlmCall(typed))


class MiniMaxM2Parser(ToolParser):
    """``<minimax:tool_call><invoke name="NAME"><parameter name="KEY">VALUE</parameter>...</invoke>``
    (several invokes in one block, or blocks one after another)."""

    name = "minimax_m2"
    start, end, opens = "<invoke name=", "</invoke>", "<minimax:tool_call>"
    _PARAMETER = re.compile(r"<parameter name=([^>]*)>(.*?)(?:</parameter>|$)", re.DOTALL)

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        at = block.find(">")
        name = minimax_name(block if at < 0 else block[:at])
        if not name:
            raise ValueError(f"a minimax_m2 tool call names its tool in <invoke name=...>, got {block!r}")
        schema = tool_parameters(tools, name)
        arguments = {}
        for key, value in self._PARAMETER.findall(block[at + 1:] if at >= 0 else ""):
            arguments[minimax_name(key)] = minimax_value(value, schema.get(minimax_name(key)))
        return ToolCall(name, json.dumps(arguments, ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> TaggedCalls:
        def typed(name: str, key: str, value: str) -> object:
            return minimax_value(value, tool_parameters(tools, name).get(key))
        return TaggedCalls(self.start, self.end, lambda: MiniMaxCall(typed))


class DeepSeekParser(ToolParser):
    """DeepSeek-V3's calls: ``<｜tool▁calls▁begin｜>``, then per call ``<｜tool▁call▁begin｜>``
    ``function<｜tool▁sep｜>NAME`` and its arguments in a JSON code fence (V3), or
    ``NAME<｜tool▁sep｜>ARGUMENTS`` (V3.1), then ``<｜tool▁call▁end｜>``."""

    name = "deepseek_v3"
    start, end, opens = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁calls▁begin｜>"
    _FENCE = re.compile(r"^(.*?)\n```(?:json)?\n(.*?)\n?```\s*$", re.DOTALL)

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        head, arguments = block.split("<｜tool▁sep｜>", 1)
        if head.strip() == "function":  # V3: the name on the first line, the arguments fenced
            fenced = self._FENCE.match(arguments)
            if fenced is None:
                raise ValueError(f"a DeepSeek-V3 tool call has its arguments in a JSON code fence, got {block!r}")
            head, arguments = fenced.groups()
        return ToolCall(head.strip(), json.dumps(json.loads(arguments), ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> TaggedCalls:
        return TaggedCalls(self.start, self.end, DeepSeekCall)


class Llama3JsonParser(ToolParser):
    """Llama 3.1's JSON calls: the whole reply (after ``<|python_tag|>``, where it is kept) is
    ``{"name": ..., "parameters": {...}}``, several separated by ``;``."""

    name = "llama3_json"
    opens = "<|python_tag|>"

    def begins(self, text: str, start: int = 0) -> int:
        first = _LEADING_SPACE.match(text).end()
        return first if text.startswith(("{", self.opens), first) else -1

    def held(self, text: str) -> int:
        first = _LEADING_SPACE.match(text).end()
        left = len(text) - first  # (all of it is held while it may still begin with a call)
        return len(text) if left == 0 or left < len(self.opens) and self.opens.startswith(text[first:]) else 0

    def blocks(self, calls: str) -> list[str]:
        calls = calls.lstrip().removeprefix(self.opens)
        return re.split(r"(?<=\})\s*;\s*(?=\{)", calls.strip())

    def read_block(self, block: str, tools: list[dict]) -> ToolCall:
        call = json.loads(block)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"a Llama 3 tool call is a JSON object with a 'name', got {block!r}")
        arguments = call.get("parameters", call.get("arguments", {}))
        return ToolCall(call["name"], arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False))

    def stream_reader(self, tools: list[dict]) -> SeparatedCalls:
        return SeparatedCalls(self.opens)


class HarmonyParser(ToolParser):
    """GPT-OSS's calls, harmony messages to ``functions.NAME`` (`runtime.harmony`); read with the
    reply's reasoning and answer by the ``openai_gptoss`` reasoning parser, which the server pairs
    with it. `extract` reads a whole reply alone: its answer messages are the content."""

    name = "openai"

    def begins(self, text: str, start: int = 0) -> int:
        return -1  # (the answer the reasoning parser leaves holds no call: it takes them out)

    def held(self, text: str) -> int:
        return 0

    def extract(self, text: str, tools: list[dict]) -> tuple[str | None, list[ToolCall]]:
        _, answer, calls = read_harmony(text)
        return answer, [ToolCall(name, arguments) for name, arguments in calls]


_LEADING_SPACE = re.compile(r"\s*")


#: the parsers by the names of vLLM's ``--tool-call-parser``
PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (
    HermesParser, Qwen3CoderParser, Glm45Parser, MiniMaxM2Parser, DeepSeekParser, Llama3JsonParser, HarmonyParser)}
PARSERS["deepseek_v31"] = DeepSeekParser  # (vLLM's name for V3.1's form, which the same parser reads)
