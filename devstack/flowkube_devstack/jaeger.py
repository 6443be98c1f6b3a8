"""The local stack's trace backend: Jaeger v2 (built from its Go module, `build.jaeger`), a host
process that takes OTLP/HTTP on the cluster's host address and keeps traces in memory.

Pods reach it through a Service of the host (``LocalCluster.host_service``): the operator and the
runner pods export to ``http://jaeger.flowkube-dev.svc`` (OTLP/HTTP, port 80 to the host's 4318), and
the tests and ``./dev demo`` read traces back through Jaeger's query API
(``GET /api/traces/{traceId}``) on the host. The Go module carries no web UI (its assets are a
separate JavaScript build): the query API is what there is.

Its config is written per stack (each lane's cluster has its own host address), not Jaeger's
all-in-one default, which binds fixed ports on every interface.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowkube_devstack import build, procs
from flowkube_devstack.cluster import LocalCluster

OTLP_PORT = 4318
QUERY_PORT = 16686
NAMESPACE = "flowkube-dev"

CONFIG = """\
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
    logs:
      level: warn
extensions:
  jaeger_query:
    storage:
      traces: mem
    http:
      endpoint: {host}:{query}
    grpc:
      endpoint: {host}:{grpc}
  jaeger_storage:
    backends:
      mem:
        memory:
          max_traces: 20000
receivers:
  otlp:
    protocols:
      http:
        endpoint: {host}:{otlp}
exporters:
  jaeger_storage_exporter:
    trace_storage: mem
"""


@dataclass(frozen=True)
class Span:
    """A span as Jaeger's query API returns it."""

    span_id: str
    parent_id: str
    name: str
    service: str
    start_us: int
    duration_us: int
    tags: dict[str, Any]

    @property
    def end_us(self) -> int:
        return self.start_us + self.duration_us


class Jaeger:
    def __init__(self, root: Path, host: str) -> None:
        self.root, self.host = root, host
        self.proc: subprocess.Popen[bytes] | None = None
        self.query = f"http://{host}:{QUERY_PORT}"
        self.otlp = f"http://{host}:{OTLP_PORT}"
        self.endpoint = ""  # the OTLP base URL pods use (``beside``): the chart's tracing.endpoint

    @classmethod
    def beside(cls, cluster: LocalCluster, root: Path | None = None) -> Jaeger:
        """Started on the cluster's host address, and a Service of the cluster in front of it."""
        jaeger = cls(root or cluster.root / "jaeger", cluster.host_ip).start()
        jaeger.endpoint = cluster.host_service("jaeger", NAMESPACE, OTLP_PORT)
        return jaeger

    def start(self, timeout: float = 60.0) -> Jaeger:
        binary = build.ensure(build.jaeger()) / "jaeger"
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "jaeger.yaml"
        config.write_text(CONFIG.format(host=self.host, query=QUERY_PORT, grpc=QUERY_PORT - 1, otlp=OTLP_PORT))
        self.proc = procs.spawn("jaeger", [str(binary), "--config", str(config)], root=self.root)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jaeger exited ({self.proc.returncode}): "
                                   f"{procs.log_path(self.root, 'jaeger').read_text()[-2000:]}")
            if self.ready():
                return self
            time.sleep(0.1)
        raise TimeoutError(f"jaeger not ready within {timeout:.0f}s")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.query}/api/services", timeout=2) as r:
                return bool(r.status == 200)
        except (OSError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        if self.proc is not None:
            procs.terminate(self.proc)
            self.proc = None

    def spans(self, trace_id: str) -> list[Span]:
        return read_spans(self.query, trace_id)


def read_spans(query: str, trace_id: str) -> list[Span]:
    """Every span the Jaeger at ``query`` has of the trace (none yet: an empty list)."""
    try:
        with urllib.request.urlopen(f"{query}/api/traces/{trace_id}", timeout=5) as r:
            data = json.load(r).get("data") or []
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return []
        raise
    out: list[Span] = []
    for t in data:
        processes = t.get("processes") or {}
        for s in t.get("spans") or []:
            parent = next((ref["spanID"] for ref in s.get("references") or [] if ref.get("refType") == "CHILD_OF"), "")
            out.append(Span(span_id=s["spanID"], parent_id=parent, name=s["operationName"],
                            service=str((processes.get(s.get("processID")) or {}).get("serviceName") or ""),
                            start_us=int(s["startTime"]), duration_us=int(s["duration"]),
                            tags={tag["key"]: tag["value"] for tag in s.get("tags") or []}))
    return out


def waterfall(spans: list[Span]) -> str:
    """A trace as indented text (what `./dev demo` prints: the Go module has no web UI)."""
    children: dict[str, list[Span]] = {}
    ids = {s.span_id for s in spans}
    for s in spans:
        children.setdefault(s.parent_id if s.parent_id in ids else "", []).append(s)
    start = min((s.start_us for s in spans), default=0)
    lines: list[str] = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda x: x.start_us):
            lines.append(f"{(s.start_us - start) / 1e6:8.2f}s {s.duration_us / 1e6:8.2f}s  {'  ' * depth}{s.name}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)
