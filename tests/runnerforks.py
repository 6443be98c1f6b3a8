"""Runner processes for the unit suite, forked from one that has loaded crewAI already.

A runner process spends 3-4 s (more with the suite beside it) importing crewAI before it does
anything, and the runner unit tests start about a hundred of them: minutes of the suite's time spent
on the same import. This server imports the runner and crewAI once (the modules a run imports when
it starts, in a process whose environment is the quiet test environment), then forks a child per
run. Each child is a process of its own (its pid, its signals, its exit code) that gets the run's
whole environment, its stdin, stdout and stderr, and runs ``python -m flowkube_runner`` as a pod
does from there: only the import is shared. Importing crewAI starts no thread (checked below before
each fork), so forking after it is safe.

What the import itself does (its time, its memory, a SIGTERM during it) is tested with real fresh
processes (``test_startup``), and every runner image path in the integration tests is a real pod.

Protocol, one JSON object per line: the client sends ``{"id", "env", "stdout", "stderr"}`` (paths);
the server answers ``{"id", "pid"}`` once forked and ``{"id", "exit"}`` (``-signal`` when a signal
ended it, as ``subprocess`` says) when the child has ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO, Any

PRELOAD = ("flowkube_runner.__main__", "flowkube_runner.run", "flowkube_runner.engine.session",
           "flowkube_runner.engine.usage", "flowkube_runner.engine.tracing")


# -- the server (python -m tests.runnerforks) -------------------------------------------------------------


def _child(request: dict[str, Any]) -> None:
    """In the forked child: become the run's process, then run the runner's entry point. Never returns."""
    code = 70
    try:
        os.setpgid(0, 0)  # its own group, as a pod's process is alone: a signal to it reaches nothing else
        for fd, path, mode in ((0, os.devnull, os.O_RDONLY), (1, request.get("stdout") or os.devnull, os.O_WRONLY),
                               (2, request["stderr"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)):
            target = os.open(path, mode, 0o644)
            os.dup2(target, fd)
            os.close(target)
        # Fresh stream objects on the new descriptors: the server's could be locked by a thread that
        # was writing when it forked (only the forking thread lives on in the child).
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        unbuffered = bool(request["env"].get("PYTHONUNBUFFERED"))
        sys.stdout = open(1, "w", buffering=1 if unbuffered else -1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
        os.environ.clear()
        os.environ.update(request["env"])
        # What the interpreter reads of the environment when it starts, done here as it would have.
        sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.argv = ["flowkube_runner"]
        import runpy

        runpy.run_module("flowkube_runner", run_name="__main__", alter_sys=True)  # exits with os._exit
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # whatever it was, the child must not return into the server
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    out_lock = threading.Lock()

    def say(message: dict[str, Any]) -> None:
        with out_lock:
            sys.stdout.write(json.dumps(message) + "\n")
            sys.stdout.flush()

    def reap(rid: int, pid: int) -> None:
        _, status = os.waitpid(pid, 0)
        say({"id": rid, "exit": os.waitstatus_to_exitcode(status)})

    say({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        others = [t for t in threading.enumerate() if t is not threading.main_thread() and t not in _reapers]
        if others:  # a thread of the preloaded modules could hold a lock the child would need
            raise RuntimeError(f"threads before a fork: {others}")
        pid = os.fork()
        if pid == 0:
            _child(request)
        say({"id": request["id"], "pid": pid})
        reaper = threading.Thread(target=reap, args=(request["id"], pid), daemon=True)
        _reapers.add(reaper)
        reaper.start()
        _reapers.difference_update({t for t in _reapers if not t.is_alive() and t is not reaper})


_reapers: set[threading.Thread] = set()


# -- the client ----------------------------------------------------------------------------------------------


class ForkedRun:
    """One forked runner process, as much of ``subprocess.Popen`` as the tests use."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._ended = threading.Event()

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(["flowkube_runner", str(self.pid)], timeout or 0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


class RunnerForks:
    """The fork server of this test process, started with ``env`` (the quiet crewAI environment)."""

    def __init__(self, env: dict[str, str]) -> None:
        self._proc = subprocess.Popen([sys.executable, "-m", "tests.runnerforks"], env=env, stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parents[1])
        assert self._proc.stdout is not None
        first = self._proc.stdout.readline()
        if not first:
            raise RuntimeError("the runner fork server ended before it was ready")
        self._lock = threading.Lock()
        self._next = 0
        self._pids: dict[int, threading.Event] = {}
        self._runs: dict[int, ForkedRun] = {}  # running
        self._handed: dict[int, ForkedRun] = {}  # forked, not yet returned by spawn
        self._reader = threading.Thread(target=self._read, args=(self._proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            message = json.loads(line)
            rid = message["id"]
            with self._lock:
                if "pid" in message:  # always before its exit: the server says it before it reaps
                    self._runs[rid] = self._handed[rid] = ForkedRun(message["pid"])
                    self._pids[rid].set()
                else:
                    self._runs.pop(rid)._end(message["exit"])

    def spawn(self, env: dict[str, str], stderr: Path, stdout: Path | None = None) -> ForkedRun:
        assert self._proc.stdin is not None
        with self._lock:
            self._next += 1
            rid = self._next
            started = self._pids[rid] = threading.Event()
            self._proc.stdin.write(json.dumps({"id": rid, "env": env, "stderr": str(stderr),
                                               "stdout": str(stdout) if stdout else None}) + "\n")
            self._proc.stdin.flush()
        if not started.wait(60):
            raise RuntimeError("the runner fork server did not fork within 60 s")
        with self._lock:
            self._pids.pop(rid)
            return self._handed.pop(rid)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        self._proc.wait(timeout=30)


_forks: RunnerForks | None = None


def runner_forks() -> RunnerForks:
    """This test process's fork server, started on first use (with a scratch HOME of its own; each run
    gets its harness's environment, HOME included) and stopped when the process ends."""
    global _forks
    if _forks is None:
        import atexit
        import tempfile

        from tests.definitions import quiet_crewai_env

        home = Path(tempfile.mkdtemp(prefix="flowkube-runnerforks-"))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "FLOWKUBE_"))}
        _forks = RunnerForks({**env, **quiet_crewai_env(home)})
        atexit.register(_forks.close)
    return _forks


if __name__ == "__main__":
    serve()
