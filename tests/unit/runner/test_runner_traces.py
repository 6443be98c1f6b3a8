"""A run's spans, through ``python -m flowkube_runner`` (forked runner processes, as in a pod) to an
OTLP/HTTP receiver: one trace for a Flow's pause and resume in two processes, under the run spans
the operator names, with the GenAI names and the stub's exact usage, no message content, and a
collector that refuses or hangs costing the run nothing but the spans (counted)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from flowkube_api import constants as c
from flowkube_api import traces
from flowkube_api.otlp import CONTENT_ATTRIBUTES
from flowkube_devstack.otlpsink import OtlpSink, SpanSeen
from flowkube_devstack.stubmodel import StubModel, ledger_usage
from tests.unit.runner.test_runner_flows import MODEL, Harness, article_definition, paused, succeeded

pytestmark = pytest.mark.slow

UID = "0b7f5a8e-8f0e-4c55-9a59-3c1f3e2d9c11"


@pytest.fixture
def sink() -> Iterator[OtlpSink]:
    s = OtlpSink()
    yield s
    s.close()


def traced(sink: OtlpSink, run_index: int) -> dict[str, str]:
    return {c.ENV_TRACEPARENT: traces.traceparent(traces.trace_id(UID), traces.run_span_id(UID, run_index)),
            c.ENV_TRACES_ENDPOINT: sink.url}


def spans_until(sink: OtlpSink, done: int) -> list[SpanSeen]:
    """The runs' spans: each run exports its last ones before it ends, so they are here by now."""
    spans = sink.spans()
    assert len({s.span_id for s in spans}) == len(spans), "no span twice"
    assert sum(1 for s in spans if s.attributes.get("gen_ai.operation.name") == "invoke_workflow") == done, (
        [s.name for s in spans])
    return spans


def test_a_pause_and_its_resume_in_two_processes_are_one_trace_with_the_exact_usage(
        harness: Harness, stub: StubModel, sink: OtlpSink) -> None:
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec, extra_env=traced(sink, 0)))
    assert first.feedback_request is not None
    second = paused(harness.run(c.Trigger.RESUME, spec, extra_env=traced(sink, 1),
                                feedback={"requestId": first.feedback_request.id, "text": "LGTM"}))
    spans = spans_until(sink, 2)
    assert first.spans_lost is not None and first.spans_lost.model_dump() == {
        "queue_full": 0, "export_failed": 0, "unflushed": 0}
    assert second.spans_lost is not None and not any(second.spans_lost.model_dump().values())

    # One trace, the Flow's; each process's workflow span is a child of its run's span.
    assert {s.trace_id for s in spans} == {traces.trace_id(UID)}
    workflows = sorted((s for s in spans if s.attributes.get("gen_ai.operation.name") == "invoke_workflow"),
                       key=lambda s: s.start_ns)
    assert [w.parent_id for w in workflows] == [traces.run_span_id(UID, 0), traces.run_span_id(UID, 1)]
    assert [w.name for w in workflows] == ["invoke_workflow Article"] * 2
    ids = {s.span_id for s in spans} | {traces.run_span_id(UID, 0), traces.run_span_id(UID, 1)}
    assert all(s.parent_id in ids for s in spans), "every span hangs under a run"
    assert {s.resource["k8s.pod.name"] for s in spans} == {"demo-1", "demo-2"}

    # The model calls: GenAI names and attributes; their tokens sum to the stub's ledger and the reports.
    chats = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "chat"]
    assert chats and {s.name for s in chats} == {f"chat {MODEL}"}
    assert all(s.attributes["gen_ai.request.model"] == MODEL and s.attributes.get("gen_ai.provider.name")
               for s in chats)
    ledger = ledger_usage(stub.ledger())
    assert len(chats) == ledger.successful_requests
    assert sum(s.attributes["gen_ai.usage.input_tokens"] for s in chats) == ledger.prompt_tokens
    assert sum(s.attributes["gen_ai.usage.output_tokens"] for s in chats) == ledger.completion_tokens
    assert (first.usage + second.usage).total_tokens == ledger.total_tokens
    assert all("flowkube.usage.cost" in s.attributes for s in chats)
    agents = [s for s in spans if s.attributes.get("gen_ai.operation.name") == "invoke_agent"]
    assert agents and {s.name for s in agents} == {"invoke_agent Writer"}

    # No message content left the pod (the draft's text, the reviewer's answer).
    for s in spans:
        assert not CONTENT_ATTRIBUTES & s.attributes.keys(), (s.name, sorted(s.attributes))
        text = repr(s.attributes)
        assert "Operators reconcile" not in text and "LGTM" not in text, (s.name, text[:400])


@pytest.mark.parametrize("collector", ["refusing", "hanging"])
def test_a_collector_that_refuses_or_hangs_costs_the_run_only_its_spans_and_they_are_counted(
        harness: Harness, stub: StubModel, sink: OtlpSink, collector: str) -> None:
    spec = {"definition": article_definition()}
    (sink.refuse if collector == "refusing" else sink.stall)()
    report = paused(harness.run(c.Trigger.KICKOFF, spec, extra_env=traced(sink, 0)))
    assert report.usage == ledger_usage(stub.ledger())
    assert report.spans_lost is not None and sum(report.spans_lost.model_dump().values()) > 0, report.spans_lost
    assert not sink.spans()


def test_without_a_traceparent_a_run_makes_no_span_and_reports_none(
        harness: Harness, stub: StubModel, sink: OtlpSink) -> None:
    report = succeeded(harness.run(c.Trigger.KICKOFF, {"definition": {
        "schema": "crewai.flow/v1", "name": "Plain", "methods": {
            "only": {"start": True, "do": {"call": "expression", "expr": "'done'"}}}}},
        extra_env={c.ENV_TRACES_ENDPOINT: sink.url}))
    assert report.spans_lost is None and not sink.spans()
