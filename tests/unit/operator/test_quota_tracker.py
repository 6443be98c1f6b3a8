"""Which FlowQuotas cover which Flows, the book fed from what the watches see, and a quota's status."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_operator.quotas.book import Refusal, Reservation, Spend
from flowkube_operator.quotas.tracker import QuotaTracker, quota_name

NOW = dt.datetime(2026, 11, 28, 8, 20, tzinfo=dt.UTC)
KEY = (quota_name("team", "tokens"), "daily")


def quota(max_tokens: int = 100, **spec: Any) -> dict[str, Any]:
    return {"spec": {"limits": [{"name": "daily", "maxTotalTokens": max_tokens, "window": {"kind": "Day"}}],
                     **spec}}


def flow(name: str, labels: dict[str, str], *runs: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team", "uid": f"uid-{name}", "labels": labels},
            "status": {"runs": list(runs)}}


def ended(pod: str, tokens: int) -> dict[str, Any]:
    return {"pod": pod, "finishedAt": "2026-11-28T08:10:00Z", "usage": {"totalTokens": tokens},
            "charges": [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": tokens}]}


def test_a_quota_counts_the_flows_its_selector_covers_and_a_runs_calls_once() -> None:
    t = QuotaTracker()
    t.flow_event("team", "a", flow("a", {"team": "a"}, ended("a-0", 30)))
    t.flow_event("team", "b", flow("b", {"team": "b"}, ended("b-0", 500)))
    assert t.quota_event(quota(selector={"matchLabels": {"team": "a"}}), "team", "tokens") is None
    assert t.label_keys() == {"team"} and t.covering("team", "a") == [], "its labels were not kept before"
    # What the service's backfill does for a key no selector named before: the Flows with it, again.
    t.flow_event("team", "a", flow("a", {"team": "a"}, ended("a-0", 30)))
    t.flow_event("team", "b", flow("b", {"team": "b"}, ended("b-0", 500)))
    assert t.covering("team", "a") == [KEY[0]] and t.covering("team", "b") == []
    assert t.book.used(KEY, NOW) == Spend(30), "a quota made after the Flows counts what they charged"
    # Flow a runs again: its calls settle as they answer, then its status shows the run ended.
    r = t.reserve("team", "a", "a-1", "m", Spend(60), NOW)
    assert isinstance(r, Reservation)
    assert isinstance(t.reserve("team", "a", "a-1", "m", Spend(11), NOW), Refusal), "30 used + 60 held + 11 > 100"
    assert t.settle("team", "a", "a-1", r.id, [(NOW, "m", Spend(20))])
    assert t.book.used(KEY, NOW) == Spend(50)
    t.flow_event("team", "a", flow("a", {"team": "a"}, ended("a-0", 30), ended("a-1", 20)))
    assert t.book.used(KEY, NOW) == Spend(50), "the run's calls moved from its pod to its Flow, counted once"
    assert t.book.reserved(KEY) == Spend()
    # b joins the team: counted; a leaves it: its spend stays (coverage is sticky against labels, or
    # relabelling a Flow would make room); a is deleted: what it spent stays spent.
    t.flow_event("team", "b", flow("b", {"team": "a"}, ended("b-0", 500)))
    assert t.book.used(KEY, NOW) == Spend(550)
    t.flow_event("team", "a", flow("a", {"team": "elsewhere"}, ended("a-0", 30), ended("a-1", 20)))
    assert t.book.used(KEY, NOW) == Spend(550) and t.covering("team", "a") == [KEY[0]]
    t.flow_event("team", "a", None)
    assert t.book.used(KEY, NOW) == Spend(550)
    # The quota's own selector changed by its owner decides afresh: b is out, a (deleted) stays spent.
    t.quota_event(quota(selector={"matchLabels": {"team": "c"}}), "team", "tokens")
    assert t.covering("team", "b") == [] and t.book.used(KEY, NOW) == Spend(50)


def test_a_quotas_status_has_each_limits_use_window_and_conditions() -> None:
    t = QuotaTracker()
    t.quota_event(quota(100, warnAt=[75]), "team", "tokens")
    t.flow_event("team", "a", flow("a", {}, ended("a-0", 80)))
    limits, conditions = t.status("team", "tokens", NOW)
    (daily,) = limits
    assert (daily.name, daily.used.total_tokens, daily.reserved.total_tokens) == ("daily", 80, 0)
    assert daily.window_start == dt.datetime(2026, 11, 28, tzinfo=dt.UTC)
    assert daily.resets_at == dt.datetime(2026, 11, 29, tzinfo=dt.UTC)
    assert [(x.type, x.status, x.message) for x in conditions] == [
        ("Exhausted", "False", ""), ("Warning", "True", "daily at 80%")]
    t.flow_event("team", "b", flow("b", {}, ended("b-0", 20)))
    _, conditions = t.status("team", "tokens", NOW)
    exhausted = conditions[0]
    assert (exhausted.type, exhausted.status, exhausted.message) == ("Exhausted", "True", "daily at 100%")


def test_a_quota_whose_spec_cannot_be_used_says_why_and_covers_nothing() -> None:
    t = QuotaTracker()
    t.flow_event("team", "a", flow("a", {}))
    why = t.quota_event({"spec": {"limits": [{"name": "x", "maxCost": "1", "window": {"kind": "Day",
                                                                                        "timeZone": "Nowhere"}}]}},
                        "team", "tokens")
    assert why is not None and "window.timeZone" in why
    assert t.covering("team", "a") == []
    assert t.reserve("team", "a", "a-0", "m", Spend(10**9), NOW) is None, "no quota: nothing to reserve"


def test_only_the_labels_selectors_name_are_kept_and_a_namespace_uses_at_most_its_limit_of_quotas() -> None:
    from flowkube_api import constants as c

    def made(minute: int, **spec: Any) -> dict[str, Any]:
        return {**quota(**spec), "metadata": {"creationTimestamp": f"2026-11-28T08:{minute:02d}:00Z"}}

    t = QuotaTracker()
    assert t.label_keys() == frozenset()
    t.quota_event(made(0, selector={"matchExpressions": [{"key": "team", "operator": "Exists"}]}), "team", "tokens")
    assert t.label_keys() == {"team"} and t.label_keys_for("team") == {"team"} and t.label_keys_for("x") == set()
    names = [f"q{i:02d}" for i in range(c.QUOTAS_PER_NAMESPACE_LIMIT + 2)]
    whys = [t.quota_event(made(i + 10), "team", n) for i, n in enumerate(names)]
    used = c.QUOTAS_PER_NAMESPACE_LIMIT - 1  # "tokens" holds one place
    assert whys[:used] == [None] * used
    assert all(w is not None and "used once an older one is deleted" in w for w in whys[used:])
    assert t.next_waiting("team") is None
    t.quota_event(None, "team", "q00")
    assert t.next_waiting("team") == names[used], "the oldest waiting one takes the free place"
    assert t.quota_event(made(1), "other", "q") is None, "the limit is per namespace"
    # Which quotas are used does not depend on the order they are seen in: an older one, seen last (a
    # relist in name order, a tenant's quotas named to come first), takes the youngest one's place.
    t.quota_event(made(10), "team", "q00")  # back, in the free place
    assert ("team", "q00") in t.quotas() and ("team", names[used - 1]) in t.quotas()
    why = t.quota_event(made(5), "team", "older")
    assert why is None and ("team", "older") in t.quotas() and ("team", names[used - 1]) not in t.quotas()
    # A selector that would make its namespace's keys pass their bound is not used; an enforced quota
    # whose edit would is kept as it was.
    many = {"matchLabels": {f"k{i}": "v" for i in range(c.QUOTA_LABEL_KEYS_LIMIT + 1)}}
    why = t.quota_event(made(2, selector=many), "other", "wide")
    assert why is not None and "label keys" in why and ("other", "wide") not in t.quotas()
    why = t.quota_event(made(1, selector=many), "other", "q")
    assert why is not None and why.endswith("the quota's earlier spec stays in force") and ("other", "q") in t.quotas()
    assert len(t.label_keys_for("other")) <= c.QUOTA_LABEL_KEYS_LIMIT


def test_two_namespaces_pods_of_one_name_hold_their_own_reservations() -> None:
    t = QuotaTracker()
    for ns in ("team", "other"):
        t.quota_event(quota(100), ns, "tokens")
        t.flow_event(ns, "a", {"metadata": {"name": "a", "namespace": ns, "uid": f"uid-{ns}"}, "status": {}})
    mine = t.reserve("team", "a", "a-0", "m", Spend(60), NOW)
    theirs = t.reserve("other", "a", "a-0", "m", Spend(60), NOW)
    assert isinstance(mine, Reservation) and isinstance(theirs, Reservation)
    assert not t.settle("other", "a", "a-0", mine.id, []), "a pod of another namespace frees nothing of mine"
    assert t.book.reserved(KEY) == Spend(60)
    ended_run = {"metadata": {"name": "a", "namespace": "other", "uid": "uid-other"},
                 "status": {"runs": [ended("a-0", 5)]}}
    t.flow_event("other", "a", ended_run)
    assert t.book.reserved(KEY) == Spend(60), "the other namespace's run ending frees only its own"
    assert t.reserve("team", "a", "a-0", "m", Spend(1), NOW) is not None


def test_a_used_up_day_holds_runs_until_the_next_local_midnight_and_a_new_flow_only_under_refuse() -> None:
    """A Day window in Berlin, used up at 08:20 UTC: runs are held and a new Flow refused (Refuse) until
    23:00 UTC (midnight in Berlin), when the window resets; under Queue a new Flow is admitted."""
    t = QuotaTracker()
    body = quota(100)
    body["spec"]["limits"][0]["window"]["timeZone"] = "Europe/Berlin"
    t.quota_event(body, "team", "tokens")
    t.flow_event("team", "a", flow("a", {}, ended("a-0", 100)))
    held = t.exhausted("team", "a", NOW)
    assert held is not None and held.startswith("FlowQuota team/tokens: limit daily")
    assert "100 tokens used of 100" in held
    assert "the window resets at 2026-11-28T23:00:00+00:00" in held
    assert t.refuses("team", {}, NOW) is not None and t.refuses("other", {}, NOW) is None
    before_midnight = dt.datetime(2026, 11, 28, 22, 59, tzinfo=dt.UTC)
    assert t.exhausted("team", "a", before_midnight) is not None
    assert t.exhausted("team", "a", dt.datetime(2026, 11, 28, 23, 0, tzinfo=dt.UTC)) is None, "a new day in Berlin"
    queued = quota(100, action="Queue")
    queued["spec"]["limits"][0]["window"]["timeZone"] = "Europe/Berlin"
    t.quota_event(queued, "team", "tokens")
    assert t.refuses("team", {}, NOW) is None and t.exhausted("team", "a", NOW) is not None, "admitted, then held"


def test_a_quotas_own_status_echo_does_not_undo_sticky_coverage_and_a_flow_made_again_is_counted() -> None:
    """Review findings: the quota's status write (or a relist) came back as an event and decided
    coverage afresh from labels, so a relabelled Flow escaped; a Flow deleted and made again under its
    name has pods of the same names, which counted as already ended and charged nothing."""
    t = QuotaTracker()
    body = quota(100, selector={"matchLabels": {"team": "a"}})
    t.quota_event(body, "team", "tokens")
    t.flow_event("team", "a", flow("a", {"team": "a"}, ended("a-0", 60)))
    t.flow_event("team", "a", flow("a", {"team": "elsewhere"}, ended("a-0", 60)))
    t.quota_event({**body, "status": {"summary": "daily 60%"}}, "team", "tokens")  # its own status, echoed
    assert t.covering("team", "a") == [KEY[0]] and t.book.used(KEY, NOW) == Spend(60)
    assert isinstance(t.reserve("team", "a", "a-1", "m", Spend(41), NOW), Refusal)

    # x ran x-0 to its end, was deleted and made again; its new x-0 runs and settles 30 tokens.
    t.flow_event("team", "x", {"metadata": {"name": "x", "namespace": "team", "uid": "uid-x1",
                                            "labels": {"team": "a"}}, "status": {"runs": [ended("x-0", 5)]}})
    t.flow_event("team", "x", None)
    t.flow_event("team", "x", {"metadata": {"name": "x", "namespace": "team", "uid": "uid-x2", "labels": {"team": "a"}},
                               "status": {"runs": [{"pod": "x-0", "startedAt": "2026-11-28T08:15:00Z"}]}})
    r = t.reserve("team", "x", "x-0", "m", Spend(30), NOW)
    assert isinstance(r, Reservation)
    assert t.settle("team", "x", "x-0", r.id, [(NOW, "m", Spend(30))]) is True
    assert t.book.used(KEY, NOW) == Spend(95), "60 (a) + 5 (the first x, deleted) + 30 (the new x's call)"


def test_a_follower_takes_the_leaders_retired_spend_as_a_floor_and_counts_an_echo_once() -> None:
    """A Flow deleted mid-run: the calls its pod settled are only in the leader's book, which moves
    them into the quota's status.retired. A follower (the next leader after a failover) takes that
    status as a floor on every event, so it counts them too; the same status seen again, or its own
    retirement of the same Flow, counts nothing twice."""
    t = QuotaTracker()
    t.quota_event(quota(), "team", "tokens")
    t.flow_event("team", "a", flow("a", {}, ended("a-0", 30), {"pod": "a-1", "startedAt": "2026-11-28T08:11:00Z"}))
    assert t.book.used(KEY, NOW) == Spend(30)
    t.flow_event("team", "a", None)  # deleted mid-run: this replica retires only what the status shows
    assert t.book.used(KEY, NOW) == Spend(30)
    leaders = {"status": {"retired": [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": 30},
                                      {"at": "2026-11-28T08:15:00Z", "model": "m", "totalTokens": 25}]}}
    t.quota_event({**quota(), **leaders}, "team", "tokens")
    assert t.book.used(KEY, NOW) == Spend(55), "the leader's retired spend of a-1's settled calls counts here too"
    t.quota_event({**quota(), **leaders}, "team", "tokens")
    assert t.book.used(KEY, NOW) == Spend(55), "seen again: counted once"
    assert {r["totalTokens"] for r in t.retired(KEY[0])} == {30, 25}
    older = {"status": {"retired": [{"at": "2026-11-28T08:00:00Z", "model": "m", "totalTokens": 10}]}}
    t.quota_event({**quota(), **older}, "team", "tokens")
    assert t.book.used(KEY, NOW) == Spend(55), "an older status lowers nothing"


def test_a_queue_quota_that_refused_a_call_for_room_holds_the_flows_next_run_until_it_has_that_room() -> None:
    """90 of 100 used: no limit is used up, but a call that may use 40 does not fit. Under
    ``action: Queue`` the Flow's next run waits until the limit has room for that call (starting it at
    once would only be refused again); under Refuse the run's failure is the Flow's."""
    t = QuotaTracker()
    t.quota_event(quota(100, action="Queue"), "team", "tokens")
    t.flow_event("team", "a", flow("a", {}, ended("a-0", 90)))
    assert t.exhausted("team", "a", NOW) is None
    refused = t.reserve("team", "a", "a-1", "m", Spend(40), NOW)
    assert isinstance(refused, Refusal)
    why = t.exhausted("team", "a", NOW)
    assert why is not None and why.endswith("the Flow waits for that room (spec.action: Queue)")
    assert "90 tokens used + 0 reserved by calls in flight, and this call may use up to 40" in why
    assert t.exhausted("team", "b", NOW) is None, "only the refused Flow waits"
    t.quota_event(quota(120, action="Queue"), "team", "tokens")  # 90 + 40 > 120: still short
    assert t.exhausted("team", "a", NOW) is not None
    t.quota_event(quota(130, action="Queue"), "team", "tokens")  # room for it now
    assert t.exhausted("team", "a", NOW) is None
    assert isinstance(t.reserve("team", "a", "a-2", "m", Spend(40), NOW), Reservation)
    assert not t._short, "a reservation that fits ends the wait"
    assert isinstance(t.reserve("team", "a", "a-2", "m", Spend(40), NOW), Refusal)  # 90 + 40 held + 40 > 130
    assert t.exhausted("team", "a", NOW) is not None
    # Under Refuse a refusal for room leaves no wait behind, and a deleted Flow's is forgotten.
    r = QuotaTracker()
    r.quota_event(quota(100), "team", "tokens")
    r.flow_event("team", "a", flow("a", {}, ended("a-0", 90)))
    assert isinstance(r.reserve("team", "a", "a-1", "m", Spend(40), NOW), Refusal)
    assert r.exhausted("team", "a", NOW) is None
    t.flow_event("team", "a", None)
    assert not t._short
