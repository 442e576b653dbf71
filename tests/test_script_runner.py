"""tests/script_runner.py: a script run in the shared worker gives what a process of its own gives."""

import subprocess
import sys

import pytest

from .script_runner import ScriptRunner

SCRIPT = """
import os, sys
print("out", sys.argv[1:], os.path.basename(sys.path[0]), os.path.basename(os.getcwd()))
print("err", file=sys.stderr)
leaked = "SCRIPT_RUNNER_LEAK" in os.environ  # set by an earlier run in the same worker
os.environ["SCRIPT_RUNNER_LEAK"] = "1"
os.write(1, b"raw\\n")
mode = sys.argv[1]
if mode == "code":
    sys.exit(3)
if mode == "message":
    sys.exit("a message")
if mode == "raise":
    raise ValueError("bad value")
if mode == "leak":
    sys.exit(4 if leaked else 0)
if mode == "hang":
    import time
    time.sleep(60)
if mode == "die":
    os._exit(7)
"""


@pytest.fixture(scope="module")
def runner():
    runner = ScriptRunner(timeout=20)
    yield runner
    runner.close()


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "probe.py").write_text(SCRIPT)
    return tmp_path


@pytest.mark.parametrize("mode", ["code", "message", "raise", "none"])
def test_a_run_reports_what_its_own_process_reports(runner, folder, mode):
    """The exit status, stdout and stderr of ``python scripts/probe.py MODE`` from `folder`: argv,
    ``sys.path[0]`` (the script's folder) and the working directory as the interpreter sets them;
    what is written to descriptor 1 directly is kept out of the captured stdout."""
    alone = subprocess.run([sys.executable, "scripts/probe.py", mode], cwd=folder, capture_output=True, text=True,
                           timeout=120)
    shared = runner.run(folder, "scripts/probe.py", mode)
    assert shared.returncode == alone.returncode == {"code": 3, "message": 1, "raise": 1, "none": 0}[mode]
    assert shared.stdout == alone.stdout.replace("raw\n", "") == f"out ['{mode}'] scripts {folder.name}\n"
    assert shared.stderr.splitlines()[0] == "err"
    assert shared.stderr.splitlines()[-1] == alone.stderr.splitlines()[-1]  # the message, or the exception's line


def test_the_environment_is_restored_and_a_hang_or_a_dead_worker_is_reported(folder):
    """A run's changes to ``os.environ`` do not reach the next run; a run past the timeout and a
    worker that dies are errors, and the next run gets a new worker."""
    runner = ScriptRunner(timeout=5)
    try:
        assert runner.run(folder, "scripts/probe.py", "code").returncode == 3
        assert runner.run(folder, "scripts/probe.py", "leak").returncode == 0  # the first run's variable is gone
        with pytest.raises(subprocess.TimeoutExpired):
            runner.run(folder, "scripts/probe.py", "hang")
        with pytest.raises(RuntimeError, match="exit status 7"):
            runner.run(folder, "scripts/probe.py", "die")
        assert runner.run(folder, "scripts/probe.py", "none").returncode == 0  # a new worker
    finally:
        runner.close()
