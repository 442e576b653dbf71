"""GPT-OSS's harmony replies read into reasoning, answer and tool calls (`runtime.harmony`), as
vLLM's ``--reasoning-parser openai_gptoss`` and ``--tool-call-parser openai`` read them; a stream's
pieces add up to the whole reply's reading wherever the text is cut; the server's pairing of the
two parsers; the chat message and stream deltas built from a reading (`runtime.openai_tools`)."""

import json
import random

import pytest

from vexact_models.runtime.harmony import HarmonyReader, arguments, parse_header, read_harmony
from vexact_models.runtime.openai_tools import ChatStream, ToolReply, chat_message, server_parsers
from vexact_models.runtime.tool_calls import PARSERS

from .stream_support import join_deltas

CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":  "Oslo"}<|call|>'
THINK = "<|channel|>analysis<|message|>Need the weather.<|end|>"

REPLIES = {  # reply: (reasoning, answer, calls)
    "analysis then final": (
        '<|channel|>analysis<|message|>User asks: "2 + 2". Simple.<|end|>'
        "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>",
        'User asks: "2 + 2". Simple.', "2 + 2 = 4.", []),
    "analysis then a call": (THINK + CALL, "Need the weather.", None, [("get_weather", '{"city": "Oslo"}')]),
    "the recipient in the role part, the type after the channel": (
        ' to=functions.add<|channel|>commentary json<|message|>{"a": 1, "b": 2}<|call|>', None, None,
        [("add", '{"a": 1, "b": 2}')]),
    "a preamble, then two calls": (
        THINK + "<|start|>assistant<|channel|>commentary<|message|>Checking two cities.<|end|>"
        + CALL.replace("<|call|>", "<|end|>") + CALL.replace("Oslo", "Rome"),
        "Need the weather.", "Checking two cities.",
        [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]),
    "messages of a kind joined by a newline": (
        "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>plan<|end|><|start|>assistant<|channel|>final<|message|>done"
        "<|return|>", "a\nb", "plan\ndone", []),
    "cut short in the reasoning": ("<|channel|>analysis<|message|>Let me th", "Let me th", None, []),
    "cut short in a call: no call": (THINK + CALL[:-12], "Need the weather.", None, []),
    "cut short in a header": (THINK + "<|start|>assistant<|chan", "Need the weather.", None, []),
    "a built-in tool's call is neither": (
        THINK + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{\"q\": 1}<|call|>",
        "Need the weather.", None, []),
    "a call's body that is not JSON is kept": (
        '<|channel|>commentary to=functions.run <|constrain|>json<|message|>{"cmd": "ls"<|call|>', None, None,
        [("run", '{"cmd": "ls"')]),
    "text between messages is answer": (
        "<|channel|>final<|message|>a<|end|>\n  more<|start|>assistant<|channel|>final<|message|>b<|end|> \n",
        None, "a\nmore\nb", []),
    "an EOS token after the last message is dropped": (
        "<|channel|>final<|message|>a<|end|><|endoftext|>", None, "a", []),
    "special tokens in text between messages are dropped": (
        "<|channel|>final<|message|>a<|end|>x<|foo|>y<|start|>assistant<|channel|>final<|message|>b<|end|>", None,
        "a\nxy\nb", []),
    "no header: an answer's body": ("Just text, and all.<|return|>", None, "Just text, and all.", []),
    "no header, then messages": ("[1, 2]<|end|><|start|>assistant<|channel|>final<|message|>3<|return|>", None,
                                 "[1, 2]\n3", []),
    "empty": ("", None, None, []),
}


@pytest.mark.parametrize("name", REPLIES)
def test_a_whole_reply_is_read_as_vllm_reads_it(name):
    text, reasoning, answer, calls = REPLIES[name]
    assert read_harmony(text) == (reasoning, answer, calls)


@pytest.mark.parametrize("name", REPLIES)
def test_a_streamed_reply_adds_up_to_the_whole_reading_wherever_it_is_cut(name):
    """A character at a time (every marker split) and random cuts: the pieces join to the whole
    reading, and no piece of a marker is ever sent."""
    text = REPLIES[name][0]
    rng = random.Random(len(text))
    cuttings = [list(range(1, len(text)))] + [sorted(rng.sample(range(1, len(text)), min(5, len(text) - 1)))
                                                 for _ in range(20)] if len(text) > 1 else [[]]
    for cuts in cuttings:
        reader, pieces = HarmonyReader(), ([], [])
        bounds = [0, *cuts, len(text)]
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            reasoning, answer = reader.feed(text[a:b], i == len(bounds) - 2)
            assert not any(marker in piece for piece in (reasoning, answer) for marker in ("<|", "|>"))
            pieces[0].append(reasoning)
            pieces[1].append(answer)
        assert ("".join(pieces[0]) or None, "".join(pieces[1]) or None, reader.calls) == read_harmony(text), cuts


@pytest.mark.parametrize("header, parsed", [
    ("<|channel|>analysis", ("analysis", None, None)),
    ("<|channel|>commentary to=functions.f <|constrain|>json", ("commentary", "functions.f", "json")),
    (" to=functions.f<|channel|>commentary json", ("commentary", "functions.f", "json")),
    ("assistant<|channel|>final", ("final", None, None)),
    ("assistant to=python<|channel|>analysis code", ("analysis", "python", "code")),
    ("", (None, None, None)),
])
def test_a_header_names_its_channel_recipient_and_content_type(header, parsed):
    assert parse_header(header) == parsed


def test_call_arguments_are_json_text_written_compactly():
    assert arguments('{"a":  [1, 2],\n "b": "é"}', "json") == '{"a": [1, 2], "b": "é"}'
    assert arguments('{"a": 1}', None) == '{"a": 1}'
    assert arguments("plain words", "text") == "plain words"
    assert arguments("{broken", "json") == "{broken"


def test_the_openai_tool_parser_reads_a_whole_harmony_reply():
    parser = PARSERS["openai"]()
    content, calls = parser.extract(REPLIES["a preamble, then two calls"][0], [])
    assert content == "Checking two cities."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Oslo"}'), ("get_weather", '{"city": "Rome"}')]
    assert parser.begins("a <|channel|> b") == -1 and parser.held("<|") == 0


@pytest.mark.parametrize("tool, reasoning, paired", [
    ("openai", None, ("openai", "openai_gptoss")),
    ("openai", "openai_gptoss", ("openai", "openai_gptoss")),
    (None, "openai_gptoss", (None, "openai_gptoss")),
    ("hermes", "qwen3", ("hermes", "qwen3")),
    (None, None, (None, None)),
])
def test_the_servers_parsers_pair_the_harmony_ones(tool, reasoning, paired):
    assert server_parsers(tool, reasoning) == paired


@pytest.mark.parametrize("tool, reasoning", [("openai", "qwen3"), ("hermes", "openai_gptoss")])
def test_parsers_of_different_formats_are_refused(tool, reasoning):
    with pytest.raises(ValueError, match=f"tool_call_parser='{tool}' and reasoning_parser='{reasoning}'"):
        server_parsers(tool, reasoning)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _streamed(stream: ChatStream, text: str) -> dict:
    """The stream's deltas of `text`, a character at a time, joined into one message."""
    return join_deltas([stream.delta(char, i == len(text) - 1) for i, char in enumerate(text)])


@pytest.mark.parametrize("parallel", [True, False])
def test_a_harmony_replys_message_and_stream_under_auto(parallel):
    """Under "auto": the reasoning, the preamble as content, the calls (the first alone without
    parallel calls), "tool_calls" as the finish reason; the stream's deltas join to the same."""
    text = REPLIES["a preamble, then two calls"][0]
    tools = ToolReply("auto", TOOLS, PARSERS["openai"](), parallel=parallel)
    message, called = chat_message(text, tools, "openai_gptoss")
    assert called and message["reasoning"] == "Need the weather." and message["content"] == "Checking two cities."
    cities = ["Oslo", "Rome"] if parallel else ["Oslo"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])["city"]) for c in message["tool_calls"]] == \
        [("get_weather", city) for city in cities]
    stream = ChatStream(tools, "openai_gptoss")
    joined = _streamed(stream, text)
    assert stream.called and (joined["content"], joined["reasoning"]) == (message["content"], message["reasoning"])
    assert [c["function"] for c in joined["tool_calls"]] == [c["function"] for c in message["tool_calls"]]


def test_a_harmony_reply_without_tools_drops_its_calls_and_may_drop_its_reasoning():
    text = REPLIES["a preamble, then two calls"][0]
    message, called = chat_message(text, None, "openai_gptoss", include_reasoning=False)
    assert message == {"role": "assistant", "content": "Checking two cities."} and not called
    stream = ChatStream(None, "openai_gptoss", include_reasoning=False)
    assert _streamed(stream, text) == {"content": "Checking two cities.", "reasoning": "", "tool_calls": []}
    assert not stream.called
    message, called = chat_message(REPLIES["analysis then a call"][0], None, "openai_gptoss")
    assert message == {"role": "assistant", "content": None, "reasoning": "Need the weather."} and not called


def test_a_harmony_reply_held_to_required_calls_reads_them_from_its_final_message():
    """"required": the grammar held the final message to the calls' JSON (after the analysis);
    the calls are read from it, whole and streamed, and the finish reason is "tool_calls"."""
    calls = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    text = THINK + f"<|start|>assistant<|channel|>final<|message|>{calls}<|return|>"
    tools = ToolReply("required", TOOLS)
    message, called = chat_message(text, tools, "openai_gptoss")
    assert called and message["reasoning"] == "Need the weather." and message["content"] == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
        [("get_weather", '{"city": "Oslo"}')]
    joined = _streamed(ChatStream(tools, "openai_gptoss"), text)
    assert joined["reasoning"] == "Need the weather." and joined["content"] == ""
    assert [c["function"] for c in joined["tool_calls"]] == [c["function"] for c in message["tool_calls"]]
