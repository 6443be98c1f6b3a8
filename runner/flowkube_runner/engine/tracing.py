"""A run's spans, in the Flow's one trace (on when the operator gives the pod a traceparent and an
OTLP endpoint).

crewAI's own GenAI-convention tracer (``crewai.telemetry.tracing``: an event-bus listener that makes
``invoke_workflow`` / method / ``invoke_agent`` / ``execute_tool`` / ``chat`` spans with
``gen_ai.*`` attributes, usage included) makes the spans; flowkube gives it what it lacks:

- **the parent**: crewAI starts a new trace per execution (a resume only links to the paused one).
  Each step (the run's first, and each warm step of the same pod) opens crewAI's session with its
  root preset to the run's span (``FLOWKUBE_TRACEPARENT``: the Flow's trace id and the span id of
  ``status.runs[i]``, both derived from the Flow's uid), so every pod, resume, retry and turn of a
  Flow lands in one trace under the operator's run spans;
- **exact usage and cost** on each ``chat`` span: the recorder's figures for that call (crewAI
  reads the same answer, but a call answered then failed inside crewAI has none in its span), and
  ``flowkube.usage.cost`` (USD, as status counts it);
- **span names, content and bounds** (``flowkube_api.otlp``): GenAI names, message content left out
  unless ``FLOWKUBE_TRACES_CONTENT`` is true, a bounded queue that never blocks a call, drops
  counted and reported (``RunReport.traceDroppedSpans``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from decimal import Decimal
from typing import Any

from crewai.telemetry.tracing.session import telemetry_session
from crewai.types.usage_metrics import UsageMetrics
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.util.types import AttributeValue

from flowkube_api import traces
from flowkube_api.otlp import Drops, Shaped, SpanQueue

log = logging.getLogger("flowkube_runner")

QUEUE_SPANS = 2048  # a run's spans waiting for export at most; past it the oldest are dropped (counted)
SCHEDULE_DELAY_MS = 500  # how often the queue is sent: a pod lost at once loses at most this much
EXPORT_TIMEOUT_S = 5.0  # one export's deadline, retries included
CLOSE_SECONDS = 1.0  # what the pod's end waits for the last spans at most
CALLS_KEPT = 4096  # per-call usage kept for the spans not yet exported


class _Providers:
    """What crewAI's session takes as ``providers``: this step's tracer provider, and a flush and
    shutdown that do nothing (the queue is the run's, closed once, with a deadline, at its end)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.tracer_provider = provider

    def get_tracer(self, name: str | None = None) -> trace.Tracer:
        return self.tracer_provider.get_tracer(name or "crewai")

    def flush(self, timeout_millis: int = 0) -> bool:
        return True

    def shutdown(self, timeout_millis: int = 0) -> None:
        return None

    def emit_log(self, *args: Any, **kwargs: Any) -> None:
        return None


class RunTracer:
    """The run's spans: one queue for the pod's life, one crewAI session per step."""

    def __init__(self, parent: str, *, endpoint: str = "", content: bool = False,
                 resource: Mapping[str, str] | None = None, exporter: SpanExporter | None = None) -> None:
        parsed = traces.parse_traceparent(parent)
        if parsed is None:
            raise ValueError(f"not a W3C traceparent: {parent[:80]!r}")
        self.trace_id, self.span_id = parsed
        self._resource = Resource({"service.name": "flowkube-runner", **(resource or {})})
        self._lock = threading.Lock()
        self._calls: OrderedDict[str, dict[str, AttributeValue]] = OrderedDict()
        self.drops = Drops()
        inner = exporter or OTLPSpanExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
        self.queue = SpanQueue(Shaped(inner, self.drops, content=content, extra=self._exact),
                               max_queue_size=QUEUE_SPANS, schedule_delay_millis=SCHEDULE_DELAY_MS)

    def counted(self, call_id: str, metrics: UsageMetrics, cost: Decimal | None) -> None:
        """The recorder counted a call: its span says these figures (the Flow's status counts them)."""
        if not call_id:
            return
        figures: dict[str, AttributeValue] = {
            "gen_ai.usage.input_tokens": metrics.prompt_tokens,
            "gen_ai.usage.output_tokens": metrics.completion_tokens,
            "flowkube.usage.total_tokens": metrics.total_tokens}
        if cost is not None:
            figures["flowkube.usage.cost"] = str(cost)
        with self._lock:
            self._calls[call_id] = figures
            while len(self._calls) > CALLS_KEPT:
                self._calls.popitem(last=False)

    def _exact(self, span: ReadableSpan) -> Mapping[str, AttributeValue] | None:
        attributes = span.attributes or {}
        if attributes.get("gen_ai.operation.name") != "chat":
            return None
        with self._lock:
            return self._calls.pop(str(attributes.get("crewai.llm.call_id") or ""), None)

    @contextmanager
    def step(self, kickoff_id: str, flow_name: str, attributes: Mapping[str, AttributeValue]) -> Iterator[None]:
        """One step's crewAI session, its spans under the run's span."""
        provider = TracerProvider(resource=self._resource, shutdown_on_exit=False)
        # Runner pods set OTEL_SDK_DISABLED (crewAI's anonymous telemetry, and a Flow's own SDK use, stay
        # off), which makes every SDK provider record nothing. The Flow's trace is the operator's to
        # turn on: this provider records. The SDK's only switch is this attribute (crewAI's own tracer
        # sets it the same way); test_runner_traces runs with the variable set and pins it.
        provider._disabled = False
        provider.add_span_processor(self.queue)
        run = trace.NonRecordingSpan(trace.SpanContext(
            trace_id=int(self.trace_id, 16), span_id=int(self.span_id, 16), is_remote=True,
            trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED)))
        with telemetry_session(kickoff_id, flow_name, providers=_Providers(provider),
                               attributes=dict(attributes)) as ctx:
            ctx.root_span = run  # parentless events (the flow's start) become the run span's children
            yield

    def close(self) -> dict[str, int]:
        """At the pod's end: the last spans sent within CLOSE_SECONDS; the spans lost, by reason."""
        self.queue.close(CLOSE_SECONDS)
        return self.drops.counts()
