"""The OpenAI server's front end, a process of its own (``python -m
vexact_models.runtime.openai_front_end FD``, started by `runtime.openai_server.OpenAIServer`):
the HTTP server and its handlers (`runtime.openai_http`), talking to the engine's process over the
connection on file descriptor FD (`runtime.engine_link.RemoteEngine`).

It receives its settings first (the tokenizer, the model's name, the address to bind, the
engine's ``max_model_len``, the tool call and reasoning parsers, the chat template, the structured
outputs' defaults), binds, answers ``("ready", url)`` (or
``("error", message)``), and serves until the engine's side sends ``("close",)``.
"""

from __future__ import annotations

import signal
import sys
import threading
from multiprocessing.connection import Connection

from .engine_link import RemoteEngine
from .openai_http import FrontEnd

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Serve the front end over the connection on the file descriptor `argv[0]`."""
    argv = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the engine's process, which stops this one
    conn = Connection(int(argv[0]))
    settings = conn.recv()
    engine = RemoteEngine(conn)
    front = FrontEnd(engine, settings["tokenizer"], settings["model_name"], settings["max_model_len"],
                     settings["tool_call_parser"], settings["reasoning_parser"], settings["chat_template"],
                     settings["structured_config"])
    try:
        http = front.http_server(settings["host"], settings["port"])
    except OSError as err:
        engine.send(("error", f"cannot listen on {settings['host']}:{settings['port']}: {err}"))
        return 1
    host, port = http.server_address[:2]
    engine.send(("ready", f"http://{host}:{port}/v1"))
    thread = threading.Thread(target=http.serve_forever, name="vexact-http", daemon=True)
    thread.start()
    engine.closed.wait()
    http.shutdown()
    http.server_close()
    try:
        engine.send(("closed",))
    except OSError:  # the engine's side is gone already
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
