"""The OpenAI-compatible server's HTTP behaviour (`runtime.openai_http`), beside vLLM's server:
every request gets an answer (a 400 naming the field for a body the handlers cannot read, never
a dropped connection, which OpenAI's client would send again), a keep-alive connection serves
its next request after an error, a client that goes away before its whole answer has its
requests aborted, a prompt and ``max_tokens`` that cannot fit the context are refused rather than
cut short, and a stream that fails still ends with ``[DONE]``."""

import http.client
import json
import socket
import time

import pytest
import torch

from vexact_models.runtime import LLM
from vexact_models.runtime.openai_server import OpenAIServer

from .llm_support import save_chat_checkpoint

openai = pytest.importorskip("openai")  # (the main test environment has it; the older-transformers runs do not)

#: a template that refuses a conversation without a user message, as Qwen3's does
TEMPLATE = ("{% if messages | selectattr('role', 'equalto', 'user') | list | length == 0 %}"
            "{{ raise_exception('No user query found in messages.') }}{% endif %}"
            "{{ bos_token }}{% for m in messages %}w10 w{{ m['content'] }} {% endfor %}w11")
USER = [{"role": "user", "content": "5"}]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp("http"), TEMPLATE)


def _engine(folder) -> LLM:
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=8,
               max_num_batched_tokens=32, max_model_len=64)


@pytest.fixture(scope="module")
def served(folder):
    llm = _engine(folder)
    server = OpenAIServer(llm, "tiny", port=0).start()
    yield llm, server
    server.close()


def _connection(server) -> http.client.HTTPConnection:
    host, port = server.url.removeprefix("http://").split("/")[0].split(":")
    return http.client.HTTPConnection(host, int(port), timeout=30)


def _post(connection: http.client.HTTPConnection, path: str, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, data, {"Content-Type": "application/json"})
    reply = connection.getresponse()
    return reply.status, json.loads(reply.read())


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "5"}]}, "messages"),  # raise_exception
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": "x"}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": USER, "structured_outputs": {"json": {}, "bogus": 1}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "w5", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/tokenize", {"messages": USER, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ("/v1/completions", {"prompt": "w5", "guided_json": {}, "structured_outputs": {"regex": "a"}}, "guided_json"),
    ("/v1/chat/completions", {"messages": USER, "use_beam_search": True}, "use_beam_search"),
])
def test_bad_bodies_get_a_400_naming_the_field_on_a_connection_that_serves_on(served, path, body, param):
    _, server = served
    connection = _connection(server)
    code, answer = _post(connection, path, body)
    assert code == 400 and answer["error"]["param"] == param, answer
    code, answer = _post(connection, "/v1/completions", {"prompt": "w5", "max_tokens": 2})  # the same connection
    assert code == 200 and answer["usage"]["completion_tokens"] == 2


def test_an_unknown_route_or_a_bad_body_leaves_the_connection_serving(served):
    """The body is read before any answer, so the connection's next request starts where it should
    (OpenAI's client keeps its connections alive)."""
    _, server = served
    connection = _connection(server)
    assert _post(connection, "/v1/embeddings", {"model": "tiny", "input": "w5 w6"})[0] == 404
    assert _post(connection, "/v1/completions", b"{not json")[0] == 400
    code, answer = _post(connection, "/v1/completions", {"prompt": "w5", "max_tokens": 3})
    assert code == 200 and answer["usage"]["completion_tokens"] == 3
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="tiny", input="w5")
    assert len(client.completions.create(model="tiny", prompt="w5", max_tokens=2).choices[0].text.split()) <= 2


def test_max_tokens_past_the_context_is_refused_as_vllm_does(served):
    llm, server = served
    connection = _connection(server)
    for path, body in [("/v1/completions", {"prompt": "w5 w6", "max_tokens": 63}),
                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 61}),  # 4 prompt tokens
                       ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 61})]:
        code, answer = _post(connection, path, body)
        assert code == 400 and answer["error"]["param"] == "max_tokens"
        assert f"maximum context length is {llm.max_model_len} tokens" in answer["error"]["message"]
    code, answer = _post(connection, "/v1/completions", {"prompt": "w5 w6", "max_tokens": 62, "ignore_eos": True})
    assert code == 200 and answer["usage"]["completion_tokens"] == 62  # exactly the context: fits
    code, answer = _post(connection, "/v1/completions", {"prompt": " ".join(["w5"] * 60)})  # + the default 16
    assert code == 400 and answer["error"]["param"] == "max_tokens"
    code, answer = _post(connection, "/v1/chat/completions", {"messages": USER, "ignore_eos": True})
    assert code == 200 and answer["usage"]["total_tokens"] == llm.max_model_len  # no max_tokens: up to the context


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens_before_the_context_check(served):
    """vLLM's field: the prompt's last k tokens (-1: as many as the engine takes) are the request's,
    in its usage and in the context check; a k above max_model_len or not -1 / >= 1 is a 400."""
    llm, server = served
    connection = _connection(server)
    long = [5 + i % 40 for i in range(100)]  # token ids past the context (64)
    code, answer = _post(connection, "/v1/completions", {"prompt": long, "max_tokens": 4, "truncate_prompt_tokens": 10,
                                                         "return_token_ids": True, "temperature": 0})
    assert code == 200 and answer["usage"]["prompt_tokens"] == 10
    assert answer["choices"][0]["prompt_token_ids"] == long[-10:]
    code, cut = _post(connection, "/v1/completions", {"prompt": long[-10:], "max_tokens": 4, "return_token_ids": True,
                                                      "temperature": 0})
    assert answer["choices"][0]["token_ids"] == cut["choices"][0]["token_ids"]  # as if only those were sent
    code, answer = _post(connection, "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "ignore_eos": True,
                                                              "truncate_prompt_tokens": 3})
    assert code == 200 and answer["usage"]["prompt_tokens"] == 3
    code, answer = _post(connection, "/v1/completions", {"prompt": long, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert code == 200 and answer["usage"]["prompt_tokens"] == llm.max_model_len - 1
    for k, words in [(65, "greater than max_model_len (64)"), (0, "must be -1 or an integer >= 1"), (True, "got True")]:
        code, answer = _post(connection, "/v1/completions", {"prompt": long, "truncate_prompt_tokens": k})
        assert code == 400 and answer["error"]["param"] == "truncate_prompt_tokens" and words in answer["error"]["message"]


def test_a_client_that_goes_away_before_a_whole_answer_has_its_request_aborted(served, monkeypatch):
    """Not streamed: the handler, waiting for the whole answer, sees the connection closed and
    aborts its requests, as vLLM does (each step slowed here, so that the request alone would run
    for seconds more)."""
    llm, server = served
    step = llm.step
    monkeypatch.setattr(llm, "step", lambda: (time.sleep(0.1), step())[1])
    body = json.dumps({"prompt": "w5 w6", "max_tokens": 60, "ignore_eos": True, "n": 4}).encode()
    host, port = server.url.removeprefix("http://").split("/")[0].split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        for _ in range(200):
            if llm.has_unfinished_requests():
                break
            time.sleep(0.01)
        assert llm.has_unfinished_requests()
        began = time.monotonic()
    for _ in range(300):  # (60 steps of 100 ms alone would take 6 s)
        if not llm.has_unfinished_requests():
            break
        time.sleep(0.01)
    assert not llm.has_unfinished_requests() and time.monotonic() - began < 3


def test_a_stream_the_engine_fails_ends_with_an_error_event_and_done(folder):
    llm = _engine(folder)
    weight = llm.model.causal_lm.lm_head.weight
    server = OpenAIServer(llm, "tiny", port=0).start()
    try:
        with torch.no_grad():
            weight[7, 0] = float("nan")
        connection = _connection(server)
        connection.request("POST", "/v1/chat/completions", json.dumps({"messages": USER, "stream": True}),
                           {"Content-Type": "application/json"})
        events = [line for line in connection.getresponse().read().decode().split("\n\n") if line]
        assert json.loads(events[0].removeprefix("data: "))["choices"][0]["delta"]["role"] == "assistant"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert error["code"] == 500 and "NaN or inf" in error["message"] and events[-1] == "data: [DONE]"
    finally:
        server.close()
