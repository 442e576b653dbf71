"""Tool calls read out of chat replies (`runtime.tool_calls`: vLLM's ``hermes``, ``qwen3_coder``,
``glm45``, ``deepseek_v3``, ``llama3_json`` and ``minimax_m2`` formats) and a chat request's tools
(`runtime.openai_tools`: ``tools``, ``tool_choice``, ``parallel_tool_calls``; the replies' messages,
whole and streamed)."""

import json

import pytest

from vexact_models.runtime.llm_chat import render_text
from vexact_models.runtime.openai_protocol import ProtocolError
from vexact_models.runtime.openai_tools import ToolReply, read_tools
from vexact_models.runtime.tool_calls import PARSERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "rain": {"type": "number"},
                                     "metric": {"type": "boolean"}, "where": {"type": "object"}, "hours": {"type": "array"}},
    "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TOOLS = [WEATHER, TIME]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_reads_the_content_before_the_calls_and_each_call():
    text = ('Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    content, calls = PARSERS["hermes"]().extract(text, TOOLS)
    assert content == "Let me look. "
    assert _calls(calls) == [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    assert all(c.id.startswith("chatcmpl-tool-") for c in calls) and calls[0].id != calls[1].id


def test_hermes_reads_a_call_the_reply_ended_inside_and_gives_text_it_cannot_read_back_whole():
    parser = PARSERS["hermes"]()
    content, calls = parser.extract('<tool_call>{"name": "get_time", "arguments": {"zone": "utc"}}', TOOLS)
    assert content is None and _calls(calls) == [("get_time", {"zone": "utc"})]
    for text in ("no calls here", 'x <tool_call>{"name": "get_time", "argu', "<tool_call>[1, 2]</tool_call>"):
        assert parser.extract(text, TOOLS) == (text, [])


def test_qwen3_coder_reads_each_parameter_as_its_schema_types_it():
    text = ("Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco, CA\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=rain>\n0.5\n</parameter>\n<parameter=metric>\nTrue\n"
            "</parameter>\n<parameter=where>\n{\"lat\": 1}\n</parameter>\n<parameter=hours>\n[1, 2]\n</parameter>\n"
            "<parameter=note>\nline one\nline two\n</parameter>\n</function>\n</tool_call>")
    content, calls = PARSERS["qwen3_coder"]().extract(text, TOOLS)
    assert content == "Sure.\n"
    assert _calls(calls) == [("get_weather", {"city": "San Francisco, CA", "days": 3, "rain": 0.5, "metric": True,
                                              "where": {"lat": 1}, "hours": [1, 2], "note": "line one\nline two"})]


def test_qwen3_coder_keeps_text_that_does_not_read_as_its_type_and_reads_unclosed_tags():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=city>\nnull\n"
            "<parameter=rain>\n2")
    content, calls = PARSERS["qwen3_coder"]().extract(text, TOOLS)
    assert content is None and _calls(calls) == [("get_weather", {"days": "three", "city": None, "rain": 2})]
    assert PARSERS["qwen3_coder"]().extract("<tool_call>no function</tool_call>", TOOLS) == (
        "<tool_call>no function</tool_call>", [])


def test_deepseek_reads_v3_and_v31_calls():
    v3 = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
          '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```'
          '<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    content, calls = PARSERS["deepseek_v3"]().extract(v3, TOOLS)
    assert content == "Checking." and _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    v31 = '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Rome"}<｜tool▁call▁end｜>'
    assert _calls(PARSERS["deepseek_v31"]().extract(v31, TOOLS)[1]) == [("get_weather", {"city": "Rome"})]
    bad = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n{}<｜tool▁call▁end｜>"
    assert PARSERS["deepseek_v3"]().extract(bad, TOOLS) == (bad, [])
    empty = "ok <｜tool▁calls▁begin｜> nothing"  # the calls opened, none written: all content
    assert PARSERS["deepseek_v3"]().extract(empty, TOOLS) == (empty, [])


def test_llama3_json_reads_a_reply_that_is_calls():
    parser = PARSERS["llama3_json"]()
    text = ' {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}'
    content, calls = parser.extract(text, TOOLS)
    assert content == " " and _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert _calls(parser.extract('<|python_tag|>{"name": "get_time", "arguments": {}}', TOOLS)[1]) == [("get_time", {})]
    for plain in ("The weather is fine.", '{"not": "a call"}', "Use {braces} later", '{"name": 3}; [1]'):
        assert parser.extract(plain, TOOLS) == (plain, [])


def test_replies_whole_messages_by_tool_choice():
    auto = ToolReply("auto", TOOLS, PARSERS["hermes"]())
    text = 'ok <tool_call>{"name": "get_time", "arguments": {}}</tool_call><tool_call>{"name": "get_time"}</tool_call>'
    message, called = auto.message(text)
    assert called and message["content"] == "ok " and len(message["tool_calls"]) == 2
    assert message["tool_calls"][0]["type"] == "function" and message["tool_calls"][0]["function"]["name"] == "get_time"
    single = ToolReply("auto", TOOLS, PARSERS["hermes"](), parallel=False).message(text)[0]
    assert len(single["tool_calls"]) == 1
    assert auto.message("plain text") == ({"role": "assistant", "content": "plain text"}, False)
    required = ToolReply("required", TOOLS)
    message, called = required.message('[{"name": "get_time", "parameters": {"zone": "cet"}}]')
    assert called and message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == '{"zone": "cet"}'
    assert required.message('[{"name": "get_ti') == ({"role": "assistant", "content": '[{"name": "get_ti'}, False)
    named = ToolReply("named", TOOLS, name="get_weather")
    message, called = named.message('{"city": "Rome"}')
    assert not called and message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_required_and_named_hold_the_reply_to_the_tools_schemas():
    schema = ToolReply("required", TOOLS).structured().json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][0]["properties"]["parameters"] == WEATHER["function"]["parameters"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert ToolReply("required", TOOLS, parallel=False).structured().json["maxItems"] == 1
    assert ToolReply("named", TOOLS, name="get_weather").structured().json == WEATHER["function"]["parameters"]
    assert ToolReply("auto", TOOLS, PARSERS["hermes"]()).structured() is None


def test_streamed_named_and_required_replies():
    named = ToolReply("named", TOOLS, name="get_time").stream()
    first, second = named.delta('{"zone"', False), named.delta(': "utc"}', True)
    assert first == {"tool_calls": [{"index": 0, "id": named.call_id, "type": "function",
                                     "function": {"name": "get_time", "arguments": '{"zone"'}}]}
    assert second == {"tool_calls": [{"index": 0, "function": {"arguments": ': "utc"}'}}]}
    required = ToolReply("required", TOOLS).stream()
    assert required.delta('[{"name": "get_', False) == {}
    first = required.delta('time", "parameters": {', False)
    assert [c["function"] for c in first["tool_calls"]] == [{"name": "get_time", "arguments": "{"}]
    assert required.delta("}}]", True) == {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]}
    assert required.called


def test_read_tools_by_tool_choice_and_its_errors():
    body = {"tools": TOOLS}
    assert read_tools(body, None) is None  # no parser: the reply is text
    assert read_tools(body, "hermes").mode == "auto"
    assert read_tools({**body, "tool_choice": "none"}, "hermes") is None
    assert read_tools({**body, "tool_choice": "required", "parallel_tool_calls": False}, None).parallel is False
    named = read_tools({**body, "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, None)
    assert (named.mode, named.name) == ("named", "get_time")
    bad = [({"tools": [{"type": "function", "function": {}}]}, "tools"),
           ({"tools": "x"}, "tools"),
           ({"tool_choice": "required"}, "tool_choice"),
           ({**body, "tool_choice": "auto"}, "tool_choice"),  # no parser
           ({**body, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({**body, "tool_choice": "sometimes"}, "tool_choice"),
           ({**body, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
           ({**body, "tool_choice": "required", "structured_outputs": {"regex": "a"}}, "tool_choice"),
           ({**body, "parallel_tool_calls": "yes"}, "parallel_tool_calls")]
    for case, field in bad:
        with pytest.raises(ProtocolError) as err:
            read_tools(case, None)
        assert err.value.param == field
    with pytest.raises(ProtocolError, match="--tool-call-parser"):
        read_tools({**body, "tool_choice": "auto"}, None)


def test_chat_rendering_takes_openai_tool_call_messages():
    """An assistant message may carry only ``tool_calls``; their JSON-text arguments reach the
    template as objects (templates write them with ``tojson``), a returned ``reasoning`` as the
    ``reasoning_content`` templates read (and GPT-OSS's ``thinking``), the caller's messages unchanged."""

    class Template:
        def apply_chat_template(self, messages, **kwargs):
            return json.dumps(messages)

    call = {"id": "c1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "utc"}'}}
    messages = [{"role": "user", "content": "time?"}, {"role": "assistant", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    rendered = json.loads(render_text(Template(), messages, None, True, False, None, {}, "LLM.chat", "conversation 0"))
    assert rendered[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "utc"}
    assert "reasoning_content" not in rendered[1]
    thought = [{**messages[1], "reasoning": "look it up"}, {"role": "assistant", "content": "x", "reasoning": "a",
                                                            "reasoning_content": "b"}]
    rendered = json.loads(render_text(Template(), thought, None, True, False, None, {}, "LLM.chat", "conversation 0"))
    assert rendered[0]["reasoning_content"] == "look it up" and rendered[1]["reasoning_content"] == "b"
    assert rendered[0]["thinking"] == "look it up" and rendered[1]["thinking"] == "b"
    own = [{"role": "assistant", "content": "x", "reasoning": "a", "thinking": "c"}]
    assert json.loads(render_text(Template(), own, None, True, False, None, {}, "LLM.chat", "conversation 0"))[0][
        "thinking"] == "c"  # (a message's own thinking stays)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"zone": "utc"}'
    with pytest.raises(ValueError, match="'content' \\(or 'tool_calls'\\)"):
        render_text(Template(), [{"role": "assistant"}], None, True, False, None, {}, "LLM.chat", "conversation 0")


def test_glm45_reads_names_and_each_argument_by_its_schema_as_vllm_does():
    """A string-typed argument keeps its text ("42" stays a string); any other is read as JSON, else
    as a Python literal, else kept as text; a key without a value is dropped; the reply may end
    inside a value; a block with no name, or a name over two lines, leaves the reply text."""
    parser = PARSERS["glm45"]()
    text = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>42</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n<arg_key>note</arg_key>\n<arg_value>[1, 'a']</arg_value>\n"
            "<arg_key>free</arg_key>\n<arg_value>plain words</arg_value>\n<arg_key>where</arg_key><arg_value>"
            '{"lat": 1}</arg_value><arg_key>lost</arg_key></tool_call><tool_call>get_time\n</tool_call>')
    content, calls = parser.extract(text, TOOLS)
    assert content == "Checking."
    assert _calls(calls) == [("get_weather", {"city": "42", "days": 3, "note": [1, "a"], "free": "plain words",
                                              "where": {"lat": 1}}), ("get_time", {})]
    _, calls = parser.extract("<tool_call>get_weather<arg_key>rain</arg_key><arg_value>2.5", TOOLS)
    assert _calls(calls) == [("get_weather", {"rain": 2.5})]
    for bad in ("<tool_call></tool_call>", "<tool_call>get\ntime</tool_call>"):
        assert parser.extract(bad, TOOLS) == (bad, [])


def test_minimax_m2_reads_each_invoke_and_types_its_parameters_as_vllm_does():
    """Several invokes in one block and blocks one after another; names quoted either way; values
    stripped and typed (integer, number, boolean words, JSON objects; null words; text where the
    schema says string or nothing); the reply may end inside a value; an invoke with no name leaves
    the reply text."""
    parser = PARSERS["minimax_m2"]()
    text = ('Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">\nRome\n</parameter>\n'
            '<parameter name="days">3</parameter>\n<parameter name=\'rain\'>2.0</parameter>\n<parameter name="metric">'
            'yes</parameter>\n<parameter name="where">{"lat": 1}</parameter>\n<parameter name="hours">nil</parameter>\n'
            '<parameter name="note">[1, 2]</parameter>\n</invoke>\n<invoke name=\'get_time\'>\n</invoke>\n'
            '</minimax:tool_call>\n<minimax:tool_call><invoke name="get_time"><parameter name="zone">utc</parameter>'
            '</invoke></minimax:tool_call>')
    content, calls = parser.extract(text, TOOLS)
    assert content == "Let me check.\n"
    assert _calls(calls) == [("get_weather", {"city": "Rome", "days": 3, "rain": 2, "metric": True, "where": {"lat": 1},
                                              "hours": None, "note": "[1, 2]"}), ("get_time", {}),
                             ("get_time", {"zone": "utc"})]
    _, calls = parser.extract('<minimax:tool_call><invoke name="get_weather"><parameter name="days">three</parameter>'
                              '<parameter name="rain">1.5', TOOLS)
    assert _calls(calls) == [("get_weather", {"days": "three", "rain": 1.5})]
    for bad in ('<minimax:tool_call><invoke name="">x</invoke>', "no <minimax:tool_call> calls"):
        assert parser.extract(bad, TOOLS) == (bad, [])


def test_minimax_values_follow_the_types_a_schema_allows():
    from vexact_models.runtime.tool_arguments import minimax_value, schema_types

    assert schema_types(None) == schema_types({"description": "x"}) == {"string"}
    assert schema_types({"type": ["Integer", "null"], "enum": [True, 1.5, "a", None, [1], {}],
                         "anyOf": [{"type": "object"}, {"oneOf": [{"$ref": "#/x"}]}]}) == {
        "integer", "null", "boolean", "number", "string", "array", "object"}
    number_or_text = {"anyOf": [{"type": "number"}, {"type": "string"}]}
    assert [minimax_value(v, number_or_text) for v in (" 4.0 ", "1e400", "abc", "None")] == [4, "1e400", "abc", None]
    assert [minimax_value(v, {"type": "boolean"}) for v in ("ON", "0", "maybe")] == [True, False, "maybe"]
    assert [minimax_value(v, {"type": "integer"}) for v in ("7", "7.5", "[1]")] == [7, 7.5, [1]]  # (else: JSON, else text)
    assert minimax_value('{"a": 1}', {"enum": [[1], [2]]}) == {"a": 1} and minimax_value("{x", {"type": "array"}) == "{x"
