"""Run the flowkube operator as a local process against a LocalCluster (tests, demo, benchmarks).

The operator runs exactly as the Helm chart would run it, minus the container: the chart is
rendered and its CRD, ServiceAccount, RBAC and webhook configurations are applied; the operator
logs in with a token of the chart's ServiceAccount (so every test exercises the chart's
least-privilege RBAC) and serves its webhooks on 127.0.0.1 (the chart's `webhook.url`).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flowkube_devstack import build, procs
from flowkube_devstack.cluster import LocalCluster, free_port, http_ok, wait_for

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "flowkube"
SYSTEM_NAMESPACE = "flowkube-system"
RELEASE = "flowkube"
SERVICE_ACCOUNT = "flowkube"  # the chart's fullname for release "flowkube"
WEBHOOK_CONFIGURATION = f"{RELEASE}-{SYSTEM_NAMESPACE}.flowkube.io"
_APPLIED_KINDS = {"CustomResourceDefinition", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
                  "RoleBinding", "Secret", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
STATUS_POLICY = f"{RELEASE}-{SYSTEM_NAMESPACE}.status.flowkube.io"


def helm_binary() -> Path:
    return build.ensure(build.helm(), quiet=True) / "helm"


def render_chart(*sets: str) -> list[dict[str, Any]]:
    args = [str(helm_binary()), "template", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE]
    for s in sets:
        args += ["--set", s]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def token_kubeconfig(cluster: LocalCluster, namespace: str, sa: str, path: Path, duration: str = "48h") -> Path:
    token = cluster.kubectl("create", "token", sa, "-n", namespace, f"--duration={duration}").stdout.strip()
    cfg = {"apiVersion": "v1", "kind": "Config",
           "clusters": [{"name": "local", "cluster": {"server": cluster.server,
                                                      "certificate-authority": str(cluster.pki_dir / "ca.crt")}}],
           "users": [{"name": sa, "user": {"token": token}}],
           "contexts": [{"name": "local", "context": {"cluster": "local", "user": sa, "namespace": namespace}}],
           "current-context": "local"}
    path.write_text(yaml.safe_dump(cfg))
    path.chmod(0o600)
    return path


def install_chart_for_local_operator(cluster: LocalCluster, webhook_port: int) -> Path:
    """Apply what the chart installs except the Deployment; return the operator's kubeconfig."""
    objs = [o for o in render_chart(f"webhook.url=https://127.0.0.1:{webhook_port}", "validator.enabled=false")
            if o.get("kind") in _APPLIED_KINDS]
    if cluster.kubectl("get", "namespace", SYSTEM_NAMESPACE, check=False).returncode != 0:
        cluster.kubectl("create", "namespace", SYSTEM_NAMESPACE)
    cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    input="\n---\n".join(json.dumps(o) for o in objs))
    cluster.kubectl("wait", "--for=condition=Established", "crd/flows.flowkube.io", "--timeout=60s")
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", SYSTEM_NAMESPACE,
                                     check=False).returncode == 0, 30, "the flowkube-system namespace ready")
    return token_kubeconfig(cluster, SYSTEM_NAMESPACE, SERVICE_ACCOUNT, cluster.root / "operator.kubeconfig")


class OperatorProcess:
    def __init__(self, cluster: LocalCluster, *, name: str = "operator",
                 env: Mapping[str, str] | None = None) -> None:
        self.cluster = cluster
        self.name = name
        self.extra_env = dict(env or {})
        self.metrics_port = free_port()
        self.health_port = free_port()
        self.webhook_port = free_port()
        self.state_port = free_port()
        self.cert_dir = cluster.root / f"{name}-webhook"
        self.proc: subprocess.Popen[bytes] | None = None
        self.managed = "KUBECONFIG" not in self.extra_env  # a caller with its own identity set it all up

    @property
    def log(self) -> Path:
        return procs.log_path(self.cluster.root, self.name)

    def start(self, timeout: float = 60.0) -> OperatorProcess:
        env: dict[str, str] = {
            **os.environ,
            "FLOWKUBE_BIND_ADDRESS": "127.0.0.1",
            "FLOWKUBE_METRICS_PORT": str(self.metrics_port),
            "FLOWKUBE_HEALTH_PORT": str(self.health_port),
            "FLOWKUBE_LOG_FORMAT": "json",
            "FLOWKUBE_RUNNER_IMAGE": "flowkube-runner:local",
            "FLOWKUBE_RUNNER_COMMAND": f"{sys.executable} -m flowkube_runner",
            # Runner processes run on this host (the local node agent): the state API is on loopback.
            "FLOWKUBE_STATE_PORT": str(self.state_port),
            "FLOWKUBE_WEBHOOK_HOST": "127.0.0.1",
            "FLOWKUBE_WEBHOOK_CERT_DIR": str(self.cert_dir),
        }
        if self.managed:
            env |= {
                "KUBECONFIG": str(install_chart_for_local_operator(self.cluster, self.webhook_port)),
                "FLOWKUBE_WEBHOOK_ENABLED": "true",
                "FLOWKUBE_WEBHOOK_PORT": str(self.webhook_port),
                "FLOWKUBE_TLS_SECRET": f"{SYSTEM_NAMESPACE}/{RELEASE}-ca",  # the chart's, as in a cluster
                "FLOWKUBE_WEBHOOK_CONFIGURATION": WEBHOOK_CONFIGURATION,
            }
        env |= self.extra_env
        self.proc = procs.spawn(self.name, [sys.executable, "-m", "flowkube_operator"],
                                root=self.cluster.root, env=env)
        wait_for(self._healthy, timeout, f"operator /healthz (log: {self.log})")
        if self.managed:
            wait_for(self._ca_installed, timeout, "the operator's CA in the webhook configurations")
        return self

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"operator exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
        return http_ok(f"http://127.0.0.1:{self.health_port}/healthz")

    def _ca_installed(self) -> bool:
        ca = (self.cert_dir / "ca.crt").read_bytes() if (self.cert_dir / "ca.crt").exists() else b""
        want = base64.b64encode(ca).decode()
        for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
            out = self.cluster.kubectl("get", kind, WEBHOOK_CONFIGURATION, "-o", "json", check=False)
            if out.returncode != 0:
                return False
            hooks = json.loads(out.stdout)["webhooks"]
            if not ca or any(h.get("clientConfig", {}).get("caBundle") != want for h in hooks):
                return False
        return True

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as r:
            text: str = r.read().decode()
            return text

    def stop(self) -> None:
        """Stop the operator and, as `helm uninstall` would, its webhook configurations and status
        policy: a later test's Flows must not be refused by a webhook nobody serves (flows fail
        closed), nor its status writes by a policy naming another operator."""
        if self.proc is not None:
            procs.terminate(self.proc, grace=10.0)
            self.proc = None
        if self.managed:
            for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
                self.cluster.kubectl("delete", kind, WEBHOOK_CONFIGURATION, "--ignore-not-found", check=False)
            for kind in ("validatingadmissionpolicybinding", "validatingadmissionpolicy"):
                self.cluster.kubectl("delete", kind, STATUS_POLICY, "--ignore-not-found", check=False)

    def kill(self) -> None:
        """SIGKILL, as a crashed or OOM-killed operator: no cleanup, no goodbye."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
