"""The OpenAI API over HTTP: the standard library's threaded HTTP server (no web framework to
install), a thread per connection, routing ``POST /v1/completions``, ``POST /v1/chat/completions``
(streamed as server-sent events with ``"stream": true``), ``GET /v1/models``, ``GET /health`` and
vLLM's ``POST /tokenize`` and ``POST /detokenize``.

It runs in the front end's process (`runtime.openai_front_end`): each handler reads its body
(`runtime.openai_protocol`), tokenizes or renders the prompt, hands the requests to the engine
(`FrontEnd.engine`: an object with `EngineThread`'s ``submit_all`` and ``abort``, here the link
to the engine's process) and writes the answer; a client that goes away before its answer is
written (streamed or not) has its requests aborted. Every request gets an answer: a body the
handlers cannot read is a 400 naming the field, a failure of ours a 500, never a dropped
connection (the OpenAI client would send the request again).
"""

from __future__ import annotations

import contextlib
import json
import queue
import select
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from jinja2 import TemplateError

from .llm_chat import chat_ids, render_text
from .openai_protocol import (EngineRequest, ProtocolError, chat_choice, chat_stream, completion_choice, prompt_logprobs,
                              read_chat, read_completion, response, sampling_field, usage)
from .outputs import RequestOutput
from .structured_outputs import StructuredOutputsConfig

__all__ = ["FrontEnd"]


class FrontEnd:
    """What the handlers serve with: the `engine`, the `tokenizer` (text prompts, chat templates,
    token texts), the API's `model_name`, the engine's `max_model_len`, the `tool_parser` that
    reads chat replies' tool calls (`runtime.tool_calls.PARSERS`; None: none) and the
    `reasoning_parser` that splits their reasoning off (`runtime.reasoning.PARSERS`; None: none);
    `chat_template`: the template chats render with instead of the tokenizer's (None: its own);
    `structured_config`: the structured outputs' defaults (``--structured-outputs-config``)."""

    def __init__(self, engine, tokenizer, model_name: str, max_model_len: int, tool_parser: str | None = None,
                 reasoning_parser: str | None = None, chat_template: str | None = None,
                 structured_config: StructuredOutputsConfig | None = None) -> None:
        self.engine, self.tokenizer, self.model_name, self.max_model_len = engine, tokenizer, model_name, max_model_len
        self.tool_parser, self.reasoning_parser, self.chat_template = tool_parser, reasoning_parser, chat_template
        self.structured_config = structured_config or StructuredOutputsConfig()

    def http_server(self, host: str, port: int) -> ThreadingHTTPServer:
        """An HTTP server of this front end bound to (`host`, `port`; 0: a free one)."""
        return _HTTPServer((host, port), type("Handler", (_Handler,), {"server_state": self}))

    def tokenize(self, text: str) -> list[int]:
        return self.tokenizer(text)["input_ids"]

    def render(self, messages, *, add_generation_prompt: bool, continue_final_message: bool, tools,
               chat_template_kwargs: dict) -> list[int]:
        """A chat request's conversation as `LLM.chat` renders it: its token ids."""
        try:
            text = render_text(self.tokenizer, messages, self.chat_template, add_generation_prompt, continue_final_message,
                               tools, chat_template_kwargs, "chat completion", "'messages'")
        except (ValueError, TypeError, TemplateError) as err:  # (a template's raise_exception: a TemplateError)
            raise ProtocolError(str(err), "messages") from None
        return chat_ids(self.tokenizer, text)

    def tokenize_answer(self, body: dict) -> dict:
        """vLLM's ``POST /tokenize``: a ``prompt`` (``add_special_tokens``, default true) or chat
        ``messages`` (rendered as a chat request's are) to token ids; ``return_token_strs`` adds
        each token's string."""
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages:
                raise ProtocolError("'messages' must be a non-empty list of messages", "messages")
            kwargs = body.get("chat_template_kwargs") or {}
            if not isinstance(kwargs, dict):
                raise ProtocolError(f"'chat_template_kwargs' must be an object, got {kwargs!r}", "chat_template_kwargs")
            ids = self.render(messages, add_generation_prompt=body.get("add_generation_prompt", True) is True,
                              continue_final_message=body.get("continue_final_message") is True, tools=body.get("tools"),
                              chat_template_kwargs=kwargs)
        elif isinstance(body.get("prompt"), str):
            ids = self.tokenizer(body["prompt"], add_special_tokens=body.get("add_special_tokens", True) is True)["input_ids"]
        else:
            raise ProtocolError("/tokenize takes a 'prompt' string or chat 'messages'", "prompt")
        strs = self.tokenizer.convert_ids_to_tokens(ids) if body.get("return_token_strs") is True else None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    def detokenize_answer(self, body: dict) -> dict:
        """vLLM's ``POST /detokenize``: ``tokens`` (ids) to their text."""
        tokens = body.get("tokens")
        vocab = len(self.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                   for t in tokens):
            raise ProtocolError(f"'tokens' must be a list of token ids in [0, {vocab}), got {tokens!r}", "tokens")
        return {"prompt": self.tokenizer.decode(tokens)}

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each token's text alone (as the engine's ``decoded_token``)."""
        return self.tokenizer.batch_decode([[t] for t in ids])

    def submit(self, request: EngineRequest, chat: bool = False) -> tuple[queue.SimpleQueue, list[str]]:
        """Queue every prompt of `request`, their outputs into one queue (all or none are queued);
        the engine's refusal is a `ProtocolError` naming the API's field (`chat`: a chat request's
        names)."""
        request.token_texts = self.token_texts
        if request.echo:  # (prompts given as token ids are echoed as their text)
            request.prompt_texts = [self.tokenizer.decode(ids) if text is None else text
                                    for text, ids in zip(request.prompt_texts, request.prompts)]
        sink: queue.SimpleQueue = queue.SimpleQueue()
        ids = [f"{request.id}-{i}" for i in range(len(request.prompts))]
        try:
            self.engine.submit_all([({"prompt_token_ids": p}, params) for p, params in zip(request.prompts, request.params)],
                                   ids, sink)
        except ValueError as err:
            message = str(err).removeprefix("LLM.add_request: ").removeprefix("LLM.generate: ")
            raise ProtocolError(message, _api_field(message, chat)) from None
        except RuntimeError as err:  # the engine is closed or its thread stopped
            raise ProtocolError(str(err), status=500, kind="internal_error") from None
        return sink, ids


class _HTTPServer(ThreadingHTTPServer):
    """A thread per connection; a listen backlog for many clients connecting at once (the
    standard library's 5 resets connections beyond it)."""

    daemon_threads = True
    request_queue_size = 1024


class _Handler(BaseHTTPRequestHandler):
    server_state: FrontEnd
    protocol_version = "HTTP/1.1"
    #: TCP_NODELAY: a response's headers and body go out as two writes, and with Nagle's
    #: algorithm the body waited for the client's delayed ACK of the headers (about 40 ms)
    disable_nagle_algorithm = True

    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name); quiet by default
        pass

    # -- routing -----------------------------------------------------------------------------
    def do_GET(self) -> None:  # noqa: N802 (the base class's name)
        state = self.server_state
        if self.path == "/health":
            self._send(HTTPStatus.OK, {})
        elif self.path == "/v1/models":
            self._send(HTTPStatus.OK, {"object": "list", "data": [
                {"id": state.model_name, "object": "model", "created": 0, "owned_by": "vexact-models",
                 "max_model_len": state.max_model_len}]})
        else:
            self._error(ProtocolError(f"no route GET {self.path}", status=404, kind="not_found_error"))

    def do_POST(self) -> None:  # noqa: N802 (the base class's name)
        kind = {"/v1/completions": "text_completion", "/v1/chat/completions": "chat.completion",
                "/tokenize": "tokenize", "/detokenize": "detokenize"}.get(self.path)
        try:
            raw = self._raw_body()  # read first, whatever the answer: the connection's next request follows it
            if kind is None:
                raise ProtocolError(f"no route POST {self.path}", status=404, kind="not_found_error")
            body = _json_object(raw)
            state = self.server_state
            model = body.get("model")
            if model is not None and model != state.model_name:
                raise ProtocolError(f"the model '{model}' does not exist (this server has '{state.model_name}')",
                                    "model", 404, "not_found_error")
            if kind in ("tokenize", "detokenize"):
                self._send(HTTPStatus.OK, getattr(state, f"{kind}_answer")(body))
                return
            if kind == "text_completion":
                request = read_completion(body, state.tokenize, state.structured_config, state.max_model_len)
            else:
                request = read_chat(body, state.render, state.max_model_len, state.tool_parser, state.reasoning_parser,
                                    state.structured_config, state.tokenizer)
            sink, ids = state.submit(request, chat=kind != "text_completion")
        except ProtocolError as err:
            self._error(err)
            return
        except Exception as err:  # a failure of ours reading the request: answered, not a dropped connection
            self._error(ProtocolError(f"the server failed to read the request: {type(err).__name__}: {err}",
                                      status=500, kind="internal_error"))
            return
        if request.stream:
            self._stream(kind, request, sink, ids)
        else:
            self._answer(kind, request, sink, ids)

    # -- answers -----------------------------------------------------------------------------
    def _answer(self, kind: str, request: EngineRequest, sink: queue.SimpleQueue, ids: list[str]) -> None:
        try:
            outputs = _collect(sink, ids, self._client_gone)
        except Exception as err:  # the engine failed a step
            self._error(ProtocolError(str(err), status=500, kind="internal_error"))
            return
        if outputs is None:  # the client went away: stop its requests
            for request_id in ids:
                self.server_state.engine.abort(request_id)
            self.close_connection = True
            return
        errors = [c.error for o in outputs for c in o.outputs if c.finish_reason == "error" and not c.token_ids]
        if errors:
            self._error(ProtocolError(errors[0]))
            return
        try:
            body = self._whole(kind, request, outputs)
        except Exception as err:  # a failure of ours writing the answer: answered, not a dropped connection
            self._error(ProtocolError(f"the server failed to write the answer: {type(err).__name__}: {err}",
                                      status=500, kind="internal_error"))
            return
        self._send(HTTPStatus.OK, body)

    def _whole(self, kind: str, request: EngineRequest, outputs: list[RequestOutput]) -> dict:
        choose = completion_choice if kind == "text_completion" else chat_choice
        n = request.params[0].n
        choices = [choose(request, i * n + c.index, o, c) for i, o in enumerate(outputs) for c in o.outputs]
        tokens = 0 if request.prompt_only else sum(len(c.token_ids) for o in outputs for c in o.outputs)
        body = response(request, kind, self.server_state.model_name, choices, usage(sum(map(len, request.prompts)), tokens))
        if kind != "text_completion" and request.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs(outputs[0])
        return body

    def _stream(self, kind: str, request: EngineRequest, sink: queue.SimpleQueue, ids: list[str]) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        chat, n, model = kind != "text_completion", request.params[0].n, self.server_state.model_name
        chunk_kind = "chat.completion.chunk" if chat else kind
        offsets, streams, scores, tokens = {}, {}, {}, 0
        try:
            if chat:
                first = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None} for i in range(n * len(ids))]
                self._event(response(request, chunk_kind, model, first, None))
            for position, output in _outputs(sink, ids):
                choices = []
                # (the prompt's scores come with a request's first output: a sample starting later echoes them too)
                output.prompt_logprobs = scores.setdefault(position, output.prompt_logprobs)
                for c in output.outputs:
                    index = position * n + c.index
                    tokens += 0 if request.prompt_only else len(c.token_ids)
                    if chat:
                        if index not in streams:
                            streams[index] = chat_stream(request)
                        choices.append(chat_choice(request, index, output, c, streams[index]))
                    else:
                        choice = completion_choice(request, index, output, c, offsets.get(index, 0), index not in offsets)
                        # text_offset goes on from the last chunk's
                        offsets[index] = offsets.get(index, 0) + (0 if choice["logprobs"] is None else
                                                                  sum(map(len, choice["logprobs"]["tokens"])))
                        choices.append(choice)
                self._event(response(request, chunk_kind, model, choices, None))
            if request.include_usage:
                self._event(response(request, chunk_kind, model, [], usage(sum(map(len, request.prompts)), tokens)))
            self._write(b"data: [DONE]\n\n")
        except (BrokenPipeError, ConnectionResetError):  # the client went away: stop its requests
            for request_id in ids:
                self.server_state.engine.abort(request_id)
        except Exception as err:  # the engine failed a step, or we a chunk: say so; the stream ends as every one does
            for request_id in ids:  # (what still runs is read by nobody now)
                self.server_state.engine.abort(request_id)
            with contextlib.suppress(OSError):  # (the client may have gone too)
                self._event(ProtocolError(str(err), status=500, kind="internal_error").body())
                self._write(b"data: [DONE]\n\n")

    # -- writing -----------------------------------------------------------------------------
    def _raw_body(self) -> bytes:
        length = self.headers.get("Content-Length") or "0"
        if not length.isdigit():  # (the body's end is unknown: the connection cannot carry another request)
            self.close_connection = True
            raise ProtocolError(f"the 'Content-Length' header must be a byte count, got {length!r}")
        return self.rfile.read(int(length))

    def _client_gone(self) -> bool:
        """Whether the client closed its end of the connection (readable, with nothing to read).
        (``poll``, not ``select``, which refuses descriptors past 1023: a server with a thousand
        connections has them.)"""
        poller = select.poll()
        poller.register(self.connection, select.POLLIN)
        try:
            if not poller.poll(0):
                return False
            return self.connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:  # (readable a moment ago, nothing now: still there)
            return False
        except OSError:  # (reset by the peer)
            return True

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, err: ProtocolError) -> None:
        self._send(err.status, err.body())

    def _event(self, body: dict) -> None:
        self._write(b"data: " + json.dumps(body).encode() + b"\n\n")

    def _write(self, data: bytes) -> None:
        self.wfile.write(data)
        self.wfile.flush()


def _json_object(raw: bytes) -> dict:
    try:
        body = json.loads(raw or b"null")
    except ValueError as err:
        raise ProtocolError(f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise ProtocolError("the body must be a JSON object")
    return body


def _api_field(message: str, chat: bool) -> str | None:
    """The API field an engine refusal names (``SamplingParams.NAME=...``): a chat's ``top_logprobs``
    for its ``logprobs``; None where it names none."""
    if not message.startswith("SamplingParams."):
        return None
    name = sampling_field(message)
    return "top_logprobs" if chat and name == "logprobs" else name


#: how often a non-streamed answer's wait looks whether its client went away (seconds)
_GONE_POLL_S = 0.25


def _outputs(sink: queue.SimpleQueue, ids: list[str], gone=None):
    """(prompt position, output) as the engine returns them, until every request finished (or,
    with `gone`, until it says the client went away: then None); an engine failure raises."""
    position = {request_id: i for i, request_id in enumerate(ids)}
    left = set(ids)
    while left:
        try:
            item = sink.get(timeout=_GONE_POLL_S) if gone is not None else sink.get()
        except queue.Empty:
            if gone():
                yield None
                return
            continue
        if isinstance(item, BaseException):
            raise item
        if item.finished:
            left.discard(item.request_id)
        yield position[item.request_id], item


def _collect(sink: queue.SimpleQueue, ids: list[str], gone=None) -> list[RequestOutput] | None:
    """The finished output of each request, in prompt order; None when `gone` says the client went
    away first."""
    outputs: list[RequestOutput | None] = [None] * len(ids)
    for item in _outputs(sink, ids, gone):
        if item is None:
            return None
        position, output = item
        outputs[position] = output
    return outputs
