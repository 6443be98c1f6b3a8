"""The node agent's pure core: environment, volume payloads and pod status from plain dicts."""

from __future__ import annotations

from typing import Any

import pytest

from flowkube_devstack.node import podspec
from flowkube_devstack.node.podspec import ConfigError, PodRecord


def _pod(**container: Any) -> dict[str, Any]:
    return {"metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"}},
            "spec": {"nodeName": "n", "serviceAccountName": "sa",
                     "containers": [{"name": "main", "image": "img", **container}]}}


def test_expand_follows_kubernetes_rules() -> None:
    env = {"A": "1"}
    assert podspec.expand("$(A)-$(B)-$$(A)-$", env) == "1-$(B)-$(A)-$"


def test_env_order_sources_and_optional_references() -> None:
    pod = _pod(envFrom=[{"secretRef": {"name": "s"}, "prefix": "S_"},
                        {"configMapRef": {"name": "missing", "optional": True}}],
               env=[{"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                    {"name": "URL", "value": "http://$(KUBERNETES_SERVICE_HOST):$(KUBERNETES_SERVICE_PORT)"},
                    {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
                    {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                    {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "missing", "key": "k",
                                                                      "optional": True}}}])
    objects = {("Secret", "s"): {"pw": b"hunter2"}, ("ConfigMap", "missing"): None}

    env = podspec.container_env(pod, pod["spec"]["containers"][0], objects, 6443, {})

    assert env["S_pw"] == env["PW"] == "hunter2"
    assert env["URL"] == "http://127.0.0.1:6443"
    assert (env["APP"], env["IP"]) == ("x", "127.0.0.1")
    assert "OPT" not in env


def test_a_missing_required_key_is_a_config_error() -> None:
    pod = _pod(env=[{"name": "PW", "valueFrom": {"secretKeyRef": {"name": "s", "key": "nope"}}}])
    with pytest.raises(ConfigError, match="couldn't find key nope"):
        podspec.container_env(pod, pod["spec"]["containers"][0], {("Secret", "s"): {}}, 1, {})


def test_resource_field_ref_uses_limits_then_node_allocatable() -> None:
    container = {"resources": {"limits": {"memory": "256Mi"}}}
    assert podspec.resource_value(container, {"resource": "limits.memory", "divisor": "1Mi"}, {}) == "256"
    assert podspec.resource_value(container, {"resource": "limits.cpu"}, {"cpu": "4"}) == "4"
    assert podspec.resource_value({"resources": {"requests": {"cpu": "250m"}}},
                                  {"resource": "requests.cpu", "divisor": "1m"}, {}) == "250"


def test_projected_service_account_volume() -> None:
    pod = _pod()
    vol = {"name": "kube-api-access-x", "projected": {"defaultMode": 420, "sources": [
        {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace",
                                    "fieldRef": {"fieldPath": "metadata.namespace"}}]}}]}}
    objects = {("ConfigMap", "kube-root-ca.crt"): {"ca.crt": b"PEM"}}

    payload = podspec.volume_payload(pod, vol, objects, {("", 3607): "tok"}, {})

    assert payload == {"token": (b"tok", 0o644), "ca.crt": (b"PEM", 0o644), "namespace": (b"ns", 0o644)}
    assert podspec.token_requests({"spec": {"volumes": [vol]}}) == {("", 3607)}
    assert ("ConfigMap", "kube-root-ca.crt") in podspec.object_refs({"spec": {"volumes": [vol]}})


def test_status_walks_pending_running_failed() -> None:
    pod = _pod()
    pod["status"] = {"conditions": [{"type": "PodScheduled", "status": "True"}]}
    rec = PodRecord.for_pod(pod)
    assert podspec.pod_status(pod, rec)["phase"] == "Pending"

    rec.initialized = rec.sandbox_ready = True
    rec.main[0].state = {"running": {"startedAt": "t"}}
    running = podspec.pod_status(pod, rec)
    conditions = {c["type"]: c["status"] for c in running["conditions"]}
    assert running["phase"] == "Running"
    assert conditions == {"PodScheduled": "True", "PodReadyToStartContainers": "True",
                          "Initialized": "True", "Ready": "True", "ContainersReady": "True"}

    rec.main[0].state = {"terminated": {"exitCode": 2}}
    rec.main[0].final = True
    failed = podspec.pod_status(pod, rec)
    assert failed["phase"] == "Failed"
    assert next(c for c in failed["conditions"] if c["type"] == "Ready")["reason"] == "PodCompleted"


def test_deadline_fails_the_pod_whatever_the_containers_say() -> None:
    rec = PodRecord.for_pod(_pod())
    rec.reason = "DeadlineExceeded"
    assert rec.phase() == "Failed"


def test_termination_message_falls_back_to_the_log_tail_only_on_error() -> None:
    log = b"".join(b"line %d\n" % i for i in range(200))
    assert podspec.termination_message(b"", log, 1, "FallbackToLogsOnError").count("\n") == 79
    assert podspec.termination_message(b"", log, 0, "FallbackToLogsOnError") == ""
    assert podspec.termination_message(b"msg", log, 1, "FallbackToLogsOnError") == "msg"
    assert podspec.termination_message(b"", log, 1, "File") == ""
