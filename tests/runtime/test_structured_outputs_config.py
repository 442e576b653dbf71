"""A server's structured-outputs defaults (``vexact serve --structured-outputs-config``,
`runtime.structured_outputs.StructuredOutputsConfig`), as vLLM's: ``disable_any_whitespace`` for
JSON schemas (the tools' of "required" and named calls included), ``enable_in_reasoning`` (the
grammar holds the reasoning too); a request's own ``structured_outputs`` keeps the fields it names;
bad configs are refused naming the field, by the server and by the command line."""

import argparse
import json

import pytest

from vexact_models.cli_args import dotted_json_args, structured_outputs_config_arg
from vexact_models.serve_cli import add_serve_parser
from vexact_models.runtime import LLM
from vexact_models.runtime.openai_protocol import read_chat, read_completion
from vexact_models.runtime.openai_server import OpenAIServer
from vexact_models.runtime.structured_outputs import StructuredOutputsConfig, StructuredOutputsParams

from .llm_support import save_bpe_checkpoint

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"enum": ["yes", "no"]}}, "required": ["x"], "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "x"}]


def _render(messages, **kwargs) -> list[int]:
    return [5]


def _spec(body: dict, config: dict | None, reasoning: str | None = None) -> StructuredOutputsParams:
    return read_chat(body, _render, 64, None, reasoning, StructuredOutputsConfig.of(config)).params[0].structured_outputs


def test_the_defaults_reach_the_tools_and_the_requests_json_schemas():
    required = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    assert _spec(required, None).disable_any_whitespace is False
    assert _spec(required, {"disable_any_whitespace": True}).disable_any_whitespace is True
    named = {**required, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    assert _spec(named, {"disable_any_whitespace": True}).disable_any_whitespace is True
    schema = {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}}
    assert _spec(schema, {"disable_any_whitespace": True}).disable_any_whitespace is True
    own = {"messages": MESSAGES, "structured_outputs": {"json": {"type": "object"}, "disable_any_whitespace": False}}
    assert _spec(own, {"disable_any_whitespace": True}).disable_any_whitespace is False  # (the request's own word)
    regex = {"messages": MESSAGES, "structured_outputs": {"regex": "a+"}}
    assert _spec(regex, {"disable_any_whitespace": True}).disable_any_whitespace is False  # (JSON schemas only)
    completion = read_completion({"prompt": [5], "structured_outputs": {"json": {"type": "object"}}}, None,
                                 StructuredOutputsConfig(disable_any_whitespace=True))
    assert completion.params[0].structured_outputs.disable_any_whitespace is True


def test_disable_any_whitespace_reaches_json_object_too():
    """vLLM compiles ``json_object`` as the schema ``{"type": "object"}`` under the server's
    whitespace setting: ``response_format: {"type": "json_object"}`` takes the default, unless the
    request's own ``structured_outputs`` names it."""
    fmt = {"messages": MESSAGES, "response_format": {"type": "json_object"}}
    assert _spec(fmt, {"disable_any_whitespace": True}).disable_any_whitespace is True
    assert _spec(fmt, None).disable_any_whitespace is False
    own = {"messages": MESSAGES, "structured_outputs": {"json_object": True, "disable_any_whitespace": False}}
    assert _spec(own, {"disable_any_whitespace": True}).disable_any_whitespace is False


def test_enable_in_reasoning_holds_the_reasoning_too():
    required = {"messages": MESSAGES, "tools": TOOLS, "tool_choice": "required"}
    assert _spec(required, None, "qwen3").after_reasoning == ("<think>", "</think>")
    assert _spec(required, {"enable_in_reasoning": True}, "qwen3").after_reasoning is None


@pytest.mark.parametrize("config, match", [
    ({"backend": "outlines"}, "backend='outlines' is not supported here"),
    ({"disable_additional_properties": True}, "disable_additional_properties=True is not supported"),
    ({"reasoning_parser": "qwen3"}, "give the server's reasoning parser as --reasoning-parser"),
    ({"whitespace": True}, "unknown field 'whitespace'"),
    ({"disable_any_whitespace": "yes"}, "disable_any_whitespace='yes' must be a bool"),
    ([True], "must be a dict of vLLM's fields"),
])
def test_bad_configs_are_refused_naming_the_field(config, match):
    with pytest.raises(ValueError, match=match):
        StructuredOutputsConfig.of(config)
    if isinstance(config, dict):
        with pytest.raises(argparse.ArgumentTypeError, match=match):
            structured_outputs_config_arg(json.dumps(config))


def test_the_command_lines_json():
    assert structured_outputs_config_arg('{"backend": "xgrammar", "disable_any_whitespace": true}') == \
        StructuredOutputsConfig(disable_any_whitespace=True)
    with pytest.raises(argparse.ArgumentTypeError, match="is not a JSON object"):
        structured_outputs_config_arg("{disable_any_whitespace}")


def test_vllms_dotted_form_merges_into_the_json():
    option = "--structured-outputs-config"
    assert dotted_json_args(["serve", "m", f"{option}.disable_any_whitespace", "true", f"{option}.backend=xgrammar",
                             "--port", "0"], option) == \
        ["serve", "m", "--port", "0", option, '{"disable_any_whitespace": true, "backend": "xgrammar"}']
    assert dotted_json_args([option, '{"backend": "auto", "enable_in_reasoning": true}', f"{option}.backend", "xgrammar",
                             f"{option}.disable_any_whitespace"], option) == \
        [option, '{"backend": "xgrammar", "enable_in_reasoning": true, "disable_any_whitespace": true}']
    assert dotted_json_args([f"{option}.a.b", "1", "--", f"{option}.c"], option) == \
        [option, '{"a": {"b": 1}}', "--", f"{option}.c"]
    plain = ["serve", "m", option, "{}"]
    assert dotted_json_args(plain, option) == plain
    assert dotted_json_args([option, "{bad", f"{option}.backend", "auto"], option) == \
        [option, "{bad", option, '{"backend": "auto"}']
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    args = parser.parse_args(dotted_json_args(["serve", "m", f"{option}.disable_any_whitespace=true"], option))
    assert args.structured_outputs_config == StructuredOutputsConfig(disable_any_whitespace=True)
    for bad, match in (([f"{option}.", "1"], "needs a key after each"),
                       ([f"{option}.a", "1", f"{option}.a.b", "2"], "was given a value")):
        with pytest.raises(ValueError, match=match):
            dotted_json_args(bad, option)


def test_vexact_serve_refuses_a_bad_dotted_field_before_loading_anything(capsys):
    from vexact_models.cli import main

    with pytest.raises(SystemExit) as exit_:
        main(["serve", "no-such/model", "--structured-outputs-config.backend", "outlines"])
    assert exit_.value.code == 2 and "structured_outputs_config.backend='outlines' is not supported" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "no-such/model", "--structured-outputs-config..x", "1"])
    assert exit_.value.code == 2 and "needs a key after each '.'" in capsys.readouterr().err


def test_a_server_without_whitespace_closes_its_required_calls_at_once(tmp_path):
    """A random model pads a JSON schema's output with whitespace when it may; under the server's
    ``disable_any_whitespace`` its "required" call is the bare JSON (single separators), within 80
    tokens for every seed tried."""
    openai = pytest.importorskip("openai")
    pytest.importorskip("xgrammar")
    template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant: "
    folder = save_bpe_checkpoint(tmp_path, chat_template=template)
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 22)
    server = OpenAIServer(llm, "tiny", port=0, structured_outputs_config={"disable_any_whitespace": True}).start()
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        for seed in range(3):
            reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                                   parallel_tool_calls=False, max_tokens=80, seed=seed,
                                                   extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice.message.content  # (cut short: "length", text)
            assert [c.function.name for c in choice.message.tool_calls] == ["f"]
            text = llm.tokenizer.decode(choice.model_extra["token_ids"], skip_special_tokens=True)
            assert not any(space in text for space in "\n\t\r"), text
    finally:
        server.close()
    with pytest.raises(ValueError, match="OpenAIServer: structured_outputs_config: unknown field 'x'"):
        OpenAIServer(llm, "tiny", structured_outputs_config={"x": True})
