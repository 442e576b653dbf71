"""The link between the OpenAI server's two processes (`runtime.engine_link`), over a real socket
pair and a real `EngineThread`: adds that arrive while the engine runs a step all join the next
one (the link does not wait for the engine to take an add before reading the next), their
answers come before their outputs, bad input is refused back to its submitter, and a link whose
engine thread stopped answers every add with the error."""

import queue
import socket
import threading
import time
from multiprocessing.connection import Connection

import pytest
import torch

from vexact_models.runtime import SamplingParams
from vexact_models.runtime.engine_link import EngineLink, RemoteEngine
from vexact_models.runtime.engine_thread import EngineThread
from vexact_models.runtime.outputs import CompletionOutput, RequestOutput


class _GatedEngine:
    """Enough of an `LLM` for an `EngineThread`: each step waits for `gate`, then finishes the
    running requests named in `finishing`; `added` records the step count at which each request was added."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.gate, self.in_step = threading.Event(), threading.Event()
        self.steps, self.added, self.running, self.finishing = 0, {}, set(), set()

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def add_request(self, request_id, prompt, params) -> None:
        if not prompt["prompt_token_ids"]:
            raise ValueError("LLM.add_request: prompt is empty")
        self.added[request_id] = self.steps
        self.running.add(request_id)

    def step(self) -> list[RequestOutput]:
        self.in_step.set()
        self.gate.wait()
        self.steps += 1
        done = self.finishing & self.running
        self.running -= done
        return [RequestOutput(rid, None, [1], [CompletionOutput(0, [7], [-0.5], "stop")], None, finished=True)
                for rid in sorted(done)]

    def abort_request(self, ids):
        for request_id in [ids] if isinstance(ids, str) else ids:
            self.running.discard(request_id)
        return []


@pytest.fixture
def linked():
    """(the gated engine, the front end's `RemoteEngine`) over a socket pair, closed after."""
    stub = _GatedEngine()
    ours, theirs = socket.socketpair()
    link = EngineLink(EngineThread(stub), Connection(ours.detach()))
    front = RemoteEngine(Connection(theirs.detach()))
    yield stub, front, link
    stub.gate.set()
    closer = threading.Thread(target=link.close)
    closer.start()
    front.closed.wait(10)
    front.send(("closed",))  # (what the front end's process answers)
    closer.join(10)


def _submit(front: RemoteEngine, request_id: str, sink: queue.SimpleQueue, prompt=(5,)) -> threading.Thread:
    thread = threading.Thread(target=front.submit_all, args=([({"prompt_token_ids": list(prompt)}, SamplingParams())],
                                                             [request_id], sink))
    thread.start()
    return thread


def test_adds_that_arrive_during_a_step_join_the_next_one_together(linked):
    stub, front, link = linked
    sink: queue.SimpleQueue = queue.SimpleQueue()
    _submit(front, "r0", sink).join(10)
    assert stub.in_step.wait(10)  # the engine runs r0's step, held at the gate
    waiting = [_submit(front, f"r{i}", sink) for i in (1, 2, 3)]
    deadline = time.monotonic() + 10
    while link.engine._commands.qsize() < 3 and time.monotonic() < deadline:  # all three queued for the engine
        time.sleep(0.01)
    assert link.engine._commands.qsize() == 3
    stub.finishing = {"r0", "r1", "r2", "r3"}
    stub.gate.set()
    for thread in waiting:
        thread.join(10)
    assert stub.added["r1"] == stub.added["r2"] == stub.added["r3"] == 1  # one step after r0's
    finished = {sink.get(timeout=10).request_id for _ in range(4)}
    assert finished == {"r0", "r1", "r2", "r3"}


def test_a_bad_add_is_refused_to_its_submitter_and_the_others_run(linked):
    stub, front, _ = linked
    stub.gate.set()
    sink: queue.SimpleQueue = queue.SimpleQueue()
    with pytest.raises(ValueError, match="prompt is empty"):
        front.submit_all([({"prompt_token_ids": []}, SamplingParams())], ["bad"], sink)
    stub.finishing = {"good"}
    front.submit_all([({"prompt_token_ids": [5]}, SamplingParams())], ["good"], sink)
    assert sink.get(timeout=10).request_id == "good" and "bad" not in stub.added


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # (the thread re-raises: a log)
def test_a_stopped_engine_thread_answers_every_add_with_its_error():
    class Broken(_GatedEngine):
        def has_unfinished_requests(self) -> bool:
            raise RuntimeError("the engine broke")

    engine = EngineThread(Broken())
    engine._thread.join(10)  # (it stopped at once)
    taken = engine.submit_async([([5], SamplingParams())], ["x"], queue.SimpleQueue())
    with pytest.raises(RuntimeError, match="the engine broke"):
        taken.result(timeout=10)
