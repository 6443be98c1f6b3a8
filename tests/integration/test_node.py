"""The local cluster's real node: kubelet, containerd and runc, the CNI bridge, kube-proxy and CoreDNS.

Each test checks something a workload relies on, through the API, with real containers of the
locally built devstack image (Debian's Python, the project's packages).
"""

from __future__ import annotations

import json
import urllib.error
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from tests.integration.conftest import terminated_states, watched_pods

pytestmark = pytest.mark.controlplane

Pod = dict[str, Any]

RESTRICTED = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
              "runAsUser": 65532, "runAsGroup": 65532, "capabilities": {"drop": ["ALL"]},
              "seccompProfile": {"type": "RuntimeDefault"}}


def _pod(cluster: LocalCluster, name: str, script: str, **spec: Any) -> Pod:
    assert cluster.images is not None
    container = {"name": "main", "image": cluster.images.devstack, "imagePullPolicy": "Never",
                 "command": ["sh", "-c", script], "securityContext": RESTRICTED,
                 "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}], **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": {"app": name}},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 10,
                     "volumes": [{"name": "tmp", "emptyDir": {}}], "containers": [container], **spec}}


def _create(cluster: LocalCluster, ns: str, obj: Pod) -> None:
    plural = {"Pod": "pods", "Secret": "secrets", "Service": "services"}[obj["kind"]]
    cluster.api("POST", f"/api/v1/namespaces/{ns}/{plural}", obj)


def _get(cluster: LocalCluster, ns: str, name: str) -> Pod | None:
    try:
        pod: Pod = cluster.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    return pod


def _wait_phase(cluster: LocalCluster, ns: str, name: str, *phases: str, timeout: float = 60) -> Pod:
    seen: dict[str, Pod] = {}

    def reached() -> bool:
        pod = _get(cluster, ns, name)
        if pod is not None:
            seen["pod"] = pod
        return pod is not None and pod.get("status", {}).get("phase") in phases

    try:
        wait_for(reached, timeout, f"pod {ns}/{name} to reach {'/'.join(phases)}", interval=0.1)
    except Exception as e:
        raise AssertionError(f"{e}; last seen: {json.dumps(seen.get('pod', {}).get('status'))[:2000]}") from e
    return seen["pod"]


def _terminated(pod: Pod) -> dict[str, Any]:
    state: dict[str, Any] = pod["status"]["containerStatuses"][0]["state"]
    return dict(state["terminated"])


def test_env_from_a_secret_exit_code_and_termination_message(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                                 "stringData": {"API_KEY": "s3cret"}})
    _create(cluster, namespace, _pod(cluster, "envy", 'printf "%s $(id -u)" "$API_KEY" > /dev/termination-log; exit 3',
                                     container={"envFrom": [{"secretRef": {"name": "creds"}}]}))
    term = _terminated(_wait_phase(cluster, namespace, "envy", "Failed"))
    assert (term["exitCode"], term.get("message")) == (3, "s3cret 65532")
    node = json.loads(cluster.kubectl("get", "node", "-o", "json").stdout)["items"][0]
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://")
    assert node["status"]["nodeInfo"]["kubeletVersion"] == "v1.36.3"


def test_logs_exec_and_a_read_only_root_filesystem(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, _pod(cluster, "shell", "echo line one; echo line two >&2; exec sleep 600"))
    _wait_phase(cluster, namespace, "shell", "Running")
    wait_for(lambda: "line two" in cluster.kubectl("logs", "-n", namespace, "shell").stdout, 30, "the log")
    # Both streams, each line whole (their order across stdout and stderr is not kept).
    assert sorted(cluster.kubectl("logs", "-n", namespace, "shell").stdout.splitlines()) == ["line one", "line two"]
    out = cluster.kubectl("exec", "-n", namespace, "shell", "--", "sh", "-c",
                          "id -u; touch /tmp/ok && echo tmp-writable; touch /nope 2>/dev/null || echo root-read-only")
    assert out.stdout.split() == ["65532", "tmp-writable", "root-read-only"]


def test_pods_reach_a_service_by_name_and_the_api_server_by_its_service(cluster: LocalCluster,
                                                                         namespace: str) -> None:
    _create(cluster, namespace, _pod(cluster, "web", "cd /tmp && echo hello > index.html && "
                                     "exec python -m http.server 8080",
                                     container={"ports": [{"containerPort": 8080}],
                                                "readinessProbe": {"tcpSocket": {"port": 8080}, "periodSeconds": 1}}))
    _create(cluster, namespace, {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "web"},
                                 "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": 8080}]}})
    wait_for(lambda: any(c["type"] == "Ready" and c["status"] == "True"
                         for c in (_get(cluster, namespace, "web") or {}).get("status", {}).get("conditions", [])),
             60, "the web pod Ready (readiness probe)")
    # CoreDNS resolves the Service's name, kube-proxy forwards its ClusterIP to the pod; the API
    # server answers at the `kubernetes` Service with the pod's own ServiceAccount identity.
    script = (
        # A new Service reaches CoreDNS and kube-proxy's rules a moment after it is created, as in
        # any cluster: the client retries until its deadline, as a real client would.
        "import json, ssl, time, urllib.request, urllib.error\n"
        f"url = 'http://web.{namespace}.svc.cluster.local/'\n"
        "deadline = time.monotonic() + 30\n"
        "while True:\n"
        "    try:\n        body = urllib.request.urlopen(url, timeout=5).read(); break\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline: raise\n"
        "        time.sleep(0.2)\n"
        "print(body.decode().strip())\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount/'\n"
        "ctx = ssl.create_default_context(cafile=sa + 'ca.crt')\n"
        "req = urllib.request.Request('https://kubernetes.default.svc/api/v1/nodes',"
        " headers={'Authorization': 'Bearer ' + open(sa + 'token').read()})\n"
        "try:\n    urllib.request.urlopen(req, context=ctx, timeout=10)\n"
        "except urllib.error.HTTPError as e:\n    print(e.code, json.loads(e.read())['message'])\n"
    )
    _create(cluster, namespace, _pod(cluster, "client", "", container={"command": ["python", "-c", script]}))
    pod = _wait_phase(cluster, namespace, "client", "Succeeded", "Failed")
    out = cluster.kubectl("logs", "-n", namespace, "client").stdout.splitlines()
    assert pod["status"]["phase"] == "Succeeded", "\n".join(out)
    assert out[0] == "hello"
    assert out[1].startswith("403 ") and f"system:serviceaccount:{namespace}:default" in out[1], out


def test_a_memory_limit_is_enforced(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, _pod(cluster, "hog", "", container={
        "command": ["python", "-c", "x = bytearray(256 * 1024 * 1024); print(len(x))"],
        "resources": {"limits": {"memory": "64Mi"}, "requests": {"memory": "64Mi"}}}))
    term = _terminated(_wait_phase(cluster, namespace, "hog", "Failed"))
    assert term["reason"] == "OOMKilled" and term["exitCode"] == 137, term


def test_deleting_a_running_pod_sends_sigterm_and_waits_for_it(cluster: LocalCluster, namespace: str) -> None:
    script = 'trap "echo got-TERM > /dev/termination-log; exit 0" TERM; while true; do sleep 0.1; done'
    with watched_pods(cluster, namespace, "-l", "app=victim") as watch:
        _create(cluster, namespace, _pod(cluster, "victim", script))
        _wait_phase(cluster, namespace, "victim", "Running")
        cluster.kubectl("delete", "pod", "victim", "-n", namespace, "--wait=true", "--timeout=60s")
        watch.wait(lambda pods: bool(terminated_states(pods)), 30, "the container reported terminated")
        terminated = terminated_states(watch.seen)
    assert terminated[-1].get("message") == "got-TERM\n" and terminated[-1]["exitCode"] == 0


@pytest.mark.slow
def test_pods_outlive_an_api_server_restart(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, _pod(cluster, "survivor", "while [ ! -e /tmp/go ]; do sleep 0.1; done; "
                                     "echo survived > /dev/termination-log"))
    _wait_phase(cluster, namespace, "survivor", "Running")
    cluster.restart_apiserver()
    cluster.kubectl("exec", "-n", namespace, "survivor", "--", "touch", "/tmp/go")
    _create(cluster, namespace, _pod(cluster, "newcomer", "true"))
    assert _terminated(_wait_phase(cluster, namespace, "survivor", "Succeeded"))["message"] == "survived\n"
    _wait_phase(cluster, namespace, "newcomer", "Succeeded")
