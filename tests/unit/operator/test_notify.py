"""Notifications without a cluster: which events a status holds, the bodies, the signature, the retry
schedule, the destination policy, the record; and the sender against a real local HTTP server."""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from flowkube_api import traces
from flowkube_api.constants import NotificationEvent as E
from flowkube_api.models import FlowStatus
from flowkube_api.traces import SpanRecord
from flowkube_operator.kube import tls
from flowkube_operator.notify import bodies, policy
from flowkube_operator.notify import notices as notify
from flowkube_operator.notify.notices import Outcome, Sink
from flowkube_operator.notify.notifier import Notifier
from flowkube_operator.notify.policy import Policy
from flowkube_operator.settings import DEFAULT_DENIED_CIDRS, Settings

NOW = dt.datetime(2026, 11, 27, 12, 0, tzinfo=dt.UTC)
HOSTILE = '<script>alert(1)</script> <!channel> <http://evil.example|click> & more'


def flow(status: dict[str, Any], spec: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": "review", "namespace": "team", "uid": "u-1"},
            "spec": spec or {"flowRef": "a:B"}, "status": status}


def paused(request_id: str = "r1") -> dict[str, Any]:
    return flow({"phase": "AwaitingFeedback", "definition": "reviewer", "usage": {"totalTokens": 42},
                 "feedback": {"request": {"id": request_id, "method": "review", "message": HOSTILE,
                                          "emit": ["approved", "rejected"], "output": "draft",
                                          "requestedAt": "2026-11-27T11:59:00Z",
                                          "deadline": "2026-11-28T11:59:00Z"}}})


SINK = Sink(name="team", secret="team-hook")


def test_a_paused_flow_holds_one_feedback_requested_event_with_a_stable_id() -> None:
    (n,) = notify.notices(paused(), "https://console.example/")
    assert n.id == "u-1/r1/FeedbackRequested" and n.type == E.FEEDBACK_REQUESTED
    assert n.data["consoleUrl"] == "https://console.example/flows/team/review"
    assert n.data["request"]["outcomes"] == ["approved", "rejected"]
    assert notify.notices(paused()) == [n]  # the same event, whoever looks, whenever


def test_endings_timeouts_and_conversations() -> None:
    failed = flow({"phase": "Failed", "runs": [{"pod": "review-0"}, {"pod": "review-1"}],
                   "conditions": [{"type": "Succeeded", "status": "False", "reason": "BudgetExceeded"}],
                   "feedback": {"history": [{"requestId": "r1", "method": "m", "timedOut": True,
                                             "respondedAt": "2026-11-27T11:00:00Z"}]}})
    ids = {n.id for n in notify.notices(failed)}
    assert ids == {"u-1/run-1/Failed", "u-1/run-1/BudgetExceeded", "u-1/r1/FeedbackTimedOut"}
    # A sink that asks for BudgetExceeded hears that instead of Failed; one that does not, Failed.
    both = Sink("a", "s", frozenset({E.FAILED, E.BUDGET_EXCEEDED}))
    assert [n.type for n in notify.wanted(both, notify.notices(failed))] == [E.BUDGET_EXCEEDED]
    only_failed = Sink("b", "s", frozenset({E.FAILED}))
    assert [n.type for n in notify.wanted(only_failed, notify.notices(failed))] == [E.FAILED]
    chat = flow({"phase": "AwaitingMessage", "conversation": {"turns": 3, "lastReply": "hi"}})
    assert [n.id for n in notify.notices(chat)] == ["u-1/turn-3/MessageAwaited"]
    # The default sink does not hear of every turn of a chat, nor of successes.
    assert notify.due(chat, [SINK]) == []


def test_due_skips_what_the_status_records_as_handled_and_record_keeps_the_newest_ids() -> None:
    f = paused()
    assert [(s.name, n.id) for s, n in notify.due(f, [SINK])] == [("team", "u-1/r1/FeedbackRequested")]
    status = FlowStatus.model_validate(f["status"])
    for i in range(20):
        events = notify.record(status, [Outcome("team", f"u-1/r{i}/FeedbackRequested", E.FEEDBACK_REQUESTED,
                                                i != 5, "Delivered" if i != 5 else "Rejected", 1, NOW, 200)])
        assert bool(events) == (i == 5)
    assert status.notifications is not None
    (rec,) = status.notifications
    assert rec.handled is not None and len(rec.handled) == 16 and rec.handled[-1] == "u-1/r19/FeedbackRequested"
    f["status"] = status.dump()
    f["status"]["feedback"]["request"]["id"] = "r19"
    assert notify.due(f, [SINK]) == []  # handled: a restart sends nothing again


def test_spec_sinks_replace_namespace_defaults_of_the_same_name() -> None:
    defaults = [Sink("team", "ns-default"), Sink("ops", "ops-hook")]
    spec = {"notifications": [{"name": "team", "secretRef": {"name": "mine", "urlKey": "u"},
                               "events": ["Succeeded"], "format": "slack"}]}
    team, ops = sorted(notify.sinks_of(spec, defaults), key=lambda s: s.name != "team")
    assert (team.secret, team.url_key, team.format, team.events) == ("mine", "u", "slack", frozenset({E.SUCCEEDED}))
    assert ops.secret == "ops-hook"
    assert notify.default_sink("d", {"url": b"x", "events": b"Failed, Succeeded", "format": b"slack"}) == \
        Sink("d", "d", frozenset({E.FAILED, E.SUCCEEDED}), "slack")
    assert notify.default_sink("d", {"events": b"Failed,Nope"}) is None


def test_cloudevent_attributes() -> None:
    (n,) = notify.notices(paused())
    body, ctype = bodies.body(SINK, n)
    ev = json.loads(body)
    assert ctype == "application/cloudevents+json"
    assert {k: ev[k] for k in ("specversion", "id", "type", "source", "subject", "time", "datacontenttype")} == {
        "specversion": "1.0", "id": "u-1/r1/FeedbackRequested", "type": "io.flowkube.flow.FeedbackRequested",
        "source": "/apis/flowkube.io/v1alpha1/namespaces/team/flows/review", "subject": "r1",
        "time": "2026-11-27T11:59:00Z", "datacontenttype": "application/json"}
    assert ev["data"]["request"]["message"] == HOSTILE  # JSON carries the text as it is
    assert ev["data"]["flow"] == {"namespace": "team", "name": "review", "uid": "u-1", "definition": "reviewer"}


def test_slack_blocks_carry_flow_text_as_plain_text_only() -> None:
    (n,) = notify.notices(paused(), "https://console.example")
    body, ctype = bodies.body(Sink("s", "s", format="slack"), n)
    msg = json.loads(body)
    assert ctype == "application/json"
    assert msg["text"] == "Flow team/review needs feedback"
    texts = [b["text"] for b in msg["blocks"] if b["type"] in ("section", "header")]
    assert {"type": "plain_text", "text": HOSTILE, "emoji": False} in texts
    assert all(t["type"] == "plain_text" for t in texts)  # never mrkdwn: no link, no mention from a model
    (ctx,) = [b for b in msg["blocks"] if b["type"] == "context"]
    assert "outcomes: approved, rejected" in ctx["elements"][0]["text"]
    (actions,) = [b for b in msg["blocks"] if b["type"] == "actions"]
    assert actions["elements"][0]["url"] == "https://console.example/flows/team/review"
    assert bodies.mrkdwn_escape(HOSTILE).count("<") == 0


def test_signature_recipe() -> None:
    key, payload = b"s3cret", b'{"id":"x"}'
    header = bodies.sign(key, payload, 1_700_000_000)
    assert header.startswith("t=1700000000,v1=")
    assert bodies.verify(key, payload, header, now=1_700_000_100)
    assert not bodies.verify(key, payload + b" ", header, now=1_700_000_100)  # the body changed
    assert not bodies.verify(b"other", payload, header, now=1_700_000_100)
    assert not bodies.verify(key, payload, header, now=1_700_000_000 + 301)  # a replay, too late
    forged = header.replace("t=1700000000", "t=1700000300")  # a fresh timestamp on an old signature
    assert not bodies.verify(key, payload, forged, now=1_700_000_300)


def documented_recipe() -> Callable[[bytes, bytes, str], bool]:
    """The receiver's check exactly as docs/api.md prints it (the first Python block under Signatures)."""
    doc = (Path(__file__).parents[3] / "docs" / "api.md").read_text()
    code = doc.split("### Signatures", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict[str, Any] = {}
    exec(code, scope)  # our own documentation's snippet
    verified: Callable[[bytes, bytes, str], bool] = scope["verified"]
    return verified


def test_the_documented_recipe_verifies_what_the_operator_signs() -> None:
    verified = documented_recipe()
    payload = b'{"id":"u-1/r1/FeedbackRequested"}'
    assert verified(b"k", payload, bodies.sign(b"k", payload, int(time.time())))
    assert not verified(b"k", payload + b"x", bodies.sign(b"k", payload, int(time.time())))
    assert not verified(b"k", payload, bodies.sign(b"k", payload, int(time.time()) - 600))


def test_retry_schedule() -> None:
    assert [notify.backoff(i) for i in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert [notify.retry_after(v) for v in ("3", "0.5", "600", "-1", None, "Wed, 21 Oct 2026 07:28:00 GMT")] == [
        3, 0.5, 60, 0, 0, 0]
    assert [c for c in (None, 500, 502, 503, 408, 429) if notify.retryable(c)] == [None, 500, 502, 503, 408, 429]
    assert not any(notify.retryable(c) for c in (400, 401, 403, 404, 410, 301, 302))


@pytest.mark.parametrize("address", [
    "127.0.0.1", "127.5.5.5", "::1", "169.254.169.254", "fe80::1", "0.0.0.0", "::ffff:127.0.0.1",
    "::ffff:169.254.169.254", "10.96.0.1", "10.244.3.7", "172.20.0.5", "192.168.1.1", "100.64.0.1", "fd00::1",
    "224.0.0.1",
])
def test_policy_refuses_this_host_link_local_and_cluster_ranges_by_default(address: str) -> None:
    assert Policy().refusal(address)


def test_policy_allows_public_addresses_and_the_allowed_list() -> None:
    assert Policy().refusal("93.184.216.34") is None and Policy().refusal("2606:2800:220:1::1") is None
    p = Policy.of(["10.96.0.10/32"], DEFAULT_DENIED_CIDRS)
    assert p.refusal("10.96.0.10") is None and p.refusal("10.96.0.11")
    with pytest.raises(ValueError, match="bogus"):
        Settings(notifications_allowed_cidrs="10.0.0.0/8,bogus")


# -- the sender, against a real HTTP server on this host ------------------------------------------------


class Receiver:
    def __init__(self, answers: list[int]) -> None:
        self.answers = answers
        self.seen: list[tuple[dict[str, str], bytes]] = []

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.seen.append((dict(request.headers), await request.read()))
        code = self.answers.pop(0) if self.answers else 200
        if code == 429:
            return web.Response(status=429, text="rate limited", headers={"Retry-After": "3"})
        if code == 302:
            raise web.HTTPFound("http://127.0.0.1:9/elsewhere")
        return web.Response(status=code, text="x" * 100_000 if code >= 400 else "ok")


@asynccontextmanager
async def receiving(answers: list[int], tls: ssl.SSLContext | None = None) -> AsyncIterator[tuple[Receiver, int]]:
    r = Receiver(answers)
    app = web.Application()
    app.router.add_post("/hook", r.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield r, port
    finally:
        await runner.cleanup()


def secret(url: str, **more: bytes) -> dict[str, Any]:
    data = {"url": url.encode(), **more}
    return {"metadata": {"name": "team-hook", "namespace": "team", "labels": {"flowkube.io/notifications": "x"}},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


async def deliver(url: str, allowed: str = "127.0.0.1/32", retry: float = 30.0,
                  spans: list[SpanRecord] | None = None, **data: bytes) -> list[Outcome]:
    woke = asyncio.Event()
    f = paused()
    f["spec"]["notifications"] = [{"name": "team", "secretRef": {"name": "team-hook"}}]
    n = Notifier(Settings(notifications_allowed_cidrs=allowed, notifications_retry_seconds=retry,
                          notifications_timeout_seconds=5), wake=lambda _key: woke.set(), flow_of=lambda _key: f,
                 spans=spans.extend if spans is not None else None)
    n.secrets.event("ADDED", secret(url, **data))
    assert not n.ready()
    n.offer(("team", "review"), f)  # before the Secrets are listed and the ranges known: nothing
    assert not n._tasks
    n.learned.set()
    try:
        n.offer(("team", "review"), f)
        n.offer(("team", "review"), f)  # offered twice (two reconciles): sent once
        await asyncio.wait_for(woke.wait(), 30)
        return n.take(("team", "review"))
    finally:
        await n.close()


def run(coro: Callable[[], Any]) -> Any:
    return asyncio.run(coro())


def test_500_three_times_then_200_is_delivered_once_with_four_attempts_signed() -> None:
    async def go() -> None:
        async with receiving([500, 503, 500, 200]) as (r, port):
            started, spans = time.monotonic(), list[SpanRecord]()
            (o,) = await deliver(f"http://127.0.0.1:{port}/hook", spans=spans, signingKey=b"k")
            assert (o.delivered, o.reason, o.attempts, o.code) == (True, "Delivered", 4, 200)
            (span,) = spans  # the delivery in the Flow's trace: every attempt, under its root
            assert (span.name, span.trace_id, span.parent_id) == (
                "deliver FeedbackRequested team", traces.trace_id("u-1"), traces.root_span_id("u-1"))
            assert span.attributes["flowkube.notification.attempts"] == 4 and span.error is None
            assert (span.end - span.start).total_seconds() >= 7
            assert time.monotonic() - started >= 7  # backoff 1 + 2 + 4
            assert len(r.seen) == 4
            headers, body = r.seen[-1]
            assert headers["X-Flowkube-Event-Id"] == "u-1/r1/FeedbackRequested"
            assert bodies.verify(b"k", body, headers["X-Flowkube-Signature"], now=time.time())
    run(go)


def test_a_429_is_retried_after_the_receivers_retry_after() -> None:
    async def go() -> None:
        async with receiving([429]) as (r, port):
            assert not r.seen
            started = time.monotonic()
            (o,) = await deliver(f"http://127.0.0.1:{port}/hook")
            assert (o.delivered, o.attempts) == (True, 2) and time.monotonic() - started >= 3  # not the 1 s backoff
            assert len(r.seen) == 2
    run(go)


def test_404_is_not_retried_and_a_redirect_is_not_followed() -> None:
    async def go() -> None:
        async with receiving([404]) as (r, port):
            (o,) = await deliver(f"http://127.0.0.1:{port}/hook")
            assert (o.delivered, o.reason, o.attempts, o.code) == (False, "Rejected", 1, 404)
            # The code and a fixed reason: nothing of the receiver's answer (a read-back channel).
            assert o.message == "404 Not Found" and "x" not in o.message
        async with receiving([302]) as (r, port):
            (o,) = await deliver(f"http://127.0.0.1:{port}/hook")
            assert (o.reason, o.attempts, o.code) == ("Rejected", 1, 302) and len(r.seen) == 1
    run(go)


def test_loopback_by_address_or_by_name_is_refused_without_a_connection() -> None:
    async def go() -> None:
        async with receiving([]) as (r, port):
            (o,) = await deliver(f"http://127.0.0.1:{port}/hook", allowed="")
            assert (o.reason, o.attempts) == ("Refused", 1) and "127.0.0.1" in o.message
            (o,) = await deliver(f"http://localhost:{port}/hook", allowed="")
            assert o.reason == "Refused" and "localhost resolves to" in o.message
            (o,) = await deliver(f"http://[::ffff:127.0.0.1]:{port}/hook", allowed="")
            assert o.reason == "Refused"
            assert r.seen == []
    run(go)


def test_tls_is_verified_against_the_secrets_ca(tmp_path: Path) -> None:
    """A private receiver's certificate verifies with the CA in the Secret's `ca` key, and not without
    it (the system's CAs do not know it): never sent unverified."""
    ca = tls.new_ca()
    serving = tls.issue(ca, str(tmp_path), ["127.0.0.1"], "")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(serving.certfile, serving.keyfile)

    async def go() -> None:
        async with receiving([], server) as (r, port):
            (o,) = await deliver(f"https://127.0.0.1:{port}/hook", ca=ca.cert_pem)
            assert (o.delivered, o.code) == (True, 200)
            (o,) = await deliver(f"https://127.0.0.1:{port}/hook", retry=0)
            assert (o.reason, o.attempts) == ("GaveUp", 1) and "certificate verify failed" in o.message
            (o,) = await deliver(f"https://127.0.0.1:{port}/hook", ca=b"not a PEM")
            assert o.reason == "Misconfigured" and "no PEM CA" in o.message
            assert len(r.seen) == 1
    run(go)


def test_a_bad_url_is_misconfigured_and_never_repeated() -> None:
    async def go() -> None:
        (o,) = await deliver("file:///etc/passwd?token=SECRET")
        assert (o.reason, o.attempts) == ("Misconfigured", 1) and "SECRET" not in o.message
        for bad in ("http://127.0.0.1:99999/hook?token=SECRET", "http://127.0.0.1/a b?token=SECRET", "http:///x"):
            (o,) = await deliver(bad)
            assert (o.reason, o.attempts) == ("Misconfigured", 1) and "SECRET" not in o.message, o
        (o,) = await deliver("http://127.0.0.1:9/hook", retry=2.5)  # nothing listens: retried, then GaveUp
        assert (o.reason, o.attempts) == ("GaveUp", 2)
    run(go)


class ClusterApi:
    """Lists nodes and ServiceCIDRs as given, then serves their watches from a queue."""

    def __init__(self, forbid: bool = False, nodes: list[dict[str, Any]] | None = None) -> None:
        self.forbid = forbid
        self.items = {"servicecidrs": [{"metadata": {"name": "kubernetes", "uid": "s"},
                                        "spec": {"cidrs": ["34.118.224.0/20", "2600:1900::/108"]}}],
                      "nodes": nodes if nodes is not None else [node("n1", "35.0.0.0/24", "34.1.2.3")]}
        self.events: dict[str, asyncio.Queue[dict[str, Any]]] = {"servicecidrs": asyncio.Queue(),
                                                                  "nodes": asyncio.Queue()}

    def _kind(self, path: str) -> str:
        return "servicecidrs" if "servicecidrs" in path else "nodes"

    async def request(self, method: str, path: str, **_: Any) -> dict[str, Any]:
        if self.forbid:
            raise PermissionError("403")
        return {"items": self.items[self._kind(path)][:1]}

    async def list_page(self, path: str, params: dict[str, str], **_: Any) -> tuple[dict[str, Any], int]:
        return {"items": self.items[self._kind(path)], "metadata": {"resourceVersion": "1"}}, 1000

    async def watch(self, path: str, params: dict[str, str], **_: Any) -> AsyncIterator[dict[str, Any]]:
        queue = self.events[self._kind(path)]
        while True:
            yield await queue.get()
            queue.task_done()  # the informer asks for the next: this one is handled

    async def tell(self, kind: str, etype: str, obj: dict[str, Any]) -> None:
        await self.events[kind].put({"type": etype, "object": obj})
        await asyncio.wait_for(self.events[kind].join(), 5)


def node(name: str, pod_cidr: str, external: str, internal: str = "10.1.2.3") -> dict[str, Any]:
    return {"metadata": {"name": name, "uid": name}, "spec": {"podCIDRs": [pod_cidr]},
            "status": {"addresses": [{"type": "InternalIP", "address": internal},
                                     {"type": "ExternalIP", "address": external},
                                     {"type": "Hostname", "address": name}],
                       "images": [{"names": ["x" * 200]}] * 50}}


def test_the_clusters_own_ranges_are_denied_as_the_api_tells_them() -> None:
    """A cluster whose Service or pod ranges, or nodes' addresses, are public: what its ServiceCIDRs
    and nodes say is denied too; a refusal to read them (namespaced RBAC) leaves the configured ranges."""
    async def go() -> None:
        for forbid in (False, True):
            n = Notifier(Settings(notifications_allowed_cidrs="34.118.224.10/32"), wake=lambda _k: None)
            task = asyncio.create_task(n.learn_cluster(ClusterApi(forbid)))  # type: ignore[arg-type]
            try:
                await asyncio.wait_for(n.learned.wait(), 5)
                assert bool(n.policy.refusal("34.118.230.1")) is not forbid
                assert bool(n.policy.refusal("35.0.0.9")) is not forbid
                assert bool(n.policy.refusal("34.1.2.3")) is not forbid  # a node's ExternalIP (NodePorts)
                assert n.policy.refusal("34.118.224.10") is None  # allowed wins
                assert n.policy.refusal("8.8.8.8") is None
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
    run(go)


def test_the_clusters_ranges_are_kept_current_as_nodes_come_and_go() -> None:
    """Read once, a node added later (a public ExternalIP, a NodePort on it) was never denied: the
    ranges are watched, and a node that goes is no longer denied."""
    async def go() -> None:
        api = ClusterApi(nodes=[])
        n = Notifier(Settings(), wake=lambda _k: None)
        task = asyncio.create_task(n.learn_cluster(api))  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(n.learned.wait(), 5)
            assert n.policy.refusal("34.9.9.9") is None
            added = node("n2", "36.0.0.0/24", "34.9.9.9")
            await api.tell("nodes", "ADDED", added)
            assert "34.9.9.9" in str(n.policy.refusal("34.9.9.9")) and n.policy.refusal("36.0.0.7")
            await api.tell("nodes", "DELETED", added)
            assert n.policy.refusal("34.9.9.9") is None
            assert n.policy.refusal("36.0.0.7") is None
            assert n.policy.refusal("10.1.2.3")  # private: denied by default anyway
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    run(go)


def test_a_number_for_a_host_is_misconfigured_at_once_not_retried() -> None:
    """`http://2130706433:8080/` is 127.0.0.1 to the C library; aiohttp refuses it when it connects
    (InvalidURL, a ValueError), which was taken for a connection error and retried for ten minutes."""
    async def go() -> None:
        for url in ("http://2130706433:8080/hook?token=SECRET", "http://0x7f.1/hook", "http://127.1:80/hook",
                    "http://017700000001/hook"):
            (o,) = await deliver(url, allowed="", retry=5)
            assert (o.reason, o.attempts, o.delivered) == ("Misconfigured", 1, False), o
            assert "SECRET" not in o.message and "dotted-quad" in o.message
    run(go)
    assert policy.numeric_host_problem("8.8.8.8") is None and policy.numeric_host_problem("example.com") is None
    assert policy.numeric_host_problem("host.1a") is None  # a name


def test_hosts_that_only_become_addresses_later_are_refused_too() -> None:
    """Full-width digits and ideographic dots are names to urlsplit, and 127.0.0.1 to yarl and aiohttp:
    refused as not ASCII. Every address connected to is checked again in the connector (IP literals
    too), and NAT64 or 6to4 forms of a denied IPv4 address are denied."""
    from flowkube_operator.notify.notifier import PolicyConnector, RefusedError

    async def go() -> None:
        async with receiving([]) as (r, port):
            for host in ("①②⑦.0.0.1", "127。0。0。1"):
                (o,) = await deliver(f"http://{host}:{port}/hook", allowed="")
                assert o.reason == "Misconfigured" and o.attempts == 1, o
            assert r.seen == []
        connector = PolicyConnector(Policy)
        try:
            for literal in ("127.0.0.1", "::1", "169.254.169.254"):
                with pytest.raises(RefusedError):
                    await connector._resolve_host(literal, 80)
        finally:
            await connector.close()
    run(go)
    for address in ("64:ff9b::7f00:1", "64:ff9b::a9fe:a9fe", "2002:7f00:1::1", "64:ff9b::a00:1"):
        assert Policy().refusal(address), address
    assert Policy().refusal("64:ff9b::808:808") is None  # 8.8.8.8 through NAT64


def test_an_event_still_current_is_never_forgotten_from_handled() -> None:
    status = FlowStatus()
    timed_out = "u-1/r0/FeedbackTimedOut"
    notify.record(status, [Outcome("team", timed_out, E.FEEDBACK_TIMED_OUT, True, "Delivered", 1, NOW)])
    for turn in range(40):  # a conversation: one MessageAwaited per turn, the timed-out request still the latest
        notify.record(status, [Outcome("team", f"u-1/turn-{turn}/MessageAwaited", E.MESSAGE_AWAITED, True,
                                       "Delivered", 1, NOW)], current=[timed_out, f"u-1/turn-{turn}/MessageAwaited"])
    assert status.notifications is not None
    (rec,) = status.notifications
    assert rec.handled is not None and len(rec.handled) == 16 and timed_out in rec.handled


def test_a_retry_of_an_event_that_is_over_is_dropped() -> None:
    """A request answered while its notification was being retried: nobody needs it any more."""
    async def go() -> None:
        async with receiving([503] * 10) as (r, port):
            f = paused()
            f["spec"]["notifications"] = [{"name": "team", "secretRef": {"name": "team-hook"}}]
            answered = {**f, "status": {"phase": "Running"}}
            n = Notifier(Settings(notifications_allowed_cidrs="127.0.0.1/32"), wake=lambda _key: None,
                         flow_of=lambda _key: answered)
            n.secrets.event("ADDED", secret(f"http://127.0.0.1:{port}/hook"))
            n.learned.set()
            try:
                n.offer(("team", "review"), f)
                await asyncio.wait_for(asyncio.gather(*n._tasks.values()), 10)
                assert len(r.seen) == 1 and n.take(("team", "review")) == []
            finally:
                await n.close()
    run(go)


# -- the labelled Secrets, as kept -----------------------------------------------------------------------


def labelled(name: str, label: str = "x", **data: bytes) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team", "labels": {"flowkube.io/notifications": label},
                         "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "y" * 200_000},
                         "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:data": {}}}]},
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()}}


PEM = b"-----BEGIN CERTIFICATE-----\n" + b"A" * 30_000 + b"\n-----END CERTIFICATE-----\n"


def test_a_secret_is_kept_as_the_bounded_values_a_sink_can_use() -> None:
    """300 Secrets of ~900 KiB were kept whole by every replica (OOMKilled): what is kept now is the
    small values and one CA bundle, never another key's bytes, annotations or managedFields."""
    n = Notifier(Settings(), wake=lambda _k: None)
    n.secrets.event("ADDED", labelled("hook", url=b"https://example.com/h", signingKey=b"k" * 64, ca=PEM,
                                      backup=b"z" * 900_000, other=b"-----BEGIN CERTIFICATE-----" + b"B" * 20_000))
    view = n.secrets.get("team", "hook")
    assert view is not None
    assert dict(view.data) == {"url": b"https://example.com/h", "signingKey": b"k" * 64, "ca": PEM}
    assert set(view.oversized) == {"backup", "other"}  # their names only; one CA bundle is kept
    assert not hasattr(view, "metadata") and sum(len(v) for v in view.data.values()) < 40_000


def test_an_oversized_key_a_sink_uses_is_misconfigured_at_once_naming_it_and_keeps_no_bytes() -> None:
    import tracemalloc

    big = b"https://example.com/" + b"a" * 900_000
    n = Notifier(Settings(), wake=lambda _k: None)
    body = labelled("team-hook", url=big)
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        n.secrets.event("ADDED", body)
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert grown < 20_000, grown  # the 900 KiB value was neither decoded nor kept
    view = n.secrets.get("team", "team-hook")
    assert view is not None and not view.data and dict(view.oversized) == {"url": notify.CA_BYTES}

    async def go() -> None:
        f = paused()
        f["spec"]["notifications"] = [{"name": "team", "secretRef": {"name": "team-hook"}}]
        woke = asyncio.Event()
        n2 = Notifier(Settings(notifications_retry_seconds=30), wake=lambda _k: woke.set(), flow_of=lambda _k: f)
        n2.secrets.event("ADDED", body)
        n2.learned.set()
        try:
            n2.offer(("team", "review"), f)
            await asyncio.wait_for(woke.wait(), 5)
            (o,) = n2.take(("team", "review"))
        finally:
            await n2.close()
        assert (o.reason, o.attempts) == ("Misconfigured", 1)
        assert "key url of Secret team-hook is over 65536 bytes" in o.message and "aaaa" not in o.message
    run(go)


def test_a_namespace_keeps_a_bounded_number_of_secrets_the_rest_are_markers() -> None:
    n = Notifier(Settings(), wake=lambda _k: None)
    for i in range(notify.SECRETS_PER_NAMESPACE + 3):
        n.secrets.event("ADDED", labelled(f"s{i:03}", url=b"https://example.com/"))
    views = n.secrets.by_namespace["team"]
    assert sum(1 for v in views.values() if v.data) == notify.SECRETS_PER_NAMESPACE
    crowded = views[f"s{notify.SECRETS_PER_NAMESPACE:03}"]
    assert not crowded.data and "more than 64 Secrets" in (crowded.problem("s064", "url") or "")
    n.secrets.event("DELETED", labelled("s000"))
    n.secrets.event("MODIFIED", labelled("s064", url=b"https://example.com/"))  # room again: kept on update
    assert n.secrets.get("team", "s064") is not None and n.secrets.get("team", "s064").data  # type: ignore[union-attr]


def test_keys_kept_are_bounded_in_number_and_defaults_still_work() -> None:
    many = {f"k{i:02}": b"v" for i in range(40)}
    view = notify.project("d", "defaults", {k: base64.b64encode(v).decode() for k, v in
                                            {**many, "url": b"https://e.com/", "format": b"slack"}.items()})
    assert len(view.data) == notify.KEYS_KEPT and {"url", "format"} <= view.data.keys()
    assert view.dropped == 42 - notify.KEYS_KEPT
    assert view.default is not None and view.default.format == "slack"
    assert "among the 8 keys kept" in view.missing("d", "k39")


# -- a FlowQuota's events: QuotaWarning, QuotaExhausted ---------------------------------------------------

SINCE = "2026-11-27T11:30:00Z"


def quota(exhausted: str = "False", warning: str = "False", *, name: str = "team-a",
          message: str = "daily at 100%", since: str = SINCE, namespace: str = "team") -> dict[str, Any]:
    def cond(ctype: str, status: str) -> dict[str, Any]:
        return {"type": ctype, "status": status, "reason": "x", "message": message if status == "True" else "",
                "lastTransitionTime": since}

    return {"metadata": {"name": name, "namespace": namespace, "uid": "q-1"},
            "spec": {"limits": [{"name": "daily", "maxTotalTokens": 100}, {"name": "monthly", "maxCost": "5"}]},
            "status": {"conditions": [cond("Ready", "True"), cond("Exhausted", exhausted), cond("Warning", warning)],
                       "limits": [{"name": "daily", "used": {"totalTokens": 100, "cost": "0"},
                                   "windowStart": "2026-11-27T00:00:00Z", "resetsAt": "2026-11-28T00:00:00Z"},
                                  {"name": "monthly", "used": {"totalTokens": 100, "cost": "1.5"},
                                   "windowStart": "2026-11-01T00:00:00Z"}]}}


def test_a_quota_holds_quota_exhausted_or_else_quota_warning_named_after_when_its_condition_turned_true() -> None:
    assert notify.quota_notices(quota()) == []
    (warned,) = notify.quota_notices(quota(warning="True"))
    assert (warned.id, warned.type, warned.kind) == (f"q-1/Warning-{SINCE}/QuotaWarning", E.QUOTA_WARNING, "FlowQuota")
    (n,) = notify.quota_notices(quota(exhausted="True", warning="True"), "https://console.example/")
    assert (n.id, n.type, n.namespace, n.name) == (f"q-1/Exhausted-{SINCE}/QuotaExhausted", E.QUOTA_EXHAUSTED,
                                                   "team", "team-a")
    assert n.time == dt.datetime(2026, 11, 27, 11, 30, tzinfo=dt.UTC)
    assert n.data["quota"] == {"namespace": "team", "name": "team-a", "uid": "q-1"}
    assert n.data["message"] == "daily at 100%" and n.data["consoleUrl"] == "https://console.example/quotas?namespace=team"
    assert n.data["limits"][0] == {"name": "daily", "used": {"totalTokens": 100, "cost": "0"},
                                   "limit": {"maxTotalTokens": 100}, "windowStart": "2026-11-27T00:00:00Z",
                                   "resetsAt": "2026-11-28T00:00:00Z"}
    assert n.data["limits"][1]["limit"] == {"maxCost": "5"}
    # The same event whoever looks, whenever; a later transition to True is another one.
    assert notify.quota_notices(quota(exhausted="True")) == [n]
    assert notify.quota_notices(quota(exhausted="True", since="2026-12-01T00:00:00Z"))[0].id != n.id
    # A ClusterFlowQuota has no namespace, so no default sinks: nothing.
    assert notify.quota_notices(quota(exhausted="True", namespace="")) == []


def test_a_flow_never_holds_quota_events_and_its_own_sink_never_hears_of_them() -> None:
    failed = flow({"phase": "Failed", "runs": [{"pod": "review-0"}],
                   "conditions": [{"type": "Succeeded", "status": "False", "reason": "QuotaExhausted"}]})
    assert {n.type for n in notify.notices(failed)} == {E.FAILED}
    assert {E.QUOTA_WARNING, E.QUOTA_EXHAUSTED} <= SINK.events  # a sink naming no events hears of them


def test_quota_cloudevent_and_slack_bodies_keep_tenant_text_plain() -> None:
    hostile = quota(exhausted="True", message=HOSTILE, name="evil-quota")
    # Names are DNS labels; the body holds whatever is there, as plain text.
    hostile["status"]["limits"][0]["name"] = hostile["spec"]["limits"][0]["name"] = "<!channel>"
    (n,) = notify.quota_notices(hostile)
    ev = json.loads(bodies.body(SINK, n)[0])
    assert (ev["type"], ev["source"], ev["subject"], ev["time"]) == (
        "io.flowkube.quota.QuotaExhausted", "/apis/flowkube.io/v1alpha1/namespaces/team/flowquotas/evil-quota",
        f"Exhausted-{SINCE}", SINCE)
    assert ev["data"]["message"] == HOSTILE
    msg = json.loads(bodies.body(Sink("s", "s", format="slack"), n)[0])
    assert msg["text"] == "FlowQuota team/evil-quota is exhausted"
    texts = [b["text"] for b in msg["blocks"] if b["type"] in ("section", "header")]
    assert {"type": "plain_text", "text": HOSTILE, "emoji": False} in texts
    assert all(t["type"] == "plain_text" for t in texts)
    (ctx,) = [b for b in msg["blocks"] if b["type"] == "context"]
    assert ctx["elements"][0]["type"] == "plain_text"
    assert ctx["elements"][0]["text"] == ("<!channel>: 100 tokens of 100, resets 2026-11-28T00:00:00Z · monthly: "
                                          "100 tokens, USD 1.5 of 5, window from 2026-11-01T00:00:00Z")
    (warned,) = notify.quota_notices(quota(warning="True"))
    assert json.loads(bodies.slack(warned))["text"] == "FlowQuota team/team-a passed a warning threshold"


def test_a_quotas_deliveries_are_recorded_in_its_status_and_not_sent_again() -> None:
    q = quota(exhausted="True")
    (n,) = notify.quota_notices(q)
    assert [(s.name, m.id) for s, m in notify.pending(q, [SINK], [n])] == [("team", n.id)]
    only_flows = Sink("flows", "s", frozenset({E.FAILED}))
    assert notify.pending(q, [only_flows], [n]) == []  # a sink that does not name the quota events
    earlier = Outcome("team", "q-0/Exhausted-x/QuotaExhausted", E.QUOTA_EXHAUSTED, True, "Delivered", 1, NOW)
    assert notify.record_quota(q, [earlier]) == [], "an earlier quota's (another uid): not this one's"
    assert "notifications" not in q["status"]
    failed = Outcome("ops", n.id, E.QUOTA_EXHAUSTED, False, "Rejected", 1, NOW, 404, "404 Not Found")
    events = notify.record_quota(q, [Outcome("team", n.id, E.QUOTA_EXHAUSTED, True, "Delivered", 1, NOW, 200),
                                     failed])
    assert events == [("Warning", "NotificationFailed", "QuotaExhausted to sink ops: Rejected after 1 attempt(s): "
                                                          "404 Not Found")]
    ops, team = q["status"]["notifications"]  # by name
    assert (team["name"], team["outcome"], team["eventId"], team["handled"]) == ("team", "Delivered", n.id, [n.id])
    assert (ops["name"], ops["outcome"], ops["code"], ops["handled"]) == ("ops", "Failed", 404, [n.id])
    assert notify.pending(q, [SINK, Sink("ops", "s")], [n]) == []  # handled: a restart sends nothing again


def test_an_exhausted_quota_tells_its_namespaces_default_sinks_once_and_a_new_operator_not_again() -> None:
    """The quota service and the notifier as app.py wires them, against a real receiver: the defaults
    sink that names no events hears of it, signed; one that names other events, and a Flow's own
    sink, do not; the delivery is folded into the next status write, and a new operator (a restart,
    a new leader) fed that status sends nothing."""
    from flowkube_operator.notify.notifier import QuotaNotices
    from flowkube_operator.quotas.service import Quotas
    from tests.unit.operator import test_quota_service as qs

    def operator(kube: qs.FakeKube, port: int, woke: asyncio.Event, now: dt.datetime) -> tuple[Notifier, Quotas]:
        box: list[Quotas] = []

        def ended(key: tuple[str, str]) -> None:
            box[0].notified(key)
            woke.set()

        n = Notifier(Settings(notifications_allowed_cidrs="127.0.0.1/32"), wake=lambda _k: None,
                     wake_quota=ended, quota_of=lambda key: box[0].noticed(key))
        box.append(Quotas(lambda: kube, lambda: True, clock=lambda: now,  # type: ignore[arg-type,return-value]
                          notices=QuotaNotices(n)))
        url = f"http://127.0.0.1:{port}/hook".encode()
        n.secrets.event("ADDED", labelled("ns-default", "defaults", url=url, signingKey=b"k"))
        n.secrets.event("ADDED", labelled("ns-flows-only", "defaults", url=url, events=b"Failed"))
        n.secrets.event("ADDED", labelled("team-hook", url=url))  # a Flow's own sink's Secret
        n.learned.set()
        return n, box[0]

    async def go() -> None:
        async with receiving([]) as (r, port):
            kube, woke = qs.FakeKube(), asyncio.Event()
            n, q = operator(kube, port, woke, qs.NOW)
            try:
                q.quota_event("ADDED", qs.quota("tokens", 100))
                q.flow_changed(("team", "a"), qs.flow("a", {}, 100))
                await q._read_reports(kube)  # type: ignore[arg-type]
                await q.one_pass()  # the status is written, its event offered
                await asyncio.wait_for(woke.wait(), 10)
                await q.one_pass()  # and recorded
            finally:
                await n.close()
            (headers, body), = r.seen
            assert bodies.verify(b"k", body, headers["X-Flowkube-Signature"], now=time.time())
            event = json.loads(body)
            assert event["type"] == "io.flowkube.quota.QuotaExhausted"
            assert event["id"] == headers["X-Flowkube-Event-Id"] == \
                "uid-tokens/Exhausted-2026-11-28T08:20:00Z/QuotaExhausted"
            status = kube.patches[-1][1]["status"]
            (rec,) = status["notifications"]
            assert (rec["name"], rec["outcome"], rec["handled"]) == ("ns-default", "Delivered", [event["id"]])

            again, woke = qs.FakeKube(), asyncio.Event()
            n, q = operator(again, port, woke, qs.NOW + dt.timedelta(minutes=10))  # restarted later
            try:
                stored = qs.quota("tokens", 100)
                stored["status"] = status
                q.quota_event("ADDED", stored)
                q.flow_changed(("team", "a"), qs.flow("a", {}, 100))
                await q._read_reports(again)  # type: ignore[arg-type]
                await q.one_pass()
                assert not n._tasks and n.take(("team", "tokens"), "FlowQuota") == []
            finally:
                await n.close()
            assert len(r.seen) == 1, "handled: not sent again"
            exhausted = next(x for x in again.patches[-1][1]["status"]["conditions"] if x["type"] == "Exhausted")
            assert exhausted["lastTransitionTime"] == "2026-11-28T08:20:00Z"
    run(go)
