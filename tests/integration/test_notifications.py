"""Notifications on the local stack: the chart's operator (two replicas, one Lease) posts to a real HTTP
receiver run by this test on the host, reached through a Service whose endpoint is the host (as
runner pods reach the stub model). The Service's IP is in a private range, denied by default: the
chart's ``notifications.allowedCIDRs`` lets exactly that address through.

What users rely on: a pause gives one notification with a stable id and a signature that verifies
with the documented recipe; a receiver's 500s are retried until it answers 200, and delivered once; a
404 is not retried, and is recorded and told as an Event; an operator SIGKILLed while a delivery is
under way, or a leader that hands over with one pending, delivers it once afterwards, and nothing that
was recorded is sent again; a FlowQuota tells its namespace's default sink when it passes its warning
threshold and when it is used up, once each, also across an operator restart.
"""

from __future__ import annotations

import base64
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows, scripted_operator
from tests.unit.operator.test_notify import documented_recipe

pytestmark = pytest.mark.slow

REVIEW = {"id": "req-1", "method": "review", "message": "Publish <this> draft?",
          "emit": ["approved", "rejected"], "output": "the draft"}
KEY = b"receiver-signing-key"


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    answered: int = 0  # the status the receiver answered with; 0 while held, or when the client went


@dataclass
class Receiver:
    """Answers each path with its scripted codes, then 200; a path set to hold keeps its requests
    waiting until `release`, then answers them 500 (the client that sent them may be dead)."""

    hits: list[Hit] = field(default_factory=list)
    script: dict[str, list[int]] = field(default_factory=dict)
    holding: set[str] = field(default_factory=set)
    changed: threading.Condition = field(default_factory=threading.Condition)
    released: threading.Event = field(default_factory=threading.Event)

    def answer(self, hit: Hit) -> int:
        with self.changed:
            self.hits.append(hit)
            self.changed.notify_all()
            hold = hit.path in self.holding
            codes = self.script.get(hit.path) or []
            code = codes.pop(0) if codes else 200
        if hold:
            self.released.wait(120)
            code = 500
        return code

    def wait(self, predicate: Any, what: str, timeout: float = 60) -> list[Hit]:
        with self.changed:
            if not self.changed.wait_for(lambda: predicate(self.hits), timeout):
                raise AssertionError(f"timed out waiting for {what}; hits: {[(h.path, h.answered) for h in self.hits]}")
            return list(self.hits)

    def on(self, path: str) -> list[Hit]:
        with self.changed:
            return [h for h in self.hits if h.path == path]


def handler(receiver: Receiver) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            hit = Hit(self.path, dict(self.headers.items()), body)
            code = receiver.answer(hit)
            try:
                self.send_response(code)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
                self.wfile.flush()
            except OSError:
                return  # the client is gone: not delivered
            with receiver.changed:
                hit.answered = code
                receiver.changed.notify_all()

    return Handler


@dataclass
class Stack:
    cluster: LocalCluster
    operator: ChartOperator
    receiver: Receiver
    url: str


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[Stack]:
    receiver = Receiver()
    server = ThreadingHTTPServer((cluster.host_ip, 0), handler(receiver))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = cluster.host_service("notification-receiver", "flowkube-dev", server.server_address[1])
    ip = cluster.kubectl("get", "service", "notification-receiver", "-n", "flowkube-dev",
                         "-o", "jsonpath={.spec.clusterIP}").stdout.strip()
    # Quotas enforced too (statuses written every 0.5 s), for the FlowQuotas' notifications; the scripted
    # runner reserves nothing, so the Flows' tests run as without.
    op = scripted_operator(cluster, values=["replicaCount=2", f"notifications.allowedCIDRs={{{ip}/32}}",
                                            "notifications.retrySeconds=120", "quotas.enabled=true",
                                            "quotas.statusSeconds=0.5"]).start()
    try:
        yield Stack(cluster, op, receiver, url)
    finally:
        receiver.released.set()
        op.stop()
        server.shutdown()


def hook(flows: Flows, name: str, url: str, *, defaults: bool = False, **data: str) -> None:
    labels = {"flowkube.io/notifications": "defaults" if defaults else "true"}
    obj = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "labels": labels},
           "data": {k: base64.b64encode(v.encode()).decode() for k, v in {"url": url, **data}.items()}}
    flows.cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(obj))


def paused_flow(flows: Flows, name: str, sink_secret: str, **sink: Any) -> str:
    flows.apply(name, {"flowRef": "a:Review", "inputs": {"plan": [{"result": "Paused", "feedback": REVIEW,
                                                                   "tokens": 2}, {"tokens": 3}]},
                       "notifications": [{"name": "team", "secretRef": {"name": sink_secret}, **sink}]})
    flows.wait_phase(name, "AwaitingFeedback")
    flow = flows.get(name)
    assert flow is not None
    return f"{flow['metadata']['uid']}/req-1/FeedbackRequested"


def record(flows: Flows, name: str, sink: str, outcome: str, timeout: float = 90) -> dict[str, Any]:
    def done(s: dict[str, Any]) -> bool:
        return any(r.get("name") == sink and r.get("outcome") == outcome for r in s.get("notifications") or [])

    st = flows.wait(name, done, f"sink {sink} {outcome} in status.notifications", timeout)
    rec: dict[str, Any] = next(r for r in st["notifications"] if r["name"] == sink)
    return rec


def delivered(hits: list[Hit], event_id: str) -> list[Hit]:
    return [h for h in hits if h.headers.get("X-Flowkube-Event-Id") == event_id and 200 <= h.answered < 300]


def test_a_pause_notifies_once_signed_as_a_cloudevent_and_namespace_defaults_get_slack(
        stack: Stack, flows: Flows) -> None:
    path, slack_path = f"/{flows.ns}/ce", f"/{flows.ns}/slack"
    hook(flows, "team-hook", stack.url + path, signingKey=KEY.decode())
    hook(flows, "ns-slack", stack.url + slack_path, defaults=True, format="slack", events="FeedbackRequested")
    event_id = paused_flow(flows, "review", "team-hook")
    rec = record(flows, "review", "team", "Delivered")
    assert (rec["eventId"], rec["event"], rec["attempts"], rec["code"]) == (event_id, "FeedbackRequested", 1, 200)
    assert rec["handled"] == [event_id]
    (hit,) = stack.receiver.on(path)
    assert hit.headers["Content-Type"].startswith("application/cloudevents+json")
    assert documented_recipe()(KEY, hit.body, hit.headers["X-Flowkube-Signature"])  # docs/api.md's check
    event = json.loads(hit.body)
    assert (event["specversion"], event["id"], event["type"], event["subject"]) == (
        "1.0", event_id, "io.flowkube.flow.FeedbackRequested", "req-1")
    assert event["source"] == f"/apis/flowkube.io/v1alpha1/namespaces/{flows.ns}/flows/review"
    assert event["data"]["request"]["message"] == "Publish <this> draft?"
    assert event["data"]["request"]["outcomes"] == ["approved", "rejected"]

    slack_rec = record(flows, "review", "ns-slack", "Delivered")
    assert slack_rec["eventId"] == event_id
    (slack,) = stack.receiver.on(slack_path)
    blocks = json.loads(slack.body)["blocks"]
    assert {"type": "plain_text", "text": "Publish <this> draft?", "emoji": False} in [
        b.get("text") for b in blocks]

    # Answered and finished: Succeeded is not among the default events, and nothing is sent twice,
    # whatever reconciles the answer and the end caused.
    rc, out = flows.patch_status("review", {"status": {"feedback": {"response": {"text": "approved"}}}})
    assert rc == 0, out
    flows.wait_phase("review", "Succeeded")
    assert len(stack.receiver.on(path)) == 1 and len(stack.receiver.on(slack_path)) == 1


def test_500_three_times_then_200_is_delivered_once_and_a_404_is_recorded_and_told(
        stack: Stack, flows: Flows) -> None:
    flaky, gone = f"/{flows.ns}/flaky", f"/{flows.ns}/gone"
    stack.receiver.script[flaky] = [500, 500, 500]
    stack.receiver.script[gone] = [404] * 10
    hook(flows, "flaky", stack.url + flaky)
    hook(flows, "gone", stack.url + gone)
    flaky_id = paused_flow(flows, "flaky", "flaky")
    gone_id = paused_flow(flows, "gone", "gone")
    rec = record(flows, "flaky", "team", "Delivered")
    assert (rec["attempts"], rec["code"], rec["eventId"]) == (4, 200, flaky_id)
    assert [h.answered for h in stack.receiver.on(flaky)] == [500, 500, 500, 200]
    rec = record(flows, "gone", "team", "Failed")
    assert (rec["reason"], rec["attempts"], rec["code"], rec["eventId"]) == ("Rejected", 1, 404, gone_id)
    assert [h.answered for h in stack.receiver.on(gone)] == [404]  # not retried
    def told() -> bool:
        out = flows.cluster.kubectl("get", "events", "-n", flows.ns, "--field-selector",
                                    "reason=NotificationFailed,involvedObject.name=gone", "-o", "json").stdout
        return any("404" in e.get("message", "") for e in json.loads(out)["items"])

    wait_for(told, 30, "a NotificationFailed Event on the Flow, naming the 404")


def test_the_leader_sigkilled_during_a_delivery_delivers_it_once_after(stack: Stack, flows: Flows) -> None:
    path = f"/{flows.ns}/held"
    stack.receiver.holding.add(path)
    hook(flows, "held", stack.url + path)
    event_id = paused_flow(flows, "held", "held")
    stack.receiver.wait(lambda hits: any(h.path == path for h in hits), "the first attempt, held")
    leader = stack.operator.leader()
    assert leader
    stack.operator.kill_container(leader)  # mid-delivery: no outcome, nothing recorded
    stack.receiver.holding.discard(path)
    stack.receiver.released.set()
    rec = record(flows, "held", "team", "Delivered", timeout=120)
    assert rec["eventId"] == event_id
    hits = stack.receiver.on(path)
    assert len(delivered(hits, event_id)) == 1
    assert len(hits) >= 2 and hits[0].answered != 200  # the killed leader's attempt was never answered 2xx
    stack.receiver.released.clear()


def test_a_pending_delivery_survives_a_leader_handover_and_is_delivered_once(stack: Stack, flows: Flows) -> None:
    path = f"/{flows.ns}/down"
    stack.receiver.script[path] = [503] * 1000  # down until the handover
    hook(flows, "down", stack.url + path)
    event_id = paused_flow(flows, "down", "down")
    stack.receiver.wait(lambda hits: sum(h.path == path for h in hits) >= 2, "two attempts refused")
    leader = stack.operator.leader()
    stack.cluster.kubectl("delete", "pod", leader, "-n", stack.operator.namespace, "--wait=false")
    wait_for(lambda: stack.operator.leader() not in ("", leader), 60, "another replica holding the Lease")
    stack.receiver.script[path] = []  # the receiver is back
    rec = record(flows, "down", "team", "Delivered", timeout=120)
    assert rec["eventId"] == event_id
    hits = stack.receiver.on(path)
    assert len(delivered(hits, event_id)) == 1 and [h.answered for h in hits[:2]] == [503, 503]
    # Recorded: neither replica sends it again (a reconcile of every Flow happens at each new term).
    status_before = flows.status("down")
    flows.patch_status("down", {"status": {"feedback": {"response": {"text": "approved"}}}})
    flows.wait_phase("down", "Succeeded")
    assert len(delivered(stack.receiver.on(path), event_id)) == 1
    assert status_before["notifications"][0]["handled"] == [event_id]


def test_a_tenant_cannot_make_the_operator_post_inside_the_cluster_or_to_the_metadata_endpoint(
        stack: Stack, flows: Flows) -> None:
    """Only the receiver's own Service IP is allowed: the API server's Service, a name that resolves to
    it, the cloud metadata address and the operator's own loopback are refused before any connection,
    recorded without the URL (a Secret's value), and never retried."""
    targets = {
        "apiserver": "https://kubernetes.default.svc/api/v1/secrets?token=SECRET-IN-URL",
        "metadata": "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
        "loopback": "http://127.0.0.1:8080/healthz",
        "mapped": "http://[::ffff:10.96.0.1]/",
    }
    for name, url in targets.items():
        hook(flows, name, url)
        paused_flow(flows, name, name)
    for name in targets:
        rec = record(flows, name, "team", "Failed")
        assert (rec["reason"], rec["attempts"]) == ("Refused", 1), rec
        assert "SECRET-IN-URL" not in json.dumps(flows.status(name))
    assert "denied" in record(flows, "apiserver", "team", "Failed")["message"]


def test_a_flowquota_tells_its_namespaces_default_sink_once_per_threshold_also_across_a_restart(
        stack: Stack, flows: Flows) -> None:
    """Flows spend 8 then 2 of a 10-token limit: the namespace's default sink (naming no events) hears
    QuotaWarning, then QuotaExhausted, signed. The operator that sent them is SIGKILLed: its successor
    offers every quota's events once it is ready (its log says so), and sends nothing again; raising
    the limit to 12 (83 %) is a new warning, the one notification after the restart."""
    path = f"/{flows.ns}/quota"
    hook(flows, "quota-defaults", stack.url + path, defaults=True, signingKey=KEY.decode())
    quota: dict[str, Any] = {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowQuota", "metadata": {"name": "team"},
             "spec": {"limits": [{"name": "daily", "maxTotalTokens": 10, "window": {"kind": "Day"}}]}}
    flows.cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(quota))

    def events(etype: str) -> list[dict[str, Any]]:
        got = [json.loads(h.body) for h in stack.receiver.on(path) if 200 <= h.answered < 300]
        return [e for e in got if e["type"] == f"io.flowkube.quota.{etype}"]

    def received(etype: str, count: int) -> None:
        stack.receiver.wait(lambda _hits: len(events(etype)) >= count, f"{count} {etype} at {path}")

    flows.apply("spends-8", {"flowRef": "a:A", "inputs": {"plan": [{"tokens": 8}]}})
    received("QuotaWarning", 1)
    flows.apply("spends-2", {"flowRef": "a:A", "inputs": {"plan": [{"tokens": 2}]}})
    received("QuotaExhausted", 1)
    (exhausted,) = events("QuotaExhausted")
    assert exhausted["source"] == f"/apis/flowkube.io/v1alpha1/namespaces/{flows.ns}/flowquotas/team"
    assert exhausted["id"].endswith("/QuotaExhausted") and exhausted["data"]["limits"][0]["limit"] == {
        "maxTotalTokens": 10}
    for hit in stack.receiver.on(path):
        assert documented_recipe()(KEY, hit.body, hit.headers["X-Flowkube-Signature"])

    def recorded() -> bool:
        st = json.loads(flows.cluster.kubectl("get", "flowquota", "team", "-n", flows.ns, "-o", "json").stdout)
        return any(exhausted["id"] in (r.get("handled") or []) for r in (st.get("status") or {}).get(
            "notifications") or [])

    wait_for(recorded, 30, "the QuotaExhausted delivery in the quota's status.notifications")
    leader = stack.operator.leader()
    killed = stack.operator.kill_container(leader)
    assert killed

    def restarted() -> str:
        """The leader's current container's log, once a container started after the kill leads."""
        now = stack.operator.leader()
        pod = next((p for p in stack.operator.pods() if p["metadata"]["name"] == now), None)
        running = [c for c in (pod or {}).get("status", {}).get("containerStatuses", [])
                   if c["name"] == "operator" and "running" in c.get("state", {})]
        if not running or running[0].get("containerID", "").endswith(killed):
            return ""
        return str(stack.cluster.kubectl("logs", now, "-n", stack.operator.namespace, "-c", "operator",
                                         check=False).stdout)

    wait_for(lambda: "notifications of" in restarted() and "FlowQuota(s) offered" in restarted(), 60,
             "the new leader offering every FlowQuota's notifications")
    quota["spec"]["limits"][0]["maxTotalTokens"] = 12
    flows.cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(quota))
    received("QuotaWarning", 2)
    assert len(events("QuotaExhausted")) == 1, "recorded as handled: the new leader did not send it again"
    first, second = events("QuotaWarning")
    assert first["id"] != second["id"], "each transition to True is an event of its own"
