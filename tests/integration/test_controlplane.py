"""The local control plane is a real Kubernetes: version, garbage collection, Pod Security admission."""

from __future__ import annotations

import json

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.versions import KUBERNETES_VERSION


def test_server_reports_the_version_it_was_built_from(cluster: LocalCluster) -> None:
    out = json.loads(cluster.kubectl("version", "-o", "json").stdout)
    assert out["serverVersion"]["gitVersion"] == KUBERNETES_VERSION
    assert out["clientVersion"]["gitVersion"] == KUBERNETES_VERSION


def _pod(name: str, **spec: object) -> dict[str, object]:
    base = {"restartPolicy": "Never",
            "containers": [{"name": "main", "image": "ignored", "command": ["sleep", "300"]}]}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": {**base, **spec}}


def test_deleting_an_owner_garbage_collects_its_pods(cluster: LocalCluster, namespace: str) -> None:
    owner = cluster.api("POST", f"/api/v1/namespaces/{namespace}/configmaps",
                        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "owner"}})
    pod = _pod("owned")
    pod["metadata"] = {"name": "owned", "ownerReferences": [{
        "apiVersion": "v1", "kind": "ConfigMap", "name": "owner", "uid": owner["metadata"]["uid"]}]}
    cluster.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod)
    cluster.api("DELETE", f"/api/v1/namespaces/{namespace}/configmaps/owner")

    def pod_gone() -> bool:
        out = cluster.kubectl("get", "pod", "owned", "-n", namespace, "--ignore-not-found", "-o", "name")
        return out.stdout.strip() == ""

    wait_for(pod_gone, 60, "the garbage collector to delete the owned pod")


def test_restricted_namespace_refuses_a_privileged_pod(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    pod = _pod("bad", hostNetwork=True)
    out = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(pod), check=False)
    assert out.returncode != 0
    assert 'violates PodSecurity "restricted:latest"' in out.stderr
    assert "host namespaces" in out.stderr
    assert "runAsNonRoot" in out.stderr
