"""One call into an `LLM` at a time: calls from other threads wait their turn.

An engine call (``generate``, ``update_weights``, ``sleep``, ``wake_up``) drives one scheduler,
one KV cache and one set of weights from start to end; two interleaved calls would mix their
steps (a ``generate`` running the other's sequences, or failing in the scheduler) or change the
weights under a running ``generate``. So every such call holds the engine's `EngineLock`: a call
from a second thread blocks until the one in progress returns (as a call into vLLM's ``LLM``
blocks), then runs as it would have alone, so neither caller's outputs change.

A call made from inside a running call on the same thread (a callback, or the iterator
``update_weights`` consumes calling ``generate``) can never get its turn: it raises RuntimeError
naming both calls instead of waiting for itself.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["EngineLock", "one_call_at_a_time"]

F = TypeVar("F", bound=Callable)


class EngineLock:
    """A lock held for the length of one engine call, which knows who holds it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holder: tuple[int, str] | None = None  # (thread id, call) while held

    @property
    def holder(self) -> str | None:
        """The call holding the lock now (e.g. ``"LLM.generate"``), or None."""
        holder = self._holder
        return None if holder is None else holder[1]

    @contextmanager
    def hold(self, call: str) -> Iterator[None]:
        """Run the body as `call`, after any call in progress on another thread has returned.
        RuntimeError, without waiting, when this thread already holds the lock."""
        holder = self._holder  # only this thread can have set it to this thread's id
        if holder is not None and holder[0] == threading.get_ident():
            raise RuntimeError(f"{call}: called from inside {holder[1]} on the same thread (a callback, or an iterator "
                               f"{holder[1]} consumes); the engine runs one call at a time, so this call would wait "
                               f"for itself: make it after {holder[1]} returns")
        with self._lock:
            self._holder = (threading.get_ident(), call)
            try:
                yield
            finally:
                self._holder = None


def one_call_at_a_time(method: F) -> F:
    """Decorate an engine method so that it runs under its engine's ``_engine_lock``
    (`EngineLock.hold`, as ``LLM.<method name>``)."""
    call = f"LLM.{method.__name__}"

    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._engine_lock.hold(call):
            return method(self, *args, **kwargs)

    return locked  # type: ignore[return-value]
