"""The whole local stack in one place: control plane + node, stub model, validator, operator.

Used by `./dev up` / `./dev demo` (held by a background supervisor) and by the end-to-end tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from flowkube_devstack.cluster import LocalCluster, free_port, http_ok, wait_for
from flowkube_devstack.operator import OperatorProcess
from flowkube_devstack.stubmodel import Rules, StubModel

RUNNER_UID = 65532  # the operator's default runAsUser for runner pods

# The demo's model: drafts are "A plain reply."; a reviewer's "approved" collapses to `approved`.
DEMO_RULES: dict[str, Any] = {
    "default": "A plain reply.",
    "rules": [{"contains": "approved", "anywhere": True, "reply": "approved"}],
}


def _runs_as(uid: int, python: str) -> bool:
    try:
        subprocess.run([python, "-c", "import flowkube_runner"], user=uid, group=uid, extra_groups=[],
                       cwd="/", capture_output=True, timeout=60, check=True)
    except (PermissionError, subprocess.CalledProcessError):
        return False
    return True


@contextmanager
def runner_python(uid: int = RUNNER_UID) -> Iterator[str]:
    """An interpreter the runner pods' user can execute, with this environment's packages.

    The local node agent really drops to ``runAsUser``; a virtualenv whose interpreter lives under
    a private home (pyenv in /root, mode 700) cannot be executed by that user. Then a throwaway
    venv is made from the system's interpreter of the same minor version, reading this
    environment's site-packages (world-readable) through a ``.pth`` hook.
    """
    if os.geteuid() != 0 or _runs_as(uid, sys.executable):  # not root: the node cannot change user
        yield sys.executable
        return
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    system = shutil.which(version, path="/usr/local/bin:/usr/bin")
    if system is None:
        raise RuntimeError(f"{sys.executable} cannot be run by uid {uid} and there is no system {version}")
    # Not under /tmp: runner pods mount their own emptyDir there.
    root = Path(tempfile.mkdtemp(prefix="flowkube-runner-python-", dir="/var/tmp"))
    try:
        root.chmod(0o755)
        venv = root / "venv"
        subprocess.run([system, "-m", "venv", "--without-pip", str(venv)], check=True, capture_output=True)
        purelib = sysconfig.get_paths()["purelib"]
        site_packages = venv / "lib" / version / "site-packages"
        # `import` lines of a .pth run at start-up; addsitedir also honours that directory's own
        # .pth files (the editable install of this project).
        (site_packages / "zz-flowkube-dev.pth").write_text(f"import site; site.addsitedir({purelib!r})\n")
        python = str(venv / "bin" / "python")
        if not _runs_as(uid, python):
            raise RuntimeError(f"uid {uid} cannot run the runner even with {python}")
        yield python
    finally:
        shutil.rmtree(root, ignore_errors=True)


class Validator:
    """``flowkube-runner validate-server`` as its own process, as it runs beside the operator."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> Validator:
        env = {**os.environ, "CREWAI_DISABLE_TELEMETRY": "true", "OTEL_SDK_DISABLED": "true",
               "CREWAI_TRACING_ENABLED": "false"}
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "flowkube_runner", "validate-server", "--host", "127.0.0.1",
                 "--port", str(self.port)], env=env, stdout=out, stderr=subprocess.STDOUT)
        wait_for(self._healthy, 120, f"validate-server /healthz (log: {self.log})", interval=0.2)
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"validate-server exited {self.proc.returncode}: {self.log.read_text()[-2000:]}")
        return http_ok(self.url + "healthz")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
            self.proc = None


@contextmanager
def dev_stack(root: Path, rules: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Start everything; yield what a user needs to know (kubeconfig, URLs, ports)."""
    with ExitStack() as stack:
        cluster = LocalCluster(root / "cluster").start()
        stack.callback(cluster.stop)
        stub = stack.enter_context(StubModel(Rules.from_json(rules or DEMO_RULES)))
        python = stack.enter_context(runner_python())
        validator = Validator(root / "validator.log").start()
        stack.callback(validator.stop)
        operator = OperatorProcess(cluster, env={
            "FLOWKUBE_RUNNER_COMMAND": f"{python} -m flowkube_runner",
            # The key comes from each Flow's own Secret (see examples/flows); the stub is the endpoint.
            "FLOWKUBE_RUNNER_DEFAULT_ENV": json.dumps({"OPENAI_BASE_URL": stub.base_url,
                                                       "CREWAI_TRACING_ENABLED": "false"}),
            "FLOWKUBE_VALIDATOR_URL": validator.url,
        }).start()
        stack.callback(operator.stop)
        yield {**cluster.describe(), "stub": stub.base_url, "validator": validator.url,
               "metrics": f"http://127.0.0.1:{operator.metrics_port}/metrics"}
