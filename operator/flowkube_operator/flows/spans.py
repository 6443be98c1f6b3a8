"""The operator's spans of a Flow's trace, read off a status write (pure: no I/O).

A status write that ends something is where the operator knows its whole extent, so each span is
made then, whole, with the ids ``flowkube_api.traces`` derives from the Flow's uid (the runner pods
parent their spans to the same ids without being told more than their run's):

- ``run {i} {trigger}``: ``status.runs[i]`` from startedAt to finishedAt, when it finishes; its pod's
  spans (crewAI's, the model calls) are its children;
- ``wait_for_feedback {method}``: a feedback request from requestedAt to respondedAt, once its
  answer (or its timeout) is recorded with its outcome (crewAI's, reported by the run that took
  the answer; or that run's end): the person's time, between the run that paused and the one that
  resumed;
- ``invoke_workflow {definition}``: the Flow's root, from its creation to its end, when it ends.

Only the leader's own successful writes make spans, each once: a write is made once, and a new
leader's first look writes nothing that was written already.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api import constants as c
from flowkube_api import traces
from flowkube_api.base import parse_time
from flowkube_api.traces import SpanRecord, Value

Body = dict[str, Any]


def _usage(usage: Body) -> dict[str, Value]:
    out: dict[str, Value] = {"flowkube.usage.total_tokens": int(usage.get("totalTokens") or 0)}
    if usage.get("cost") is not None:
        out["flowkube.usage.cost"] = str(usage["cost"])
    return out


def _flow_attributes(meta: Body) -> dict[str, Value]:
    return {"k8s.namespace.name": str(meta.get("namespace") or ""), "flowkube.flow.name": str(meta.get("name") or ""),
            "flowkube.flow.uid": str(meta.get("uid") or "")}


def spans_of(meta: Body, old: Body, new: Body, now: dt.datetime | None = None) -> list[SpanRecord]:
    """The spans a status write from ``old`` to ``new`` at ``now`` completes (none without a uid).

    Status times are whole seconds: an end is the write's time when that is within the second the
    status names (the truer end: a run's pod spans end up to a second past a truncated finishedAt)."""
    uid = str(meta.get("uid") or "")
    if not uid:
        return []
    flow = _flow_attributes(meta)
    return [*_runs(uid, flow, old, new, now), *_waits(uid, flow, old, new), *_root(uid, flow, meta, old, new, now)]


def _end(stamped: dt.datetime, now: dt.datetime | None) -> dt.datetime:
    if now is None or not stamped <= now < stamped + dt.timedelta(seconds=1):
        return stamped
    return now


def _runs(uid: str, flow: dict[str, Value], old: Body, new: Body, now: dt.datetime | None) -> list[SpanRecord]:
    out: list[SpanRecord] = []
    before = old.get("runs") or []
    for i, run in enumerate(new.get("runs") or []):
        ended, started = parse_time(run.get("finishedAt")), parse_time(run.get("startedAt"))
        was = before[i] if i < len(before) else {}
        if ended is None or was.get("finishedAt") or was.get("pod", run.get("pod")) != run.get("pod"):
            continue
        failed = run.get("result") == c.RunResult.FAILED
        attributes: dict[str, Value] = {
            **flow, "flowkube.run.index": i, "flowkube.run.trigger": str(run.get("trigger") or ""),
            "flowkube.run.result": str(run.get("result") or ""), "flowkube.run.reason": str(run.get("reason") or ""),
            "k8s.pod.name": str(run.get("pod") or ""), **_usage(run.get("usage") or {})}
        if run.get("exitCode") is not None:
            attributes["flowkube.run.exit_code"] = int(run["exitCode"])
        if run.get("spansLost"):
            attributes["flowkube.run.spans_lost"] = int(run["spansLost"])
        if run.get("warmSeconds") is not None:
            attributes["flowkube.run.warm_seconds"] = float(run["warmSeconds"])
        out.append(SpanRecord(f"run {i} {run.get('trigger') or ''}".strip(), traces.trace_id(uid),
                              traces.run_span_id(uid, i), traces.root_span_id(uid), started or ended, _end(ended, now),
                              attributes,
                              error=str(run.get("message") or run.get("reason") or "failed") if failed else None))
    return out


def _answered(record: Body, runs: list[Body]) -> bool:
    """A feedback record whose wait is known whole: answered (or timed out), with its outcome, or,
    when the answer had none to give, once the run that took it ended (crewAI's outcome comes with it)."""
    responded = parse_time(record.get("respondedAt"))
    if responded is None or parse_time(record.get("requestedAt")) is None:
        return False
    if record.get("outcome") or record.get("timedOut"):
        return True
    # The run that took the answer ended: one that started after it (a new pod), or one running when
    # it came that ended later (a warm pod). Status times are whole seconds: the run that paused can
    # end in the second the answer came, so "later" is strictly later.
    for r in runs:
        started, ended = parse_time(r.get("startedAt")), parse_time(r.get("finishedAt"))
        if ended is not None and ((started is not None and started >= responded) or ended > responded):
            return True
    return False


def _waits(uid: str, flow: dict[str, Value], old: Body, new: Body) -> list[SpanRecord]:
    out: list[SpanRecord] = []
    known = {str(r.get("requestId")) for r in ((old.get("feedback") or {}).get("history") or [])
             if _answered(r, old.get("runs") or [])}
    for record in (new.get("feedback") or {}).get("history") or []:
        request = str(record.get("requestId") or "")
        if not request or request in known or not _answered(record, new.get("runs") or []):
            continue
        asked, answered = parse_time(record.get("requestedAt")), parse_time(record.get("respondedAt"))
        assert asked is not None and answered is not None
        attributes: dict[str, Value] = {
            **flow, "flowkube.feedback.request_id": request,
            "flowkube.feedback.method": str(record.get("method") or ""),
            "flowkube.feedback.timed_out": bool(record.get("timedOut")),
            "flowkube.wait.seconds": max(0.0, (answered - asked).total_seconds())}
        if record.get("outcome"):
            attributes["flowkube.feedback.outcome"] = str(record["outcome"])
        if record.get("respondedBy"):
            attributes["flowkube.feedback.responded_by"] = str(record["respondedBy"])
        out.append(SpanRecord(f"wait_for_feedback {record.get('method') or ''}".strip(), traces.trace_id(uid),
                              traces.wait_span_id(uid, request), traces.root_span_id(uid), asked, answered,
                              attributes))
    return out


def _root(uid: str, flow: dict[str, Value], meta: Body, old: Body, new: Body,
          now: dt.datetime | None) -> list[SpanRecord]:
    if new.get("phase") not in c.TERMINAL_PHASES or old.get("phase") in c.TERMINAL_PHASES:
        return []
    created = parse_time(meta.get("creationTimestamp")) or parse_time(new.get("startedAt"))
    ended = parse_time(new.get("finishedAt"))
    if created is None or ended is None:
        return []
    definition = str(new.get("definition") or meta.get("name") or "")
    attributes: dict[str, Value] = {
        **flow, "gen_ai.operation.name": "invoke_workflow", "gen_ai.workflow.name": definition,
        "flowkube.phase": str(new.get("phase")), "flowkube.runs": len(new.get("runs") or []),
        **_usage(new.get("usage") or {})}
    failed = new.get("phase") == c.Phase.FAILED
    return [SpanRecord(f"invoke_workflow {definition}", traces.trace_id(uid), traces.root_span_id(uid), None,
                       created, _end(ended, now), attributes,
                       error=str(new.get("message") or "failed") if failed else None)]
