"""CronFlows on the local stack: the chart's operator (two replicas) and scripted runner pods.

An every-minute schedule: one Flow per scheduled time, named after it; Forbid skips a time while its
Flow runs; the history limit prunes and the CronFlow's usage keeps the pruned Flow's tokens; the leader
SIGKILLed just before a scheduled time leaves exactly one Flow for it.

The operator's CronFlow clock runs four times faster than the real one (FLOWKUBE_CRON_CLOCK_RATE,
from an epoch both replicas share): a schedule's minute passes in 15 real seconds. The schedules name
the two minutes the test watches, so a leader's failover (the 10 s Lease and a retry period: 44 of
the clock's seconds) cannot let a third one start. The real clock itself is the default, checked by
the unit tests (tests/unit/operator/test_cronplan.py).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_api import cron
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows, scripted_operator, watched_pods

pytestmark = pytest.mark.slow

RATE = 4  # the CronFlow clock's minutes are 15 real seconds
EPOCH = time.time()  # where it and the real clock agree: the operator's replicas are given the same


@pytest.fixture(scope="module")
def ha(cluster: LocalCluster) -> Iterator[ChartOperator]:
    """The chart's operator, two replicas (leader election), the scripted runner, the fast clock."""
    op = scripted_operator(cluster, values=["replicaCount=2"], extra_env={
        "FLOWKUBE_CRON_CLOCK_RATE": str(RATE), "FLOWKUBE_CRON_CLOCK_EPOCH": repr(EPOCH)}).start()
    try:
        yield op
    finally:
        op.stop()


def clock() -> float:
    """The operator's CronFlow clock now (Unix seconds)."""
    return EPOCH + (time.time() - EPOCH) * RATE


def cronflow(name: str, plan: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow", "metadata": {"name": name},
            "spec": {"schedule": "* * * * *",
                     "flowTemplate": {"metadata": {"labels": {"team": "reports"}},
                                      "spec": {"flowRef": "a:B", "inputs": {"plan": plan}}}, **spec}}


def get(cluster: LocalCluster, ns: str, kind: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", kind, name, "-n", ns, "-o", "json")
    obj: dict[str, Any] = json.loads(out.stdout)
    return obj


def next_minute(after: float) -> dt.datetime:
    return dt.datetime.fromtimestamp((int(after) // 60 + 1) * 60, dt.UTC)


def until(moment: dt.datetime) -> float:
    """Real seconds until the CronFlow clock shows ``moment``."""
    return (moment.timestamp() - clock()) / RATE


@pytest.mark.timeout(600)  # up to three of the clock's minutes
def test_one_flow_per_minute_forbid_skips_history_prunes_and_a_killed_leader_starts_each_time_once(
        ha: ChartOperator, flows: Flows, cluster: LocalCluster) -> None:
    ns = flows.ns
    soon = next_minute(clock())
    if until(soon) < 6:  # leave time to apply both before the first scheduled minute
        wait_for(lambda: until(soon) < -0.5, 10, "the next minute")
    first = next_minute(clock())
    second = first + dt.timedelta(minutes=1)
    minutes = f"{first.minute},{second.minute} * * * *"
    with watched_pods(cluster, ns, "-l", "flowkube.io/cronflow", resource="flows") as seen:
        cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [
            cronflow("tick", [{"sleep": 1, "tokens": 3}], schedule=minutes, successfulFlowsHistoryLimit=1),
            cronflow("slow", [{"sleep": 100, "tokens": 2}], schedule=minutes, concurrencyPolicy="Forbid",
                     startingDeadlineSeconds=120),
        ]}))
        tick_1, slow_1 = cron.flow_name("tick", first), cron.flow_name("slow", first)
        st = flows.wait_phase(tick_1, "Succeeded", timeout=until(first) + 60)
        flow = get(cluster, ns, "flow", tick_1)
        assert flow["metadata"]["labels"] == {"team": "reports", "flowkube.io/cronflow": "tick"}
        assert flow["metadata"]["annotations"]["flowkube.io/scheduled-at"] == f"{first:%Y-%m-%dT%H:%M:%SZ}"
        assert flow["metadata"]["ownerReferences"][0]["kind"] == "CronFlow"
        assert st["usage"]["totalTokens"] == 3
        flows.wait_phase(slow_1, "Running", timeout=60)

        # SIGKILL the leader a second before the second minute: whoever leads next starts it, once.
        wait_for(lambda: until(second) < 1 / RATE, until(second) + 5, "a second before the second minute",
                 interval=0.05)
        leader = ha.leader()
        ha.kill_container(leader)
        tick_2 = cron.flow_name("tick", second)
        flows.wait_phase(tick_2, "Succeeded", timeout=90)
        # History: one Succeeded Flow kept, the first pruned, its tokens still in the CronFlow's usage.
        wait_for(lambda: flows.get(tick_1) is None, 60, f"{tick_1} pruned by the history limit")

        def tick_status_settled() -> bool:
            st = get(cluster, ns, "cronflow", "tick").get("status") or {}
            return (st.get("usage") or {}).get("totalTokens") == 6 and not st.get("active")

        wait_for(tick_status_settled, 120, "tick's status: both Flows' tokens, nothing active")
        tick = get(cluster, ns, "cronflow", "tick")["status"]
        assert tick["lastScheduleTime"] == f"{second:%Y-%m-%dT%H:%M:%SZ}"
        assert tick["prunedUsage"]["totalTokens"] == 3 and tick["lastSuccessfulTime"]

        # Forbid: the second minute found slow's first Flow running and started nothing; past the
        # 120 s starting deadline it never will.
        slow = get(cluster, ns, "cronflow", "slow")["status"]
        assert slow["lastSkipped"]["reason"] == "ConcurrencyForbidden", slow
        assert slow["lastSkipped"]["time"] == f"{second:%Y-%m-%dT%H:%M:%SZ}"
        assert slow["active"] == [slow_1]
        names = {o["metadata"]["name"] for o in seen.seen}
        assert names == {tick_1, tick_2, slow_1}, names  # every Flow ever created: one per time, none twice
        uids = {(o["metadata"]["name"], o["metadata"]["uid"]) for o in seen.seen}
        assert len(uids) == 3, uids
    events = cluster.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.kind=CronFlow",
                             "-o", "json").stdout
    reasons = [e["reason"] for e in json.loads(events)["items"]]
    assert "Started" in reasons and "ConcurrencyForbidden" in reasons, reasons


def test_a_cronflow_is_refused_at_apply_naming_the_field(ha: ChartOperator, flows: Flows,
                                                         cluster: LocalCluster) -> None:
    def refused(obj: dict[str, Any]) -> str:
        out = cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(obj), check=False)
        assert out.returncode != 0, f"admitted: {obj}"
        return str(out.stderr)

    assert "spec.schedule: minute: 61 is out of range 0-59" in refused(
        cronflow("bad", [{}], schedule="61 * * * *"))
    assert "spec.timeZone: unknown time zone 'Mars/Olympus'" in refused(cronflow("bad", [{}], timeZone="Mars/Olympus"))
    bad = cronflow("bad", [{}])
    bad["spec"]["flowTemplate"]["spec"] = {"templateRef": {"name": "nowhere"}}
    assert 'spec.flowTemplate.spec.templateRef: FlowTemplate "nowhere"' in refused(bad)
    assert "metadata.name must be at most 52 characters" in refused(cronflow("x" * 53, [{}]))
