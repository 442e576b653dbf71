"""Tool calls streamed as they are written (`runtime.tool_call_stream`, `runtime.json_stream`,
`runtime.openai_tools.ToolStream`): JSON written token by token as ``json.dumps`` writes it, each
parser's calls sent as their names and arguments come, and the stream's pieces joined equal to
the whole reply's message, wherever the text is cut."""

import json
import random

import pytest

from .stream_support import join_deltas, stream_of
from vexact_models.runtime.json_stream import JsonTokens, canonical
from vexact_models.runtime.openai_tools import ToolReply
from vexact_models.runtime.tool_calls import PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "rain": {"type": "number"},
                                     "where": {"type": "object"}}}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]
CUTS = (-1, 0, 1, 2, 3)  # a character at a time, and four random cuttings

DS_BEGIN, DS_CALL, DS_SEP, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
REPLIES = {
    "hermes": [
        'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "S\\u00e3o \\"Paulo\\"", "days": 2,'
        ' "where": {"lat": -23.5, "tags": ["a", null, true]}}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        '<tool_call>{"arguments":{"zone":"utc","emoji":"\\ud83d\\ude00 \U0001F600"},"name":"get_time"}</tool_call>',
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}</tool_call>',
        '<tool_call>{"name": "get_time"}</tool_call> trailing text',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "<tool_call>"}}</tool_call> after',
        '<tool_call>{"name": "get_time", "arguments": {"n": 1E3, "x": 1.50}}',  # (the reply ended inside the block)
        "a < b and <tool but no call",
        'x <tool_call>{"broken',
    ],
    "qwen3_coder": [
        "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n<parameter=note>\nline "
        "one\nline two\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n"
        "</tool_call>",
        "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=city>\nnull\n"
        "<parameter=rain>\n2",
        "<tool_call><function=get_time><parameter=zone>utc</function> ignored</tool_call>",
        "<tool_call>no function</tool_call>",
    ],
    "glm45": [
        'Sure.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>S\u00e3o "Paulo"</arg_value>\n'
        '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>where</arg_key>\n<arg_value>{"lat": -1.5}'
        '</arg_value>\n<arg_key>note</arg_key>\n<arg_value>[1, \'a\']</arg_value>\n</tool_call>\n'
        "<tool_call>get_time\n</tool_call>",
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n<arg_key>rain</arg_key>\n"
        "<arg_value>2.5",
        "<tool_call>get_time<arg_key>zone</arg_key><arg_value>utc</arg_value><arg_key>x</arg_key></tool_call> after",
        "<tool_call>two\nlines</tool_call>",
        "<tool_call></tool_call>",
    ],
    "minimax_m2": [
        'Sure.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">S\u00e3o "Paulo"</parameter>\n'
        '<parameter name=\'days\'>\n3\n</parameter>\n<parameter name="where">{"lat": -1.5}</parameter>\n<parameter '
        'name="rain">none</parameter>\n</invoke>\n<invoke name="get_time">\n</invoke>\n</minimax:tool_call>',
        '<minimax:tool_call><invoke name="get_weather"><parameter name="days">three</parameter><parameter name="rain">2.5',
        '<minimax:tool_call><invoke name="get_time"><parameter name="zone">utc</invoke> after</minimax:tool_call>',
        '<minimax:tool_call><invoke name="">x</invoke></minimax:tool_call>',
        "a <minimax:tool but no call",
    ],
    "deepseek_v3": [
        f'Checking.{DS_BEGIN}{DS_CALL}function{DS_SEP}get_weather\n```json\n{{"city": "Paris"}}\n```{DS_END}{DS_CALL}'
        f'function{DS_SEP}get_time\n```\n{{}}\n```{DS_END}<｜tool▁calls▁end｜>',
        f'{DS_BEGIN}{DS_CALL}get_weather{DS_SEP}{{"city":"Rome","days":[1,2]}}{DS_END}{DS_CALL}get_time{DS_SEP}{{}}'
        f'{DS_END}',
        f"ok {DS_BEGIN} nothing",
    ],
    "llama3_json": [
        ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        '<|python_tag|>{"name": "get_time", "arguments": {"zone": "utc"}}',
        '{"name": "get_time", "parameters": {}} ; \n{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "plain text, no call",
        '{"no": "call"}',
    ],
}
CASES = [(parser, text) for parser, texts in REPLIES.items() for text in texts]


def _whole(reply: ToolReply, text: str) -> dict:
    message, called = reply.message(text)
    calls = [{"id": c["id"], "type": "function", "function": c["function"]} for c in message.get("tool_calls", [])]
    return {"content": message["content"] or "", "calls": calls, "called": called}


def _joined(reply: ToolReply, text: str, seed: int) -> dict:
    stream = reply.stream()
    message = join_deltas(stream_of(stream, text, seed))
    return {"content": message["content"], "calls": message["tool_calls"], "called": stream.called}


def _same(got: dict, want: dict) -> None:
    assert got["content"] == want["content"] and got["called"] == want["called"]
    assert [c["function"] for c in got["calls"]] == [c["function"] for c in want["calls"]]


@pytest.mark.parametrize("parser, text", CASES)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_streamed_auto_reply_joins_to_its_whole_message(parser, text, parallel):
    reply = ToolReply("auto", TOOLS, PARSERS[parser](), parallel=parallel)
    want = _whole(reply, text)
    for seed in CUTS:
        _same(_joined(reply, text, seed), want)


@pytest.mark.parametrize("text", [
    '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, {"name": "get_time", "parameters": {}}]',
    '[{"parameters":{"zone":"utc"},"name":"get_time"}]',
    '[{"name": "get_time", "parameters": "x"}]',
])
def test_a_streamed_required_reply_joins_to_its_whole_message(text):
    reply = ToolReply("required", TOOLS)
    want = _whole(reply, text)
    assert want["calls"]
    for seed in CUTS:
        _same(_joined(reply, text, seed), want)


def test_each_call_goes_out_as_it_is_written():
    """hermes: the call's id and name once its name is written, its arguments as they come (in
    ``json.dumps``'s form), the first call whole before the second begins."""
    stream = ToolReply("auto", TOOLS, PARSERS["hermes"]()).stream()
    assert stream.delta('ok <tool_call>{"name": "get_wea', False) == {"content": "ok "}
    opened = stream.delta('ther", "arguments": {"city":"Par', False)
    [item] = opened["tool_calls"]
    assert item["index"] == 0 and item["function"] == {"name": "get_weather", "arguments": '{"city": "Par'}
    assert stream.delta('is"}}</tool_call><tool_call>{"name": "get_time"', False) == {"tool_calls": [
        {"index": 0, "function": {"arguments": 'is"}'}},
        {"index": 1, "id": stream._ids[1], "type": "function", "function": {"name": "get_time", "arguments": ""}}]}
    assert stream.called
    assert stream.delta("}</tool_call>", True) == {"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}]}


def test_qwen3_coder_sends_each_parameter_as_it_closes():
    stream = ToolReply("auto", TOOLS, PARSERS["qwen3_coder"]()).stream()
    assert stream.delta("<tool_call>\n<function=get_weather>\n<parameter=days>\n3", False)["tool_calls"] == [
        {"index": 0, "id": stream._ids[0], "type": "function", "function": {"name": "get_weather", "arguments": ""}}]
    assert stream.delta("\n</parameter>\n<parameter=city>\nRo", False) == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"days": 3'}}]}
    assert stream.delta("me\n</parameter>\n</function>", False) == {
        "tool_calls": [{"index": 0, "function": {"arguments": ', "city": "Rome"}'}}]}


def test_minimax_m2_sends_each_invoke_as_its_name_is_written_and_each_parameter_as_it_closes():
    stream = ToolReply("auto", TOOLS, PARSERS["minimax_m2"]()).stream()
    assert stream.delta('ok\n<minimax:tool_call>\n<invoke name="get_wea', False) == {"content": "ok\n"}
    assert stream.delta('ther">\n<parameter name="days">3', False)["tool_calls"] == [
        {"index": 0, "id": stream._ids[0], "type": "function", "function": {"name": "get_weather", "arguments": ""}}]
    assert stream.delta('</parameter>\n</invoke>\n<invoke name="get_time">', False) == {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"days": 3}'}},
        {"index": 1, "id": stream._ids[1], "type": "function", "function": {"name": "get_time", "arguments": ""}}]}


def test_a_required_reply_sends_its_first_call_before_the_array_closes():
    stream = ToolReply("required", TOOLS).stream()
    delta = stream.delta('[{"name": "get_time", "parameters": {"zone": "u', False)
    assert delta["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "u'}
    assert stream.called  # ("required": finish_reason "tool_calls", as vLLM and OpenAI answer)


def test_a_call_cut_short_streams_what_was_written_while_the_whole_reply_is_text():
    """The reply ended inside a call's JSON (max_tokens): the whole reply cannot read it and is
    text (vLLM's parsers answer so); the stream had sent its name and arguments as they came
    (vLLM's streams do too) and calls it a call."""
    text = '<tool_call>{"name": "get_time", "arguments": {"zone": "ut'
    reply = ToolReply("auto", TOOLS, PARSERS["hermes"]())
    assert _whole(reply, text) == {"content": text, "calls": [], "called": False}
    got = _joined(reply, text, -1)
    assert got["content"] == "" and got["called"]
    assert [c["function"] for c in got["calls"]] == [{"name": "get_time", "arguments": '{"zone": "ut'}]


def _json_values(rng: random.Random, depth: int = 0):
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([0, -12, 3.5, 1e21, True, False, None, "héllo", 'a"b\\c\n\t', "\U0001F600x", "\x01", "", "\ud83d"])
    if r < 0.65:
        keys = [rng.choice(["a", 'b"', "ключ", "\U0001F600"]) + str(i) for i in range(rng.randint(0, 3))]
        return {key: _json_values(rng, depth + 1) for key in keys}
    return [_json_values(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def test_json_tokens_write_each_value_as_json_dumps_does_wherever_it_is_cut():
    """Values written with every escape form, spacing and indent, fed at random cuts: the tokens'
    canonical pieces join to ``json.dumps(json.loads(text), ensure_ascii=False)``."""
    rng = random.Random(0)
    for _ in range(1500):
        value = _json_values(rng)
        text = json.dumps(value if isinstance(value, (dict, list)) else {"v": value}, ensure_ascii=rng.random() < 0.5,
                          indent=rng.choice([None, 2]), separators=rng.choice([None, (",", ":"), (" ,", " : ")]))
        tokens, out, at = JsonTokens(), [], 0
        while at < len(text):
            step = rng.randint(1, 6)
            got, used = tokens.feed(text[at:at + step], at + step >= len(text))
            assert used == len(text[at:at + step])
            out += [canonical(token) for token in got]
            at += step
        assert tokens.done and not tokens.failed
        assert "".join(out) == json.dumps(json.loads(text), ensure_ascii=False), text


def test_json_tokens_stop_where_the_value_ends_or_the_text_is_no_json():
    tokens = JsonTokens()
    got, used = tokens.feed('{"a": [1, "x"]} ; {"b": 2}')
    assert used == 15 and tokens.done and [t.depth for t in got if t.kind in "{}[]"] == [0, 1, 1, 0]
    assert tokens.feed("more") == ([], 0)
    scalar = JsonTokens()
    assert scalar.feed("12")[0] == [] and [t.text for t in scalar.feed("5", finished=True)[0]] == ["125"]
    for bad in ('{"a": tru x', '{"a": 1}]'[8:], '{"a": "x\ny"}', '{"a": 01x}', "{'a': 1}"):
        broken = JsonTokens()
        broken.feed(bad, finished=True)
        assert broken.failed and not broken.done, bad
