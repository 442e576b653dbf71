"""The connection between the OpenAI server's two processes: the engine's (`EngineLink`, over an
`EngineThread`) and the front end's (`RemoteEngine`, what its HTTP handlers submit to).

The HTTP front end runs in a process of its own (`runtime.openai_server` says why). Over one
``multiprocessing`` connection the front end sends ``("add", call, ids, requests)`` and
``("abort", id)``; the engine's side answers each add with ``("added", call, error or None)``
once the engine thread took it (the link does not wait for that before reading the next add, so
adds that arrive within a step join the same step), and sends every output as it comes,
``("out", RequestOutput)``, or ``("out", exception)`` when the engine failed a step (every
request then fails). ``("close",)`` from the engine's side asks
the front end to stop; it answers ``("closed",)``.
"""

from __future__ import annotations

import itertools
import queue
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing.connection import Connection

from .engine_thread import EngineThread, fail_all, route

__all__ = ["EngineLink", "RemoteEngine"]


class EngineLink:
    """The engine's end: applies the front end's commands to `engine` and sends back the outputs
    (a thread each way). When the front end goes away, the requests it left running are aborted."""

    def __init__(self, engine: EngineThread, conn: Connection) -> None:
        self.engine, self.conn = engine, conn
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # the sink of every request
        self._send_lock = threading.Lock()
        self._threads = [threading.Thread(target=target, name=name, daemon=True)
                         for target, name in ((self._receive, "vexact-link-in"), (self._send_outputs, "vexact-link-out"))]
        for thread in self._threads:
            thread.start()

    def send(self, message: tuple) -> None:
        with self._send_lock:
            self.conn.send(message)

    def close(self) -> None:
        """Ask the front end to stop; once it has, close the connection and the engine thread."""
        self._send_quietly(("close",))
        for thread in self._threads:
            thread.join()
        self.conn.close()
        self.engine.close()

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):  # the front end is gone
                break
            if message[0] == "closed":
                break
            if message[0] == "abort":
                self.engine.abort(message[1])
                continue
            _, call, ids, requests = message
            try:  # (not waiting for the engine to take them: the adds that came meanwhile join the same step)
                taken = self.engine.submit_async(requests, ids, self._outbox)
            except RuntimeError as err:  # the engine thread is closed
                self._send_quietly(("added", call, err))
                continue
            # the engine thread answers when it takes them, through the outbox: before their outputs
            taken.add_done_callback(lambda done, call=call: self._outbox.put(_Added(call, done.exception())))
        self.engine.abort_all()  # the engine thread serves this link alone: what it holds is the front end's
        self._outbox.put(None)

    def _send_outputs(self) -> None:
        while (item := self._outbox.get()) is not None:
            self._send_quietly(("added", item.call, item.error) if isinstance(item, _Added) else ("out", item))

    def _send_quietly(self, message: tuple) -> None:
        try:
            self.send(message)
        except (OSError, ValueError):  # the front end is gone: its requests are aborted on the way out
            pass


@dataclass
class _Added:
    """The engine took (or refused: `error`, the front end raises it) the requests of add `call`."""

    call: int
    error: BaseException | None


class RemoteEngine:
    """The front end's end: `EngineThread`'s ``submit_all`` and ``abort`` over the connection; a
    thread routes what comes back to the submitters' queues. `closed` is set when the engine's
    side asks the front end to stop (or is gone)."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.closed = threading.Event()
        self._lock = threading.Lock()
        self._sinks: dict[str, queue.SimpleQueue] = {}
        self._calls: dict[int, Future] = {}
        self._ids = itertools.count()
        threading.Thread(target=self._receive, name="vexact-remote-engine", daemon=True).start()

    def send(self, message: tuple) -> None:
        with self._lock:
            self.conn.send(message)

    def submit_all(self, requests: list, request_ids: list[str], sink: queue.SimpleQueue) -> None:
        """`EngineThread.submit_all`: queue `requests` as `request_ids`, their outputs into `sink`;
        the first bad one's ValueError is raised, none of them queued."""
        taken: Future = Future()
        with self._lock:
            if self.closed.is_set():
                raise RuntimeError("the engine is closed")
            call = next(self._ids)
            self._calls[call] = taken
            self._sinks.update((request_id, sink) for request_id in request_ids)
            self.conn.send(("add", call, request_ids, requests))
        error = taken.result()
        if error is not None:
            with self._lock:
                for request_id in request_ids:
                    self._sinks.pop(request_id, None)
            raise error

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
            if not self.closed.is_set():
                self.conn.send(("abort", request_id))

    def _receive(self) -> None:
        while True:
            try:
                message = self.conn.recv()
            except (EOFError, OSError):
                message = ("close",)
            if message[0] == "close":
                self._shut(RuntimeError("the engine closed"))
                return
            with self._lock:
                if message[0] == "added":
                    self._calls.pop(message[1]).set_result(message[2])
                    continue
                item = message[1]
                if isinstance(item, BaseException):  # the engine failed a step: every request out fails
                    fail_all(self._sinks, item)
                else:
                    route(self._sinks, item)

    def _shut(self, error: BaseException) -> None:
        with self._lock:
            self.closed.set()
            for call in self._calls.values():
                call.set_exception(error)
            self._calls.clear()
            fail_all(self._sinks, error)
