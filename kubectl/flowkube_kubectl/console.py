"""`kubectl flow console`: the web console on this machine, with the kubeconfig's user."""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import webbrowser
from pathlib import Path
from typing import Any

from flowkube_kubectl.args import Args, UsageError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _console_command() -> list[str]:
    """flowkube-console beside this plugin (the same installation), or on PATH."""
    here = Path(sys.argv[0]).resolve().parent / "flowkube-console"
    found = str(here) if here.exists() else shutil.which("flowkube-console")
    if not found:
        raise UsageError("the console is not installed here: pip install 'flowkube[console]' "
                         "(it provides flowkube-console)")
    return [found]


def console(a: Args) -> int:
    """`kubectl proxy` with your kubeconfig's credentials on a unix socket only you can open, the
    console in local mode behind it on a loopback port, and the browser opened on a one-time link."""
    command = _console_command()
    port, key = int(a.opts.get("--port") or _free_port()), secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory(prefix="flowkube-console-") as private:  # mode 0700
        sock = str(Path(private) / "kube.sock")
        proxy = subprocess.Popen([os.environ.get("KUBECTL", "kubectl"), "proxy", f"--unix-socket={sock}", *a.kube],
                                 stdout=subprocess.PIPE, text=True)
        procs: list[subprocess.Popen[Any]] = [proxy]
        try:
            assert proxy.stdout is not None
            first = proxy.stdout.readline()  # "Starting to serve on /path/kube.sock"
            if sock not in first:
                return proxy.wait(timeout=30) or 1  # kubectl said why on stderr
            procs.append(subprocess.Popen([*command, "--mode", "local", "--api-socket", sock, "--host", "127.0.0.1",
                                           "--port", str(port)],
                                          env={**os.environ, "FLOWKUBE_CONSOLE_LAUNCH_KEY": key}))
            url = f"http://127.0.0.1:{port}/auth/local?key={key}"
            print(f"flowkube console: {url}\n(the link signs in one browser, once; Ctrl-C stops it)", flush=True)
            if a.opts.get("--no-browser", "false").lower() in ("false", "0"):
                webbrowser.open(url)
            return procs[1].wait()
        except KeyboardInterrupt:
            return 0
        finally:
            for p in reversed(procs):
                _stop(p)


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
