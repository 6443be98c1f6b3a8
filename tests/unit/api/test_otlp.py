"""A Flow's trace ids (traces.py) and the span export both sides share (otlp.py)."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from flowkube_api import traces
from flowkube_api.otlp import Drops, Shaped, SpanQueue, span_name


def test_a_flows_ids_are_its_uids_alone_and_valid_w3c_ids() -> None:
    uid, other = "3f1c-uid", "3f1c-uid2"
    assert traces.trace_id(uid) == traces.trace_id(uid) != traces.trace_id(other)
    assert len(traces.trace_id(uid)) == 32 and len(traces.run_span_id(uid, 0)) == 16
    spans = {traces.root_span_id(uid), traces.run_span_id(uid, 0), traces.run_span_id(uid, 1),
             traces.wait_span_id(uid, "req-1"), traces.wait_span_id(uid, "req-2")}
    assert len(spans) == 5
    parent = traces.traceparent(traces.trace_id(uid), traces.run_span_id(uid, 3))
    assert traces.parse_traceparent(parent) == (traces.trace_id(uid), traces.run_span_id(uid, 3))
    for bad in ("", "00-xyz", f"00-{'0' * 32}-{'1' * 16}-01", f"00-{'1' * 32}-{'0' * 16}-01",
                f"00-{'1' * 32}-{'1' * 16}-01-extra"):
        assert traces.parse_traceparent(bad) is None, bad


def span(name: str, attributes: dict[str, object], i: int = 1) -> ReadableSpan:
    context = trace.SpanContext(trace_id=7, span_id=i, is_remote=False,
                                trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return ReadableSpan(name=name, context=context, attributes=attributes,  # type: ignore[arg-type]
                        start_time=1, end_time=2)


class Held(SpanExporter):
    """An exporter that keeps what it gets, or blocks until released (a collector that hangs)."""

    def __init__(self, *, block: bool = False, result: SpanExportResult = SpanExportResult.SUCCESS) -> None:
        self.got: list[ReadableSpan] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.block, self.result = block, result

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.entered.set()
        if self.block:
            self.release.wait()
        self.got.extend(spans)
        return self.result

    def shutdown(self) -> None:
        self.release.set()


def test_spans_take_the_genai_names_lose_their_content_and_carry_the_exact_figures() -> None:
    assert span_name("call llm", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "gpt-4o"}) == "chat gpt-4o"
    assert span_name("execute agent", {"gen_ai.operation.name": "invoke_agent", "gen_ai.agent.name": "W"}) == (
        "invoke_agent W")
    assert span_name("call method", {"crewai.method.name": "draft"}) == "method draft"
    assert span_name("other", {}) == "other"
    inner = Held()
    shaped = Shaped(inner, Drops(), extra=lambda s: {"flowkube.usage.cost": "0.5"})
    chat = span("call llm", {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                             "gen_ai.input.messages": "secret prompt", "gen_ai.output.messages": "secret answer",
                             "gen_ai.usage.input_tokens": 3})
    assert shaped.export([chat]) is SpanExportResult.SUCCESS
    (out,) = inner.got
    assert out.name == "chat m" and out.context == chat.context
    assert dict(out.attributes or {}) == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "m",
                                          "gen_ai.usage.input_tokens": 3, "flowkube.usage.cost": "0.5"}
    kept = Held()
    Shaped(kept, Drops(), content=True).export([chat])
    assert (kept.got[0].attributes or {})["gen_ai.input.messages"] == "secret prompt"


def test_a_full_queue_drops_and_counts_a_failing_export_counts_and_the_end_never_waits_on_a_hung_collector() -> None:
    hung = Held(block=True)
    drops = Drops()
    queue = SpanQueue(Shaped(hung, drops), max_queue_size=2, schedule_delay_millis=10)
    queue.on_end(span("first", {}, 1))
    assert hung.entered.wait(10), "the first span goes out (and the export hangs)"
    for i in range(2, 7):  # two fit the queue; three find it full
        queue.on_end(span(f"s{i}", {}, i))
    assert drops.counts()["queue_full"] == 3
    queue.close(0.2)  # returns although the export hangs: what is queued or in flight is lost, counted
    assert drops.counts() == {"queue_full": 3, "export_failed": 0, "unflushed": 3}
    hung.release.set()

    refused = Drops()
    failing = SpanQueue(Shaped(Held(result=SpanExportResult.FAILURE), refused), max_queue_size=8,
                        schedule_delay_millis=10)
    for i in range(1, 4):
        failing.on_end(span(f"s{i}", {}, i))
    failing.close(5)
    assert refused.counts()["export_failed"] == 3 and refused.exported == 0
