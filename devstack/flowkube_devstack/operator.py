"""Run the flowkube operator as a local process against a LocalCluster (tests, demo, benchmarks)."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from flowkube_devstack import procs
from flowkube_devstack.cluster import LocalCluster, free_port, wait_for

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "flowkube.io_flows.yaml"


def install_crd(cluster: LocalCluster) -> None:
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    cluster.kubectl("wait", "--for=condition=Established", "crd/flows.flowkube.io", "--timeout=60s")


class OperatorProcess:
    def __init__(self, cluster: LocalCluster, *, name: str = "operator",
                 env: Mapping[str, str] | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.extra_env = dict(env or {})
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return procs.log_path(self.cluster.root, self.name)

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        install_crd(self.cluster)
        env = {
            **os.environ,
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "FLOWKUBE_BIND_ADDRESS": "127.0.0.1",
            "FLOWKUBE_METRICS_PORT": str(self.metrics_port),
            "FLOWKUBE_HEALTH_PORT": str(self.health_port),
            "FLOWKUBE_LOG_FORMAT": "json",
            "FLOWKUBE_RUNNER_IMAGE": "flowkube-runner:local",
            "FLOWKUBE_RUNNER_COMMAND": f"{sys.executable} -m flowkube_runner",
            **self.extra_env,
        }
        self.proc = procs.spawn(self.name, [sys.executable, "-m", "flowkube_operator"],
                                root=self.cluster.root, env=env)
        wait_for(self._healthy, timeout, f"operator /healthz (log: {self.log})")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as r:
                return bool(r.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text

    def stop(self) -> None:
        if self.proc is not None:
            procs.terminate(self.proc, grace=10.0)
            self.proc = None

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed operator: no cleanup, no goodbye."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
