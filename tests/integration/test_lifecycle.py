"""The operator's run lifecycle: the Helm-installed operator on the real node, scripted fake runner pods."""

from __future__ import annotations

import json
import ssl
import subprocess
from typing import Any

import pytest

from flowkube_api.constants import report_key
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows, terminated_states, watched_pods

pytestmark = pytest.mark.usefixtures("operator")


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == ctype)


def test_flow_succeeds_with_usage_output_and_a_restricted_owned_pod(flows: Flows) -> None:
    flows.apply("ok", {"flowRef": "pkg.flows:Research",
                       "inputs": {"plan": [{"tokens": 7, "output": "hello"}]}})
    st = flows.wait_phase("ok", "Succeeded")
    assert st["usage"]["totalTokens"] == 7 and st["usage"]["byModel"]["stub-model"]["promptTokens"] == 7
    assert st["result"]["output"] == "hello"
    assert [r["trigger"] for r in st["runs"]] == ["kickoff"] and st["runs"][0]["result"] == "Succeeded"
    assert cond(st, "Succeeded")["status"] == "True" and st["definition"] == "Research"
    (pod,) = flows.pods("ok")
    assert pod["metadata"]["name"] == "ok-0"
    header, row = flows.cluster.kubectl("get", "flow", "ok", "-n", flows.ns, "-o", "wide").stdout.splitlines()
    assert header.split()[-3:] == ["LAST-RUN", "TURNS", "FLOW-ID"] and "ok-0" in row.split()
    assert pod["metadata"]["ownerReferences"][0]["kind"] == "Flow"
    sc = pod["spec"]["containers"][0]["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"]["drop"] == ["ALL"]
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True

    def success_event() -> bool:
        out = flows.cluster.kubectl("get", "events", "-n", flows.ns, "--field-selector",
                                    "involvedObject.name=ok,reason=RunSucceeded", "-o", "json").stdout
        return any("ok-0 succeeded" in (e.get("message") or e.get("note") or "")
                   for e in json.loads(out)["items"])

    wait_for(success_event, 30, "the RunSucceeded Event for `kubectl describe`")


def test_failures_are_retried_with_backoff_then_the_flow_fails(flows: Flows) -> None:
    flows.apply("flaky", {"flowRef": "a:B", "retries": {"limit": 2, "backoffSeconds": 1},
                          "inputs": {"plan": [{"result": "Failed", "exit": 3, "tokens": 1}]}})
    st = flows.wait_phase("flaky", "Failed", timeout=90)
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "retry", "retry"]
    assert all(r["result"] == "Failed" and r["exitCode"] == 3 for r in st["runs"])
    assert cond(st, "Succeeded")["reason"] == "RetriesExhausted"
    assert st["usage"]["totalTokens"] == 3  # every failed run's tokens count, once
    assert len(flows.pods("flaky")) == 3


def test_retry_succeeds_after_a_failure(flows: Flows) -> None:
    flows.apply("second-time", {"flowRef": "a:B", "retries": {"limit": 1, "backoffSeconds": 0},
                                "inputs": {"plan": [{"result": "Failed", "exit": 3}, {}]}})
    st = flows.wait_phase("second-time", "Succeeded")
    assert [(r["trigger"], r["result"]) for r in st["runs"]] == [("kickoff", "Failed"), ("retry", "Succeeded")]


def test_permanent_failure_is_not_retried(flows: Flows) -> None:
    flows.apply("broken", {"flowRef": "a:B", "retries": {"limit": 3},
                           "inputs": {"plan": [{"result": "Failed", "exit": 2, "reason": "InvalidFlowRef",
                                                "message": "No module named 'a'"}]}})
    st = flows.wait_phase("broken", "Failed")
    assert len(st["runs"]) == 1
    assert cond(st, "Accepted")["status"] == "False" and cond(st, "Accepted")["reason"] == "InvalidFlowRef"
    assert "No module named" in st["message"]


def test_active_deadline_stops_the_flow_and_counts_every_token_it_reported(
        flows: Flows, cluster: LocalCluster) -> None:
    # The pod makes a "call" and reports its usage every 0.1 s, and completes calls for 1 s more once
    # it is told to stop, then says how many it made in all and before the stop (its termination
    # message). The run ends only once the pod is gone, so every call is in the status, also those
    # completed after SIGTERM, not just those reported when the deadline passed.
    with watched_pods(cluster, flows.ns, "-l", "flowkube.io/flow=slow") as watch:
        # 8 s: long enough for the pod's Python to be up and handling SIGTERM on a loaded machine (as
        # PID 1 it ignores a SIGTERM that comes before its handler, and runs on until SIGKILL).
        flows.apply("slow", {"flowRef": "a:B", "activeDeadlineSeconds": 8, "retries": {"limit": 3}, "inputs": {
            "plan": [{"sleep": 120, "interim": 0.1, "finish_on_term": 1}]}})
        flows.wait_phase("slow", "Running")
        st = flows.wait_phase("slow", "Failed", timeout=60)
        # The last state the kubelet reported of the runner container, before the pod went away.
        watch.wait(lambda pods: bool(terminated_states(pods)), 30, "the runner container reported terminated")
        messages = [t.get("message", "") for t in terminated_states(watch.seen)]
    assert cond(st, "Succeeded")["reason"] == "DeadlineExceeded"
    assert len(st["runs"]) == 1
    assert messages and messages[-1].startswith("calls="), (messages, terminated_states(watch.seen))
    fields = dict(kv.split("=") for kv in messages[-1].split())
    made, at_term = int(fields["calls"]), int(fields["at_term"])
    # Calls completed after SIGTERM exist, and every call, before and after, is counted once.
    assert made > at_term and st["usage"]["totalTokens"] == made, (made, at_term, st["usage"])


@pytest.mark.parametrize("how", ["evicted", "deleted"])
def test_a_disrupted_runner_is_replaced_without_a_retry_and_every_call_counts(
        flows: Flows, cluster: LocalCluster, how: str) -> None:
    # No `retries`: a pod taken away by Kubernetes (the Eviction API, as a drain does) or deleted by
    # someone is not the flow's failure. The pod finishes its call in flight after SIGTERM, reports
    # it, and a replacement continues the flow.
    name = f"moved-{how}"
    with watched_pods(cluster, flows.ns, "-l", f"flowkube.io/flow={name}") as watch:
        flows.apply(name, {"flowRef": "a:B", "inputs": {
            "plan": [{"sleep": 120, "interim": 0.1, "finish_on_term": 1}, {"tokens": 2}]}})
        flows.wait_phase(name, "Running")

        def reported() -> bool:  # the pod is up and its interim report is in (a call "answered")
            cm = cluster.kubectl("get", "configmap", f"{name}-state", "-n", flows.ns, "-o", "json", check=False)
            return cm.returncode == 0 and report_key(f"{name}-0") in json.loads(cm.stdout).get("binaryData", {})

        wait_for(reported, 60, "the first runner's interim report")
        if how == "evicted":
            eviction = {"apiVersion": "policy/v1", "kind": "Eviction",
                        "metadata": {"name": f"{name}-0", "namespace": flows.ns}}
            cluster.kubectl("create", "--raw", f"/api/v1/namespaces/{flows.ns}/pods/{name}-0/eviction",
                            "-f", "-", input=json.dumps(eviction))
        else:
            cluster.kubectl("delete", "pod", "-n", flows.ns, f"{name}-0", "--wait=false")
        st = flows.wait_phase(name, "Succeeded", timeout=90)
        watch.wait(lambda pods: any(t.get("message", "").startswith("calls=") for t in terminated_states(pods)),
                   30, "the first runner's termination message")
        messages = [t["message"] for t in terminated_states(watch.seen) if t.get("message", "").startswith("calls=")]
    runs = st["runs"]
    assert [r["trigger"] for r in runs] == ["kickoff", "retry"], runs
    assert runs[0]["reason"] in ("Disrupted", "PodDeleted") and runs[1]["result"] == "Succeeded", runs
    if how == "evicted" and runs[0]["reason"] == "Disrupted":
        assert "EvictionByEvictionAPI" in runs[0]["message"]
    fields = dict(kv.split("=") for kv in messages[-1].split())
    made, at_term = int(fields["calls"]), int(fields["at_term"])
    assert made > at_term and st["usage"]["totalTokens"] == made + 2, (made, at_term, st["usage"])
    events = cluster.kubectl("get", "events", "-n", flows.ns, "--field-selector",
                             f"involvedObject.name={name},reason=Disrupted", "-o", "json").stdout
    assert json.loads(events)["items"], "a Disrupted event for `kubectl describe`"


def test_suspend_and_unsuspend(flows: Flows, cluster: LocalCluster) -> None:
    flows.apply("held", {"flowRef": "a:B", "suspend": True})
    flows.wait_phase("held", "Suspended")
    assert flows.pods("held") == []
    cluster.kubectl("patch", "flow", "held", "-n", flows.ns, "--type=merge", "-p", '{"spec":{"suspend":false}}')
    flows.wait_phase("held", "Succeeded")


def test_ttl_deletes_the_finished_flow_and_its_pods(flows: Flows) -> None:
    # Watched, not polled: a busy machine's kubectl can miss the second the Flow spends Succeeded.
    with watched_pods(flows.cluster, flows.ns, "--field-selector", "metadata.name=short-lived",
                      resource="flows") as watch:
        flows.apply("short-lived", {"flowRef": "a:B", "ttlSecondsAfterFinished": 1})
        watch.wait(lambda seen: any((f.get("status") or {}).get("phase") == "Succeeded" for f in seen), 60,
                   "the flow to succeed")
        wait_for(lambda: flows.get("short-lived") is None, 30, "the TTL to delete the flow")
    wait_for(lambda: flows.pods("short-lived") == [], 60, "its pods to be garbage-collected")


def test_deleting_a_running_flow_removes_its_pod(flows: Flows, cluster: LocalCluster) -> None:
    flows.apply("doomed", {"flowRef": "a:B", "inputs": {"plan": [{"sleep": 120}]}})
    flows.wait_phase("doomed", "Running")
    cluster.kubectl("delete", "flow", "doomed", "-n", flows.ns, "--wait=false")
    wait_for(lambda: flows.pods("doomed") == [], 60, "the running pod to go with its flow")


def test_pod_deleted_from_outside_is_a_failed_attempt_and_is_retried(flows: Flows, cluster: LocalCluster) -> None:
    flows.apply("victim", {"flowRef": "a:B", "retries": {"limit": 1, "backoffSeconds": 0},
                           "inputs": {"plan": [{"sleep": 120}, {}]}})
    flows.wait_phase("victim", "Running")
    cluster.kubectl("delete", "pod", "victim-0", "-n", flows.ns, "--wait=false")
    st = flows.wait_phase("victim", "Succeeded", timeout=90)
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "retry"]
    assert st["runs"][0]["result"] == "Failed"


def test_operator_killed_mid_run_resumes_without_a_duplicate_pod(
        flows: Flows, operator: ChartOperator, tmp_path: Any) -> None:
    flows.apply("survivor", {"flowRef": "a:B", "inputs": {"plan": [{"sleep": 4}]}})
    flows.wait_phase("survivor", "Running")
    operator.kill()
    operator.start()
    st = flows.wait_phase("survivor", "Succeeded", timeout=90)
    assert len(st["runs"]) == 1
    assert [p["metadata"]["name"] for p in flows.pods("survivor")] == ["survivor-0"]


def test_runner_credentials_reach_only_their_own_flows_state(flows: Flows, cluster: LocalCluster,
                                                             operator: ChartOperator, tmp_path: Any) -> None:
    import httpx

    from flowkube_api import constants as c

    flows.apply("theirs", {"flowRef": "a:B", "inputs": {"plan": [{"tokens": 1}]}})
    flows.wait_phase("theirs", "Succeeded")
    flows.apply("mine", {"flowRef": "a:B", "inputs": {"plan": [{"sleep": 120}]}})
    flows.wait_phase("mine", "Running")
    (pod,) = flows.pods("mine")
    spec = pod["spec"]
    # No Kubernetes API credentials in the pod: no automounted token, one token for the state API only.
    assert spec["automountServiceAccountToken"] is False and spec.get("serviceAccountName", "default") == "default"
    tokens = [s["serviceAccountToken"] for v in spec["volumes"] for s in (v.get("projected") or {}).get("sources", [])
              if "serviceAccountToken" in s]
    assert tokens == [{"audience": c.STATE_AUDIENCE, "expirationSeconds": 3600, "path": "token"}]

    def bound_token(pod_name: str, audience: str = c.STATE_AUDIENCE) -> str:
        uid = cluster.kubectl("get", "pod", pod_name, "-n", flows.ns, "-o", "jsonpath={.metadata.uid}").stdout
        return cluster.kubectl("create", "token", "default", "-n", flows.ns, f"--audience={audience}",
                               "--bound-object-kind=Pod", f"--bound-object-name={pod_name}",
                               f"--bound-object-uid={uid}", "--duration=10m").stdout.strip()

    # Through the state API's Service, verified as runners verify it: the operator's CA, the Service's name.
    state = httpx.Client(base_url=operator.state_url,
                         verify=ssl.create_default_context(cafile=str(operator.ca_file())), timeout=10)

    def call(method: str, key: str, token: str, body: bytes | None = None) -> httpx.Response:
        return state.request(method, c.STATE_API_PREFIX + key, content=body,
                             headers={"Authorization": f"Bearer {token}"},
                             extensions={"sni_hostname": operator.state_server_name})

    mine = bound_token("mine-0")
    assert call("PUT", c.STATE_KEY, mine, b"mine").status_code == 204
    assert call("GET", c.STATE_KEY, mine).content == b"mine"
    # The token names no Flow: it reaches its own Flow's state key and its own run's report, no more.
    assert call("GET", c.report_key("theirs-0"), mine).status_code == 403
    assert call("PUT", c.report_key("mine-1"), mine, b"x").status_code == 403
    theirs_cm = json.loads(cluster.kubectl("get", "configmap", "theirs-state", "-n", flows.ns, "-o", "json").stdout)
    assert c.STATE_KEY not in theirs_cm.get("binaryData", {}) and c.report_key("theirs-0") in theirs_cm["binaryData"]
    # A finished run's pod is still there, but its token no longer opens anything.
    assert call("GET", c.STATE_KEY, bound_token("theirs-0")).status_code == 403
    # The API server refuses the runner's token (wrong audience) for everything.
    (tmp_path / "empty").write_text("")
    out = subprocess.run([str(cluster.bins["kubectl"]), "--kubeconfig", str(tmp_path / "empty"),
                          "--server", cluster.server, "--certificate-authority", str(cluster.pki_dir / "ca.crt"),
                          "--token", mine, "get", "configmap", "mine-state", "-n", flows.ns],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "unauthorized" in out.stderr.lower(), out.stderr
    # Tokens for the API server's audience, and tokens of pods that are not runners, are refused.
    assert call("GET", c.STATE_KEY, bound_token("mine-0", "https://kubernetes.default.svc")).status_code == 401
    assert call("GET", c.STATE_KEY, "not-a-token").status_code == 401
    bystander = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bystander-0", "namespace": flows.ns},
                 "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "x"}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(bystander))
    assert call("GET", c.STATE_KEY, bound_token("bystander-0")).status_code == 403
    # A token dies with its pod (and its run).
    cluster.kubectl("delete", "pod", "mine-0", "-n", flows.ns, "--grace-period=0", "--force")
    wait_for(lambda: call("GET", c.STATE_KEY, mine).status_code in (401, 403), 30,
             "the deleted pod's token to be refused")


def test_api_server_restart_mid_run_loses_nothing(flows: Flows, cluster: LocalCluster) -> None:
    flows.apply("outage", {"flowRef": "a:B", "inputs": {"plan": [{"sleep": 4, "tokens": 5}]}})
    flows.wait_phase("outage", "Running")
    cluster.restart_apiserver()
    st = flows.wait_phase("outage", "Succeeded", timeout=120)
    assert len(st["runs"]) == 1 and st["usage"]["totalTokens"] == 5
    assert [p["metadata"]["name"] for p in flows.pods("outage")] == ["outage-0"]


def test_a_flow_recreated_under_the_same_name_runs_afresh(flows: Flows, cluster: LocalCluster) -> None:
    flows.apply("again", {"flowRef": "a:B", "inputs": {"plan": [{"tokens": 1, "output": "first"}]}})
    flows.wait_phase("again", "Succeeded")
    old_uid = flows.get("again")["metadata"]["uid"]  # type: ignore[index]
    cluster.kubectl("delete", "flow", "again", "-n", flows.ns, "--wait=false")
    wait_for(lambda: flows.get("again") is None, 30, "the first flow to be gone")
    # Re-applied at once: its pod and state ConfigMap may still be the first flow's (GC is async).
    flows.apply("again", {"flowRef": "a:B", "inputs": {"plan": [{"tokens": 9, "output": "second"}]}})
    st = flows.wait_phase("again", "Succeeded", timeout=90)
    assert st["usage"]["totalTokens"] == 9 and st["result"]["output"] == "second"
    (pod,) = flows.pods("again")
    assert pod["metadata"]["ownerReferences"][0]["uid"] != old_uid


def test_garbage_the_collector_missed_does_not_hold_up_a_flow_of_the_same_name(
        flows: Flows, cluster: LocalCluster) -> None:
    # The garbage collector can miss a Flow deleted and re-created under the same name during a break in
    # its watch (its relist sees one update) and never remove the old Flow's pods and state. Stand-in
    # for that miss: a stopped kube-controller-manager, and a pod and state left by a Flow "ghost".
    from flowkube_api import constants as c

    gone = {"apiVersion": c.API_VERSION, "kind": c.KIND, "name": "ghost", "controller": True,
            "blockOwnerDeletion": True, "uid": "00000000-0000-4000-8000-000000000000"}
    labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_FLOW: "ghost", c.LABEL_COMPONENT: c.COMPONENT_RUNNER}
    leftovers = [
        {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": "ghost-0", "labels": labels, "ownerReferences": [gone]},
         "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False, "containers": [{
             "name": "runner", "image": "x", "command": ["true"], "securityContext": {
                 "allowPrivilegeEscalation": False, "runAsNonRoot": True, "runAsUser": 65532,
                 "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}}}]}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "ghost-state", "ownerReferences": [gone]},
         "data": {"left": "behind"}},
    ]
    with cluster.controller_manager_stopped():
        cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input="\n---\n".join(json.dumps(o) for o in leftovers))
        flows.apply("ghost", {"flowRef": "a:B", "inputs": {"plan": [{"tokens": 2}]}})
        st = flows.wait_phase("ghost", "Succeeded", timeout=90)
        uid = flows.get("ghost")["metadata"]["uid"]  # type: ignore[index]
        (pod,) = flows.pods("ghost")
        assert pod["metadata"]["ownerReferences"][0]["uid"] == uid and st["usage"]["totalTokens"] == 2
        cm = json.loads(cluster.kubectl("get", "configmap", "ghost-state", "-n", flows.ns, "-o", "json").stdout)
        assert cm["metadata"]["ownerReferences"][0]["uid"] == uid and "left" not in (cm.get("data") or {})


def test_a_refused_runner_pod_is_reported_as_an_event(flows: Flows) -> None:
    # A label key the Pod API refuses (a Flow's CRD schema takes any string as a key).
    flows.apply("unplaceable", {"flowRef": "a:B", "podTemplate": {"metadata": {"labels": {"no such/key/x": "v"}}}})

    def failed_create() -> bool:
        out = flows.cluster.kubectl("get", "events", "-n", flows.ns, "--field-selector",
                                    "involvedObject.name=unplaceable,reason=FailedCreate", "-o", "json").stdout
        return any("no such/key/x" in (e.get("message") or e.get("note") or "") for e in json.loads(out)["items"])

    wait_for(failed_create, 30, "a FailedCreate Event naming the refused label")
    assert flows.status("unplaceable")["phase"] == "Pending" and flows.pods("unplaceable") == []
