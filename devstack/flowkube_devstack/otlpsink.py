"""A collector stand-in for the unit tests: ``POST /v1/traces`` (OTLP/HTTP, protobuf) kept in memory.

The local stack runs a real trace backend (Jaeger, ``jaeger.py``); the unit tests that run a runner
process without a cluster read its spans here, decoded with OpenTelemetry's own protobuf classes.
``stall()`` makes it take requests and never answer (a collector that hangs), ``refuse()`` answer 503.
"""

from __future__ import annotations

import gzip
import http.server
import threading
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class SpanSeen:
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    resource: dict[str, Any]
    status: int
    events: list[str] = field(default_factory=list)


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(body: bytes) -> list[SpanSeen]:
    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    spans: list[SpanSeen] = []
    for rs in request.resource_spans:
        resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                spans.append(SpanSeen(
                    trace_id=s.trace_id.hex(), span_id=s.span_id.hex(), parent_id=s.parent_span_id.hex(),
                    name=s.name, start_ns=s.start_time_unix_nano, end_ns=s.end_time_unix_nano,
                    attributes={kv.key: _value(kv.value) for kv in s.attributes}, resource=resource,
                    status=s.status.code, events=[e.name for e in s.events]))
    return spans


class OtlpSink:
    def __init__(self, host: str = "127.0.0.1") -> None:
        self._lock = threading.Lock()
        self._spans: list[SpanSeen] = []
        self._mode = "ok"
        self._release = threading.Event()
        sink = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *_args: Any) -> None:
                return

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if sink._mode == "stall":
                    sink._release.wait()
                    return
                if sink._mode == "refuse" or self.path != "/v1/traces":
                    self.send_response(503 if sink._mode == "refuse" else 404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                with sink._lock:
                    sink._spans.extend(decode(body))
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

        self._server = http.server.ThreadingHTTPServer((host, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{host}:{self._server.server_address[1]}/v1/traces"
        threading.Thread(target=self._server.serve_forever, name="otlp-sink", daemon=True).start()

    def spans(self) -> list[SpanSeen]:
        with self._lock:
            return list(self._spans)

    def stall(self) -> None:
        self._mode = "stall"

    def refuse(self) -> None:
        self._mode = "refuse"

    def close(self) -> None:
        self._release.set()
        self._server.shutdown()
        self._server.server_close()
