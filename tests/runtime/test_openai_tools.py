"""Tool calls through the OpenAI-compatible server and OpenAI's own client (`runtime.openai_tools`):
a tiny model held by a grammar to a hermes or qwen3_coder call gets it read back as ``tool_calls``
(whole and streamed; after a think block split off by the reasoning parser), ``tool_choice``
"required" and named hold it to the tools' schemas, OpenAI's tool-call messages render through the
chat template, and the replies' tokens and logprobs stay the engine's (``LLM.chat``'s, bitwise)."""

import json

import pytest

from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.openai_server import OpenAIServer
from vexact_models.runtime.structured_outputs import StructuredOutputsParams

from .llm_support import save_bpe_checkpoint

openai = pytest.importorskip("openai")  # (the main test environment has it; the older-transformers runs do not)
ChatCompletionStreamState = pytest.importorskip("openai.lib.streaming.chat").ChatCompletionStreamState
pytest.importorskip("xgrammar")

#: Qwen-like: the tools in a system turn, assistant tool calls as hermes blocks, tool results as turns
TEMPLATE = """{%- if tools %}system: <tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
{% endif %}{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}assistant: {{ m.content or '' }}
{%- for c in m.tool_calls %}<tool_call>
{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}
</tool_call>{% endfor %}
{% elif m.role == 'tool' %}tool: {{ m.content }}
{% else %}{{ m.role }}: {{ m.content }}
{% endif %}{%- endfor %}{% if add_generation_prompt %}assistant: {% endif %}"""
CORPUS = ('{"name": "get_weather", "arguments": {"city": "Paris"}} yes no way <function=get_weather> <parameter=city> '
          'Paris </parameter> user assistant tool system')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
             "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                              "days": {"type": "integer"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
HERMES = '<tool_call>\n\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)"\\}\\}\n</tool_call>'
CODER = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n(Paris|Rome)\n</parameter>\n<parameter=days>\n"
         "[1-9]\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_bpe_checkpoint(tmp_path_factory.mktemp("tools"), corpus=CORPUS, added_tokens=("<tool_call>", "</tool_call>"),
                               chat_template=TEMPLATE)


def _serve(folder, parser, reasoning=None, chat_template=None):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 22, max_num_seqs=8)
    return OpenAIServer(llm, "tiny", port=0, tool_call_parser=parser, reasoning_parser=reasoning,
                        chat_template=chat_template).start()


@pytest.fixture(scope="module")
def hermes(folder):
    server = _serve(folder, "hermes")
    yield openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    server.close()


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 22)


def _chat(client, **kwargs):
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0,
                                          extra_body={"return_token_ids": True, **kwargs.pop("extra_body", {})},
                                          **kwargs)


def _streamed(client, **kwargs) -> tuple[str, dict[int, dict], str, int]:
    """The content, the calls (by index: id, name, arguments), the finish reason of a streamed
    reply, as OpenAI's own stream accumulator (``ChatCompletionStreamState``) joins its chunks, and
    how many chunks carried a piece of the calls' arguments."""
    state, pieces = ChatCompletionStreamState(), 0
    for chunk in _chat(client, stream=True, **kwargs):
        state.handle_chunk(chunk)
        pieces += sum(bool(call.function and call.function.arguments) for choice in chunk.choices
                      for call in choice.delta.tool_calls or [])
    [choice] = state.get_final_completion().choices
    calls = {i: {"id": call.id, "name": call.function.name, "arguments": call.function.arguments}
             for i, call in enumerate(choice.message.tool_calls or [])}
    return choice.message.content or "", calls, choice.finish_reason, pieces


@pytest.mark.parametrize("seed, head", [(0, ""), (5, "no way ")])
def test_auto_reads_the_hermes_call_the_model_wrote(hermes, reference, seed, head):
    """The model writes the call (a regex holds it to the format, after `head`); the server
    returns it as a call, the text before it as content, "tool_calls" as the finish reason, and
    the tokens and logprobs ``LLM.chat`` gives the same request."""
    regex = head + HERMES
    extra = {"structured_outputs": {"regex": regex}}
    reply = _chat(hermes, max_tokens=80, seed=seed, logprobs=True, extra_body=extra)
    choice = reply.choices[0]
    want = reference.chat(MESSAGES, SamplingParams(temperature=1.0, max_tokens=80, seed=seed,
                                                   structured_outputs=StructuredOutputsParams(regex=regex)),
                          tools=TOOLS, use_tqdm=False)[0].outputs[0]
    assert choice.model_extra["token_ids"] == want.token_ids
    assert [t.logprob for t in choice.logprobs.content] == want.logprobs  # bitwise
    assert choice.finish_reason == "tool_calls"
    assert want.text.startswith(head + "<tool_call>")
    call = want.text.split("<tool_call>")[1]
    assert choice.message.content == (head or None)
    city = json.loads(call.split("\n")[1])["arguments"]["city"]
    [got] = choice.message.tool_calls
    assert got.type == "function" and got.id.startswith("chatcmpl-tool-")
    assert (got.function.name, json.loads(got.function.arguments)) == ("get_weather", {"city": city})
    content, calls, finish, pieces = _streamed(hermes, max_tokens=80, seed=seed, extra_body=extra)
    assert (content or None, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", got.function.arguments)]
    assert pieces > 1  # (the arguments came as the model wrote them, over several chunks)


def test_auto_reply_without_a_call_is_text(hermes):
    reply = _chat(hermes, max_tokens=8, seed=1, extra_body={"structured_outputs": {"choice": ["yes", "no way"]}})
    choice = reply.choices[0]
    assert choice.message.content in ("yes", "no way") and not choice.message.tool_calls
    assert choice.finish_reason == "stop"


def test_qwen3_coder_calls_get_their_schema_types(folder):
    server = _serve(folder, "qwen3_coder")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        reply = _chat(client, max_tokens=80, seed=2, extra_body={"structured_outputs": {"regex": CODER}})
        [call] = reply.choices[0].message.tool_calls
        arguments = json.loads(call.function.arguments)
        assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
        assert isinstance(arguments["days"], int) and reply.choices[0].finish_reason == "tool_calls"
    finally:
        server.close()


def test_reasoning_is_split_off_before_the_calls_are_read(folder, reference):
    """``--reasoning-parser qwen3``: the think block comes back as ``reasoning``, the call after it
    as a call, whole and streamed; the tokens are ``LLM.chat``'s."""
    server = _serve(folder, "hermes", "qwen3")
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        regex = "<think>(yes|no way)</think>" + HERMES
        whole = {"structured_outputs": {"regex": regex, "after_reasoning": None}}  # (the regex holds the think block too)
        reply = _chat(client, max_tokens=80, seed=6, extra_body=whole)
        choice = reply.choices[0]
        want = reference.chat(MESSAGES, SamplingParams(temperature=1.0, max_tokens=80, seed=6,
                                                       structured_outputs=StructuredOutputsParams(regex=regex)),
                              tools=TOOLS, use_tqdm=False)[0].outputs[0]
        assert choice.model_extra["token_ids"] == want.token_ids
        thought = want.text.split("</think>")[0].removeprefix("<think>")
        assert choice.message.model_extra["reasoning"] == thought and choice.message.content is None
        assert choice.message.tool_calls[0].function.name == "get_weather" and choice.finish_reason == "tool_calls"
        chunks = list(_chat(client, max_tokens=80, seed=6, stream=True, extra_body=whole))
        assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks) == thought
        plain = _chat(client, max_tokens=80, seed=6, extra_body={**whole, "include_reasoning": False})
        assert "reasoning" not in plain.choices[0].message.model_extra
    finally:
        server.close()


@pytest.mark.parametrize("parallel", [False, True])
def test_required_holds_the_reply_to_calls_of_the_tools(hermes, parallel):
    reply = _chat(hermes, tool_choice="required", parallel_tool_calls=parallel, max_tokens=300, seed=3)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""  # (vLLM's, OpenAI's)
    assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
    for call in choice.message.tool_calls:
        arguments = json.loads(call.function.arguments)
        if call.function.name == "get_time":
            assert set(arguments) == {"zone"} and arguments["zone"] in ("utc", "cet")
        else:
            assert call.function.name == "get_weather" and arguments["city"] in ("Paris", "Rome")
    _, calls, finish, pieces = _streamed(hermes, tool_choice="required", parallel_tool_calls=parallel, max_tokens=300,
                                         seed=3)
    assert finish == "tool_calls" and pieces > len(calls)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_named_function_is_the_reply(hermes):
    choice = {"type": "function", "function": {"name": "get_time"}}
    reply = _chat(hermes, tool_choice=choice, max_tokens=60, seed=4)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("utc", "cet")
    assert reply.choices[0].message.content == "" and reply.choices[0].finish_reason == "stop"
    tokens = reply.choices[0].model_extra["token_ids"]
    _, calls, finish, _ = _streamed(hermes, tool_choice=choice, max_tokens=60, seed=4)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_time", call.function.arguments)]
    assert calls[0]["id"].startswith("chatcmpl-tool-") and finish == "stop" and tokens


def test_each_streamed_sample_has_its_own_call(hermes):
    """``n: 2`` streamed: each choice's chunks carry its own call (index 0 within the choice), the
    same as the whole reply's."""
    choice = {"type": "function", "function": {"name": "get_time"}}
    whole = _chat(hermes, tool_choice=choice, max_tokens=60, seed=9, n=2)
    calls: dict[int, str] = {}
    for chunk in _chat(hermes, tool_choice=choice, max_tokens=60, seed=9, n=2, stream=True):
        for c in chunk.choices:
            for call in c.delta.tool_calls or []:
                assert call.index == 0
                calls[c.index] = calls.get(c.index, "") + (call.function.arguments or "")
    assert calls == {c.index: c.message.tool_calls[0].function.arguments for c in whole.choices}


def test_tool_call_messages_render_with_their_arguments_as_objects(hermes, folder):
    """A conversation with an assistant's call (OpenAI's JSON-text arguments, no content) and the
    tool's answer: the prompt is the template's rendering of the arguments as an object."""
    from transformers import AutoTokenizer

    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    messages = MESSAGES + [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1",
                                                                        "content": "sunny"}]
    reply = hermes.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, max_tokens=2, seed=0,
                                           extra_body={"return_token_ids": True, "ignore_eos": True})
    tokenizer = AutoTokenizer.from_pretrained(folder)
    decoded = [{**m, "tool_calls": [{**call, "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]}
               if m.get("tool_calls") else m for m in messages]
    text = tokenizer.apply_chat_template(decoded, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '"arguments": {"city": "Rome"}' in text
    assert reply.choices[0].model_extra["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_bad_tool_requests_get_errors_naming_the_field(hermes, folder):
    cases = [(dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
             (dict(tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
             (dict(parallel_tool_calls="yes"), "parallel_tool_calls"),
             (dict(tools=[{"type": "function", "function": {"description": "no name"}}]), "tools"),
             (dict(tool_choice={"type": "function", "function": "get_time"}), "tool_choice"),
             (dict(tool_choice={"type": "function", "function": {"name": "get_time"}},
                   tools=[{"type": "function", "function": {"name": "get_time", "parameters": "zone"}}]), "tools")]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            hermes.chat.completions.create(**{"model": "tiny", "messages": MESSAGES, "tools": TOOLS, **kwargs})
        assert err.value.body["param"] == field
    plain = _serve(folder, None)  # no parser: "auto" is refused, no tool_choice answers text
    try:
        client = openai.OpenAI(base_url=plain.url, api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
            _chat(client, tool_choice="auto", max_tokens=4)
        reply = _chat(client, max_tokens=40, seed=0, extra_body={"structured_outputs": {"regex": HERMES}})
        assert reply.choices[0].message.tool_calls is None and "<tool_call>" in reply.choices[0].message.content
    finally:
        plain.close()


def test_a_server_chat_template_replaces_the_tokenizers(folder):
    """``chat_template`` (``vexact serve --chat-template``): chats render with it, not with the
    checkpoint's own (for checkpoints whose template renders no tools)."""
    from transformers import AutoTokenizer

    template = "tools: {{ tools | length }}\n" + TEMPLATE
    server = _serve(folder, "hermes", chat_template=template)
    try:
        client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
        reply = _chat(client, max_tokens=2, seed=0, extra_body={"ignore_eos": True})
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=template, tokenize=False,
                                             add_generation_prompt=True)
        assert text.startswith("tools: 2system: ")  # ({%- strips the newline)
        assert reply.choices[0].model_extra["prompt_token_ids"] == tokenizer(text, add_special_tokens=False)["input_ids"]
    finally:
        server.close()
    with pytest.raises(ValueError, match="chat_template must be a Jinja template string"):
        OpenAIServer(LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20), "tiny", chat_template=3)


def test_server_refuses_an_unknown_parser(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="tool_call_parser='mistral' is not one of"):
        OpenAIServer(llm, "tiny", tool_call_parser="mistral")
    with pytest.raises(ValueError, match="reasoning_parser='r1' is not one of"):
        OpenAIServer(llm, "tiny", reasoning_parser="r1")
