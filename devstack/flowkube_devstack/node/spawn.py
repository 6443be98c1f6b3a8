# pathlib and typing cost import time here, which is what this file exists to avoid:
# ruff: noqa: PTH103, PTH110, PTH113, PTH118, PTH120, S302
"""Container start-up helper: `python -I -S spawn.py STATUS_FD AGENT_PID`, stdin a pipe from the agent.

The agent starts one helper ahead of need (its own session, parent-death signal set), so Python's
start-up is off the critical path. When a container is due the agent writes its spec (marshal) to the
helper's stdin and closes it; the helper then points stdout/stderr at the container log, enters a
private mount and UTS namespace, bind-mounts the volumes, sets the hostname, changes directory, drops
to the pod's user, re-arms the parent-death signal, and execs the command with exactly its
environment. Any failure before exec is written to STATUS_FD and the process exits 128; a successful
exec closes STATUS_FD (close-on-exec) with nothing written: that is how the agent learns the container
started. An empty stdin means the agent no longer needs this helper.

Standard library only, and only cheap modules (marshal, not json; os.path, not pathlib; no typing).
"""

from __future__ import annotations

import ctypes
import marshal
import os
import signal
import sys

TYPE_CHECKING = False  # mypy honours any constant named TYPE_CHECKING
if TYPE_CHECKING:
    from typing import Any, NoReturn

CLONE_NEWNS, CLONE_NEWUTS = 0x00020000, 0x04000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT = 1, 2, 4, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _die_with(agent_pid: int) -> None:
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL), "prctl")
    if os.getppid() != agent_pid:  # the agent died before the signal was armed
        os._exit(0)


def _mount(source: str | None, target: str, flags: int, fstype: str | None = None,
           data: str | None = None) -> None:
    def c(s: str | None) -> bytes | None:
        return s.encode() if s is not None else None

    rc = _libc.mount(c(source), target.encode(), c(fstype), ctypes.c_ulong(flags), c(data))
    _check(rc, f"mount {target}")


def _bind(fd: int, target: str, read_only: bool) -> None:
    _mount(f"/proc/self/fd/{fd}", target, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY)
    os.close(fd)


def _ensure_target(target: str, is_file: bool) -> None:
    if is_file:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.exists(target):
            os.close(os.open(target, os.O_WRONLY | os.O_CREAT, 0o644))
    else:
        os.makedirs(target, exist_ok=True)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def setup(spec: dict[str, Any], agent_pid: int) -> None:
    log = os.open(spec["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    if spec["namespaces"]:
        _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
        _mount(None, "/", MS_REC | MS_PRIVATE)
        name = spec["hostname"].encode()
        _check(_libc.sethostname(name, len(name)), "sethostname")
        # Hold every source before the first mount: a volume at /tmp must not hide a later source
        # that lives under /tmp on the host.
        runtime = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in spec["runtime"]["paths"]]
        sources = [os.open(m["source"], os.O_PATH | os.O_CLOEXEC) for m in spec["mounts"]]
        # The "image": the agent's Python environment, made reachable for a non-root user when it
        # lives under a directory closed to others (pyenv in a 0700 /root): that directory becomes
        # an empty tmpfs holding only the environment, read-only.
        for closed in spec["runtime"]["closed"]:
            _mount("tmpfs", closed, MS_NOSUID | MS_NODEV, "tmpfs", "mode=755")
        for path, fd in zip(spec["runtime"]["paths"], runtime, strict=True):
            os.makedirs(path, exist_ok=True)
            _bind(fd, path, read_only=True)
        keep = [os.open(p, os.O_PATH | os.O_CLOEXEC) for p in spec["runtime"].get("keep", [])]
        for m, fd in zip(spec["mounts"], sources, strict=True):
            _ensure_target(m["target"], m["file"])
            _bind(fd, m["target"], m["readOnly"])
        # The "image" stays whole: put back any part of the environment a volume just covered.
        targets = [m["target"].rstrip("/") or "/" for m in spec["mounts"]]
        for path, fd in zip(spec["runtime"].get("keep", []), keep, strict=True):
            if any(path == t or path.startswith(t + "/") for t in targets):
                os.makedirs(path, exist_ok=True)
                _bind(fd, path, read_only=True)
            else:
                os.close(fd)
    os.makedirs(spec["cwd"], exist_ok=True)
    os.chdir(spec["cwd"])
    if spec["uid"] is not None:
        os.setgroups(spec["groups"])
        os.setgid(spec["gid"])
        os.setuid(spec["uid"])
    _die_with(agent_pid)  # a credential change clears the parent-death signal


def _which(command: str, path: str) -> str:
    # os.execvpe would import `warnings` lazily, which a dropped-privilege user may not be able to read.
    if "/" in command:
        return command
    for directory in path.split(":"):
        candidate = os.path.join(directory or ".", command)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise FileNotFoundError(command)


def _fail(status_fd: int, message: str) -> NoReturn:
    os.write(status_fd, message.encode()[:4000] or b"start failed")
    os._exit(128)


def main() -> None:
    status_fd, agent_pid = int(sys.argv[1]), int(sys.argv[2])
    os.set_inheritable(status_fd, False)
    _die_with(agent_pid)
    data = _read_all(0)
    if not data:
        os._exit(0)
    try:
        spec = marshal.loads(data)
        setup(spec, agent_pid)
    except Exception as exc:  # everything before exec is a start error the agent reports
        _fail(status_fd, str(exc))
    argv, env = spec["argv"], spec["env"]
    try:
        os.execve(_which(argv[0], env.get("PATH", "")), argv, env)  # noqa: S606
    except FileNotFoundError:
        _fail(status_fd, f'exec: "{argv[0]}": executable file not found in $PATH')
    except Exception as exc:
        _fail(status_fd, f'exec: "{argv[0]}": {getattr(exc, "strerror", None) or exc}')


if __name__ == "__main__":
    main()
