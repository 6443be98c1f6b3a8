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
    assert t.covering("team", "a") == [KEY[0]] and t.covering("team", "b") == []
    assert t.book.used(KEY, NOW) == Spend(30), "a quota made after the Flows counts what they charged"
    # Flow a runs again: its calls settle as they answer, then its status shows the run ended.
    r = t.reserve("team", "a", "a-1", "m", Spend(60), NOW)
    assert isinstance(r, Reservation)
    assert isinstance(t.reserve("team", "a", "a-1", "m", Spend(11), NOW), Refusal), "30 used + 60 held + 11 > 100"
    assert t.settle("a-1", r.id, [(NOW, "m", Spend(20))])
    assert t.book.used(KEY, NOW) == Spend(50)
    t.flow_event("team", "a", flow("a", {"team": "a"}, ended("a-0", 30), ended("a-1", 20)))
    assert t.book.used(KEY, NOW) == Spend(50), "the run's calls moved from its pod to its Flow, counted once"
    assert t.book.reserved(KEY) == Spend()
    # b joins the team: counted; a is deleted: what it spent stays spent.
    t.flow_event("team", "b", flow("b", {"team": "a"}, ended("b-0", 500)))
    assert t.book.used(KEY, NOW) == Spend(550)
    t.flow_event("team", "a", None)
    assert t.book.used(KEY, NOW) == Spend(550)


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
    assert isinstance(t.reserve("team", "a", "a-0", "m", Spend(10**9), NOW), Reservation), "no quota: no limit"
