"""The CronFlow reconcile: one Flow per scheduled time, concurrency policies, deadlines, history."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api import cron
from flowkube_api.models import Usage
from flowkube_operator.cron.controller import Clock
from flowkube_operator.cron.plan import Child, CronPlan, plan

T0 = dt.datetime(2026, 11, 27, 2, 0, tzinfo=dt.UTC)  # a scheduled time of "0 * * * *"
HOUR = dt.timedelta(hours=1)


def cronflow(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "nightly", "namespace": "team", "uid": "cf1", "generation": 1,
                         "creationTimestamp": "2026-11-27T00:30:00Z"},
            "spec": {"schedule": "0 * * * *", "flowTemplate": {"spec": {"flowRef": "pkg.mod:Report"}}, **spec}}


def child(at: dt.datetime, phase: str = "Running", tokens: int = 0, **kw: Any) -> Child:
    usage = Usage(total_tokens=tokens, prompt_tokens=tokens, successful_requests=1) if tokens else None
    return Child(name=cron.flow_name("nightly", at), uid=f"u-{at:%H}", phase=phase, scheduled=at, created=at,
                 finished_at=at + dt.timedelta(minutes=5) if phase in ("Succeeded", "Failed") else None,
                 usage=usage, owner="cf1", **kw)


def step(body: dict[str, Any], children: list[Child], now: dt.datetime) -> CronPlan:
    p = plan(body, children, now)
    body["status"] = p.status.dump()
    return p


def test_each_scheduled_time_starts_one_flow_named_after_it_and_the_next_is_timed() -> None:
    body = cronflow()
    p = step(body, [], T0 + dt.timedelta(seconds=3))
    assert p.create == (cron.flow_name("nightly", T0), T0)
    assert body["status"]["lastScheduleTime"] == "2026-11-27T02:00:00Z"
    assert body["status"]["active"] == [p.create[0]]
    assert p.requeue_after is not None and abs(p.requeue_after - (3600 - 3)) < 1
    # Again (a restart, a new leader, the same instant): the Flow is there; nothing more starts.
    again = plan(body, [child(T0)], T0 + dt.timedelta(seconds=4))
    assert again.create is None and again.delete == []
    # The status write after the create was lost: the Flow is found by its name, not started twice.
    lost = cronflow()
    p = step(lost, [child(T0)], T0 + dt.timedelta(seconds=5))
    assert p.create is None and lost["status"]["lastScheduleTime"] == "2026-11-27T02:00:00Z"


def test_missed_times_start_only_the_latest_and_only_within_the_starting_deadline() -> None:
    body = cronflow()
    body["status"] = {"lastScheduleTime": "2026-11-26T20:00:00Z"}
    p = step(body, [], T0 + dt.timedelta(minutes=10))
    assert p.create == (cron.flow_name("nightly", T0), T0)
    assert ("Warning", "MissedSchedules") in [(e[0], e[1]) for e in p.events]
    late = cronflow(startingDeadlineSeconds=300)
    late["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    p = step(late, [], T0 + dt.timedelta(minutes=10))
    assert p.create is None and late["status"]["lastSkipped"]["reason"] == "MissedDeadline"
    assert [e[1] for e in p.events] == ["MissedDeadline"]
    assert plan(late, [], T0 + dt.timedelta(minutes=11)).events == [], "said once"


def test_forbid_waits_for_the_running_flow_and_replace_deletes_it() -> None:
    running = child(T0 - HOUR)
    body = cronflow(concurrencyPolicy="Forbid")
    body["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    p = step(body, [running], T0 + dt.timedelta(seconds=1))
    assert p.create is None and body["status"]["lastSkipped"]["reason"] == "ConcurrencyForbidden"
    assert body["status"]["lastScheduleTime"] == "2026-11-27T01:00:00Z"
    # It ends: the time it waited for starts now (no deadline set).
    ended = child(T0 - HOUR, "Succeeded", tokens=10)
    p = step(body, [ended], T0 + dt.timedelta(minutes=2))
    assert p.create == (cron.flow_name("nightly", T0), T0)

    body = cronflow(concurrencyPolicy="Replace")
    body["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    p = step(body, [child(T0 - HOUR, tokens=7)], T0 + dt.timedelta(seconds=1))
    assert p.create is not None and p.delete == [(running.name, running.uid)]
    assert body["status"]["prunedUsage"]["totalTokens"] == 7 and body["status"]["pruning"] == ["u-01"]
    assert body["status"]["active"] == [p.create[0]]
    # The delete was lost with a restart: the replaced Flow is deleted again, its tokens not counted twice.
    p = step(body, [child(T0 - HOUR, tokens=7), child(T0)], T0 + dt.timedelta(seconds=2))
    assert p.create is None and [d.name for d in p.delete] == [running.name]
    assert body["status"]["usage"]["totalTokens"] == 7


def test_allow_runs_them_side_by_side() -> None:
    body = cronflow()
    body["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    p = step(body, [child(T0 - HOUR)], T0 + dt.timedelta(seconds=1))
    assert p.create is not None and p.delete == []
    assert len(body["status"]["active"]) == 2


def test_history_limits_prune_the_oldest_and_their_usage_stays_in_the_total_once() -> None:
    body = cronflow(successfulFlowsHistoryLimit=2, failedFlowsHistoryLimit=0)
    body["status"] = {"lastScheduleTime": "2026-11-27T02:00:00Z"}
    flows = [child(T0 - n * HOUR, "Succeeded", tokens=10 * (n + 1)) for n in range(4)]
    flows.append(child(T0 - 5 * HOUR, "Failed", tokens=1))
    now = T0 + dt.timedelta(minutes=30)
    p = step(body, flows, now)
    oldest_two_and_the_failed_one = sorted([flows[2].name, flows[3].name, flows[4].name])
    assert sorted(d.name for d in p.delete) == oldest_two_and_the_failed_one
    total = sum(10 * (n + 1) for n in range(4)) + 1
    assert body["status"]["usage"]["totalTokens"] == total
    assert body["status"]["prunedUsage"]["totalTokens"] == 30 + 40 + 1
    assert body["status"]["lastSuccessfulTime"] == "2026-11-27T02:05:00Z"
    # Deleting: still seen (with deletionTimestamp), then gone; the total never moves.
    deleting = [*flows[:2], *(Child(**{**ch.__dict__, "deleting": True}) for ch in flows[2:])]
    p = step(body, deleting, now)
    assert p.delete == [] and body["status"]["usage"]["totalTokens"] == total
    p = step(body, flows[:2], now)
    assert body["status"]["usage"]["totalTokens"] == total and "pruning" not in body["status"]


def test_suspended_starts_nothing_and_a_flow_of_another_cronflow_is_not_counted() -> None:
    body = cronflow(suspend=True)
    p = step(body, [], T0 + dt.timedelta(seconds=1))
    assert p.create is None and p.requeue_after is None


def test_an_invalid_schedule_is_said_not_run() -> None:
    body = cronflow(schedule="61 * * * *")
    p = step(body, [], T0)
    assert p.create is None and body["status"]["lastSkipped"]["reason"] == "InvalidSchedule"


def test_a_refused_create_replaces_nothing_and_says_why() -> None:
    body = cronflow(concurrencyPolicy="Replace")
    body["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    running = child(T0 - HOUR, tokens=7)
    p = plan(body, [running], T0 + dt.timedelta(seconds=1), refused="422: spec.inputs.topic: required")
    assert p.create is None and p.delete == [], "the running Flow stays when its replacement cannot start"
    assert p.status.last_skipped is not None and p.status.last_skipped.reason == "FailedCreate"
    assert p.status.last_schedule_time == T0 - HOUR and not p.status.pruning


def test_a_time_whose_flow_is_being_deleted_is_not_started_again() -> None:
    # The status write after the create was lost, and the Flow failed and is pruned meanwhile.
    body = cronflow(failedFlowsHistoryLimit=0)
    body["status"] = {"lastScheduleTime": "2026-11-27T01:00:00Z"}
    failed = child(T0, "Failed", tokens=2)
    p = step(body, [failed], T0 + dt.timedelta(minutes=10))
    assert p.create is None and [d.name for d in p.delete] == [failed.name]
    assert body["status"]["lastScheduleTime"] == "2026-11-27T02:00:00Z"


def test_forbid_waiting_says_so_once_and_says_nothing_of_missed_times_meanwhile() -> None:
    body = cronflow(concurrencyPolicy="Forbid")
    body["status"] = {"lastScheduleTime": "2026-11-27T00:00:00Z"}
    running = child(T0 - 2 * HOUR)
    p = step(body, [running], T0 + dt.timedelta(seconds=1))
    assert [e[1] for e in p.events] == ["ConcurrencyForbidden"]
    p = step(body, [running], T0 + dt.timedelta(seconds=30))
    assert p.events == []


def test_the_clock_for_tests_and_demos_runs_faster_from_its_epoch_and_times_its_wakeups_in_real_seconds() -> None:
    real = [T0.timestamp()]
    assert Clock(real=lambda: real[0]).now() == T0  # rate 1: the real clock
    fast = Clock(3.0, epoch=T0.timestamp(), real=lambda: real[0])
    assert fast.now() == T0
    real[0] += 20
    assert fast.now() == T0 + dt.timedelta(minutes=1)  # one of its minutes in 20 real seconds
    assert fast.real_seconds(60) == 20  # a wake-up a minute away is queued 20 real seconds away
    p = plan(cronflow(schedule="* * * * *"), [], fast.now() + dt.timedelta(seconds=3))
    assert p.requeue_after is not None and fast.real_seconds(p.requeue_after) == 19


def test_a_decisions_events_are_posted_before_the_status_write_that_records_it() -> None:
    """A leader killed between the two loses no Event: the next one decides again and posts it."""
    import asyncio

    from flowkube_operator.cron.controller import CronFlows
    from flowkube_operator.kube.shell import Writes

    calls: list[tuple[str, str]] = []

    class Kube:
        async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
            calls.append(("POST", path.rsplit("/", 1)[-1]))
            return body

        async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
            calls.append(("PATCH", path.rsplit("/", 1)[-1]))
            return {**body, "status": patch["status"]}

    body = {**cronflow(), "metadata": {**cronflow()["metadata"], "resourceVersion": "7"}}
    cron_flows = CronFlows(Writes(lambda: Kube(), lambda: True, "test"),  # type: ignore[arg-type,return-value]
                           Clock(real=lambda: (T0 + dt.timedelta(seconds=3)).timestamp()))
    cron_flows.cronflows[("team", "nightly")] = body
    p = asyncio.run(cron_flows.reconcile(("team", "nightly")))
    assert p is not None and [reason for _, reason, _ in p.events] == ["MissedSchedules", "Started"]  # 01:00 missed
    assert calls == [("POST", "flows"), ("POST", "events"), ("POST", "events"), ("PATCH", "status")]
