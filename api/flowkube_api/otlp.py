"""Span export shared by the operator and the runner: OpenTelemetry's SDK (its batch processor and
OTLP/HTTP exporter), bounded so that a slow or dead collector never holds up a Flow, and counted
so that what was lost is a metric, not a guess.

- ``SpanQueue``: the SDK's ``BatchSpanProcessor`` (a bounded queue its own thread drains); ``on_end``
  only appends, so a span's end never waits for the network. A span that finds the queue full is
  dropped (the SDK drops the oldest) and counted ``queue_full``; a batch the exporter could not
  deliver is counted ``export_failed``; what is still queued when a process must end within its
  deadline is counted ``unflushed`` (``close``).
- ``Shaped``: the exporter between the two: it names spans as the GenAI conventions do
  (``chat gpt-4o``, ``invoke_agent Writer``, ``execute_tool search``, ``invoke_workflow Article``; a
  Flow method's ``method draft``),
  removes message content unless asked to keep it, and lets its owner add attributes it knows
  better (a call's exact tokens and cost, keyed by crewAI's call id).

Imported only where tracing is on: this is the one module of the API package that needs the SDK.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.util.types import AttributeValue

# Attributes that carry what people and models wrote: kept out of spans unless content is wanted.
CONTENT_ATTRIBUTES = frozenset({
    "gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.system_instructions",
    "gen_ai.tool.call.arguments", "gen_ai.tool.call.result", "gen_ai.tool.definitions",
    "crewai.crew.inputs", "crewai.crew.output", "crewai.flow.inputs", "crewai.flow.result",
    "crewai.human_feedback.feedback", "crewai.human_feedback.message", "crewai.method.params",
    "crewai.method.result", "crewai.method.state", "crewai.task.output", "crewai.task.description",
    "crewai.task.expected_output", "crewai.knowledge.query", "crewai.knowledge.retrieved_knowledge",
    "crewai.knowledge.task_prompt", "crewai.memory.content", "crewai.memory.query", "crewai.memory.results",
    "crewai.memory.value", "crewai.memory.metadata", "crewai.mcp.tool_args", "crewai.mcp.tool_result",
    "crewai.reasoning.plan", "crewai.guardrail.error", "crewai.llm.available_functions",
    "crewai.tool.failure.message", "input.value", "output.value",
})

# gen_ai.operation.name -> the attribute naming what the operation acts on (its span's name).
_TARGETS = {
    "chat": "gen_ai.request.model",
    "invoke_agent": "gen_ai.agent.name",
    "execute_tool": "gen_ai.tool.name",
    "invoke_workflow": "gen_ai.workflow.name",
}

DROP_REASONS = ("queue_full", "export_failed", "unflushed")


class Drops:
    """Spans lost, by reason, and spans exported (thread-safe); ``listener`` hears each change
    (``"exported"`` or the reason, and how many), e.g. a Prometheus counter."""

    def __init__(self, listener: Callable[[str, int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(DROP_REASONS, 0)
        self.exported = 0
        self._listener = listener

    def add(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self._counts[reason] += n
        if self._listener is not None:
            self._listener(reason, n)

    def add_exported(self, n: int) -> None:
        with self._lock:
            self.exported += n
        if self._listener is not None:
            self._listener("exported", n)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


def span_name(name: str, attributes: Mapping[str, Any]) -> str:
    """``{gen_ai.operation.name} {target}`` for a GenAI operation's span, else its own name."""
    operation = attributes.get("gen_ai.operation.name")
    target = attributes.get(_TARGETS.get(str(operation), ""))
    if operation in _TARGETS and target:
        return f"{operation} {target}"
    method = attributes.get("crewai.method.name")
    return f"method {method}" if method else name


class Shaped(SpanExporter):
    """Renames, strips content, overlays what ``extra`` says, counts, then hands on to ``inner``."""

    def __init__(self, inner: SpanExporter, drops: Drops, *, content: bool = False,
                 extra: Callable[[ReadableSpan], Mapping[str, AttributeValue] | None] | None = None) -> None:
        self._inner, self.drops, self._content, self._extra = inner, drops, content, extra
        self.in_flight = 0  # spans handed to the inner exporter and not yet answered
        self.failing = False  # the last export failed: the collector is down or refuses

    def shape(self, span: ReadableSpan) -> ReadableSpan:
        attributes: dict[str, AttributeValue] = {
            k: v for k, v in (span.attributes or {}).items() if self._content or k not in CONTENT_ATTRIBUTES}
        if self._extra is not None:
            attributes.update(self._extra(span) or {})
        return ReadableSpan(
            name=span_name(span.name, attributes), context=span.context, parent=span.parent,
            resource=span.resource, attributes=attributes,
            events=span.events if self._content else [e for e in span.events if e.name == "exception"],
            links=span.links, kind=span.kind, status=span.status, start_time=span.start_time,
            end_time=span.end_time, instrumentation_scope=span.instrumentation_scope)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.in_flight = len(spans)
        try:
            result = self._inner.export([self.shape(s) for s in spans])
        except Exception:  # an exporter must not raise; if it does, the batch is lost all the same
            result = SpanExportResult.FAILURE
        finally:
            self.in_flight = 0
        self.failing = result is not SpanExportResult.SUCCESS
        if result is SpanExportResult.SUCCESS:
            self.drops.add_exported(len(spans))
        else:
            self.drops.add("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class SpanQueue(BatchSpanProcessor):
    """The SDK's batch processor, counting the spans a full queue drops.

    The SDK (1.45) drops the oldest span when its queue is full and says so only in a log; whether
    the queue is full is read from the processor's own queue (private: tests/unit/api/test_otlp.py
    pins it to the SDK version in use)."""

    def __init__(self, exporter: Shaped, *, max_queue_size: int, schedule_delay_millis: float) -> None:
        super().__init__(exporter, max_queue_size=max_queue_size, schedule_delay_millis=schedule_delay_millis,
                         max_export_batch_size=min(512, max_queue_size))
        self.exporter, self.drops = exporter, exporter.drops

    def queued(self) -> int:
        return len(self._batch_processor._queue)

    def on_end(self, span: ReadableSpan) -> None:
        if span.context is None or not span.context.trace_flags.sampled:
            return
        if self.queued() >= self._batch_processor._max_queue_size:
            self.drops.add("queue_full")
        super().on_end(span)

    def close(self, deadline: float) -> None:
        """Export what is queued within ``deadline`` seconds (on a thread of its own: the SDK's
        flush takes no timeout), then stop; what is left is counted ``unflushed``. Never longer, and
        not at all while the collector fails or an export hangs: the process ends at once."""
        done = threading.Event()
        if self.exporter.failing or self.exporter.in_flight:
            deadline = 0.0

        def flush() -> None:
            try:
                self.force_flush()
            finally:
                done.set()

        threading.Thread(target=flush, name="flowkube-span-flush", daemon=True).start()
        if not done.wait(deadline):
            left = self.queued() + self.exporter.in_flight
            if left:
                self.drops.add("unflushed", left)
        self._batch_processor._shutdown = True  # no export after this: the process is ending
        self._batch_processor._worker_awaken.set()
