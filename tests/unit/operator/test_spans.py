"""The operator's spans of a Flow's trace, read off its status writes (flows/spans.py), and what
turns them into exported spans (tracing.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from flowkube_api import traces
from flowkube_operator.flows.spans import spans_of
from flowkube_operator.tracing import Traces

UID = "6c1e7a0e-7d43-4f0e-9a5c-1b9b8f0d2e11"
META = {"name": "article", "namespace": "team-a", "uid": UID, "creationTimestamp": "2026-11-28T10:00:00Z"}


def run(i: int, trigger: str, started: str, finished: str | None = None, **more: Any) -> dict[str, Any]:
    body = {"pod": f"article-{i}", "trigger": trigger, "startedAt": started, **more}
    if finished:
        body["finishedAt"] = finished
    return body


def test_a_pause_a_wait_and_a_resume_are_three_spans_under_the_root_and_the_end_is_the_root() -> None:
    paused = run(0, "kickoff", "2026-11-28T10:00:01Z", "2026-11-28T10:00:09Z", result="Paused", exitCode=0,
                 usage={"totalTokens": 120, "cost": "0.0012"})
    asked = {"phase": "AwaitingFeedback", "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z")]}
    waiting = {"phase": "AwaitingFeedback", "runs": [paused]}
    (first,) = spans_of(META, asked, waiting)
    assert (first.name, first.trace_id, first.span_id, first.parent_id) == (
        "run 0 kickoff", traces.trace_id(UID), traces.run_span_id(UID, 0), traces.root_span_id(UID))
    assert first.attributes["flowkube.usage.total_tokens"] == 120 and first.error is None
    assert spans_of(META, waiting, waiting) == [], "a write that ends nothing makes no span"

    record = {"requestId": "req-1", "method": "review", "requestedAt": "2026-11-28T10:00:09Z",
              "respondedAt": "2026-11-28T10:05:09Z", "respondedBy": "alice"}
    taken = {"phase": "Running", "feedback": {"history": [record]},
             "runs": [paused, run(1, "resume", "2026-11-28T10:05:10Z")]}
    assert spans_of(META, waiting, taken) == [], "the answer's outcome comes with the run that takes it"
    # Answered in the very second the run paused (status times are whole seconds): still waiting for it.
    quick = {**taken, "feedback": {"history": [{**record, "respondedAt": "2026-11-28T10:00:09Z"}]}}
    assert spans_of(META, waiting, quick) == []
    resumed = {**taken, "feedback": {"history": [{**record, "outcome": "approved"}]}}
    (wait,) = spans_of(META, taken, resumed)
    assert (wait.name, wait.span_id, wait.parent_id) == (
        "wait_for_feedback review", traces.wait_span_id(UID, "req-1"), traces.root_span_id(UID))
    assert wait.attributes["flowkube.wait.seconds"] == 300.0
    assert wait.attributes["flowkube.feedback.responded_by"] == "alice"

    done = {**resumed, "phase": "Succeeded", "finishedAt": "2026-11-28T10:05:20Z", "definition": "Article",
            "usage": {"totalTokens": 200, "cost": "0.002"},
            "runs": [paused, run(1, "resume", "2026-11-28T10:05:10Z", "2026-11-28T10:05:20Z", result="Succeeded")]}
    second, root = spans_of(META, resumed, done)
    assert second.name == "run 1 resume" and second.span_id == traces.run_span_id(UID, 1)
    assert (root.name, root.span_id, root.parent_id) == ("invoke_workflow Article", traces.root_span_id(UID), None)
    assert root.attributes["gen_ai.operation.name"] == "invoke_workflow" and root.attributes["flowkube.runs"] == 2
    assert spans_of(META, done, done) == []
    # An answer without an outcome: its wait is whole when the run that took it ends.
    bare = {**done, "feedback": {"history": [record]}}
    assert [r.name for r in spans_of(META, {**taken, "phase": "Running"}, bare)] == [
        "run 1 resume", "wait_for_feedback review", "invoke_workflow Article"]


def test_a_failed_run_and_a_failed_flow_are_error_spans_and_a_flow_without_a_uid_none() -> None:
    before = {"phase": "Running", "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z")]}
    after = {"phase": "Failed", "finishedAt": "2026-11-28T10:00:05Z", "message": "budget",
             "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z", "2026-11-28T10:00:05Z", result="Failed",
                          reason="BudgetExceeded", message="token budget exceeded", spansLost=3)]}
    failed_run, root = spans_of(META, before, after)
    assert failed_run.error == "token budget exceeded" and root.error == "budget"
    assert failed_run.attributes["flowkube.run.spans_lost"] == 3
    assert spans_of({**META, "uid": ""}, before, after) == []


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.got: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.got.extend(spans)
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def test_the_operators_spans_keep_their_derived_ids_times_and_parents() -> None:
    kept = Kept()
    out = Traces("http://unused", exporter=kept)
    before = {"phase": "Running", "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z")]}
    after = {"phase": "Succeeded", "finishedAt": "2026-11-28T10:00:05Z", "definition": "Article",
             "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z", "2026-11-28T10:00:05Z", result="Succeeded")]}
    out.emit(spans_of(META, before, after))
    out.close(10)
    by_name = {s.name: s for s in kept.got}
    assert set(by_name) == {"run 0 kickoff", "invoke_workflow Article"}
    root, first = by_name["invoke_workflow Article"], by_name["run 0 kickoff"]
    assert root.parent is None and first.parent is not None
    assert format(first.parent.span_id, "016x") == traces.root_span_id(UID)
    assert format(first.context.trace_id, "032x") == traces.trace_id(UID)
    assert (first.end_time or 0) - (first.start_time or 0) == 4_000_000_000
    assert out.drops.exported == 2


def test_an_end_in_whole_seconds_is_the_writes_time_within_that_second() -> None:
    import datetime as dt

    before = {"phase": "Running", "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z")]}
    after = {"phase": "Running", "runs": [run(0, "kickoff", "2026-11-28T10:00:01Z", "2026-11-28T10:00:05Z")]}
    at = dt.datetime(2026, 11, 28, 10, 0, 5, 600000, tzinfo=dt.UTC)
    assert spans_of(META, before, after, at)[0].end == at
    late = at + dt.timedelta(seconds=30)  # a write long after: the status's second stands
    assert spans_of(META, before, after, late)[0].end == dt.datetime(2026, 11, 28, 10, 0, 5, tzinfo=dt.UTC)
