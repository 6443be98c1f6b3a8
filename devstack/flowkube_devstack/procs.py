"""Child processes that cannot outlive their parent, and pid files for the ones that must be found again."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # The kernel sends this when the parent thread dies, even by SIGKILL: an interrupted or killed
    # test run leaves no control plane behind. SIGKILL, not SIGTERM: a kube-apiserver whose etcd is
    # gone too can hang in its graceful shutdown for ever (seen). Orderly stops go through stop().
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    root: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    tied: bool = True,
) -> subprocess.Popen[bytes]:
    log = log_path(root, name).open("ab")
    proc = subprocess.Popen(
        list(argv),
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=dict(env) if env is not None else None,
        cwd=cwd,
        preexec_fn=_die_with_parent if tied else None,
        start_new_session=True,
    )
    log.close()
    pid_file(root, name).write_text(str(proc.pid))
    return proc


def log_path(root: Path, name: str) -> Path:
    d = root / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.log"


def pid_file(root: Path, name: str) -> Path:
    d = root / "pids"
    d.mkdir(parents=True, exist_ok=True)
    return d / f"{name}.pid"


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def terminate(proc: subprocess.Popen[bytes] | int, grace: float = 10.0) -> None:
    """SIGTERM the process group, wait up to grace seconds, then SIGKILL it."""
    pid = proc if isinstance(proc, int) else proc.pid
    try:
        pgid = os.getpgid(pid)
    except ProcessLookupError:
        pgid = None
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            if pgid is not None:
                os.killpg(pgid, sig)
            else:
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if isinstance(proc, subprocess.Popen):
                if proc.poll() is not None:
                    return
            elif not alive(pid):
                return
            time.sleep(0.05)


def kill_stale(root: Path) -> list[str]:
    """Stop processes a previous run under root left behind (their pid files survive a crash)."""
    stopped: list[str] = []
    d = root / "pids"
    if not d.is_dir():
        return stopped
    for f in d.glob("*.pid"):
        try:
            pid = int(f.read_text().strip())
        except ValueError:
            pid = 0
        if pid > 0 and alive(pid) and _cmdline_mentions(pid, str(root)):
            terminate(pid, grace=3.0)
            stopped.append(f.stem)
        f.unlink(missing_ok=True)
    return stopped


def _cmdline_mentions(pid: int, text: str) -> bool:
    # A pid may have been reused by an unrelated process since; only stop ours.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return False
    return text in cmdline
