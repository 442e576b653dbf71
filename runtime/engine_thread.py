"""An `LLM`'s online requests driven from a thread of its own, for callers on other threads (the
OpenAI-compatible server's handlers, `runtime.openai_server`).

The engine thread owns the engine: it alone calls ``add_request``, ``abort_request`` and ``step``.
Other threads hand it commands through a queue; it applies them between steps, so a request joins
the running batch at the next step. `EngineThread.submit_all` returns once the engine took the
requests (or raises the ValueError of the first bad one, none of them queued); their outputs
arrive on the caller's queue, or on a `RequestStream` (`EngineThread.submit`).
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from concurrent.futures import Future

import torch

from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["EngineThread", "RequestStream", "fail_all", "route"]


class RequestStream:
    """The outputs of one submitted request, in order; iterating ends after the finished one. An
    engine failure (a step that raised) ends it with that exception."""

    def __init__(self, request_id: str, sink: queue.SimpleQueue) -> None:
        self.request_id, self._sink = request_id, sink

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            item = self._sink.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    def result(self) -> RequestOutput:
        """The last output: for a FINAL_ONLY or CUMULATIVE request, the whole finished request."""
        last = None
        for last in self:
            pass
        return last


class EngineThread:
    """Runs `llm`'s steps on a daemon thread while it has online requests; `close` stops it."""

    def __init__(self, llm) -> None:
        self.llm = llm
        # the engine's CUDA device, with its index (`llm_setup.pick_device`): a new thread does not
        # inherit the current device of the thread that built the engine
        self._cuda = llm.device if llm.device.type == "cuda" else None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, queue.SimpleQueue] = {}
        self._ids = itertools.count()
        self._closed = False
        self._stopped: BaseException | None = None  # the error that stopped the thread
        self._lock = threading.Lock()  # (a submission is queued before the thread's last drain, or refused)
        self._thread = threading.Thread(target=self._run, name="vexact-engine", daemon=True)
        self._thread.start()

    def submit(self, prompt, params: SamplingParams, request_id: str | None = None) -> RequestStream:
        """Queue one request (`LLM.add_request`'s arguments; an id is made when None)."""
        request_id = f"req-{next(self._ids)}" if request_id is None else request_id
        sink: queue.SimpleQueue = queue.SimpleQueue()
        self.submit_all([(prompt, params)], [request_id], sink)
        return RequestStream(request_id, sink)

    def submit_all(self, requests: list[tuple[object, SamplingParams]], request_ids: list[str],
                   sink: queue.SimpleQueue) -> None:
        """Queue `requests` ((prompt, params) pairs) as `request_ids`, their outputs put into `sink`
        (then an exception, if the engine fails a step), and wait until the engine took them: the
        first one's ValueError (bad input) is raised here, none of them queued."""
        taken = self.submit_async(requests, request_ids, sink)
        while True:
            try:
                return taken.result(timeout=1.0)
            except TimeoutError:
                if not self._thread.is_alive():  # (it stopped on an error, which its sinks got)
                    raise RuntimeError("EngineThread.submit_all: the engine thread stopped") from None

    def submit_async(self, requests: list[tuple[object, SamplingParams]], request_ids: list[str],
                     sink: queue.SimpleQueue) -> Future:
        """`submit_all` without the wait: the future is done once the engine took the requests
        (its exception the first bad one's ValueError, none of them queued; or the error that
        stopped the thread), so that one caller can queue several submissions for the same step
        (the server's link)."""
        taken: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("EngineThread.submit_all: the engine thread is closed")
            if self._stopped is not None:
                taken.set_exception(self._stopped)
            else:
                self._commands.put(("add", list(zip(request_ids, requests)), sink, taken))
        return taken

    def abort(self, request_id: str) -> None:
        """Stop `request_id` now (`LLM.abort_request`): its sink gets its last output, finished,
        the samples still running ending "abort" with their tokens so far."""
        self._commands.put(("abort", request_id))

    def abort_all(self) -> None:
        """`abort` every request this thread holds (their submitter went away: the server's link)."""
        self._commands.put(("abort", None))

    def close(self) -> None:
        """Stop the thread after aborting what still runs (their sinks get a RuntimeError)."""
        with self._lock:  # (a submission is queued before the close, which fails it, or refused)
            closing, self._closed = not self._closed, True
        if closing:
            self._commands.put(("close",))
            self._thread.join()

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as error:  # the thread cannot go on: what it holds and what waits gets the error
            self._fail(error)
            with self._lock:
                self._stopped = error
                while (command := self._next_command()) is not None:
                    if command[0] == "add":
                        command[-1].set_exception(error)
            raise

    def _serve(self) -> None:
        llm = self.llm
        if self._cuda is not None:  # the current device is the thread's own
            torch.cuda.set_device(self._cuda)
        while True:
            command = self._commands.get() if not llm.has_unfinished_requests() else self._next_command()
            while command is not None:
                if command[0] == "close":
                    self._shut(RuntimeError("EngineThread: the engine thread was closed"))
                    return
                self._apply(command)
                command = self._next_command()
            if llm.has_unfinished_requests():
                self._step()

    def _next_command(self):
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _apply(self, command) -> None:
        if command[0] == "abort":  # one request, or (None) all of them
            for output in self.llm.abort_request(list(self._sinks) if command[1] is None else command[1]):
                route(self._sinks, output)
            return
        _, requests, sink, taken = command
        added = []
        try:
            for request_id, (prompt, params) in requests:
                self.llm.add_request(request_id, prompt, params)
                added.append(request_id)
        except Exception as error:  # bad input: none of them stays; the submitting thread raises it
            self.llm.abort_request(added)
            taken.set_exception(error)
            return
        self._sinks.update((request_id, sink) for request_id in added)
        taken.set_result(None)

    def _step(self) -> None:
        try:
            outputs = self.llm.step()
        except Exception as error:  # the engine dropped every request (LLM.step)
            self._fail(error)
            return
        for output in outputs:
            route(self._sinks, output)

    def _shut(self, error: BaseException) -> None:
        """Abort what runs, fail its sinks and any submission still queued."""
        self.llm.abort_request(list(self._sinks))
        self._fail(error)
        while (command := self._next_command()) is not None:
            if command[0] == "add":
                command[-1].set_exception(error)

    def _fail(self, error: BaseException) -> None:
        fail_all(self._sinks, error)


def route(sinks: dict[str, queue.SimpleQueue], output: RequestOutput) -> None:
    """Put `output` into its request's sink (if it has one still); forget the request once finished."""
    sink = sinks.get(output.request_id)
    if sink is not None:
        sink.put(output)
        if output.finished:
            del sinks[output.request_id]


def fail_all(sinks: dict[str, queue.SimpleQueue], error: BaseException) -> None:
    """Put `error` once into every sink of `sinks` (requests may share one), and forget them all."""
    for sink in {id(sink): sink for sink in sinks.values()}.values():
        sink.put(error)
    sinks.clear()
