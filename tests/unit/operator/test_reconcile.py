"""The pure reconcile: each test drives one Flow through the states a user sees in `kubectl get`."""

from __future__ import annotations

import datetime as dt
from decimal import Decimal
from typing import Any

import pytest

from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.report import FeedbackRequest, RunReport, TokenUsage, Usage
from flowkube_operator.flows.reconcile import Plan, Taken, plan
from flowkube_operator.meta import PodView

T0 = dt.datetime(2026, 11, 22, 12, 0, 0, tzinfo=dt.UTC)


def flow(**spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
        "metadata": {"name": "f", "namespace": "ns", "uid": "u1", "generation": 1, "resourceVersion": "1"},
        "spec": {"flowRef": "pkg.mod:Research", **spec},
    }


def step(body: dict[str, Any], pods: dict[str, PodView] | None = None, report: RunReport | None = None,
         at: float = 0) -> Plan:
    """Plan, then write the planned status back as the operator would (reading reports it asks for)."""
    p = plan(body, pods or {}, report, now=T0 + dt.timedelta(seconds=at))
    if p.need_report:
        assert p.status.dump() == (body.get("status") or {}) and p.create_pod is None
        p = plan(body, pods or {}, report, now=T0 + dt.timedelta(seconds=at), report_checked=True)
    body["status"] = p.status.dump()
    return p


def pod(name: str, phase: str, exit_code: int | None = None, at: float = 0) -> dict[str, PodView]:
    return {name: PodView(name=name, phase=phase, created_at=T0 + dt.timedelta(seconds=at), uid=f"uid-{name}",
                          exit_code=exit_code, finished_at=T0 + dt.timedelta(seconds=at + 5)
                          if exit_code is not None else None)}


def usage(prompt: int, completion: int, model: str = "gpt-4o-mini") -> Usage:
    t = TokenUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   successful_requests=1)
    return Usage(**t.model_dump(), by_model={model: t})


def report(pod_name: str, result: RunResult, **kw: Any) -> RunReport:
    trigger = kw.pop("trigger", Trigger.KICKOFF)
    reason = kw.pop("reason", Reason.RUN_SUCCEEDED)
    return RunReport(pod=pod_name, trigger=trigger, result=result, reason=reason,
                     exit_code=kw.pop("exit_code", 0), **kw)


def cond(body: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in body["status"]["conditions"] if c["type"] == ctype)


def test_new_flow_records_a_kickoff_run_and_sets_every_condition() -> None:
    body = flow()
    p = step(body)
    assert p.create_pod is not None and p.create_pod.index == 0 and p.create_pod.trigger == Trigger.KICKOFF
    st = body["status"]
    assert st["phase"] == Phase.PENDING
    assert st["runs"] == [{"pod": "f-0", "trigger": "kickoff"}]
    assert st["definition"] == "Research"
    assert {c["type"] for c in st["conditions"]} == {"Accepted", "Running", "AwaitingFeedback", "Succeeded"}
    assert all(c["observedGeneration"] == 1 and c["reason"] for c in st["conditions"])


def test_replanning_before_the_pod_shows_up_asks_for_the_same_pod_not_another() -> None:
    body = flow()
    step(body)
    again = step(body, at=1)
    assert again.create_pod is not None and again.create_pod.index == 0
    assert len(body["status"]["runs"]) == 1


def test_a_kickoff_pod_comes_before_its_record_and_a_pod_whose_record_was_lost_is_adopted() -> None:
    body = flow()
    first = plan(body, {}, now=T0)
    assert first.create_pod is not None and first.create_pod.first, "kickoff: the pod, then one status write"
    # The operator stopped after creating f-0 and before the write that records it: the next plan
    # finds the pod under the next run's name and records it as that run, started when it was.
    made = {"f-0": PodView(name="f-0", phase="Running", created_at=T0 + dt.timedelta(seconds=1),
                           trigger="kickoff")}
    p = step(body, made, at=9)
    assert p.create_pod is None, "no second pod for the same attempt"
    assert body["status"]["runs"] == [{"pod": "f-0", "trigger": "kickoff", "startedAt": "2026-11-22T12:00:01Z"}]
    assert body["status"]["phase"] == Phase.RUNNING
    # One that already ended is adopted too, and followed to its end in the next reconcile.
    done = flow()
    ended = {"f-0": PodView(name="f-0", phase="Succeeded", created_at=T0, exit_code=0, trigger="kickoff",
                            finished_at=T0 + dt.timedelta(seconds=5))}
    p = step(done, ended, at=9)
    assert p.create_pod is None and p.requeue_after is not None and p.requeue_after <= 0.05
    step(done, ended, report("f-0", RunResult.SUCCEEDED, usage=usage(3, 4)), at=10)
    assert done["status"]["phase"] == Phase.SUCCEEDED and done["status"]["usage"]["totalTokens"] == 7


def test_run_succeeds_with_usage_and_output() -> None:
    body = flow()
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    assert body["status"]["phase"] == Phase.RUNNING
    assert body["status"]["runs"][0]["startedAt"] == "2026-11-22T12:00:00Z"
    rep = report("f-0", RunResult.SUCCEEDED, usage=usage(10, 5), output="done", flow_id="abc")
    p = step(body, pod("f-0", "Succeeded", exit_code=0), rep, at=6)
    st = body["status"]
    assert st["phase"] == Phase.SUCCEEDED and st["result"]["output"] == "done" and st["flowId"] == "abc"
    assert st["usage"]["totalTokens"] == 15 and st["usage"]["byModel"]["gpt-4o-mini"]["promptTokens"] == 10
    assert cond(body, "Succeeded")["status"] == "True"
    assert p.create_pod is None and st["finishedAt"]
    # Seen again (e.g. after an operator restart): nothing changes, nothing is created.
    before = dict(st)
    p2 = step(body, pod("f-0", "Succeeded", exit_code=0), rep, at=60)
    assert p2.create_pod is None and body["status"] == before


def test_retryable_failure_backs_off_then_retries_and_then_gives_up() -> None:
    body = flow(retries={"limit": 1, "backoffSeconds": 10})
    step(body)
    step(body, pod("f-0", "Running"))
    p = step(body, pod("f-0", "Failed", exit_code=137), at=5)
    assert body["status"]["phase"] == Phase.PENDING
    assert cond(body, "Running")["reason"] == Reason.RETRY_BACKOFF
    assert p.create_pod is None and p.requeue_after is not None and 4 <= p.requeue_after <= 10
    p = step(body, pod("f-0", "Failed", exit_code=137), at=21)
    assert p.create_pod is not None and p.create_pod.index == 1 and p.create_pod.trigger == Trigger.RETRY
    pods = {**pod("f-0", "Failed", exit_code=137), **pod("f-1", "Failed", exit_code=3, at=22)}
    step(body, pods, at=30)
    assert body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.RETRIES_EXHAUSTED


def test_permanent_failure_is_not_retried() -> None:
    body = flow(retries={"limit": 5})
    step(body)
    rep = report("f-0", RunResult.FAILED, reason=Reason.INVALID_DEFINITION, exit_code=2,
                 message="1 validation error for FlowDefinition")
    p = step(body, pod("f-0", "Failed", exit_code=2), rep, at=5)
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Accepted") == {**cond(body, "Accepted"), "status": "False", "reason": "InvalidDefinition"}
    assert "validation error" in body["status"]["message"]


def paused(body: dict[str, Any], default: str | None = None) -> None:
    step(body)
    fr = FeedbackRequest(id="req-1", method="review", message="Approve?", emit=["approved", "rejected"],
                         default_outcome=default, output="draft text")
    rep = report("f-0", RunResult.PAUSED, reason=Reason.RUN_PAUSED, feedback_request=fr, usage=usage(3, 2))
    step(body, pod("f-0", "Succeeded", exit_code=0), rep, at=5)


def test_pause_records_the_request_and_a_valid_answer_resumes_exactly_once() -> None:
    body = flow(feedback={"timeoutSeconds": 600})
    paused(body)
    st = body["status"]
    assert st["phase"] == Phase.AWAITING_FEEDBACK
    req = st["feedback"]["request"]
    assert req["id"] == "req-1" and req["emit"] == ["approved", "rejected"] and req["output"] == "draft text"
    assert req["deadline"] == "2026-11-22T12:10:05Z"
    assert cond(body, "AwaitingFeedback")["status"] == "True"

    st["feedback"]["response"] = {"text": "approved", "requestId": "req-1", "respondedBy": "alice"}
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=30)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RESUME
    assert not p.create_pod.first, "the answer leaves the inbox in the write that records the resume, before its pod"
    assert p.create_pod.feedback == {"requestId": "req-1", "text": "approved", "timedOut": False}
    fb = body["status"]["feedback"]
    assert "request" not in fb and "response" not in fb
    assert fb["history"][0]["respondedBy"] == "alice" and fb["history"][0]["response"] == "approved"
    # The same patch arriving again finds nothing pending: refused, no second resume.
    body["status"]["feedback"]["response"] = {"text": "approved"}
    p = step(body, {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Running", at=31)}, at=32)
    assert p.create_pod is None and len(body["status"]["runs"]) == 2
    assert any(e[1] == Reason.FEEDBACK_REFUSED for e in p.events)


def test_stale_request_id_or_empty_text_is_refused_and_the_request_stays() -> None:
    body = flow()
    paused(body)
    for response in ({"text": "ok", "requestId": "old"}, {"text": "  "}):
        body["status"]["feedback"]["response"] = response
        p = step(body, pod("f-0", "Succeeded", exit_code=0), at=10)
        assert p.create_pod is None
        assert body["status"]["feedback"]["request"]["id"] == "req-1"
        assert "response" not in body["status"]["feedback"]
        assert "refused" in cond(body, "AwaitingFeedback")["message"]
        assert p.events[0][0] == "Warning"


def test_feedback_timeout_uses_the_default_outcome() -> None:
    body = flow(feedback={"timeoutSeconds": 60})
    paused(body, default="approved")
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=30)
    assert p.create_pod is None and p.requeue_after == 35
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=66)
    assert p.create_pod is not None
    assert p.create_pod.feedback == {"requestId": "req-1", "text": "", "timedOut": True, "outcome": "approved"}
    assert body["status"]["feedback"]["history"][0]["timedOut"] is True


def test_feedback_timeout_without_default_fails() -> None:
    body = flow(feedback={"timeoutSeconds": 60})
    paused(body)
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=70)
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.FEEDBACK_TIMED_OUT


def test_waiting_for_feedback_does_not_count_against_the_deadline() -> None:
    body = flow(activeDeadlineSeconds=100, feedback={"timeoutSeconds": 100000})
    paused(body)  # the first run took 5s
    body["status"]["feedback"]["response"] = {"text": "go"}
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=5000)
    assert p.create_pod is not None and p.create_pod.active_deadline_seconds == 96
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Running", at=5000)}
    p = step(body, pods, at=5050)
    assert body["status"]["phase"] == Phase.RUNNING and p.requeue_after == 45
    p = step(body, pods, at=5100)
    assert p.delete_pods == [("f-1", "uid-f-1")] and body["status"]["phase"] == Phase.RUNNING  # stopping the pod it saw
    step(body, pod("f-0", "Succeeded", exit_code=0), at=5102)  # f-1 is gone
    assert body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.DEADLINE_EXCEEDED


def test_suspend_holds_new_pods_and_unsuspend_starts_them() -> None:
    body = flow(suspend=True)
    p = step(body)
    assert p.create_pod is None and body["status"]["phase"] == Phase.SUSPENDED
    body["spec"]["suspend"] = False
    p = step(body, at=1)
    assert p.create_pod is not None and body["status"]["phase"] == Phase.PENDING


def test_ttl_deletes_the_finished_flow() -> None:
    body = flow(ttlSecondsAfterFinished=30)
    step(body)
    step(body, pod("f-0", "Succeeded", exit_code=0), report("f-0", RunResult.SUCCEEDED), at=1)
    assert step(body, at=10).delete_flow is None
    assert step(body, at=32).delete_flow == ("f", "u1")  # by the uid it saw


def test_a_pod_deleted_from_outside_is_replaced_without_using_a_retry() -> None:
    body = flow()  # no retries at all
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    p = step(body, {}, at=2)
    assert body["status"]["runs"][0]["result"] == RunResult.FAILED
    assert body["status"]["runs"][0]["reason"] == Reason.POD_DELETED
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY  # at once: no backoff
    assert body["status"]["phase"] == Phase.PENDING
    assert [e[1] for e in p.events] == [Reason.DISRUPTED]


def evicted(name: str, at: float, *, deleting: bool = True, disruption: str | None = "EvictionByEvictionAPI",
            exit_code: int = 3) -> dict[str, PodView]:
    return {name: PodView(name=name, phase="Failed", created_at=T0 + dt.timedelta(seconds=at), exit_code=exit_code,
                          finished_at=T0 + dt.timedelta(seconds=at + 1), deleting=deleting, disruption=disruption)}


def test_evictions_and_graceful_deletes_are_disruptions_not_failures_of_the_flow() -> None:
    body = flow(retries={"limit": 1, "backoffSeconds": 60})
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    # Evicted through the Eviction API during a call: the runner finished the call, reported it, and
    # exited with the retryable code after SIGTERM.
    stopped = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, exit_code=3, usage=usage(5, 5))
    p = step(body, evicted("f-0", 2), stopped, at=3)
    run = body["status"]["runs"][0]
    assert run["reason"] == Reason.DISRUPTED and "EvictionByEvictionAPI" in run["message"]
    assert p.create_pod is not None and p.create_pod.index == 1  # replaced at once, backoff not applied
    step(body, pod("f-1", "Running", at=4), at=4)
    # `kubectl delete pod` (no DisruptionTarget, just a deletion the operator did not ask for).
    p = step(body, evicted("f-1", 5, disruption=None), report("f-1", RunResult.FAILED,
                                                            reason=Reason.RUN_INTERRUPTED, exit_code=3), at=6)
    assert body["status"]["runs"][1]["reason"] == Reason.DISRUPTED and p.create_pod is not None
    # The flow's own failure still follows retries: limit 1 allows one, the second ends the flow.
    step(body, pod("f-2", "Failed", exit_code=3, at=7), report("f-2", RunResult.FAILED, reason=Reason.FLOW_ERROR,
                                                             exit_code=3), at=13)
    assert body["status"]["phase"] == Phase.PENDING  # retry 1 of 1, after its backoff
    step(body, at=80)
    step(body, pod("f-3", "Failed", exit_code=3, at=80), report("f-3", RunResult.FAILED, exit_code=3,
                                                              reason=Reason.FLOW_ERROR), at=90)
    assert body["status"]["phase"] == Phase.FAILED and cond(body, "Succeeded")["reason"] == Reason.RETRIES_EXHAUSTED
    assert body["status"]["usage"]["totalTokens"] == 10


def test_a_pod_evicted_by_the_kubelet_is_a_disruption_and_the_cap_stops_a_loop() -> None:
    body = flow(retries={"disruptionLimit": 2})
    step(body)
    for i in range(3):
        kubelet = evicted(f"f-{i}", i * 10, deleting=False, disruption="TerminationByKubelet", exit_code=137)
        p = step(body, kubelet, at=i * 10 + 5)
        if i < 2:
            assert p.create_pod is not None and p.create_pod.index == i + 1
    assert body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.DISRUPTIONS_EXHAUSTED
    assert "retries.disruptionLimit=2" in cond(body, "Succeeded")["message"]


def test_a_permanent_failure_during_a_disruption_is_still_permanent() -> None:
    body = flow()
    step(body)
    bad = report("f-0", RunResult.FAILED, reason=Reason.INVALID_INPUTS, exit_code=2)
    p = step(body, evicted("f-0", 0, exit_code=2), bad, at=3)
    assert p.create_pod is None and cond(body, "Succeeded")["reason"] == Reason.INVALID_INPUTS


def test_a_run_that_reported_before_its_pod_vanished_stands_as_reported() -> None:
    # The operator was down while the pod finished, reported and was deleted: no second run.
    body = flow(retries={"limit": 1, "backoffSeconds": 0})
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    p = step(body, {}, report("f-0", RunResult.SUCCEEDED, usage=usage(3, 2), output="done"), at=9)
    assert p.create_pod is None and body["status"]["phase"] == Phase.SUCCEEDED
    assert body["status"]["runs"][0]["result"] == RunResult.SUCCEEDED
    assert body["status"]["usage"]["totalTokens"] == 5 and body["status"]["result"]["output"] == "done"
    # An interim report (the run was cut short) is a lost pod: a failed attempt, retried.
    body = flow(retries={"limit": 1, "backoffSeconds": 0})
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    p = step(body, {}, report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, usage=usage(1, 1)), at=2)
    assert body["status"]["runs"][0]["reason"] == Reason.POD_DELETED and body["status"]["usage"]["totalTokens"] == 2
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY


def test_usage_sums_every_run_once_and_the_budget_stops_resumes() -> None:
    body = flow(budget={"maxTotalTokens": 5})
    paused(body)  # 5 tokens in the first run
    body["status"]["feedback"]["response"] = {"text": "go"}
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=10)
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.BUDGET_EXCEEDED
    assert body["status"]["usage"]["totalTokens"] == 5


def test_an_asynchronous_refusal_stays_visible_until_the_request_is_answered() -> None:
    body = flow()
    paused(body)
    body["status"]["feedback"]["response"] = {"text": "ok", "requestId": "old"}
    step(body, pod("f-0", "Succeeded", exit_code=0), at=10)
    for at in (11, 12):  # later reconciles (e.g. caused by the operator's own status write)
        p = step(body, pod("f-0", "Succeeded", exit_code=0), at=at)
        assert p.events == []
        awaiting = cond(body, "AwaitingFeedback")
        assert awaiting["reason"] == Reason.FEEDBACK_REFUSED and "'old'" in awaiting["message"]
        assert "refused" in body["status"]["message"]
    body["status"]["feedback"]["response"] = {"text": "ok"}
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=13)
    assert p.create_pod is not None and cond(body, "AwaitingFeedback")["status"] == "False"


def test_a_run_over_the_deadline_ends_once_its_pod_is_gone_with_every_token() -> None:
    body = flow(activeDeadlineSeconds=10)
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    # At the deadline the pod is stopped, but the run stays open: the pod may still finish an LLM
    # call and write a newer interim report before it is gone.
    p = step(body, pod("f-0", "Running"), at=11)
    assert [d.name for d in p.delete_pods] == ["f-0"] and body["status"]["runs"][0].get("finishedAt") is None
    stopping = {"f-0": PodView(name="f-0", phase="Running", created_at=T0, deleting=True)}
    p = step(body, stopping, at=12)
    assert p.delete_pods == [] and body["status"]["phase"] == Phase.RUNNING  # not deleted twice
    late = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, usage=usage(4, 3))
    p = step(body, {}, late, at=13)
    assert body["status"]["usage"]["totalTokens"] == 7 and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.DEADLINE_EXCEEDED and p.create_pod is None


def test_a_run_that_ended_before_the_deadline_is_judged_by_when_it_ended() -> None:
    # The operator was away: it sees a failure that happened at 5 s only at 30 s, past the 10 s limit.
    body = flow(activeDeadlineSeconds=10, retries={"limit": 1, "backoffSeconds": 0})
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    failed = pod("f-0", "Failed", exit_code=3)  # finished at 5 s
    p = step(body, failed, report("f-0", RunResult.FAILED, reason=Reason.FLOW_ERROR, exit_code=3), at=30)
    assert body["status"]["runs"][0]["reason"] == Reason.FLOW_ERROR  # not DeadlineExceeded: retried
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY


def test_a_pod_that_will_not_stop_at_the_deadline_ends_its_run_anyway() -> None:
    body = flow(activeDeadlineSeconds=10)
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    step(body, pod("f-0", "Running"), at=11)
    stuck = {"f-0": PodView(name="f-0", phase="Running", created_at=T0, deleting=True)}
    interim = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, usage=usage(4, 1))
    p = step(body, stuck, interim, at=40)
    assert body["status"]["phase"] == Phase.RUNNING and p.requeue_after is not None
    step(body, stuck, interim, at=80)  # the node never confirmed the deletion
    assert body["status"]["phase"] == Phase.FAILED and body["status"]["usage"]["totalTokens"] == 5


def test_a_closed_runs_pod_that_kept_going_counts_its_late_calls_once() -> None:
    from flowkube_operator.flows.reconcile import late_pods

    body = flow(activeDeadlineSeconds=10)
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    stuck = {"f-0": PodView(name="f-0", phase="Running", created_at=T0, deleting=True)}
    interim = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, usage=usage(4, 1))
    step(body, stuck, interim, at=80)  # closed with 5 tokens while the pod still runs a call
    assert body["status"]["phase"] == Phase.FAILED and body["status"]["usage"]["totalTokens"] == 5
    # The call in flight was answered after the close: the state API passes the pod's new report on.
    later = interim.model_copy(update={"usage": interim.usage + usage(10, 2)})
    p = plan(body, stuck, now=T0 + dt.timedelta(seconds=85), late={"f-0": later})
    body["status"] = p.status.dump()
    assert body["status"]["usage"]["totalTokens"] == 17
    assert body["status"]["runs"][0]["usage"]["successfulRequests"] == 2
    assert [e[1] for e in p.events] == [Reason.LATE_REPORT]
    # The same report again (the operator restarted, or the pod ended and its final report is read)
    # adds nothing; the run's end moves to when its pod ended, so it is not read again.
    ended = {"f-0": PodView(name="f-0", phase="Failed", created_at=T0, exit_code=3,
                            finished_at=T0 + dt.timedelta(seconds=90))}
    assert late_pods(body["status"], ended) == ["f-0"]
    p = plan(body, ended, now=T0 + dt.timedelta(seconds=91), late={"f-0": later})
    body["status"] = p.status.dump()
    assert body["status"]["usage"]["totalTokens"] == 17 and p.events == []
    assert late_pods(body["status"], ended) == []
    # A report claiming to be another pod's is ignored.
    forged = later.model_copy(update={"pod": "f-9", "usage": usage(1000, 0)})
    assert plan(body, ended, now=T0 + dt.timedelta(seconds=92), late={"f-0": forged}).status.dump()["usage"] \
        == body["status"]["usage"]


def test_a_pod_killed_by_its_deadline_is_deadline_exceeded_with_its_tokens() -> None:
    body = flow(retries={"limit": 3})
    step(body)
    killed = {"f-0": PodView(name="f-0", phase="Failed", created_at=T0, exit_code=137,
                             reason="DeadlineExceeded", finished_at=T0)}
    interim = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, usage=usage(2, 2))
    p = step(body, killed, interim, at=5)
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.DEADLINE_EXCEEDED
    assert body["status"]["usage"]["totalTokens"] == 4


def test_history_records_the_outcome_crewai_collapsed_the_answer_to() -> None:
    from flowkube_api.report import FeedbackApplied

    body = flow()
    paused(body)
    body["status"]["feedback"]["response"] = {"text": "ship it"}
    step(body, pod("f-0", "Succeeded", exit_code=0), at=10)
    applied = FeedbackApplied(request_id="req-1", method="review", response="ship it", outcome="approved")
    done = report("f-1", RunResult.SUCCEEDED, trigger=Trigger.RESUME, feedback_applied=applied)
    step(body, {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Succeeded", exit_code=0, at=11)}, done, at=20)
    (h,) = body["status"]["feedback"]["history"]
    assert h["response"] == "ship it" and h["outcome"] == "approved"


def test_runner_pod_is_restricted_owned_deterministic_and_carries_the_feedback() -> None:
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    body = flow(env=[{"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "k", "key": "v"}}}],
                podTemplate={"nodeSelector": {"pool": "llm"}, "metadata": {"labels": {"team": "a"}}})
    settings = Settings(runner_image_pull_policy="Always", runner_default_env={"OPENAI_API_KEY": "ignored",
                                                                               "OPENAI_BASE_URL": "http://m"})
    pod = runner_pod(body, index=2, trigger=Trigger.RESUME, settings=settings,
                     feedback={"requestId": "r", "text": "ok", "timedOut": False})
    assert pod["metadata"]["name"] == "f-2" and pod["metadata"]["labels"]["team"] == "a"
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "u1"
    spec = pod["spec"]
    assert spec["nodeSelector"] == {"pool": "llm"} and spec["restartPolicy"] == "Never"
    assert spec["securityContext"]["runAsNonRoot"] is True
    (c,) = spec["containers"]
    assert c["imagePullPolicy"] == "Always" and c["securityContext"]["readOnlyRootFilesystem"] is True
    env = {e["name"]: e for e in c["env"]}
    assert env["OPENAI_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "k"  # the Flow's own env wins
    assert env["OPENAI_BASE_URL"]["value"] == "http://m"
    assert env["FLOWKUBE_FEEDBACK"]["value"] == '{"requestId":"r","text":"ok","timedOut":false}'


def test_a_retry_of_a_failed_resume_carries_the_accepted_answer() -> None:
    body = flow(retries={"limit": 2, "backoffSeconds": 0})
    paused(body)
    body["status"]["feedback"]["response"] = {"text": "ship it"}
    step(body, pod("f-0", "Succeeded", exit_code=0), at=10)
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Failed", exit_code=137, at=11)}
    p = step(body, pods, at=20)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY
    assert p.create_pod.feedback == {"requestId": "req-1", "text": "ship it", "timedOut": False}


def test_a_finished_flow_stops_a_runner_pod_left_alive() -> None:
    body = flow()
    step(body)
    step(body, pod("f-0", "Succeeded", exit_code=0), report("f-0", RunResult.SUCCEEDED), at=1)
    p = step(body, {**pod("f-0", "Succeeded", exit_code=0), **pod("f-9", "Running")}, at=5)
    assert [d.name for d in p.delete_pods] == ["f-9"] and body["status"]["phase"] == Phase.SUCCEEDED


def test_a_money_budget_stops_the_flow_before_another_run() -> None:
    body = flow(budget={"maxCost": "0.01"}, retries={"limit": 3, "backoffSeconds": 0})
    step(body)
    spent = usage(100, 20)
    spent = spent.model_copy(update={"cost": Decimal("0.012"), "by_model": {
        m: t.model_copy(update={"cost": Decimal("0.012")}) for m, t in spent.by_model.items()}})
    p = step(body, pod("f-0", "Failed", exit_code=3), report("f-0", RunResult.FAILED, reason=Reason.FLOW_ERROR,
                                                          exit_code=3, usage=spent), at=1)
    p = step(body, at=10)  # the retry is due: the budget is spent, so none starts
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Succeeded")["reason"] == Reason.BUDGET_EXCEEDED
    assert "USD 0.012 spent of budget.maxCost=0.01" in cond(body, "Succeeded")["message"]
    assert body["status"]["usage"]["cost"] == "0.012" and body["status"]["usage"]["currency"] == "USD"


def test_a_retry_carries_what_earlier_runs_spent_into_its_pod() -> None:
    from flowkube_operator.flows import resources
    from flowkube_operator.settings import Settings

    body = flow(budget={"maxCost": "1"}, retries={"limit": 1, "backoffSeconds": 0})
    step(body)
    spent = usage(100, 20).model_copy(update={"cost": Decimal("0.012")})
    step(body, pod("f-0", "Failed", exit_code=3), report("f-0", RunResult.FAILED, reason=Reason.FLOW_ERROR,
                                                      exit_code=3, usage=spent), at=1)
    p = step(body, at=10)
    assert p.create_pod is not None and p.create_pod.prior.total_tokens == 120
    assert p.spec is not None
    pod_body = resources.runner_pod(body, p.spec, index=1, trigger=Trigger.RETRY, settings=Settings(),
                                   prior=p.create_pod.prior)
    env = {e["name"]: e.get("value") for e in pod_body["spec"]["containers"][0]["env"]}
    assert env["FLOWKUBE_PRIOR_TOTAL_TOKENS"] == "120" and env["FLOWKUBE_PRIOR_COST"] == "0.012"


def test_a_flow_cannot_reach_the_operators_runner_variables_through_env_or_envfrom() -> None:
    """The reproduced hole: FLOWKUBE_STATE_DIR and FLOWKUBE_TERMINATION_LOG in spec.env switched the
    runner to a file store and an unread summary; its usage was never reported and each retry started
    with FLOWKUBE_PRIOR_TOTAL_TOKENS=0."""
    from flowkube_api import constants as k
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    body = flow(env=[{"name": "FLOWKUBE_STATE_DIR", "value": "/tmp/mine"},
                     {"name": "FLOWKUBE_TERMINATION_LOG", "value": "/tmp/summary"},
                     {"name": "FLOWKUBE_PRIOR_TOTAL_TOKENS", "value": "0"},
                     {"name": "FLOWKUBE_ANYTHING", "value": "x"},
                     {"name": "TEAM_SETTING", "value": "kept"}],
                envFrom=[{"configMapRef": {"name": "holds-FLOWKUBE_-keys"}}])
    settings = Settings(runner_default_env={"FLOWKUBE_STATE_RETRY_SECONDS": "60", "FLOWKUBE_STATE_DIR": "/x"})
    pod_body = runner_pod(body, index=0, trigger=Trigger.KICKOFF, settings=settings,
                          prior=usage(100, 20).totals())
    (container,) = pod_body["spec"]["containers"]
    names = [e["name"] for e in container["env"]]
    assert len(names) == len(set(names))  # one value per name: nothing left for the API server to pick
    env = {e["name"]: e.get("value") for e in container["env"]}
    # Every variable the runner reads is set by the operator (empty = unset), so envFrom cannot set it.
    assert set(k.RUNNER_ENV) <= set(env)
    assert env["FLOWKUBE_STATE_DIR"] == "" and env["FLOWKUBE_TERMINATION_LOG"] == ""
    assert env["FLOWKUBE_PRIOR_TOTAL_TOKENS"] == "120"
    assert "FLOWKUBE_ANYTHING" not in env and env["TEAM_SETTING"] == "kept"
    assert env["FLOWKUBE_STATE_RETRY_SECONDS"] == "60"  # the chart's defaults may tune what is tunable
    assert container["envFrom"] == [{"configMapRef": {"name": "holds-FLOWKUBE_-keys"}}]
    assert env["FLOWKUBE_QUOTAS"] == "" and env["FLOWKUBE_QUOTA_HEARTBEAT_SECONDS"] == ""
    # With quotas on, a pod reminds the leader of its calls in flight three times per recovery window.
    quotas = Settings(quotas_enabled=True, quota_recovery_seconds=30)
    (on,) = runner_pod(body, index=0, trigger=Trigger.KICKOFF, settings=quotas)["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in on["env"]}
    assert (env["FLOWKUBE_QUOTAS"], env["FLOWKUBE_QUOTA_HEARTBEAT_SECONDS"]) == ("true", "10")


def test_a_flow_over_the_spec_bounds_fails_invalid_spec_without_a_pod() -> None:
    from flowkube_api.limits import SPEC_ENV_LIMIT

    body = flow(inputs={"topic": "x" * (SPEC_ENV_LIMIT + 1)})
    p = step(body)
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert cond(body, "Accepted")["status"] == "False" and cond(body, "Accepted")["reason"] == Reason.INVALID_SPEC
    assert "spec.inputs" in cond(body, "Succeeded")["message"]


def test_the_runner_pod_policy_names_each_field_and_keeps_it_out_of_the_pod() -> None:
    """Creating a Flow is not creating a pod: the operator makes it with its own rights."""
    from flowkube_operator.flows.resources import pod_policy_problems
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    spec = {"flowRef": "a:B",
            "env": [{"name": "KEY", "valueFrom": {"secretKeyRef": {"name": "db-admin", "key": "password"}}},
                    {"name": "OPENAI_API_KEY", "valueFrom": {"secretKeyRef": {"name": "openai", "key": "k"}}}],
            "envFrom": [{"secretRef": {"name": "db-admin"}}, {"configMapRef": {"name": "settings"}}],
            "podTemplate": {"priorityClassName": "system-cluster-critical",
                            "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "effect": "NoSchedule"},
                                            {"operator": "Exists"}, {"key": "gpu", "operator": "Exists"}],
                            "imagePullSecrets": [{"name": "registry"}]}}
    settings = Settings(runner_secret_names="openai,registry", runner_toleration_keys="gpu")
    problems = pod_policy_problems(spec, settings)
    assert [p.split(":")[0] for p in problems] == [
        "spec.podTemplate.priorityClassName", "spec.podTemplate.tolerations[0]", "spec.podTemplate.tolerations[1]",
        "spec.env[0].valueFrom.secretKeyRef.name", "spec.envFrom[0].secretRef.name"]
    assert "'db-admin' is not one Flows may use" in problems[3]
    pod_spec = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=settings)["spec"]
    (container,) = pod_spec["containers"]
    assert "priorityClassName" not in pod_spec and pod_spec["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert pod_spec["imagePullSecrets"] == [{"name": "registry"}]
    env = {e["name"]: e for e in container["env"]}
    assert "KEY" not in env and env["OPENAI_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "openai"
    assert container["envFrom"] == [{"configMapRef": {"name": "settings"}}]
    # Off, or allowing everything: copied as it is.
    for loose in (Settings(runner_policy=False),
                  Settings(runner_secret_names="*", runner_toleration_keys="*", runner_priority_class_names="*")):
        assert pod_policy_problems(spec, loose) == []
        assert runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=loose)["spec"]["priorityClassName"]


def test_images_and_script_steps_are_the_policys_to_allow() -> None:
    """A Flow running its own code reports its own usage: the platform team decides who may."""
    from flowkube_operator.flows.resources import SCRIPTS_ENV, pod_policy_problems
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    spec = {"flowRef": "a:B", "image": "evil.example.com/miner:1", "env": [{"name": SCRIPTS_ENV, "value": "true"}],
            "envFrom": [{"configMapRef": {"name": "turns-scripts-on"}}]}
    settings = Settings(runner_images="registry.example.com/team/*", runner_image="ghcr.io/flowkube/runner:1")
    problems = pod_policy_problems(spec, settings)
    assert [p.split(":")[0] for p in problems] == ["spec.image", "spec.env[0]"]
    assert pod_policy_problems({**spec, "image": "registry.example.com/team/flows:2", "env": []}, settings) == []
    (container,) = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=settings)["spec"]["containers"]
    assert container["image"] == "ghcr.io/flowkube/runner:1"
    assert [e for e in container["env"] if e["name"] == SCRIPTS_ENV] == [{"name": SCRIPTS_ENV, "value": "false"}]
    allowed = Settings(runner_allow_scripts=True)
    (container,) = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=allowed)["spec"]["containers"]
    assert container["image"] == "evil.example.com/miner:1"
    assert [e for e in container["env"] if e["name"] == SCRIPTS_ENV] == [{"name": SCRIPTS_ENV, "value": "true"}]


def test_reserved_label_and_annotation_keys_are_refused_by_name_and_kept_off_the_pod() -> None:
    """A Flow editor who may not create pods may not set, on the pods the operator makes, the keys a
    mesh, a network plugin, AppArmor or flowkube itself act on; a Flow stored before the rule (or
    while the webhook was down) gets its pod without them."""
    from flowkube_operator.flows.resources import pod_policy_problems
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    spec = {"flowRef": "a:B", "podTemplate": {"metadata": {
        "labels": {"team": "a", "istio.io/rev": "canary", "example.com/tier": "x", "flowkube.io/flow": "other",
                   "app.kubernetes.io/name": "reports"},
        "annotations": {"sidecar.istio.io/inject": "false", "k8s.v1.cni.cncf.io/networks": "host-net",
                        "container.apparmor.security.beta.kubernetes.io/runner": "unconfined",
                        "linkerd.io/inject": "disabled", "note": "kept", "notkubernetes.io/x": "kept"}}}}
    settings = Settings()
    problems = pod_policy_problems(spec, settings)
    assert [p.split(": ")[0] for p in problems] == [
        'spec.podTemplate.metadata.labels["istio.io/rev"]', 'spec.podTemplate.metadata.labels["flowkube.io/flow"]',
        'spec.podTemplate.metadata.annotations["sidecar.istio.io/inject"]',
        'spec.podTemplate.metadata.annotations["k8s.v1.cni.cncf.io/networks"]',
        'spec.podTemplate.metadata.annotations["container.apparmor.security.beta.kubernetes.io/runner"]',
        'spec.podTemplate.metadata.annotations["linkerd.io/inject"]']
    assert problems[0].startswith('spec.podTemplate.metadata.labels["istio.io/rev"]: the prefix istio.io/ is '
                                  "reserved (runnerPolicy.reservedMetadataPrefixes: istio.io/)")
    assert "sidecar.istio.io/ is reserved (runnerPolicy.reservedMetadataPrefixes: istio.io/ and its subdomains)" \
        in problems[2]
    meta = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=settings)["metadata"]
    assert meta["annotations"] == {"note": "kept", "notkubernetes.io/x": "kept"}
    assert "istio.io/rev" not in meta["labels"] and (meta["labels"]["team"], meta["labels"]["example.com/tier"]) == (
        "a", "x")
    assert meta["labels"]["flowkube.io/flow"] == "f"
    assert meta["labels"]["app.kubernetes.io/name"] == "reports", "Kubernetes' recommended labels are the user's"
    # The list is the chart's: `istio.io` and `istio.io/` alike; empty reserves nothing; the policy off copies all.
    mesh_only = Settings(runner_reserved_metadata_prefixes="Istio.io")
    assert [p.split(": ")[0] for p in pod_policy_problems(spec, mesh_only)] == [
        'spec.podTemplate.metadata.labels["istio.io/rev"]',
        'spec.podTemplate.metadata.annotations["sidecar.istio.io/inject"]']
    for loose in (Settings(runner_reserved_metadata_prefixes=""), Settings(runner_policy=False)):
        assert pod_policy_problems(spec, loose) == []
        pod = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=loose)
        assert pod["metadata"]["annotations"]["linkerd.io/inject"] == "disabled"


def test_reserved_keys_in_a_template_are_refused_naming_the_templates_field() -> None:
    """A FlowTemplate's podTemplate is the pod of every Flow of it: the same refusal, at the template."""
    import asyncio
    from types import SimpleNamespace

    from flowkube_operator import handlers
    from flowkube_operator.settings import Settings

    async def no_validator(spec: Any) -> None:
        return None

    app = SimpleNamespace(settings=Settings(), validator=SimpleNamespace(problem=no_validator))
    template = {"template": {"flowRef": "a:B", "podTemplate": {"metadata": {"labels": {"istio.io/rev": "x"}}}}}
    problem = asyncio.run(handlers._spec_problem(app, dict(template["template"])))  # type: ignore[arg-type]
    assert problem is not None and problem.replace("spec.", "spec.template.").startswith(
        'spec.template.podTemplate.metadata.labels["istio.io/rev"]: the prefix istio.io/ is reserved')


def test_enforced_env_is_refused_by_name_and_wins_in_the_pod() -> None:
    """The platform team's metering gateway: a Flow cannot point its runner elsewhere (spec.env is
    refused; a Flow admitted before keeps the enforced value in its pod), whatever the runner policy."""
    from flowkube_operator.flows.resources import pod_policy_problems
    from flowkube_operator.settings import Settings
    from tests.unit.operator.pods import pod_of as runner_pod

    gateway = "http://metering.llm:8080/v1"
    spec = {"flowRef": "a:B", "env": [{"name": "TOPIC", "value": "x"},
                                      {"name": "OPENAI_BASE_URL", "value": "https://api.openai.com/v1"}],
            "envFrom": [{"configMapRef": {"name": "elsewhere"}}]}
    for policy in (True, False):
        settings = Settings(runner_policy=policy, runner_enforced_env={"OPENAI_BASE_URL": gateway},
                            runner_default_env={"OPENAI_BASE_URL": "http://default"})
        assert pod_policy_problems(spec, settings) == [
            "spec.env[1].name: OPENAI_BASE_URL is set by the operator in every runner pod (runner.enforcedEnv) "
            "and a Flow may not override it"]
        (container,) = runner_pod(flow(**spec), index=0, trigger=Trigger.KICKOFF, settings=settings)["spec"][
            "containers"]
        named = [e for e in container["env"] if e["name"] == "OPENAI_BASE_URL"]
        assert named == [{"name": "OPENAI_BASE_URL", "value": gateway}]  # env wins over envFrom too
        assert {"name": "TOPIC", "value": "x"} in container["env"]
    assert pod_policy_problems(spec, Settings()) == []  # nothing enforced: a Flow's own env wins over defaults
    with pytest.raises(ValueError, match="FLOWKUBE_PRICES"):
        Settings(runner_enforced_env={"FLOWKUBE_PRICES": "{}"})


def test_a_final_report_ends_the_run_before_its_pod_has_and_the_pods_end_changes_nothing() -> None:
    from flowkube_operator.flows.reconcile import late_pods

    body = flow()
    step(body)
    running = pod("f-0", "Running")
    step(body, running, at=1)
    final = report("f-0", RunResult.SUCCEEDED, usage=usage(10, 5), output="done", final=True,
                   finished_at=T0 + dt.timedelta(seconds=3))
    p = step(body, running, final, at=3.1)
    st = body["status"]
    assert st["phase"] == Phase.SUCCEEDED and st["usage"]["totalTokens"] == 15 and st["result"]["output"] == "done"
    assert st["runs"][0]["closedOnReport"] is True and st["runs"][0]["result"] == RunResult.SUCCEEDED
    assert st["runs"][0]["finishedAt"] == "2026-11-22T12:00:03Z" and p.delete_pods == []
    # The next reconcile (its own status write) finds the pod still ending: it is left to end.
    again = plan(body, running, None, now=T0 + dt.timedelta(seconds=3.5))
    assert again.delete_pods == [] and again.status.dump() == st and again.requeue_after == 59.5
    # One that hangs on its way out is stopped a minute after its report.
    hung = plan(body, running, None, now=T0 + dt.timedelta(seconds=64))
    assert [d.name for d in hung.delete_pods] == ["f-0"] and hung.status.dump() == st
    # It ends, later than the run did: its report is read once more (a later one's hint may have
    # been lost with an operator restart), and the same report changes nothing.
    ended = pod("f-0", "Succeeded", exit_code=0)
    assert late_pods(st, ended) == ["f-0"]
    later = plan(body, ended, None, now=T0 + dt.timedelta(seconds=6), late={"f-0": final})
    assert not later.need_report and later.status.dump() == st and later.delete_pods == [] and not later.events
    # A report after the final one (handed over by the state API as a late report, or read at the
    # pod's end) still counts: a pod cannot hide calls behind an early final report. The run's end
    # stays the report's.
    more = report("f-0", RunResult.SUCCEEDED, usage=usage(30, 5), final=True)
    p = plan(body, ended, None, now=T0 + dt.timedelta(seconds=7), late={"f-0": more})
    assert p.status.dump()["usage"]["totalTokens"] == 35 and any(e[1] == Reason.LATE_REPORT for e in p.events)
    assert p.status.dump()["runs"][0]["finishedAt"] == "2026-11-22T12:00:03Z"


def test_a_failed_final_report_waits_for_the_pod_to_end() -> None:
    """A failure is judged with the pod's end: a runner stopped by its pod's deletion reports a
    failure that is a disruption (replaced, not counted against retries.limit)."""
    body = flow()
    step(body)
    running = pod("f-0", "Running")
    step(body, running, at=0.5)
    stopped = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, exit_code=3, final=True,
                     finished_at=T0 + dt.timedelta(seconds=3))
    step(body, running, stopped, at=3.1)
    run = body["status"]["runs"][0]
    assert "finishedAt" not in run and "closedOnReport" not in run
    deleted = {"f-0": PodView(name="f-0", phase="Failed", created_at=T0, exit_code=3, deleting=True,
                              finished_at=T0 + dt.timedelta(seconds=4))}
    step(body, deleted, stopped, at=5)
    assert body["status"]["runs"][0]["reason"] == Reason.DISRUPTED and body["status"]["phase"] == Phase.PENDING


def test_a_runner_pod_that_cannot_start_says_why_in_the_flows_status_until_it_starts() -> None:
    """A pod the scheduler cannot place (or whose image or Secret is missing) leaves the Flow Pending
    with Kubernetes' reason and message, where `kubectl get flows` shows them; not a silent Pending."""
    body = flow()
    step(body)
    unschedulable = PodView.from_pod({
        "metadata": {"name": "f-0", "resourceVersion": "2"},
        "status": {"phase": "Pending", "conditions": [
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
             "message": "0/1 nodes are available: 1 Insufficient cpu."}]}})
    step(body, {"f-0": unschedulable}, at=1)
    st = body["status"]
    assert st["phase"] == Phase.PENDING
    assert st["message"] == ("runner pod f-0 is waiting (Unschedulable): 0/1 nodes are available: "
                             "1 Insufficient cpu.")
    assert (cond(body, "Running")["status"], cond(body, "Running")["reason"]) == ("Unknown", "Unschedulable")

    no_secret = PodView.from_pod({
        "metadata": {"name": "f-0", "resourceVersion": "3"},
        "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}],
                   "containerStatuses": [{"name": "runner", "state": {"waiting": {
                       "reason": "CreateContainerConfigError", "message": 'secret "model-key" not found'}}}]}})
    step(body, {"f-0": no_secret}, at=2)
    assert cond(body, "Running")["reason"] == "CreateContainerConfigError"
    assert 'secret "model-key" not found' in body["status"]["message"]

    creating = PodView.from_pod({
        "metadata": {"name": "f-0", "resourceVersion": "4"},
        "status": {"phase": "Pending", "containerStatuses": [{"name": "runner", "state": {"waiting": {
            "reason": "ContainerCreating"}}}]}})
    assert creating.waiting is None  # passes by itself
    step(body, {"f-0": creating}, at=3)
    assert body["status"]["message"] == "waiting for runner pod f-0"
    assert cond(body, "Running")["reason"] == Reason.RUN_PENDING
    step(body, pod("f-0", "Running"), at=4)
    assert body["status"]["phase"] == Phase.RUNNING and cond(body, "Running")["status"] == "True"



def test_a_runner_pod_whose_image_name_is_invalid_fails_the_flow_with_it_and_is_deleted() -> None:
    """InvalidImageName never passes (a pod's image cannot change): the Flow used to stay Pending with
    it forever. Now the run fails with the kubelet's reason, not retried, and the pod is deleted."""
    body = flow(retries={"limit": 3})
    step(body)
    bad = PodView.from_pod({
        "metadata": {"name": "f-0", "resourceVersion": "2", "uid": "uid-f-0"},
        "status": {"phase": "Pending", "containerStatuses": [{"name": "runner", "state": {"waiting": {
            "reason": "InvalidImageName", "message": 'Failed to apply default image tag "../../etc"'}}}]}})
    p = step(body, {"f-0": bad}, at=1)
    st = body["status"]
    assert st["phase"] == Phase.FAILED and len(st["runs"]) == 1  # no retry: it would be the same
    assert st["runs"][0]["reason"] == Reason.INVALID_IMAGE_NAME
    assert 'Failed to apply default image tag "../../etc"' in st["message"]
    assert cond(body, "Succeeded")["reason"] == Reason.INVALID_IMAGE_NAME
    assert [d.name for d in p.delete_pods] == ["f-0"]


# -- templates ---------------------------------------------------------------------------------------

TEMPLATE = {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate",
            "metadata": {"name": "article", "namespace": "ns", "uid": "t1", "generation": 3, "resourceVersion": "9"},
            "spec": {"parameters": [{"name": "topic", "required": True, "type": "string"}],
                     "template": {"flowRef": "pkg.mod:Article", "image": "runner:template",
                                  "budget": {"maxTotalTokens": 10}}}}


def templated(**spec: Any) -> dict[str, Any]:
    body = flow(**spec)
    del body["spec"]["flowRef"]
    body["spec"]["templateRef"] = {"name": "article"}
    return body


def test_a_flow_waits_for_its_template_then_takes_it_once_and_runs_it() -> None:
    body = templated(inputs={"topic": "operators"})
    p = plan(body, {}, now=T0)
    body["status"] = p.status.dump()
    assert body["status"]["phase"] == Phase.PENDING and p.create_pod is None
    assert body["status"]["message"] == ('FlowTemplate "article" in namespace "ns" not found: '
                                         "the Flow starts once it exists")
    assert cond(body, "Running")["reason"] == Reason.TEMPLATE_NOT_FOUND
    assert [e[1] for e in p.events] == [Reason.TEMPLATE_NOT_FOUND]
    assert plan(body, {}, now=T0).events == [], "said once, not at every reconcile"

    p = plan(body, {}, now=T0, template=TEMPLATE)
    body["status"] = p.status.dump()
    taken = body["status"]["template"]
    assert (taken["kind"], taken["name"], taken["generation"], taken["uid"]) == ("FlowTemplate", "article", 3, "t1")
    assert p.create_pod is not None and body["status"]["definition"] == "Article"
    assert [e[1] for e in p.events] == [Reason.TEMPLATE_RESOLVED]

    # The take stores the template once, in a snapshot the status names (no copy in the status).
    assert p.snapshot is not None and p.snapshot["kind"] == "ControllerRevision"
    assert taken["snapshot"] == p.snapshot["metadata"]["name"] and "spec" not in taken
    assert p.snapshot["metadata"]["namespace"] == "ns" and p.snapshot["data"]["spec"] == TEMPLATE["spec"]
    assert p.template_spec == TEMPLATE["spec"]

    # The template changes: the Flow keeps running what it took, read from its snapshot (none looked up).
    p = plan(body, {}, now=T0, template=Taken(spec=TEMPLATE["spec"]))
    assert p.status.template is not None and p.status.template.generation == 3 and p.snapshot is None
    assert p.status.definition == "Article" and p.status.phase == Phase.PENDING


def test_a_flow_whose_snapshot_is_gone_fails_naming_it_and_never_runs_something_else() -> None:
    body = templated(inputs={"topic": "operators"})
    p = plan(body, {}, now=T0, template=TEMPLATE)
    body["status"] = p.status.dump()
    name = body["status"]["template"]["snapshot"]
    p = plan(body, {}, now=T0, template=Taken(problem=f"template snapshot {name!r} (ControllerRevision) is gone"))
    body["status"] = p.status.dump()
    assert body["status"]["phase"] == Phase.FAILED and p.create_pod is None
    assert cond(body, "Succeeded")["reason"] == Reason.TEMPLATE_SNAPSHOT_UNUSABLE
    assert name in body["status"]["message"]
    # Its pod running when the snapshot goes: stopped, by the uid the plan saw.
    running = templated(inputs={"topic": "operators"})
    running["status"] = {"template": body["status"]["template"], "phase": "Running",
                         "runs": [{"pod": "f-0", "trigger": "kickoff", "startedAt": "2026-11-22T12:00:00Z"}]}
    p = plan(running, pod("f-0", "Running"), now=T0, template=Taken(problem="template snapshot gone"))
    assert p.status.phase == Phase.FAILED and [(d.name, d.uid) for d in p.delete_pods] == [("f-0", "uid-f-0")]
    # Nothing read at all (a caller that did not load it): failed too, never the Flow's own spec alone.
    again = templated(inputs={"topic": "operators"})
    again["status"] = {**body["status"], "phase": "Pending", "finishedAt": None, "conditions": None}
    assert plan(again, {}, now=T0).status.phase == Phase.FAILED


def test_a_flow_an_older_operator_gave_a_status_copy_keeps_running_from_it() -> None:
    body = templated(inputs={"topic": "operators"})
    body["status"] = {"template": {"kind": "FlowTemplate", "name": "article", "uid": "t1", "generation": 3,
                                   "spec": TEMPLATE["spec"]}}
    p = plan(body, {}, now=T0)
    assert p.create_pod is not None and p.snapshot is None and p.status.definition == "Article"
    assert p.template_spec == TEMPLATE["spec"] and p.status.template is not None and p.status.template.spec


def test_inputs_that_do_not_fit_the_templates_parameters_fail_the_flow_naming_the_parameter() -> None:
    body = templated(inputs={"topic": 42})
    p = plan(body, {}, now=T0, template=TEMPLATE)
    body["status"] = p.status.dump()
    assert body["status"]["phase"] == Phase.FAILED and p.create_pod is None
    assert cond(body, "Accepted")["status"] == "False"
    assert cond(body, "Accepted")["reason"] == Reason.INVALID_INPUTS
    assert "spec.inputs.topic: must be string" in body["status"]["message"]


def test_a_fork_copies_its_checkpoint_first_then_runs_from_it_with_only_its_own_usage_counted() -> None:
    from flowkube_api.report import CheckpointEntry, SpentSoFar
    from flowkube_operator.flows.reconcile.forks import ForkSource

    body = flow(forkFrom={"name": "origin", "checkpoint": 2})
    entry = CheckpointEntry(id=2, method="review", kind="Paused", time=T0,
                            usage=SpentSoFar(total_tokens=300, cost=Decimal("0.5")))
    source = ForkSource("ns", "origin", "u0", entry, b"gz-state")
    # First: the copy, and the status that says so; no run yet (its pod comes after that write).
    p = plan(body, {}, now=T0, fork=source)
    body["status"] = p.status.dump()
    assert p.fork_state == b"gz-state" and p.create_pod is None and p.requeue_after is not None
    assert body["status"]["forkedFrom"] == {"namespace": "ns", "name": "origin", "uid": "u0", "checkpoint": 2,
                                            "method": "review", "kind": "Paused"}
    assert body["status"]["inheritedUsage"] == {"totalTokens": 300, "cost": "0.5"}
    assert [e[1] for e in p.events] == [Reason.FORKED]
    # Then its first run: a fork run, from nothing its origin spent (the budget is its own).
    p = step(body, at=1)
    assert p.fork_state is None and p.create_pod is not None and p.create_pod.trigger == Trigger.FORK
    assert p.create_pod.prior == TokenUsage()
    # Its run ends: usage is its own calls, the inherited spend stays beside it, and the checkpoints it
    # took are its index (the last spec.checkpoints.keep, by id).
    own = usage(40, 2)
    taken = [CheckpointEntry(id=n, method=f"m{n}", kind="Completed", time=T0) for n in range(3, 10)]
    rep = report("f-0", RunResult.SUCCEEDED, trigger=Trigger.FORK, usage=own, checkpoints=taken)
    step(body, pod("f-0", "Succeeded", exit_code=0), rep, at=5)
    assert body["status"]["phase"] == Phase.SUCCEEDED
    assert body["status"]["usage"]["totalTokens"] == 42
    assert body["status"]["inheritedUsage"]["totalTokens"] == 300
    assert [e["id"] for e in body["status"]["checkpoints"]] == [5, 6, 7, 8, 9]


def test_a_fork_whose_origin_or_checkpoint_is_gone_fails_saying_which() -> None:
    from flowkube_operator.flows.reconcile.forks import ForkSource

    body = flow(forkFrom={"name": "origin", "checkpoint": 7})
    why = "checkpoint 7 of Flow ns/origin is no longer kept (it keeps the last spec.checkpoints.keep=5; it lists: 8)"
    p = plan(body, {}, now=T0, fork=ForkSource("ns", "origin", problem=why))
    body["status"] = p.status.dump()
    assert body["status"]["phase"] == Phase.FAILED and p.create_pod is None and p.fork_state is None
    assert cond(body, "Succeeded")["reason"] == Reason.FORK_SOURCE_UNAVAILABLE
    assert body["status"]["message"] == why


def test_the_checkpoint_index_keeps_the_last_ones_and_none_when_keep_is_zero() -> None:
    from flowkube_api.report import CheckpointEntry
    from flowkube_operator.flows.reconcile.forks import fold, kept

    def entries(*ids: int) -> list[CheckpointEntry]:
        return [CheckpointEntry(id=n, method="m", kind="Completed", time=T0) for n in ids]

    assert [e.id for e in fold(entries(1, 2, 3), entries(3, 4), 3) or []] == [2, 3, 4]
    assert fold(entries(1), None, 3) == entries(1)
    assert fold(None, entries(1, 2), 0) is None
    assert kept({"checkpoints": {"keep": 0}}) == 0 and kept({}) == 5 and kept({"checkpoints": {"keep": 99}}) == 5


def test_a_runs_charges_by_quarter_hour_are_kept_only_when_they_add_up_to_its_usage() -> None:
    from flowkube_api.report import Charge

    for tokens, kept in ((42, True), (41, False)):
        body = flow()
        step(body)
        charges = [Charge(at=T0, model="gpt-4o-mini", total_tokens=tokens)]
        rep = report("f-0", RunResult.SUCCEEDED, usage=usage(40, 2), charges=charges)
        step(body, pod("f-0", "Succeeded", exit_code=0), rep, at=5)
        run = body["status"]["runs"][0]
        assert run["usage"]["totalTokens"] == 42
        assert (run.get("charges") == [{"at": "2026-11-22T12:00:00Z", "model": "gpt-4o-mini", "totalTokens": 42,
                                        "cost": "0"}]) is kept, run


QUOTA = "FlowQuota ns/team: limit daily (maxTotalTokens=100, per day in UTC) is exhausted: 100 tokens used of 100"


def test_an_exhausted_quota_holds_a_kickoff_and_a_resume_keeps_its_answer_until_there_is_room() -> None:
    body = flow()
    p = plan(body, {}, now=T0, quota=QUOTA)
    body["status"] = p.status.dump()
    assert p.create_pod is None and not body["status"].get("runs"), "no kickoff is recorded while held"
    assert body["status"]["phase"] == Phase.PENDING and body["status"]["message"] == QUOTA
    assert p.requeue_after == 30 and [e[1] for e in p.events] == [Reason.QUOTA_EXHAUSTED]
    again = plan(body, {}, now=T0 + dt.timedelta(seconds=30), quota=QUOTA)
    assert again.create_pod is None and again.events == [], "said once, not at every look"
    # The window resets: the kickoff starts.
    p = step(body, at=60)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.KICKOFF

    # A paused Flow answered while its quota is exhausted: the answer is taken and the resume recorded
    # (the inbox is empty again), its pod made only once there is room.
    body = flow(feedback={"timeoutSeconds": 600})
    paused(body)
    body["status"]["feedback"]["response"] = {"text": "approved", "requestId": "req-1"}
    p = plan(body, pod("f-0", "Succeeded", exit_code=0), now=T0 + dt.timedelta(seconds=30), quota=QUOTA)
    body["status"] = p.status.dump()
    assert p.create_pod is None and body["status"]["runs"][-1]["trigger"] == Trigger.RESUME
    assert "response" not in body["status"]["feedback"] and body["status"]["message"] == QUOTA
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=90)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RESUME and p.create_pod.index == 1
    assert p.create_pod.feedback == {"requestId": "req-1", "text": "approved", "timedOut": False}


ROOM = ("FlowQuota ns/team: limit daily (maxTotalTokens=100, per day in UTC): 90 tokens used + 0 reserved by calls "
        "in flight, and this call may use up to 400: the Flow waits for that room (spec.action: Queue)")


def test_a_run_a_queue_quota_stopped_for_room_waits_and_is_retried_once_there_is_room() -> None:
    """A run refused at a call by an ``action: Queue`` quota that still has room, but not enough for
    that call: the quota service says the Flow waits (``quota``), so the Flow is Pending, not Failed,
    and the retry starts when there is room (not counted against retries.limit: 0 here). Without that
    word (a Refuse quota) the run's failure is the Flow's, as budget.maxCost's is."""
    stopped = report("f-0", RunResult.FAILED, reason=Reason.QUOTA_EXHAUSTED, exit_code=2, usage=usage(3, 4),
                     message="FlowQuota ns/team: limit daily ...")

    def planned(body: dict[str, Any], at: float, quota: str | None) -> Plan:
        pods, now = pod("f-0", "Failed", exit_code=2), T0 + dt.timedelta(seconds=at)
        p = plan(body, pods, stopped, now=now, quota=quota)
        if p.need_report:
            p = plan(body, pods, stopped, now=now, quota=quota, report_checked=True)
        body["status"] = p.status.dump()
        return p

    body = flow()
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    p = planned(body, 5, ROOM)
    st = body["status"]
    assert p.create_pod is None and st["phase"] == Phase.PENDING and st["message"] == ROOM
    assert st["runs"][0]["reason"] == Reason.QUOTA_EXHAUSTED and st["usage"]["totalTokens"] == 7
    assert cond(body, "Running")["reason"] == Reason.QUOTA_EXHAUSTED and p.requeue_after == 30
    assert planned(body, 35, ROOM).create_pod is None, "still no room"
    p = planned(body, 65, None)  # room: the limit was raised, or the window reset
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY and p.create_pod.index == 1

    body = flow()
    step(body)
    step(body, pod("f-0", "Running"), at=1)
    planned(body, 5, None)
    assert body["status"]["phase"] == Phase.FAILED and cond(body, "Succeeded")["reason"] == Reason.QUOTA_EXHAUSTED


def test_a_runs_lost_spans_come_from_its_report_and_a_pod_cannot_claim_more_than_the_bound() -> None:
    from flowkube_api.report import SpansLost

    body = flow()
    step(body)
    running = pod("f-0", "Running")
    step(body, running, at=1)
    boast = SpansLost(queue_full=10**12, export_failed=3, unflushed=0)
    final = report("f-0", RunResult.SUCCEEDED, usage=usage(10, 5), final=True, spans_lost=boast,
                   finished_at=T0 + dt.timedelta(seconds=3))
    step(body, running, final, at=3.1)
    assert body["status"]["runs"][0]["spansLost"] == 10**9
