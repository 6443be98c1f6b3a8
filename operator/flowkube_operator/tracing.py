"""The operator's side of a Flow's one trace (tracing on when an OTLP endpoint is configured).

``Traces`` takes the spans ``flows.spans`` reads off each status write and exports them whole, with
their derived ids and their own times (so no span outlives a process, and a failover re-makes
none), through the SDK's batch processor and OTLP/HTTP exporter (``flowkube_api.otlp``: bounded,
never blocking the reconcile, losses counted in ``flowkube_operator_trace_spans_total``). The
exporter reads the standard ``OTEL_EXPORTER_OTLP_*`` settings (headers, timeout, compression,
certificate); the runner pods get only the traces URL (``Settings.runner_traces_url``).
"""

from __future__ import annotations

import datetime as dt
import logging

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Status, StatusCode

from flowkube_api.otlp import Drops, Shaped, SpanQueue
from flowkube_api.traces import SpanRecord
from flowkube_operator import selfmetrics

log = logging.getLogger("flowkube.tracing")

QUEUE_SPANS = 4096
SCHEDULE_DELAY_MS = 1000
SCOPE = InstrumentationScope("flowkube-operator")


def _ns(t: dt.datetime) -> int:
    return int(t.timestamp() * 1e9)


class Traces:
    def __init__(self, url: str, *, resource: dict[str, str] | None = None,
                 exporter: SpanExporter | None = None) -> None:
        self.drops = Drops(lambda result, n: selfmetrics.TRACE_SPANS.labels("operator", result).inc(n))
        self._resource = Resource({"service.name": "flowkube-operator", **(resource or {})})
        self.queue = SpanQueue(Shaped(exporter or OTLPSpanExporter(endpoint=url), self.drops),
                               max_queue_size=QUEUE_SPANS, schedule_delay_millis=SCHEDULE_DELAY_MS)

    def emit(self, records: list[SpanRecord]) -> None:
        for r in records:
            flags = trace.TraceFlags(trace.TraceFlags.SAMPLED)
            context = trace.SpanContext(int(r.trace_id, 16), int(r.span_id, 16), is_remote=False, trace_flags=flags)
            parent = (trace.SpanContext(int(r.trace_id, 16), int(r.parent_id, 16), is_remote=True, trace_flags=flags)
                      if r.parent_id else None)
            status = Status(StatusCode.ERROR, r.error) if r.error is not None else Status(StatusCode.UNSET)
            self.queue.on_end(ReadableSpan(
                name=r.name, context=context, parent=parent, resource=self._resource, attributes=r.attributes,
                kind=trace.SpanKind.INTERNAL, status=status, start_time=_ns(r.start), end_time=_ns(max(r.end, r.start)),
                instrumentation_scope=SCOPE))

    def runner_lost(self, spans: int) -> None:
        """A runner pod's run ended with ``spans`` of its spans lost (its report says so)."""
        if spans:
            selfmetrics.TRACE_SPANS.labels("runner", "lost").inc(spans)

    def close(self, deadline: float = 2.0) -> None:
        self.queue.close(deadline)
