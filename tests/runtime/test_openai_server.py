"""The OpenAI-compatible server (`runtime.openai_server`, ``vexact serve``), through OpenAI's own
Python client: completions and chat completions, streamed or not, answer with the engine's tokens
and logprobs (bitwise ``LLM.generate``'s and ``LLM.chat``'s, the training forward's), concurrent
clients share the running batch without changing each other's results, bad requests get OpenAI's
error bodies naming the field, and a client that goes away has its request aborted."""

import json
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from vexact_models.runtime import LLM, SamplingParams
from vexact_models.runtime.engine_thread import EngineThread
from vexact_models.runtime.llm_setup import pick_device
from vexact_models.runtime.openai_protocol import ProtocolError, read_chat
from vexact_models.runtime.openai_server import OpenAIServer

from .llm_support import save_chat_checkpoint

openai = pytest.importorskip("openai")  # (the main test environment has it; the older-transformers runs do not)

TEMPLATE = "{{ bos_token }}{% for m in messages %}w{{ 10 if m['role'] == 'user' else 11 }} w{{ m['content'] }} {% endfor %}w11"
EXTRA = {"ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny Qwen3 with a word-level tokenizer (``w<i>`` is token i, w2 its BOS) and a chat template."""
    return save_chat_checkpoint(tmp_path_factory.mktemp("serve"), TEMPLATE)


@pytest.fixture(scope="module")
def served(folder):
    llm = LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20, max_num_seqs=8,
              max_num_batched_tokens=32)
    server = OpenAIServer(llm, "tiny", port=0).start()
    yield llm, server, openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    server.close()


def _reference(folder):
    """A second engine over the same checkpoint, for ``generate`` beside the server's."""
    return LLM(str(folder), device="cpu", block_size=4, kv_cache_bytes=1 << 20)


def test_completions_are_generates_tokens_and_logprobs(served, folder):
    _, _, client = served
    reply = client.completions.create(model="tiny", prompt=["w5 w6 w7", [9, 8]], n=2, max_tokens=6, temperature=0.9,
                                      seed=3, logprobs=2, extra_body=EXTRA)
    want = _reference(folder).generate(["w5 w6 w7", [9, 8]], SamplingParams(
        n=2, temperature=0.9, max_tokens=6, seed=3, ignore_eos=True), use_tqdm=False)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    for choice, (out, sample) in zip(reply.choices, [(o, c) for o in want for c in o.outputs]):
        assert choice.text == sample.text and choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == sample.logprobs  # the floats, bitwise
        assert choice.model_extra["token_ids"] == sample.token_ids
        assert choice.model_extra["prompt_token_ids"] == out.prompt_token_ids
        for token, top in zip(choice.logprobs.tokens, choice.logprobs.top_logprobs):
            assert token in top and len(top) in (2, 3)  # the token and the 2 most probable
    assert reply.usage.prompt_tokens == 5 and reply.usage.completion_tokens == 24


def test_streamed_completions_add_up_to_the_whole(served):
    _, _, client = served
    kwargs = dict(model="tiny", prompt=["w5 w6 w7", "w9"], n=2, max_tokens=7, temperature=0.9, seed=4, logprobs=0,
                  extra_body=EXTRA)
    whole = client.completions.create(**kwargs)
    texts, ids, logprobs, finish, usage = {}, {}, {}, {}, None
    for chunk in client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            ids[c.index] = ids.get(c.index, []) + c.model_extra["token_ids"]
            logprobs[c.index] = logprobs.get(c.index, []) + c.logprobs.token_logprobs
            finish[c.index] = c.finish_reason or finish.get(c.index)
    for c in whole.choices:
        assert (texts[c.index], ids[c.index], logprobs[c.index], finish[c.index]) == (
            c.text, c.model_extra["token_ids"], c.logprobs.token_logprobs, c.finish_reason)
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_chat_is_llm_chats_reply_streamed_or_not(served, folder):
    _, _, client = served
    messages = [{"role": "user", "content": "5"}, {"role": "assistant", "content": "6"}, {"role": "user", "content": "7"}]
    want = _reference(folder).chat(messages, SamplingParams(temperature=0.8, max_tokens=5, seed=2, ignore_eos=True),
                                   use_tqdm=False)[0]
    reply = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.8, seed=2,
                                           logprobs=True, top_logprobs=3, extra_body=EXTRA)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.outputs[0].text
    assert [t.logprob for t in choice.logprobs.content] == want.outputs[0].logprobs
    assert all(len(t.top_logprobs) == 3 for t in choice.logprobs.content)
    assert choice.model_extra["prompt_token_ids"] == want.prompt_token_ids
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, temperature=0.8,
                                                 seed=2, stream=True, extra_body=EXTRA))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_concurrent_clients_get_their_own_results(served, folder):
    """Eight clients at once, each request joining the running batch: each gets what ``generate``
    gives its request alone."""
    _, _, client = served
    prompts = [f"w{5 + i} w{40 + i}" + " w7" * i for i in range(8)]
    params = [SamplingParams(temperature=0.9, max_tokens=4 + 2 * i, seed=20 + i, ignore_eos=True) for i in range(8)]
    reference = _reference(folder)
    want = [reference.generate([p], q, use_tqdm=False)[0].outputs[0] for p, q in zip(prompts, params)]
    got = [None] * 8

    def ask(i: int) -> None:
        reply = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=params[i].max_tokens,
                                          temperature=0.9, seed=20 + i, logprobs=0, extra_body=EXTRA)
        got[i] = reply.choices[0]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for choice, sample in zip(got, want):
        assert choice.model_extra["token_ids"] == sample.token_ids
        assert choice.logprobs.token_logprobs == sample.logprobs


def test_structured_outputs_reach_the_engine(served):
    pytest.importorskip("xgrammar")
    _, _, client = served
    reply = client.completions.create(model="tiny", prompt="w5", max_tokens=8, seed=1,
                                      extra_body={"structured_outputs": {"choice": ["w9", "w17"]}, "return_token_ids": True})
    # the word-level vocabulary's raw token texts: the choice, then the EOS the grammar allows after it
    assert reply.choices[0].model_extra["token_ids"][0] in (9, 17) and reply.choices[0].finish_reason == "stop"


def test_response_format_is_read_as_structured_outputs():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    messages = [{"role": "user", "content": "5"}]

    def render(messages, **options):
        return [5]

    def params(fmt):
        return read_chat({"messages": messages, "response_format": fmt}, render, 64).params[0]

    assert params({"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}).structured_outputs.json == schema
    assert params({"type": "json_object"}).structured_outputs.json_object is True
    assert params({"type": "text"}).structured_outputs is None and params({"type": "text"}).max_tokens == 63
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {}}, "json"):
        with pytest.raises(ProtocolError, match="response_format"):
            params(bad)


@pytest.mark.parametrize("body, param, status", [
    ({"prompt": "w5", "max_tokens": 0}, "max_tokens", 400),
    ({"prompt": "w5", "temperature": "hot"}, "temperature", 400),
    ({"prompt": "w5", "top_k": -2}, "top_k", 400),  # (0 is -1, all tokens, as vLLM reads it)
    ({"prompt": "w5", "echo": "yes"}, "echo", 400),
    ({"prompt": "w5", "prompt_logprobs": 50}, "prompt_logprobs", 400),  # above the engine's max_logprobs
    ({"prompt": "w5", "best_of": 3}, "best_of", 400),
    ({"prompt": "w5", "logit_bias": {"x": 1}}, "logit_bias", 400),
    ({"prompt": "w5", "logprobs": 50}, "logprobs", 400),  # above the engine's max_logprobs
    ({"prompt": []}, "prompt", 400),
    ({"prompt": "w5", "model": "other"}, "model", 404),
])
def test_bad_completions_get_openais_error_body(served, body, param, status):
    _, server, _ = served
    code, answer = _post(server.url + "/completions", body)
    assert code == status and answer["error"]["param"] == param and answer["error"]["message"]


def test_bad_chats_and_routes(served):
    _, server, _ = served
    for body, param in [({"messages": []}, "messages"), ({"messages": [{"role": "user"}]}, "messages"),
                        ({"messages": [{"role": "user", "content": "5"}], "tool_choice": "auto"}, "tool_choice"),
                        ({"messages": [{"role": "user", "content": "5"}], "top_logprobs": 2}, "top_logprobs"),
                        ({"messages": [{"role": "user", "content": "5"}], "echo": True}, "echo"),
                        ({"messages": [{"role": "user", "content": "5"}], "prompt_logprobs": 1, "stream": True},
                         "prompt_logprobs")]:
        code, answer = _post(server.url + "/chat/completions", body)
        assert code == 400 and answer["error"]["param"] == param, answer
    assert _post(server.url + "/embeddings", {})[0] == 404
    request = urllib.request.Request(server.url + "/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request)
    assert info.value.code == 400
    with urllib.request.urlopen(server.url.removesuffix("/v1") + "/health") as reply:
        assert reply.status == 200
    assert [m.id for m in served[2].models.list()] == ["tiny"]


def test_tokenize_and_detokenize_routes(served):
    """vLLM's ``/tokenize`` (a prompt, or chat messages rendered as a chat request's are) and
    ``/detokenize``."""
    llm, server, client = served
    root = server.url.removesuffix("/v1")
    code, answer = _post(root + "/tokenize", {"prompt": "w5 w6 w7", "return_token_strs": True})
    assert code == 200 and answer == {"count": 3, "max_model_len": llm.max_model_len, "tokens": [5, 6, 7],
                                      "token_strs": ["w5", "w6", "w7"]}
    messages = [{"role": "user", "content": "5"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1, extra_body=EXTRA)
    code, answer = _post(root + "/tokenize", {"messages": messages})
    assert code == 200 and answer["tokens"] == chat.choices[0].model_extra["prompt_token_ids"]
    assert answer["token_strs"] is None
    assert _post(root + "/detokenize", {"tokens": [5, 6, 7]}) == (200, {"prompt": "w5 w6 w7"})
    for route, body, param in [("/detokenize", {"tokens": [5, 9999]}, "tokens"), ("/detokenize", {}, "tokens"),
                               ("/tokenize", {"text": "w5"}, "prompt"), ("/tokenize", {"messages": []}, "messages")]:
        code, answer = _post(root + route, body)
        assert code == 400 and answer["error"]["param"] == param


def test_a_client_that_goes_away_has_its_request_aborted(served):
    llm, server, client = served
    stream = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    for _ in range(200):  # the handler's next write fails; the engine drops the request
        if not llm.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert not llm.has_unfinished_requests()


def test_engine_thread_takes_all_requests_or_none(folder):
    llm = _reference(folder)
    engine = EngineThread(llm)
    try:
        import queue

        sink = queue.SimpleQueue()
        with pytest.raises(ValueError, match="max_tokens|empty"):
            engine.submit_all([([5, 6], SamplingParams(max_tokens=3)), ([], SamplingParams())], ["a", "b"], sink)
        stream = engine.submit([5, 6], SamplingParams(max_tokens=3, ignore_eos=True, seed=1), "c")
        output = stream.result()
        assert output.request_id == "c" and len(output.outputs[0].token_ids) == 3 and sink.empty()
    finally:
        engine.close()
    assert not llm.has_unfinished_requests()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit([5], SamplingParams())


class _StubEngine:
    """Enough of an `LLM` for `EngineThread` to start on: idle, or failing when first asked."""

    def __init__(self, device: str, fail: bool = False) -> None:
        self.device, self.fail = torch.device(device), fail

    def has_unfinished_requests(self) -> bool:
        if self.fail:
            raise RuntimeError("the engine broke")
        return False

    def abort_request(self, ids):
        return []


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the thread re-raises: a log)
def test_an_engine_thread_that_stops_fails_its_callers_instead_of_hanging():
    engine = EngineThread(_StubEngine("cpu", fail=True))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the engine broke|the engine thread stopped|closed"):
        engine.submit([5], SamplingParams())
    assert time.monotonic() - start < 30
    engine._thread.join(timeout=30)  # (its error reported within this test)


def test_an_engine_thread_takes_the_engines_cuda_device_with_its_index(monkeypatch):
    """The engine's thread sets the engine's CUDA device (its index the builder's current device,
    `llm_setup.pick_device`: 2 here), which a new thread does not inherit."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    engine = EngineThread(_StubEngine(pick_device("folder", torch.device("cuda"), None)))
    engine.close()
    assert chosen == [torch.device("cuda", 2)]


def test_vexact_serve_command(folder):
    """``vexact serve`` starts the server on a free port and prints where (its tool parser
    reaching the front end: tool_choice "auto" is served); SIGTERM (as Ctrl-C) stops both
    processes cleanly."""
    process = subprocess.Popen([sys.executable, "-m", "vexact_models.cli", "serve", str(folder), "--port", "0",
                                "--device", "cpu", "--kv-cache-bytes", str(1 << 20), "--served-model-name", "tiny",
                                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("vexact serve: tiny at http://127.0.0.1:"), line
        url = line.split(" at ")[1].strip()
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        reply = client.completions.create(model="tiny", prompt="w5 w6", max_tokens=3, extra_body=EXTRA)
        assert len(reply.choices[0].model_extra["token_ids"]) == 3
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
        chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "5"}], tools=tools,
                                              tool_choice="auto", max_tokens=3, extra_body=EXTRA)
        assert chat.choices[0].message.content and chat.choices[0].finish_reason == "length"
        process.send_signal(signal.SIGTERM)  # (under pytest-xdist SIGINT is ignored, and inherited so)
        assert process.wait(timeout=60) == 0
        assert "vexact serve: stopped" in process.stderr.read()
        with pytest.raises(openai.APIConnectionError):
            client.completions.create(model="tiny", prompt="w5", max_tokens=1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)


def test_vexact_serve_refuses_auto_tool_choice_without_a_parser(folder):
    done = subprocess.run([sys.executable, "-m", "vexact_models.cli", "serve", str(folder), "--enable-auto-tool-choice"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--enable-auto-tool-choice needs --tool-call-parser (deepseek_v3 or" in done.stderr


def _post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_front_end_that_cannot_listen_says_why(served):
    llm, server, _ = served
    port = int(server.url.rsplit(":", 1)[1].split("/")[0])
    with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
        OpenAIServer(llm, "tiny", port=port).start()
    assert not llm.has_unfinished_requests()


def test_requests_of_a_front_end_that_dies_are_aborted(folder):
    """The front end's process killed while its requests run: the engine drops them (the link's
    end of the connection closes), and a new server over the same engine serves."""
    llm = _reference(folder)
    server = OpenAIServer(llm, "tiny", port=0).start()
    client = openai.OpenAI(base_url=server.url, api_key="none", max_retries=0)
    threading.Thread(target=lambda: _quietly(lambda: client.completions.create(
        model="tiny", prompt="w5", max_tokens=400, extra_body={"ignore_eos": True})), daemon=True).start()
    for _ in range(200):
        if llm.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert llm.has_unfinished_requests()
    server._process.kill()
    for _ in range(200):
        if not llm.has_unfinished_requests():
            break
        time.sleep(0.05)
    assert not llm.has_unfinished_requests()
    server.close()
    again = OpenAIServer(llm, "tiny", port=0).start()
    try:
        reply = openai.OpenAI(base_url=again.url, api_key="none", max_retries=0).completions.create(
            model="tiny", prompt="w5", max_tokens=3, extra_body=EXTRA)
        assert len(reply.choices[0].model_extra["token_ids"]) == 3
    finally:
        again.close()


def _quietly(call) -> None:
    try:
        call()
    except openai.APIError:
        pass


def test_an_engine_failure_is_a_500_and_the_server_serves_on(folder):
    llm = _reference(folder)
    weight = llm.model.causal_lm.lm_head.weight
    saved = weight.detach().clone()
    server = OpenAIServer(llm, "tiny", port=0).start()
    try:
        with torch.no_grad():
            weight[7, 0] = float("nan")
        code, answer = _post(server.url + "/completions", {"prompt": "w5 w6", "max_tokens": 4})
        assert code == 500 and "NaN or inf" in answer["error"]["message"]
        with torch.no_grad():
            weight.copy_(saved)
        code, answer = _post(server.url + "/completions", {"prompt": "w5 w6", "max_tokens": 4, "ignore_eos": True})
        assert code == 200 and answer["usage"]["completion_tokens"] == 4
    finally:
        server.close()
