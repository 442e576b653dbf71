"""GPT-OSS's harmony replies through the OpenAI-compatible server and OpenAI's own client
(``--tool-call-parser openai``, which brings ``--reasoning-parser openai_gptoss``): a tiny model
whose tokenizer has harmony's special tokens, held by a grammar to a harmony reply, gets its
analysis back as ``reasoning``, its final message as content and its ``functions.NAME`` message as
a call, whole and streamed, with the tokens and logprobs ``LLM.chat`` gives (bitwise); the reply
is read from its special tokens whatever the request's ``skip_special_tokens``; the returned
message renders back through the chat template."""

import json
import subprocess
import sys
import urllib.request

import pytest

from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.openai_server import OpenAIServer
from vexact_models.runtime.structured_outputs import StructuredOutputsParams

from .llm_support import save_bpe_checkpoint

openai = pytest.importorskip("openai")  # (the main test environment has it; the older-transformers runs do not)
pytest.importorskip("xgrammar")

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")
#: harmony-like: tools in a developer message, an assistant's thinking in its analysis channel, its
#: calls to functions.NAME, tool results from functions.NAME; the reply opens "<|start|>assistant"
TEMPLATE = """{%- if tools %}<|start|>developer<|message|># Tools{% for t in tools %}
{{ t.function.name }}{% endfor %}<|end|>{% endif %}
{%- for m in messages %}{%- if m.role == 'assistant' %}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif %}
{%- for c in m.tool_calls or [] %}<|start|>assistant<|channel|>commentary to=functions.{{ c.function.name }} \
<|constrain|>json<|message|>{{ c.function.arguments | tojson }}<|call|>{% endfor %}
{%- if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}
{%- elif m.role == 'tool' %}<|start|>functions.{{ m.name }} to=assistant<|channel|>commentary<|message|>\
{{ m.content }}<|end|>
{%- else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>{% endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% if final_channel %}<|channel|>final<|message|>{% endif %}\
{% endif %}"""
CORPUS = ('analysis final commentary assistant to=functions get_weather json {"city": "Paris"} Rome yes no way '
          'user tool developer Tools')
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "weather in Paris?"}]
_E = r"\|"  # (a marker's bars, escaped for the regex)
THINK = f"<{_E}channel{_E}>analysis<{_E}message{_E}>(yes|no way)<{_E}end{_E}>"
# (each reply ends where GPT-OSS's does: at one of its EOS tokens, <|return|> or <|call|>)
CALL = (THINK + f"<{_E}start{_E}>assistant<{_E}channel{_E}>commentary to=functions\\.get_weather <{_E}constrain{_E}>json"
        f'<{_E}message{_E}>\\{{"city": "(Paris|Rome)"\\}}')
FINAL = THINK + f"<{_E}start{_E}>assistant<{_E}channel{_E}>final<{_E}message{_E}>(yes|no way)"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    # the markers follow the 300 trained tokens; <|return|> and <|call|> are the EOS tokens (GPT-OSS's generation config)
    eos = [300 + MARKERS.index("<|return|>"), 300 + MARKERS.index("<|call|>")]
    path = save_bpe_checkpoint(tmp_path_factory.mktemp("harmony"), eos=eos, corpus=CORPUS, special_tokens=MARKERS,
                               chat_template=TEMPLATE)
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(path).convert_ids_to_tokens(eos) == ["<|return|>", "<|call|>"]
    return path


@pytest.fixture(scope="module")
def reference(folder):
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def server(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 22, max_num_seqs=8)
    server = OpenAIServer(llm, "tiny", port=0, tool_call_parser="openai").start()
    yield server
    server.close()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)


def _chat(client, regex: str, seed: int, **kwargs):
    # (the regex holds the whole reply, its analysis included: a grammar would start after the reasoning)
    extra = {"return_token_ids": True, "structured_outputs": {"regex": regex, "after_reasoning": None},
             **kwargs.pop("extra_body", {})}
    return client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, temperature=1.0, seed=seed,
                                          max_tokens=200, extra_body=extra, **kwargs)


def _want(reference, regex: str, seed: int):
    """``LLM.chat``'s reply to the same request, decoded with its special tokens."""
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=seed, skip_special_tokens=False,
                            structured_outputs=StructuredOutputsParams(regex=regex))
    return reference.chat(MESSAGES, params, tools=TOOLS, use_tqdm=False)[0].outputs[0]


def _body(text: str) -> str:
    """A last message's body: the reply's text ends before the EOS token that ended it (left out of
    the text, as vLLM leaves it)."""
    assert not text.endswith(("<|return|>", "<|call|>")), text
    return text


def _streamed(client, regex: str, seed: int, **kwargs) -> tuple[str, str, list[dict], str]:
    """The reasoning, the content, the calls and the finish reason of a streamed reply."""
    reasoning, content, calls, finish = "", "", [], None
    for chunk in _chat(client, regex, seed, stream=True, **kwargs):
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            content += choice.delta.content or ""
            calls += [{"name": c.function.name, "arguments": c.function.arguments} for c in choice.delta.tool_calls or []]
            finish = choice.finish_reason or finish
    return reasoning, content, calls, finish


@pytest.mark.parametrize("seed", [0, 4])
def test_a_harmony_call_comes_back_as_reasoning_and_a_call(client, reference, seed):
    reply = _chat(client, CALL, seed, logprobs=True)
    choice, want = reply.choices[0], _want(reference, CALL, seed)
    assert choice.model_extra["token_ids"] == want.token_ids
    assert [t.logprob for t in choice.logprobs.content] == want.logprobs  # bitwise
    assert any(t in MARKERS for t in reference.tokenizer.convert_ids_to_tokens(want.token_ids))  # (special tokens sampled)
    thought = want.text.split("<|message|>")[1].split("<|end|>")[0]
    city = json.loads(_body(want.text.split("<|message|>")[2]))["city"]
    assert choice.message.model_extra["reasoning"] == thought and choice.message.content is None
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": city})
    assert choice.finish_reason == "tool_calls"
    assert _streamed(client, CALL, seed) == (thought, "", [{"name": "get_weather", "arguments": call.function.arguments}],
                                             "tool_calls")


def test_a_harmony_final_message_is_the_content_whatever_skip_special_tokens_says(client, reference):
    want = _want(reference, FINAL, 2)
    thought, answer = want.text.split("<|message|>")[1].split("<|end|>")[0], _body(want.text.split("<|message|>")[2])
    for skip in (True, False):
        choice = _chat(client, FINAL, 2, extra_body={"skip_special_tokens": skip}).choices[0]
        assert choice.model_extra["token_ids"] == want.token_ids
        assert (choice.message.model_extra["reasoning"], choice.message.content) == (thought, answer)
        assert not choice.message.tool_calls and choice.finish_reason == "stop"
    assert _streamed(client, FINAL, 2) == (thought, answer, [], "stop")
    quiet = _chat(client, FINAL, 2, extra_body={"include_reasoning": False}).choices[0].message
    assert "reasoning" not in quiet.model_extra and quiet.content == answer


def test_required_holds_the_final_message_to_json_calls(client, server):
    """"required" holds the reply to the calls' JSON once its final channel opened (its grammar
    starts after the reasoning): here the prompt opens it (a template option), so the grammar
    holds the reply from its first token, and the calls are read from the final message."""
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="required",
                                           max_tokens=300, seed=3, extra_body={
                                               "chat_template_kwargs": {"final_channel": True}, "return_token_ids": True})
    choice = reply.choices[0]
    assert server.llm.tokenizer.decode(choice.model_extra["prompt_token_ids"]).endswith(
        "<|start|>assistant<|channel|>final<|message|>")
    assert choice.finish_reason == "tool_calls" and choice.message.content == "" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)


def test_the_returned_message_renders_back_through_the_template(client, server):
    """The assistant message the server returned (reasoning and call) and the tool's result,
    rendered for the next turn: the reasoning in the analysis channel, the call to its function."""
    message = _chat(client, CALL, 0).choices[0].message
    turn = {"role": "assistant", "content": None, "reasoning": message.model_extra["reasoning"],
            "tool_calls": [c.model_dump() for c in message.tool_calls]}
    conversation = MESSAGES + [turn, {"role": "tool", "name": "get_weather", "tool_call_id": message.tool_calls[0].id,
                                      "content": "sunny"}]
    body = json.dumps({"model": "tiny", "messages": conversation, "tools": TOOLS}).encode()
    request = urllib.request.Request(server.url.removesuffix("/v1") + "/tokenize", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as answer:
        tokens = json.loads(answer.read())["tokens"]
    rendered = server.llm.tokenizer.decode(tokens)
    arguments = json.dumps(json.loads(message.tool_calls[0].function.arguments))
    assert (f"<|start|>assistant<|channel|>analysis<|message|>{turn['reasoning']}<|end|>"
            f"<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{arguments}"
            "<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>"
            "<|start|>assistant") in rendered


def test_vexact_serve_refuses_parsers_of_two_formats_before_loading(folder):
    result = subprocess.run([sys.executable, "-m", "vexact_models.cli", "serve", str(folder), "--device", "cpu",
                             "--tool-call-parser", "openai", "--reasoning-parser", "qwen3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "tool_call_parser='openai' and reasoning_parser='qwen3' read different formats" in result.stderr
