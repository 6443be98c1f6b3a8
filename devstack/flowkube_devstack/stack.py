"""The whole local stack in one place: a cluster with a real node, the stub model, the operator.

Used by `./dev up` / `./dev demo` (held by a background supervisor). Everything runs as it would in a
cluster: the operator is installed with `helm install` of charts/flowkube from its locally built
image, runner pods run from the runner image, and the stub model (the one stand-in: there is no
network to a real model provider) runs as a pod behind the Service `stub-model.flowkube-dev`. Traces
go to Jaeger (built from its Go module), a process of the host behind the Service `jaeger.flowkube-dev`.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from flowkube_devstack import images
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.jaeger import Jaeger
from flowkube_devstack.operator import ChartOperator

STUB_NAMESPACE = "flowkube-dev"
STUB_PORT = 8000

# The demo's model: drafts are "A plain reply."; a reviewer's "approved" collapses to `approved`.
DEMO_RULES: dict[str, Any] = {
    "default": "A plain reply.",
    "rules": [{"contains": "approved", "anywhere": True, "reply": "approved"}],
}

_RESTRICTED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
               "runAsUser": 65532, "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}


def deploy_stub_model(kubectl: Callable[..., subprocess.CompletedProcess[str]], image: str, rules: dict[str, Any],
                      timeout: float = 180.0) -> str:
    """The stub model, run from ``image`` (the devstack image), as a Deployment and Service of the cluster
    ``kubectl`` reaches; returns the URL runner pods use. ``kubectl(*args, check=, input=, timeout=)`` as
    ``LocalCluster.kubectl``: it raises when ``check`` and kubectl fails."""
    if kubectl("get", "namespace", STUB_NAMESPACE, check=False).returncode != 0:
        kubectl("create", "namespace", STUB_NAMESPACE)
    kubectl("label", "namespace", STUB_NAMESPACE, "--overwrite", "pod-security.kubernetes.io/enforce=restricted")
    labels = {"app.kubernetes.io/name": "stub-model"}
    objs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "stub-model-rules", "namespace": STUB_NAMESPACE},
         "data": {"rules.json": json.dumps(rules, indent=2)}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "stub-model", "namespace": STUB_NAMESPACE},
         "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
             "metadata": {"labels": labels},
             "spec": {"automountServiceAccountToken": False, "containers": [{
                 "name": "stub-model", "image": image, "imagePullPolicy": "Never",
                 "command": [*images.STUB_MODEL_COMMAND, "--host", "0.0.0.0",  # noqa: S104 (in its pod)
                             "--port", str(STUB_PORT),
                             "--rules", "/etc/stub-model/rules.json"],
                 "ports": [{"name": "http", "containerPort": STUB_PORT}],
                 "readinessProbe": {"tcpSocket": {"port": "http"}, "periodSeconds": 1},
                 "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "128Mi"}},
                 "securityContext": _RESTRICTED,
                 "volumeMounts": [{"name": "rules", "mountPath": "/etc/stub-model"}]}],
                 "volumes": [{"name": "rules", "configMap": {"name": "stub-model-rules"}}]}}}},
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "stub-model", "namespace": STUB_NAMESPACE},
         "spec": {"selector": labels, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}},
    ]
    kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(o) for o in objs))
    kubectl("rollout", "status", "deployment/stub-model", "-n", STUB_NAMESPACE, f"--timeout={int(timeout)}s",
            timeout=timeout + 10)
    return f"http://stub-model.{STUB_NAMESPACE}.svc"


@contextmanager
def dev_stack(root: Path, rules: dict[str, Any] | None = None) -> Iterator[dict[str, Any]]:
    """Start everything; yield what a user needs to know (kubeconfig, URLs)."""
    with ExitStack() as stack:
        cluster = LocalCluster(root / "cluster").start()
        stack.callback(cluster.stop)
        assert cluster.images is not None
        stub = deploy_stub_model(cluster.kubectl, cluster.images.devstack, rules or DEMO_RULES)
        # The trace backend: Jaeger on the host, a Service of the cluster for the operator and its pods.
        jaeger = Jaeger.beside(cluster, root / "jaeger")
        stack.callback(jaeger.stop)
        # The key comes from each Flow's own Secret (see examples/flows); the stub is the endpoint.
        operator = ChartOperator(cluster, runner_env={"OPENAI_BASE_URL": f"{stub}/v1",
                                                      "CREWAI_TRACING_ENABLED": "false"},
                                 values=[f"tracing.endpoint={jaeger.endpoint}",
                                         f"console.traceUrl={jaeger.query}/api/traces/{{traceId}}"]).start()
        token = root / "metrics.token"  # /metrics asks for a token of a user allowed `get /metrics`
        token.write_text(operator.metrics_token())
        token.chmod(0o600)
        yield {**cluster.describe(), "stub": stub, "metrics": f"http://{operator.metrics_target}/metrics",
               "metrics_token_file": str(token), "console": operator.console_url(), "jaeger": jaeger.query}
