"""Run command-line scripts as ``python SCRIPT ARGS...`` would, many in one Python process.

A script's start-up is mostly importing torch, transformers and the kernels (about 10 s of CPU on
the CI machine); the tests of the benchmark scripts' usage (``--help``, refusals on CPU, bad
options) run about eighty of them. `ScriptRunner` keeps one worker process that has those modules
imported and executes each script in it with `runpy.run_path` as ``__main__``: a fresh namespace,
``sys.argv``, ``sys.path[0]`` (the script's folder) and the working directory as the interpreter
sets them, the exit status as the interpreter reports it (``sys.exit(n)``, 1 and a traceback for an
uncaught exception), its stdout and stderr captured apart. ``os.environ``, the working directory,
``sys.argv`` and ``sys.path`` are restored after each run. The worker hides any CUDA device
(``CUDA_VISIBLE_DEVICES=""``) and starts without the project's ``VEXACT_*`` and Triton switches.
What it cannot give is a clean interpreter: modules a script imports stay imported for the next.
Scripts that do real work run in a process of their own (`subprocess.run`).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

_WORKER = r'''
import contextlib, io, json, os, runpy, sys, traceback
import torch, transformers  # noqa: F401  (what every script imports first)
reply = os.fdopen(os.dup(1), "w")  # the replies' own descriptor: whatever writes to fd 1 goes to stderr
os.dup2(2, 1)
reply.write("ready\n")
reply.flush()
for line in sys.stdin:
    request = json.loads(line)
    script = os.path.join(request["cwd"], request["argv"][0])
    saved = (dict(os.environ), os.getcwd(), list(sys.argv), list(sys.path))
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        os.chdir(request["cwd"])
        sys.argv = list(request["argv"])
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
            except SystemExit as exit_:
                if isinstance(exit_.code, int) or exit_.code is None:
                    code = exit_.code or 0
                else:
                    print(exit_.code, file=sys.stderr)
                    code = 1
            except BaseException:
                traceback.print_exc()
                code = 1
    finally:
        os.environ.clear()
        os.environ.update(saved[0])
        os.chdir(saved[1])
        sys.argv, sys.path[:] = saved[2], saved[3]
    reply.write(json.dumps({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}) + "\n")
    reply.flush()
'''


@dataclass(frozen=True)
class ScriptRun:
    """What `subprocess.run(..., capture_output=True, text=True)` gives of a run."""

    returncode: int
    stdout: str
    stderr: str


class ScriptRunner:
    """One worker process running scripts on request (`run`); `close` ends it. A run that does not
    answer within `timeout` seconds ends the worker and raises `subprocess.TimeoutExpired`; one that
    ends the worker (``os._exit``, a crash) raises RuntimeError. The next run starts a new worker."""

    def __init__(self, timeout: float = 300.0) -> None:
        self.timeout = timeout
        self._proc: subprocess.Popen | None = None
        self._replies: queue.Queue[str | None] = queue.Queue()

    def _start(self) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VEXACT_", "TRITON_"))}
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
        proc = subprocess.Popen([sys.executable, "-c", _WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env)
        # each worker's reader puts into its own queue: the end of a worker killed for a hang, read
        # after this one starts, stays in the old queue
        self._replies = queue.Queue()
        threading.Thread(target=self._read, args=(proc, self._replies), daemon=True).start()
        try:  # the imports, under a limit of their own: a hang guard, not a speed check
            ready = self._replies.get(timeout=600)
        except queue.Empty:
            ready = None
        if ready != "ready\n":
            proc.kill()
            raise RuntimeError(f"the script runner's worker did not start (exit status {proc.wait()})")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, replies: queue.Queue) -> None:
        for line in proc.stdout:
            replies.put(line)
        replies.put(None)  # the worker ended

    def run(self, cwd: Path | str, script: str, *args: str) -> ScriptRun:
        """``python script *args`` in `cwd`, in the worker: its exit status, stdout and stderr."""
        if self._proc is None or self._proc.poll() is not None:
            self._proc = self._start()
        self._proc.stdin.write(json.dumps({"cwd": str(cwd), "argv": [script, *args]}) + "\n")
        self._proc.stdin.flush()
        try:
            reply = self._replies.get(timeout=self.timeout)
        except queue.Empty:
            self.close()
            raise subprocess.TimeoutExpired([script, *args], self.timeout) from None
        if reply is None:
            code = self._proc.wait()
            self._proc = None
            raise RuntimeError(f"the script runner's worker ended (exit status {code}) running {[script, *args]}")
        return ScriptRun(**json.loads(reply))

    def close(self) -> None:
        """End the worker (a no-op when none runs)."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None
