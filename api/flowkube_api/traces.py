"""One trace per Flow: its ids, derived from the Flow's uid (standard library only).

Every process that writes a span of a Flow (the operator leading now, a runner pod, the next
leader after a failover) computes the same ids from the uid, so nothing has to be read or stored
before a span can be written: the trace id (``status.trace.traceId`` says it), the root span (the
Flow's whole life), the span of each run (``status.runs[i]``: its pod's spans are its children) and
of each wait for a person (a feedback request, by id). A Flow made again under the same name has a
new uid, so a new trace; a fork too.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import re
from dataclasses import dataclass, field

_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")


def _digest(*parts: str) -> bytes:
    return hashlib.sha256("/".join(("flowkube", "trace", *parts)).encode()).digest()


def _nonzero(raw: bytes) -> str:
    """An id of ``raw``'s length; all zeros is invalid in W3C trace context (never hit in practice)."""
    return raw.hex() if any(raw) else (b"\x01" + raw[1:]).hex()


def trace_id(uid: str) -> str:
    """The Flow's trace id: 32 hex digits."""
    return _nonzero(_digest(uid)[:16])


def span_id(uid: str, *path: str) -> str:
    """A span of the Flow named by ``path``: 16 hex digits."""
    return _nonzero(_digest(uid, *path)[:8])


def root_span_id(uid: str) -> str:
    return span_id(uid, "root")


def run_span_id(uid: str, index: int) -> str:
    return span_id(uid, "run", str(index))


def wait_span_id(uid: str, request_id: str) -> str:
    return span_id(uid, "wait", request_id)


def traceparent(trace: str, span: str) -> str:
    """W3C trace context's ``traceparent`` (version 00, sampled)."""
    return f"00-{trace}-{span}-01"


def parse_traceparent(value: str) -> tuple[str, str] | None:
    """(trace id, span id) of a ``traceparent``, or None when it is not one (or an id is all zeros)."""
    m = _TRACEPARENT.match(value.strip().lower())
    if m is None or set(m.group(1)) == {"0"} or set(m.group(2)) == {"0"}:
        return None
    return m.group(1), m.group(2)


Value = str | int | float | bool


@dataclass(frozen=True)
class SpanRecord:
    """A span made whole, with the ids above and its own times (the operator's: a run, a wait, a
    notification's delivery, the Flow), for whatever exports it."""

    name: str
    trace_id: str
    span_id: str
    parent_id: str | None  # None: the trace's root
    start: dt.datetime
    end: dt.datetime
    attributes: dict[str, Value] = field(default_factory=dict)
    error: str | None = None  # the status message of a span that failed
