"""An OpenAI-compatible HTTP server over an `LLM` (``vexact serve``), in the style of ``vllm serve``:
``POST /v1/completions``, ``POST /v1/chat/completions`` (each streamed as server-sent events with
``"stream": true``), ``GET /v1/models``, ``GET /health`` (`runtime.openai_http`).

Two processes, as vLLM's API server and engine core. This one keeps the engine: its requests run
as the engine's online requests (`runtime.llm_online`) on one engine thread
(`runtime.engine_thread`), each joining the running batch at the next step. The HTTP front end
(`runtime.openai_front_end`) runs in a process of its own, its handlers parsing bodies, tokenizing,
rendering chat templates and writing JSON; in the engine's process that Python work held the
interpreter's lock against the step loop and made every step slower (docs/performance.md section
3). The two talk over a socket pair (`runtime.engine_link`). Logprobs are the engine's floats,
bitwise those the training forward recomputes (`runtime.openai_protocol`).
"""

from __future__ import annotations

import socket
import subprocess
import sys
from multiprocessing.connection import Connection

from .engine_link import EngineLink
from .engine_thread import EngineThread
from .reasoning import PARSERS as REASONING_PARSERS
from .openai_tools import server_parsers
from .structured_outputs import StructuredOutputsConfig
from .tool_calls import PARSERS

__all__ = ["OpenAIServer"]


class OpenAIServer:
    """Serve `llm` at ``http://host:port/v1`` as model `model_name` (port 0: a free one). `start`
    starts the front end's process and returns once it listens (`url` says where);
    `serve_forever` also waits until it stops; `close` stops it and the engine thread.
    `tool_call_parser`: the format chat replies' tool calls are read in (`runtime.tool_calls.PARSERS`:
    ``"hermes"``, ``"qwen3_coder"``, ``"glm45"``, ``"minimax_m2"``, ``"deepseek_v3"``, ``"llama3_json"``,
    ``"openai"``), as ``vllm serve --tool-call-parser``; None: tool_choice ``"auto"`` is refused (`runtime.openai_tools`).
    `reasoning_parser`: how chat replies' reasoning is split off into ``reasoning``
    (`runtime.reasoning.PARSERS`: ``"qwen3"``, ``"deepseek_r1"``, ``"minimax_m2"``, ``"openai_gptoss"``,
    ...), as ``vllm serve --reasoning-parser``; None: the reply is all content. GPT-OSS's ``"openai"`` tool parser brings
    the ``"openai_gptoss"`` reasoning parser (`runtime.harmony`), and goes with no other. `chat_template`: a Jinja chat template
    that chats render with instead of the tokenizer's (``vllm serve --chat-template``).
    `structured_outputs_config`: the structured outputs' defaults, a dict of vLLM's fields
    (``disable_any_whitespace``, ``enable_in_reasoning``; `runtime.structured_outputs.StructuredOutputsConfig`),
    as ``vllm serve --structured-outputs-config``."""

    def __init__(self, llm, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 chat_template: str | None = None, structured_outputs_config: dict | None = None) -> None:
        if llm.tokenizer is None:
            raise ValueError("OpenAIServer: the engine has no tokenizer (the API's prompts and replies are text); "
                             "load a checkpoint folder that has one, or pass LLM(..., tokenizer=...)")
        if tool_call_parser is not None and tool_call_parser not in PARSERS:
            raise ValueError(f"OpenAIServer: tool_call_parser={tool_call_parser!r} is not one of {sorted(PARSERS)}")
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"OpenAIServer: reasoning_parser={reasoning_parser!r} is not one of "
                             f"{sorted(REASONING_PARSERS)}")
        try:
            tool_call_parser, reasoning_parser = server_parsers(tool_call_parser, reasoning_parser)
            self.structured_config = StructuredOutputsConfig.of(structured_outputs_config)
        except ValueError as err:
            raise ValueError(f"OpenAIServer: {err}") from None
        self.llm, self.model_name, self.host, self.port = llm, model_name, host, port
        if chat_template is not None and not isinstance(chat_template, str):
            raise ValueError(f"OpenAIServer: chat_template must be a Jinja template string, got "
                             f"{type(chat_template).__name__}")
        self.tool_call_parser, self.reasoning_parser, self.chat_template = tool_call_parser, reasoning_parser, chat_template
        self.url: str | None = None
        self._process: subprocess.Popen | None = None
        self._link: EngineLink | None = None

    def start(self) -> OpenAIServer:
        """Start the front end and the engine thread; RuntimeError when the front end cannot
        listen (its reason) or dies starting."""
        if self._process is not None:
            return self
        ours, theirs = socket.socketpair()
        self._process = subprocess.Popen([sys.executable, "-m", "vexact_models.runtime.openai_front_end",
                                          str(theirs.fileno())], pass_fds=[theirs.fileno()])
        theirs.close()
        conn = Connection(ours.detach())
        conn.send({"tokenizer": self.llm.tokenizer, "model_name": self.model_name, "host": self.host,
                   "port": self.port, "max_model_len": self.llm.max_model_len, "tool_call_parser": self.tool_call_parser,
                   "reasoning_parser": self.reasoning_parser, "chat_template": self.chat_template,
                   "structured_config": self.structured_config})
        try:
            kind, detail = conn.recv()
        except EOFError:
            kind, detail = "error", f"the front end's process exited ({self._process.wait()}) before listening"
        if kind != "ready":
            conn.close()
            self._process.wait()
            self._process = None
            raise RuntimeError(f"OpenAIServer: {detail}")
        self.url = detail
        self._link = EngineLink(EngineThread(self.llm), conn)
        return self

    def serve_forever(self) -> None:
        """`start`, then serve until the front end stops (or Ctrl-C); then `close`."""
        self.start()
        try:
            self._process.wait()
        finally:
            self.close()

    def close(self) -> None:
        """Stop the front end (requests still out are aborted) and the engine thread."""
        if self._process is None:
            return
        self._link.close()
        self._process.wait()
        self._process = self._link = None
