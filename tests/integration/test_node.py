"""The local node agent runs bound pods as host processes and reports them truthfully through the API."""

from __future__ import annotations

import sys
import textwrap
import urllib.error
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for

pytestmark = pytest.mark.controlplane

Pod = dict[str, Any]


def _pod(name: str, script: str, **spec: Any) -> Pod:
    container = {"name": "main", "image": "ignored", "command": ["sh", "-c", script],
                 **spec.pop("container", {})}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 10,
                     "containers": [container], **spec}}


def _create(cluster: LocalCluster, ns: str, obj: Pod) -> None:
    plural = {"Pod": "pods", "Secret": "secrets", "ConfigMap": "configmaps"}[obj["kind"]]
    cluster.api("POST", f"/api/v1/namespaces/{ns}/{plural}", obj)


def _get(cluster: LocalCluster, ns: str, name: str) -> Pod | None:
    try:
        pod: Pod = cluster.api("GET", f"/api/v1/namespaces/{ns}/pods/{name}")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            return None
        raise
    return pod


def _wait_phase(cluster: LocalCluster, ns: str, name: str, *phases: str, timeout: float = 30) -> Pod:
    seen: dict[str, Pod] = {}

    def reached() -> bool:
        pod = _get(cluster, ns, name)
        if pod is not None:
            seen["pod"] = pod
        return pod is not None and pod.get("status", {}).get("phase") in phases

    wait_for(reached, timeout, f"pod {ns}/{name} to reach {'/'.join(phases)}", interval=0.05)
    return seen["pod"]


def _terminated(pod: Pod) -> dict[str, Any]:
    state: dict[str, Any] = pod["status"]["containerStatuses"][0]["state"]
    return dict(state["terminated"])


def test_env_from_a_secret_exit_code_and_termination_message(cluster: LocalCluster,
                                                              namespace: str) -> None:
    _create(cluster, namespace, {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "creds"},
                                 "stringData": {"password": "hunter2", "user": "bob"}})
    _create(cluster, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "cfg"},
                                 "data": {"greeting": "hello"}})
    script = 'printf "%s %s %s %s %s" "$PASSWORD" "$CREDS_user" "$GREETING" "$ME" "$(pwd)" ' \
             '> /dev/termination-log; exit 3'
    _create(cluster, namespace, _pod("env", script, container={
        "workingDir": "/tmp",
        "env": [{"name": "PASSWORD", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "password"}}},
                {"name": "GREETING", "valueFrom": {"configMapKeyRef": {"name": "cfg", "key": "greeting"}}},
                {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
        "envFrom": [{"secretRef": {"name": "creds"}, "prefix": "CREDS_"}]}))

    pod = _wait_phase(cluster, namespace, "env", "Failed")

    term = _terminated(pod)
    assert term["exitCode"] == 3
    assert term["reason"] == "Error"
    assert term["message"] == "hunter2 bob hello env /tmp"
    assert pod["status"]["podIP"] == "127.0.0.1"
    assert {c["type"]: c["status"] for c in pod["status"]["conditions"]}["Ready"] == "False"


def test_a_failing_container_reports_its_log_tail_when_asked(cluster: LocalCluster,
                                                             namespace: str) -> None:
    _create(cluster, namespace, _pod("fails", "echo first; echo boom >&2; exit 7", container={
        "terminationMessagePolicy": "FallbackToLogsOnError"}))

    term = _terminated(_wait_phase(cluster, namespace, "fails", "Failed", "Succeeded"))

    assert (term["exitCode"], term["reason"]) == (7, "Error")
    assert term["message"] == "first\nboom"


def test_a_container_without_command_fails_with_a_reason(cluster: LocalCluster, namespace: str) -> None:
    pod = _pod("nocmd", "")
    del pod["spec"]["containers"][0]["command"]
    _create(cluster, namespace, pod)

    term = _terminated(_wait_phase(cluster, namespace, "nocmd", "Failed"))

    assert term["reason"] == "StartError"
    assert "ENTRYPOINT" in term["message"]


WHOAMI = textwrap.dedent("""
    import json, os, ssl, sys, time, urllib.request
    from pathlib import Path
    shared = Path(sys.argv[1])
    (shared / os.environ["ME"]).touch()
    while len(list(shared.iterdir())) < 2:  # both pods are up: their mounts coexist
        time.sleep(0.02)
    sa = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ["KUBERNETES_SERVICE_PORT"]
    req = urllib.request.Request(
        f"https://{host}:{port}/apis/authentication.k8s.io/v1/selfsubjectreviews", method="POST",
        data=json.dumps({"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"}).encode(),
        headers={"Authorization": "Bearer " + (sa / "token").read_text(),
                 "Content-Type": "application/json"})
    ctx = ssl.create_default_context(cafile=str(sa / "ca.crt"))
    info = json.load(urllib.request.urlopen(req, context=ctx))["status"]["userInfo"]
    pod_name = info["extra"]["authentication.kubernetes.io/pod-name"][0]
    Path("/dev/termination-log").write_text(f"{info['username']} {pod_name} {(sa / 'namespace').read_text()}")
""")


def test_pods_call_the_api_with_their_own_service_account_token(cluster: LocalCluster, namespace: str,
                                                                 tmp_path: Path) -> None:
    for name in ("who-a", "who-b"):
        pod = _pod(name, "", container={
            "command": [sys.executable, "-c", WHOAMI, str(tmp_path)],
            "env": [{"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]})
        _create(cluster, namespace, pod)

    for name in ("who-a", "who-b"):
        pod = _wait_phase(cluster, namespace, name, "Succeeded", "Failed")
        term = _terminated(pod)
        assert term["exitCode"] == 0, term
        assert term["message"] == f"system:serviceaccount:{namespace}:default {name} {namespace}"


def test_init_containers_empty_dir_and_config_map_volumes(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "files"},
                                 "data": {"a.txt": "from-configmap"}})
    pod = _pod("vols", "cat /work/init.txt /work/files/renamed.txt > /dev/termination-log", container={
        "volumeMounts": [{"name": "work", "mountPath": "/work"},
                         {"name": "files", "mountPath": "/work/files", "readOnly": True}]},
        initContainers=[{"name": "init", "image": "ignored",
                         "command": ["sh", "-c", "printf from-init- > /work/init.txt"],
                         "volumeMounts": [{"name": "work", "mountPath": "/work"}]}],
        volumes=[{"name": "work", "emptyDir": {}},
                 {"name": "files", "configMap": {"name": "files",
                                                 "items": [{"key": "a.txt", "path": "renamed.txt"}]}}])
    _create(cluster, namespace, pod)

    done = _wait_phase(cluster, namespace, "vols", "Succeeded", "Failed")

    assert _terminated(done)["message"] == "from-init-from-configmap"
    init = done["status"]["initContainerStatuses"][0]["state"]["terminated"]
    assert (init["exitCode"], init["reason"]) == (0, "Completed")
    assert not Path("/work/init.txt").exists(), "the emptyDir must not leak onto the host path"


def test_a_volume_over_tmp_hides_nothing_the_agent_mounts_after_it(cluster: LocalCluster,
                                                                   namespace: str) -> None:
    # The agent's state (and so every volume source) lives under /tmp in tests, as it does for the
    # operator's runner pods, which mount an emptyDir at /tmp.
    _create(cluster, namespace, _pod("tmpvol", "echo ok > /dev/termination-log; test -z \"$(ls /tmp)\"",
                                     container={"volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}]},
                                     volumes=[{"name": "tmp", "emptyDir": {}}]))

    term = _terminated(_wait_phase(cluster, namespace, "tmpvol", "Succeeded", "Failed"))

    assert (term["exitCode"], term.get("message")) == (0, "ok\n")


def test_active_deadline_fails_the_pod(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, _pod("slow", "sleep 300", activeDeadlineSeconds=2))

    pod = _wait_phase(cluster, namespace, "slow", "Failed", timeout=20)

    assert pod["status"]["reason"] == "DeadlineExceeded"
    assert _terminated(pod)["exitCode"] == 128 + 15  # SIGTERM


def test_deleting_a_running_pod_terminates_it_gracefully(cluster: LocalCluster, namespace: str,
                                                         tmp_path: Path) -> None:
    started, trapped = tmp_path / "started", tmp_path / "trapped"
    script = f'trap "echo TERM > {trapped}; exit 0" TERM; touch {started}; ' \
             'while true; do sleep 0.05; done'
    _create(cluster, namespace, _pod("victim", script))
    _wait_phase(cluster, namespace, "victim", "Running")
    wait_for(started.exists, 10, "the container to start")

    cluster.api("DELETE", f"/api/v1/namespaces/{namespace}/pods/victim")

    wait_for(lambda: _get(cluster, namespace, "victim") is None, 15, "the pod to disappear")
    assert trapped.read_text().strip() == "TERM"


def test_kubectl_logs_returns_the_container_output(cluster: LocalCluster, namespace: str) -> None:
    _create(cluster, namespace, _pod("talker", "echo line one; echo line two >&2"))
    _wait_phase(cluster, namespace, "talker", "Succeeded")

    out = cluster.kubectl("logs", "-n", namespace, "talker")
    tail = cluster.kubectl("logs", "-n", namespace, "talker", "--tail=1")

    assert out.stdout == "line one\nline two\n"
    assert tail.stdout == "line two\n"


def test_run_as_user_runs_the_process_as_that_user(cluster: LocalCluster, namespace: str) -> None:
    # As the venv's Python: the agent must make its Python environment reachable for that user.
    script = ("import os; token = open('/var/run/secrets/kubernetes.io/serviceaccount/token').read(); "
              "open('/dev/termination-log', 'w').write(f'{os.getuid()} {os.getgid()} {token[:3]}')")
    _create(cluster, namespace, _pod("nobody", "", container={"command": [sys.executable, "-c", script]},
                                     securityContext={"runAsUser": 65534, "runAsGroup": 65534,
                                                      "runAsNonRoot": True}))

    term = _terminated(_wait_phase(cluster, namespace, "nobody", "Succeeded", "Failed"))

    assert term.get("message") == "65534 65534 eyJ", term


@pytest.mark.slow
def test_pods_outlive_an_api_server_restart(cluster: LocalCluster, namespace: str,
                                            tmp_path: Path) -> None:
    go = tmp_path / "go"
    _create(cluster, namespace, _pod(
        "survivor", f"while [ ! -e {go} ]; do sleep 0.05; done; echo survived > /dev/termination-log"))
    _wait_phase(cluster, namespace, "survivor", "Running")

    cluster.restart_apiserver()
    go.touch()
    _create(cluster, namespace, _pod("newcomer", "true"))

    assert _terminated(_wait_phase(cluster, namespace, "survivor", "Succeeded"))["message"] == "survived\n"
    _wait_phase(cluster, namespace, "newcomer", "Succeeded")
