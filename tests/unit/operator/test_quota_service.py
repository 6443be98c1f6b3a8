"""The operator's FlowQuota service: the status it writes (only when changed, at most once a period,
keeping when each condition last changed), the Flows a new selector key needs listed, the quotas that
wait for a place, and the desk answering only on the leader."""

from __future__ import annotations

import asyncio
import copy
import datetime as dt
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from flowkube_api import constants as c
from flowkube_api.constants import NotificationEvent as E
from flowkube_operator.notify import notices as notify
from flowkube_operator.notify.notices import Outcome, Sink
from flowkube_operator.quotas.book import Refusal, Spend
from flowkube_operator.quotas.service import Quotas

NOW = dt.datetime(2026, 11, 28, 8, 20, tzinfo=dt.UTC)


@dataclass(frozen=True)
class Pod:
    namespace: str
    flow: str
    pod: str


class FakeKube:
    def __init__(self, flows: list[dict[str, Any]] | None = None) -> None:
        self.patches: list[tuple[str, dict[str, Any]]] = []
        self.lists: list[dict[str, str]] = []
        self.flows = flows or []
        self.quotas: dict[str, dict[str, Any]] = {}

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.patches.append((path, patch))
        return {}

    async def list_page(self, path: str, params: dict[str, str], *, max_bytes: int) -> tuple[dict[str, Any], int]:
        self.lists.append(params)
        key = params["labelSelector"]
        return {"items": [f for f in self.flows if key in f["metadata"].get("labels", {})], "metadata": {}}, 0

    async def get(self, path: str) -> dict[str, Any] | None:
        return self.quotas.get(path.rsplit("/", 1)[1])


def quota(name: str, max_tokens: int = 100, selector: dict[str, Any] | None = None, gen: int = 1) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "generation": gen,
                         "creationTimestamp": f"2026-11-28T00:00:{len(name):02d}Z"},
            "spec": {**({"selector": selector} if selector else {}),
                     "limits": [{"name": "daily", "maxTotalTokens": max_tokens, "window": {"kind": "Day"}}]}}


def flow(name: str, labels: dict[str, str], tokens: int = 0) -> dict[str, Any]:
    runs = [{"pod": f"{name}-0", "finishedAt": "2026-11-28T08:10:00Z", "usage": {"totalTokens": tokens},
             "charges": [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": tokens}]}] if tokens else []
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "labels": labels},
            "status": {"runs": runs}}


def service(kube: FakeKube, leading: list[bool], now: list[dt.datetime]) -> Quotas:
    return Quotas(lambda: kube, lambda: leading[0], clock=lambda: now[0])  # type: ignore[arg-type,return-value]


def test_status_is_written_when_it_changes_and_a_condition_keeps_when_it_last_changed() -> None:
    kube, leading, now = FakeKube(), [True], [NOW]
    q = service(kube, leading, now)
    q.quota_event("ADDED", quota("tokens"))
    q.flow_changed(("team", "a"), flow("a", {}, 50))

    async def scenario() -> None:
        assert await q.write_statuses() == 1
        assert await q.write_statuses() == 0, "nothing changed: nothing written"
        path, patch = kube.patches[-1]
        assert path == "/apis/flowkube.io/v1alpha1/namespaces/team/flowquotas/tokens/status"
        status = patch["status"]
        assert status["summary"] == "daily 50%" and status["observedGeneration"] == 1
        assert status["limits"][0]["used"]["totalTokens"] == 50
        assert status["nextReset"] == "2026-11-29T00:00:00Z"
        types = {x["type"]: x for x in status["conditions"]}
        assert types["Ready"]["status"] == "True" and types["Exhausted"]["status"] == "False"
        # Later, more is used: written again; Exhausted turns True (its time moves), Ready keeps its time.
        now[0] = NOW + dt.timedelta(minutes=5)
        q.flow_changed(("team", "b"), flow("b", {}, 50))
        assert await q.write_statuses() == 1
        again = {x["type"]: x for x in kube.patches[-1][1]["status"]["conditions"]}
        assert again["Exhausted"]["status"] == "True" and again["Exhausted"]["message"] == "daily at 100%"
        assert again["Exhausted"]["lastTransitionTime"] != types["Exhausted"]["lastTransitionTime"]
        assert again["Ready"]["lastTransitionTime"] == types["Ready"]["lastTransitionTime"]
        # A follower writes nothing and answers no reservation.
        leading[0] = False
        assert q.reserve(Pod("team", "a", "a-1"), "m", Spend(1), True) is None

    asyncio.run(scenario())


def test_a_quota_that_cannot_be_used_says_why_in_its_ready_condition() -> None:
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    bad = quota("tz")
    bad["spec"]["limits"][0]["window"]["timeZone"] = "Nowhere/Atlantis"
    q.quota_event("ADDED", bad)
    asyncio.run(q.write_statuses())
    (ready,) = kube.patches[-1][1]["status"]["conditions"]
    assert (ready["type"], ready["status"], ready["reason"]) == ("Ready", "False", "NotUsed")
    assert "timeZone" in ready["message"]


def test_a_new_selector_key_lists_only_the_flows_carrying_it_and_covers_them() -> None:
    kube = FakeKube([flow("a", {"team": "a", "noise": "x" * 60}, 30), flow("b", {"team": "b"}, 7)])
    q = service(kube, [True], [NOW])
    # The cache saw the Flows before any quota named "team": their labels were not kept.
    for f in kube.flows:
        q.flow_changed(("team", f["metadata"]["name"]), {**f, "metadata": {**f["metadata"], "labels": {}}})
    q.quota_event("ADDED", quota("tokens", selector={"matchLabels": {"team": "a"}}))
    assert q.tracker.covering("team", "a") == []
    asyncio.run(q._catch_up())
    assert kube.lists == [{"labelSelector": "team", "limit": "200"}], "one list, of the Flows with the key"
    assert q.tracker.covering("team", "a") == ["FlowQuota team/tokens"] and q.tracker.covering("team", "b") == []
    assert q.tracker.book.used(("FlowQuota team/tokens", "daily"), NOW) == Spend(30)
    asyncio.run(q._catch_up())
    assert len(kube.lists) == 1, "a key already listed is not listed again"


def test_a_namespace_past_its_quota_limit_waits_and_the_oldest_waiting_one_takes_a_freed_place() -> None:
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    names = [f"q{i:02d}" for i in range(c.QUOTAS_PER_NAMESPACE_LIMIT + 1)]
    for n in names:
        kube.quotas[n] = quota(n)
        q.quota_event("ADDED", quota(n))
    last = names[-1]
    assert len(q.tracker.quotas()) == c.QUOTAS_PER_NAMESPACE_LIMIT
    asyncio.run(q.write_statuses())
    waiting = next(p for path, p in kube.patches if path.endswith(f"/{last}/status"))
    assert "used once an older one is deleted" in waiting["status"]["conditions"][0]["message"]
    q.quota_event("DELETED", quota(names[0]))
    asyncio.run(q._catch_up())
    assert ("team", last) in q.tracker.quotas()


def test_the_desk_reserves_for_covered_flows_only_and_refuses_past_the_limit() -> None:
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    q.quota_event("ADDED", quota("tokens", 100))
    q.flow_changed(("team", "a"), flow("a", {}))
    assert "ask again" in str(q.reserve(Pod("team", "a", "a-0"), "m", Spend(1), True)), "a new leader reads first"
    asyncio.run(q._read_reports(kube))  # type: ignore[arg-type]  # a new leader: no covered pod ran
    assert q.reserve(Pod("team", "elsewhere", "e-0"), "m", Spend(10**6), True) == 0, "not covered: id 0"
    first = q.reserve(Pod("team", "a", "a-0"), "m", Spend(80), True)
    assert isinstance(first, int) and first > 0
    refused = q.reserve(Pod("team", "a", "a-0"), "m", Spend(21), True)
    assert isinstance(refused, Refusal) and refused.message().startswith("FlowQuota team/tokens: limit daily")
    assert q.settle(Pod("team", "a", "a-0"), first, [(NOW, "m", Spend(10))]) is True
    assert isinstance(q.reserve(Pod("team", "a", "a-0"), "m", Spend(90), True), int)


def test_a_new_leader_lets_no_call_through_until_the_running_pods_spend_and_calls_in_flight_are_back() -> None:
    """What a running pod spent since its run began is in its interim report; what it has in flight it
    says with its next request. Until both are in (or the recovery time passes), reservations are
    answered "ask again", so a restart or failover lets no call pass a limit."""
    import base64

    from flowkube_api.constants import Reason, RunResult, Trigger
    from flowkube_api.report import Charge, RunReport, Usage

    running = {"pod": "a-0", "startedAt": "2026-11-28T08:00:00Z"}
    a = {"metadata": {"name": "a", "namespace": "team", "uid": "uid-a"}, "status": {"runs": [running]}}
    b = {"metadata": {"name": "b", "namespace": "team", "uid": "uid-b"},
         "status": {"runs": [{"pod": "b-0", "startedAt": "2026-11-28T08:00:00Z"}]}}
    report = RunReport(pod="a-0", trigger=Trigger.KICKOFF, result=RunResult.FAILED, reason=Reason.RUN_INTERRUPTED,
                       exit_code=75, usage=Usage(total_tokens=40),
                       charges=[Charge(at=NOW, model="m", total_tokens=40)])
    cm = {"metadata": {"name": "a-state", "ownerReferences": [{"uid": "uid-a", "controller": True}]},
          "binaryData": {c.report_key("a-0"): base64.b64encode(report.encode()).decode()}}

    class Kube(FakeKube):
        async def get(self, path: str) -> dict[str, Any] | None:
            return cm if path.endswith("/configmaps/a-state") else None

    kube = Kube()
    q = Quotas(lambda: kube, lambda: True, recovery_seconds=600, clock=lambda: NOW)  # type: ignore[arg-type,return-value]
    q.quota_event("ADDED", quota("tokens", 100))
    q.flow_changed(("team", "a"), a)
    q.flow_changed(("team", "b"), b)
    key = ("FlowQuota team/tokens", "daily")
    why = q.reserve(Pod("team", "b", "b-0"), "m", Spend(1), True, [], [])
    assert isinstance(why, str) and "ask again" in why, "nothing is answered before the reports are read"

    async def recover() -> None:
        await q._read_reports(kube)  # type: ignore[arg-type]  # what the loop does first

    asyncio.run(recover())
    assert q.tracker.book.used(key, NOW) == Spend(40), "a's interim report: what it spent so far"
    why = q.reserve(Pod("team", "b", "b-0"), "m", Spend(1), True, [], [])
    assert isinstance(why, str) and "1 running pod" in why, "a has not said what it holds yet"
    # a's call made with the old leader is still in flight: its reminder (heartbeat) says what it
    # holds, answered while the book recovers, and ends the wait for a.
    assert q.hold(Pod("team", "a", "a-0"), [(NOW, "m", Spend(45))], [(777, "m", Spend(30))]) is True
    assert q.tracker.book.used(key, NOW) == Spend(45) and q.tracker.book.reserved(key) == Spend(30)
    # Then it settles another call it reserved with the old leader; 777 is still held.
    assert q.settle(Pod("team", "a", "a-0"), 12345, [(NOW, "m", Spend(45))], [(777, "m", Spend(30))]) is False
    assert q.tracker.book.used(key, NOW) == Spend(45) and q.tracker.book.reserved(key) == Spend(30)
    # Now the book is whole: b may reserve what is left (100 - 45 - 30), not a token more.
    assert isinstance(q.reserve(Pod("team", "b", "b-0"), "m", Spend(26), True, [], []), Refusal)
    granted = q.reserve(Pod("team", "b", "b-0"), "m", Spend(25), True, [], [])
    assert isinstance(granted, int) and granted > 0
    # A stale word from a (fewer charges than the book has) changes nothing.
    q.reserve(Pod("team", "a", "a-0"), "m", Spend(0), True, [(NOW, "m", Spend(10))], [(777, "m", Spend(30))])
    assert q.tracker.book.used(key, NOW) == Spend(45) and q.tracker.book.reserved(key) == Spend(55)


def test_the_quota_metrics_are_used_limit_and_reserved_per_limit_and_unit() -> None:
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    body = quota("tokens", 100)
    body["spec"]["limits"].append({"name": "monthly", "maxCost": "2.5", "window": {"kind": "Month"}})
    q.quota_event("ADDED", body)
    q.flow_changed(("team", "a"), flow("a", {}, 30))
    asyncio.run(q._read_reports(kube))  # type: ignore[arg-type]
    assert isinstance(q.reserve(Pod("team", "a", "a-1"), "m", Spend(20, Decimal("0.5")), True), int)
    lines = q.metrics_text().splitlines()
    assert 'flowkube_quota_used{namespace="team",quota="tokens",limit="daily",unit="tokens"} 30' in lines
    assert 'flowkube_quota_limit{namespace="team",quota="tokens",limit="daily",unit="tokens"} 100' in lines
    assert 'flowkube_quota_reserved{namespace="team",quota="tokens",limit="daily",unit="tokens"} 20' in lines
    assert 'flowkube_quota_limit{namespace="team",quota="tokens",limit="monthly",unit="usd"} 2.5' in lines
    assert 'flowkube_quota_reserved{namespace="team",quota="tokens",limit="monthly",unit="usd"} 0.5' in lines
    assert not [x for x in lines if 'limit="daily",unit="usd"' in x], "no series for a cap the limit does not set"
    assert "# TYPE flowkube_quota_used gauge" in lines


def test_a_deleted_flows_spend_stays_in_its_quotas_windows_across_an_operator_restart() -> None:
    """A Flow deleted mid-run: its ended run and the calls its pod settled move into the quota's
    status.retired (its reservations go with its pod); a new operator reads them back from the
    quota's status, and counts them once."""
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    q.quota_event("ADDED", quota("tokens", 1000))
    running = flow("a", {}, 30)
    running["status"]["runs"].append({"pod": "a-1", "startedAt": "2026-11-28T08:12:00Z"})
    q.flow_changed(("team", "a"), running)
    asyncio.run(q._read_reports(kube))  # type: ignore[arg-type]
    reservation = q.reserve(Pod("team", "a", "a-1"), "m", Spend(100), True)
    assert isinstance(reservation, int)
    assert q.settle(Pod("team", "a", "a-1"), reservation, [(NOW, "m", Spend(12))]) is True
    q.reserve(Pod("team", "a", "a-1"), "m", Spend(100), True)  # a call in flight when the Flow goes
    key = ("FlowQuota team/tokens", "daily")
    assert q.tracker.book.used(key, NOW) == Spend(42) and q.tracker.book.reserved(key) == Spend(100)
    q.flow_changed(("team", "a"), None)
    assert q.tracker.book.used(key, NOW) == Spend(42) and q.tracker.book.reserved(key) == Spend(), "counted once"
    asyncio.run(q.write_statuses())
    status = kube.patches[-1][1]["status"]
    assert status["retired"] == [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": 30, "cost": "0"},
                                 {"at": "2026-11-28T08:15:00Z", "model": "m", "totalTokens": 12, "cost": "0"}]
    # A new operator: the quota as the API server has it now, no Flow left.
    again = service(FakeKube(), [True], [NOW])
    stored = quota("tokens", 1000)
    stored["status"] = status
    again.quota_event("ADDED", stored)
    assert again.tracker.book.used(key, NOW) == Spend(42)
    again.quota_event("MODIFIED", stored)  # the echo of its own write changes nothing
    assert again.tracker.book.used(key, NOW) == Spend(42)


def test_a_cluster_quota_covers_the_flows_of_the_namespaces_its_selector_picks_and_sums_them() -> None:
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    for ns, label in (("ns1", "a"), ("ns2", "a"), ("ns3", "b")):
        q.namespace_event("ADDED", {"metadata": {"name": ns, "labels": {"team": label, "noise": "x" * 60}}})
        f = flow("f", {}, 40)
        f["metadata"]["namespace"] = ns
        f["metadata"]["uid"] = f"uid-{ns}"
        q.flow_changed((ns, "f"), f)
    team = {"metadata": {"name": "team-a", "uid": "uid-cq", "generation": 1},
            "spec": {"namespaceSelector": {"matchLabels": {"team": "a"}},
                     "limits": [{"name": "daily", "maxTotalTokens": 100, "window": {"kind": "Day"}}]}}
    q.quota_event("ADDED", team)
    assert q.tracker.namespace_keys() == {"team"}
    # The namespaces were seen before any selector named "team": listed again, as the loop does.
    for name, label in (("ns1", "a"), ("ns2", "a"), ("ns3", "b")):
        q.namespace_event("MODIFIED", {"metadata": {"name": name, "labels": {"team": label}}})
    key = ("ClusterFlowQuota team-a", "daily")
    assert q.tracker.book.used(key, NOW) == Spend(80), "ns1's and ns2's Flows, not ns3's"
    assert q.tracker.covering("ns3", "f") == [] and q.tracker.covering("ns1", "f") == ["ClusterFlowQuota team-a"]
    asyncio.run(q._read_reports(kube))  # type: ignore[arg-type]
    refused = q.reserve(Pod("ns2", "f", "f-1"), "m", Spend(21), True)
    assert isinstance(refused, Refusal) and refused.message().startswith("ClusterFlowQuota team-a: limit daily")
    assert q.tracker.refuses("ns1", {}, NOW) is None and q.tracker.exhausted("ns1", "f", NOW) is None
    # ns2 leaves the team: its Flow is not covered any more (a namespace's labels are its admins').
    q.namespace_event("MODIFIED", {"metadata": {"name": "ns2", "labels": {"team": "b"}}})
    assert q.tracker.covering("ns2", "f") == [] and q.tracker.book.used(key, NOW) == Spend(40)
    asyncio.run(q.write_statuses())
    path = next(p for p, _ in kube.patches if "clusterflowquotas" in p)
    assert path == "/apis/flowkube.io/v1alpha1/clusterflowquotas/team-a/status"


def test_a_settle_before_the_flows_are_listed_is_asked_again_not_lost() -> None:
    """Found by the parallel test under load: a new leader took a pod's settle before its Flow cache
    listed the Flow, dropped it without remembering the id as freed, and a later held list took that
    reservation again: it stayed reserved and refused the next Flow's calls."""
    kube = FakeKube()
    listed = [False]
    q = service(kube, [True], [NOW])
    q.listed = lambda: listed[0]
    q.quota_event("ADDED", quota("tokens", 100))
    assert q.settle(Pod("team", "a", "a-0"), 777, [(NOW, "m", Spend(10))], []) is None, "asked again (503)"
    listed[0] = True
    q.flow_changed(("team", "a"), {"metadata": {"name": "a", "namespace": "team", "uid": "uid-a"},
                                   "status": {"runs": [{"pod": "a-0", "startedAt": "2026-11-28T08:00:00Z"}]}})
    assert q.settle(Pod("team", "a", "a-0"), 777, [(NOW, "m", Spend(10))], []) is False
    q.settle(Pod("team", "a", "a-0"), 778, [(NOW, "m", Spend(20))], [(777, "m", Spend(10))])  # a stale list
    key = ("FlowQuota team/tokens", "daily")
    assert q.tracker.book.reserved(key) == Spend() and q.tracker.book.used(key, NOW) == Spend(20)


# -- notifications: QuotaWarning, QuotaExhausted ---------------------------------------------------------

T = "2026-11-28T07:00:00Z"  # when an earlier operator saw the quota exhausted


class FakeNotices:
    """The notifier as Quotas sees it (quotas.service.Notices), folding with the real record."""

    def __init__(self) -> None:
        self.announced: list[tuple[tuple[str, str], dict[str, Any]]] = []
        self.ended: dict[tuple[str, str], list[Any]] = {}
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    def announce(self, key: tuple[str, str], quota: dict[str, Any]) -> None:
        self.announced.append((key, copy.deepcopy(quota)))

    def take(self, key: tuple[str, str]) -> list[Any]:
        return list(self.ended.get(key, []))

    def fold(self, quota: dict[str, Any], ended: list[Any]) -> list[tuple[str, str, str]]:
        return notify.record_quota(quota, ended)

    def recorded(self, key: tuple[str, str], ended: list[Any]) -> None:
        left = [o for o in self.ended.get(key, []) if o not in ended]
        if left:
            self.ended[key] = left
        else:
            self.ended.pop(key, None)


def noticed(quota: dict[str, Any]) -> list[str]:
    return [n.id for n in notify.quota_notices(quota)]


def exhausted_since(when: str) -> dict[str, Any]:
    body = quota("tokens", 100)
    body["status"] = {"conditions": [
        {"type": "Ready", "status": "True", "reason": "Enforced", "lastTransitionTime": "2026-11-28T00:00:00Z"},
        {"type": "Exhausted", "status": "True", "reason": "LimitReached", "lastTransitionTime": when},
        {"type": "Warning", "status": "False", "reason": "WithinLimits", "lastTransitionTime": when}]}
    return body


def test_a_new_operator_keeps_when_each_condition_last_changed_from_the_status_it_observes() -> None:
    """An event is named after when its condition turned True: a restart that took that time for
    "now" would make every exhausted quota a new event, sent again."""
    kube = FakeKube()
    q = service(kube, [True], [NOW])
    q.quota_event("ADDED", exhausted_since(T))
    q.flow_changed(("team", "a"), flow("a", {}, 100))
    assert asyncio.run(q.write_statuses()) == 1
    conditions = {x["type"]: x for x in kube.patches[-1][1]["status"]["conditions"]}
    assert conditions["Exhausted"]["status"] == "True" and conditions["Exhausted"]["lastTransitionTime"] == T
    assert conditions["Ready"]["lastTransitionTime"] == "2026-11-28T00:00:00Z"
    # A condition that did change takes the time of this write.
    again = service(FakeKube(), [True], [NOW])
    again.quota_event("ADDED", exhausted_since(T))
    again.flow_changed(("team", "a"), flow("a", {}, 10))
    asyncio.run(again.write_statuses())
    assert {x["type"]: x for x in again._written[("team", "tokens")]["conditions"]}["Exhausted"] == {
        "type": "Exhausted", "status": "False", "reason": "WithinLimits", "message": "", "lastTransitionTime":
        "2026-11-28T08:20:00Z"}


def test_the_leader_offers_a_quotas_events_after_each_write_and_records_ended_deliveries_in_the_next() -> None:
    kube, notices, events = FakeKube(), FakeNotices(), []
    q = Quotas(lambda: kube, lambda: True, clock=lambda: NOW, notices=notices,  # type: ignore[arg-type,return-value]
               event=lambda obj, *what: events.append((obj["metadata"]["uid"], *what)))
    key = ("team", "tokens")
    q.quota_event("ADDED", quota("tokens", 100))
    assert [k for k, _ in notices.announced] == [key], "seen: offered (it holds no event yet)"
    q.flow_changed(("team", "a"), flow("a", {}, 100))
    assert asyncio.run(q.write_statuses()) == 1
    offered = notices.announced[-1][1]
    (event_id,) = noticed(offered)
    assert event_id == "uid-tokens/Exhausted-2026-11-28T08:20:00Z/QuotaExhausted"
    assert offered["spec"]["limits"] == [{"name": "daily", "maxTotalTokens": 100, "maxCost": None}]
    # The deliveries end (the notifier wakes the loop): the next write records them, though nothing else changed.
    notices.ended[key] = [Outcome("team", event_id, E.QUOTA_EXHAUSTED, True, "Delivered", 1, NOW, 200),
                          Outcome("ops", event_id, E.QUOTA_EXHAUSTED, False, "Rejected", 1, NOW, 404, "404 Not Found")]
    q._wake.clear()
    q.notified(key)
    assert q._wake.is_set()
    assert asyncio.run(q.write_statuses()) == 1
    ops, team = kube.patches[-1][1]["status"]["notifications"]
    assert (team["name"], team["outcome"], team["handled"]) == ("team", "Delivered", [event_id])
    assert (ops["name"], ops["reason"], ops["handled"]) == ("ops", "Rejected", [event_id])
    assert events == [("uid-tokens", "Warning", "NotificationFailed",
                       "QuotaExhausted to sink ops: Rejected after 1 attempt(s): 404 Not Found")]
    assert notices.ended == {}, "recorded once written"
    assert notify.pending(notices.announced[-1][1], [Sink("team", "s"), Sink("ops", "s")],
                          notify.quota_notices(notices.announced[-1][1])) == [], "offered again: nothing due"
    assert asyncio.run(q.write_statuses()) == 0
    # The watch's echo of an earlier write (no records yet) comes late: what is offered is what was written.
    stale = quota("tokens", 100)
    stale["status"] = kube.patches[0][1]["status"]
    q.quota_event("MODIFIED", stale)
    assert notices.announced[-1][1]["status"]["notifications"] == [ops, team]
    # A delivery that ends after its quota is gone is dropped: nowhere to record it.
    q.quota_event("DELETED", quota("tokens", 100))
    notices.ended[key] = [Outcome("team", event_id, E.QUOTA_EXHAUSTED, True, "Delivered", 2, NOW, 200)]
    q.notified(key)
    assert notices.ended == {}


def test_a_follower_offers_and_writes_nothing_and_a_new_leader_offers_every_quota_once_ready() -> None:
    kube, notices, leading = FakeKube(), FakeNotices(), [False]
    q = Quotas(lambda: kube, lambda: leading[0], clock=lambda: NOW, notices=notices)  # type: ignore[arg-type,return-value]
    q.quota_event("ADDED", exhausted_since(T))
    q.quota_event("ADDED", {**quota("other", 100), "metadata": {**quota("other")["metadata"], "namespace": "b"}})
    q.flow_changed(("team", "a"), flow("a", {}, 100))
    q.defaults_changed("team")
    asyncio.run(q.one_pass())
    assert notices.announced == [] and kube.patches == [], "a follower: nothing offered, nothing written"
    leading[0], notices.is_ready = True, False
    asyncio.run(q._read_reports(kube))  # type: ignore[arg-type]
    asyncio.run(q.one_pass())
    assert len(kube.patches) == 2
    offered = [k for k, _ in notices.announced]
    asyncio.run(q.one_pass())
    assert [k for k, _ in notices.announced] == offered, "the notifier not ready: nothing more offered"
    notices.is_ready = True
    asyncio.run(q.one_pass())
    assert sorted(k for k, _ in notices.announced[len(offered):]) == [("b", "other"), ("team", "tokens")]
    (last,) = [b for k, b in notices.announced if k == ("team", "tokens")][-1:]
    assert noticed(last) == [f"uid-tokens/Exhausted-{T}/QuotaExhausted"], "the earlier operator's event, not a new one"
    count = len(notices.announced)
    asyncio.run(q.one_pass())
    assert len(notices.announced) == count, "once a term, not every pass"
    q.defaults_changed("b")  # new default sinks in namespace b: its quotas are offered again
    asyncio.run(q.one_pass())
    assert [k for k, _ in notices.announced[count:]] == [("b", "other")]


def test_a_cluster_quota_has_no_notifications() -> None:
    kube, notices = FakeKube(), FakeNotices()
    q = Quotas(lambda: kube, lambda: True, clock=lambda: NOW, notices=notices)  # type: ignore[arg-type,return-value]
    q.quota_event("ADDED", {"metadata": {"name": "team-a", "uid": "uid-cq", "generation": 1},
                            "spec": {"limits": [{"name": "daily", "maxTotalTokens": 100, "window": {"kind": "Day"}}]}})
    asyncio.run(q.write_statuses())
    assert notices.announced == [] and "notifications" not in kube.patches[-1][1]["status"]
