"""Notifications, the pure part: which events a Flow's (or a FlowQuota's) status holds for which sink,
the bodies sent (CloudEvents 1.0, Slack), the signature, the retry schedule, the destination policy,
and how a delivery is recorded in ``status.notifications``. The bodies and their signature are
`bodies`', where the operator may send `policy`'s, the sending `notifier`'s.

Events are read off the status, level-based, like everything else the operator does: a Flow that
waits for an answer *has* a FeedbackRequested event (its id names the request), whoever looks; a
FlowQuota whose Exhausted condition is True *has* a QuotaExhausted event (its id names when the
condition turned True). Each
sink's record keeps the ids it is done with (`handled`), so an operator restart or a new leader sends
what is not recorded there, once, and nothing that is. The gap left is the moment between a
receiver's 2xx and the status write that records it: a crash there sends that one event again, with
the same id (at least once; receivers deduplicate by id).
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote

from flowkube_api import constants as c
from flowkube_api.base import parse_time
from flowkube_api.constants import NotificationEvent as E
from flowkube_api.constants import Phase, Reason
from flowkube_api.models import NotificationRecord
from flowkube_api.models.quota import FlowQuotaStatus

Body = dict[str, Any]

TEXT_LIMIT = 3000  # characters of one text in a body (Slack's limit for a section's text)
MESSAGE_LIMIT = 1024  # characters of status.notifications[].message


# -- sinks ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sink:
    """One place to send to: a Flow's spec.notifications[] entry, or a namespace default (a Secret
    labelled flowkube.io/notifications=defaults, whose data names its events and format)."""

    name: str
    secret: str
    events: frozenset[E] = frozenset(c.DEFAULT_NOTIFICATION_EVENTS)
    format: str = "cloudevents"
    url_key: str = "url"
    signing_key_key: str = "signingKey"
    ca_key: str = "ca"


def default_sink(name: str, data: Mapping[str, bytes]) -> Sink | None:
    """A namespace default from its Secret's data (`url`, `format`, `events`, `signingKey`, `ca`);
    None when ``format`` or ``events`` name something unknown (the Secret is ignored and logged)."""
    fmt = data.get("format", b"cloudevents").decode(errors="replace").strip() or "cloudevents"
    names = [e.strip() for e in data.get("events", b"").decode(errors="replace").split(",") if e.strip()]
    if fmt not in ("cloudevents", "slack") or any(n not in E.__members__.values() for n in names):
        return None
    events = frozenset(E(n) for n in names) or frozenset(c.DEFAULT_NOTIFICATION_EVENTS)
    return Sink(name=name, secret=name, events=events, format=fmt)


# -- the Secrets, as kept ---------------------------------------------------------------------------------

# What the operator keeps of a labelled Secret (every replica keeps every one): the values a sink can
# use, each bounded, and nothing else. A sink names its keys (spec.notifications[].secretRef's urlKey,
# signingKeyKey, caKey, any names), so which key is which is known only at delivery; the bounds go by
# the value instead. A value of at most VALUE_BYTES is kept (a URL of a few KiB, a signing key,
# `format`, `events`); one PEM value of at most CA_BYTES is kept (the CA bundle); a larger value is kept
# as its key's name only, and a delivery that uses that key ends Misconfigured at once, naming the key
# and the bound. At most KEYS_KEPT keys are kept, the names the defaults use first (url, signingKey,
# ca, format, events), then by name. So one Secret costs at most KEYS_KEPT * VALUE_BYTES + CA_BYTES
# (96 KiB), whatever it holds; annotations, managedFields and the other keys are never kept.
VALUE_BYTES = 4 * 1024
CA_BYTES = 64 * 1024
KEYS_KEPT = 8
# Labelled Secrets kept whole (as above) per namespace; beyond, each is a marker of its name (its
# deliveries end Misconfigured, naming the bound) until an update finds room. A namespace's quota on
# Secrets is its admin's choice, not the operator's: the bound is here.
SECRETS_PER_NAMESPACE = 64
DEFAULT_KEYS = ("url", "signingKey", "ca", "format", "events")


@dataclass(frozen=True)
class SecretView:
    """A labelled Secret as kept (`project`): its bounded values, and the keys too large to keep."""

    data: Mapping[str, bytes] = field(default_factory=dict)
    default: Sink | None = None  # the sink it makes for every Flow of its namespace (label `defaults`)
    oversized: Mapping[str, int] = field(default_factory=dict)  # key -> the bound its value is over
    dropped: int = 0  # keys beyond KEYS_KEPT, not kept
    refused: str = ""  # why nothing of it is kept (the namespace's bound): its deliveries say this

    def problem(self, secret: str, key: str) -> str | None:
        """Why a delivery cannot use ``key`` of this Secret (a message naming the Secret, the key and
        the bound, never a value), or None."""
        if self.refused:
            return self.refused
        if key in self.oversized:
            return (f"key {key} of Secret {secret} is over {self.oversized[key]} bytes (the operator keeps "
                    f"values of up to {VALUE_BYTES} bytes, and one PEM CA bundle of up to {CA_BYTES}): not used")
        return None

    def missing(self, secret: str, key: str) -> str:
        more = f" among the {KEYS_KEPT} keys kept of it ({self.dropped} more are not)" if self.dropped else ""
        return f"Secret {secret} has no key {key}{more}"


def _decoded_size(value: str) -> int:
    return len(value) * 3 // 4 - value[-2:].count("=")


def _looks_pem(raw: bytes) -> bool:
    return raw.lstrip()[:11] == b"-----BEGIN "


def project(name: str, label: str, data: Mapping[str, Any]) -> SecretView:
    """A labelled Secret's ``data`` (base64 strings, as the API sends them) as kept: see VALUE_BYTES.
    A value's size is read off its base64 length, so no oversized value is ever decoded."""
    kept: dict[str, bytes] = {}
    oversized: dict[str, int] = {}
    dropped, ca_kept = 0, False
    for key in sorted(data, key=lambda k: (k not in DEFAULT_KEYS, k)):
        value = data[key]
        if not isinstance(value, str):
            continue
        if len(kept) + len(oversized) >= KEYS_KEPT:
            dropped += 1
            continue
        size = _decoded_size(value)
        if size > CA_BYTES or (size > VALUE_BYTES and ca_kept):
            oversized[key] = CA_BYTES if size > CA_BYTES else VALUE_BYTES
            continue
        try:
            raw = base64.b64decode(value, validate=True)
        except (binascii.Error, ValueError):
            continue
        if len(raw) > VALUE_BYTES:
            if not _looks_pem(raw):
                oversized[key] = VALUE_BYTES
                continue
            ca_kept = True
        kept[key] = raw
    default = default_sink(name, kept) if label == c.NOTIFICATION_DEFAULTS and not (
        {"format", "events"} & oversized.keys()) else None
    return SecretView(kept, default, oversized, dropped)


def crowded(namespace: str, name: str) -> SecretView:
    """The marker of a labelled Secret beyond SECRETS_PER_NAMESPACE in its namespace."""
    return SecretView(refused=f"namespace {namespace} has more than {SECRETS_PER_NAMESPACE} Secrets labelled "
                              f"{c.LABEL_NOTIFICATIONS}: Secret {name} is not kept (delete some, then update it)")


def sinks_of(spec: Body, defaults: Iterable[Sink]) -> list[Sink]:
    """The Flow's sinks: its namespace's defaults, each replaced by a spec entry of the same name."""
    out = {s.name: s for s in defaults}
    for entry in spec.get("notifications") or []:
        ref = entry.get("secretRef") or {}
        out[entry["name"]] = Sink(
            name=entry["name"], secret=ref.get("name", ""),
            events=frozenset(E(e) for e in entry.get("events") or c.DEFAULT_NOTIFICATION_EVENTS),
            format=entry.get("format") or "cloudevents", url_key=ref.get("urlKey") or "url",
            signing_key_key=ref.get("signingKeyKey") or "signingKey", ca_key=ref.get("caKey") or "ca")
    return sorted(out.values(), key=lambda s: s.name)


# -- events -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Notice:
    """One event of one object (a Flow, or a FlowQuota), as every sink that wants it is told of it."""

    # <uid>/<request id | turn-N | run-N | Exhausted-<time> | Warning-<time>>/<type>: stable across
    # restarts and leaders
    id: str
    type: E
    namespace: str
    name: str
    time: dt.datetime | None  # when the status says it happened
    data: Body = field(compare=False)
    kind: str = c.KIND  # whose event: a Flow's, or a FlowQuota's


def of_object(event_id: str, obj: Body) -> bool:
    """Is this event id one of this object's (not of an earlier one of the same name)? Ids begin with the uid."""
    return event_id.startswith(f"{(obj.get('metadata') or {}).get('uid')}/")


def _failure_reason(status: Body) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == c.ConditionType.SUCCEEDED and cond.get("status") == "False":
            return str(cond.get("reason") or "")
    return ""


def _cut(value: Any, limit: int = TEXT_LIMIT) -> str:
    text = "" if value is None else str(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def notices(flow: Body, console_url: str = "") -> list[Notice]:
    """The events the Flow's status holds now: the request that waits for an answer, the message a
    conversation waits for, the latest timed-out request, the end. (One that is over before it was
    sent, such as a request answered already, is not sent: nobody needs it any more.)"""
    meta, status = flow.get("metadata") or {}, flow.get("status") or {}
    uid, ns, name = meta.get("uid", ""), meta.get("namespace", ""), meta.get("name", "")
    phase = status.get("phase")
    runs = status.get("runs") or []
    usage = status.get("usage") or {}
    base: Body = {
        "flow": {"namespace": ns, "name": name, "uid": uid, "definition": status.get("definition") or ""},
        "phase": phase, "message": _cut(status.get("message")),
        "usage": {"totalTokens": usage.get("totalTokens", 0), "cost": usage.get("cost")},
    }
    if console_url:
        base["consoleUrl"] = f"{console_url.rstrip('/')}/flows/{quote(ns, safe='')}/{quote(name, safe='')}"
    out = []

    def add(key: str, etype: E, time: Any, **extra: Any) -> None:
        out.append(Notice(f"{uid}/{key}/{etype}", etype, ns, name, parse_time(time),
                          {**base, "event": str(etype), **extra}))

    fb = status.get("feedback") or {}
    req = fb.get("request")
    if req and phase not in c.TERMINAL_PHASES:
        add(str(req.get("id")), E.FEEDBACK_REQUESTED, req.get("requestedAt"), request=_request(req))
    history = fb.get("history") or []
    if history and history[-1].get("timedOut"):
        h = history[-1]
        add(str(h.get("requestId")), E.FEEDBACK_TIMED_OUT, h.get("respondedAt"),
            request={"id": h.get("requestId"), "method": h.get("method"), "outcome": h.get("outcome")})
    conv = status.get("conversation") or {}
    if phase == Phase.AWAITING_MESSAGE and not conv.get("ended"):
        turns = int(conv.get("turns") or 0)
        add(f"turn-{turns}", E.MESSAGE_AWAITED, conv.get("idleSince"),
            conversation={"turns": turns, "lastReply": _cut(conv.get("lastReply"))})
    if phase in c.TERMINAL_PHASES:
        run = f"run-{max(len(runs) - 1, 0)}"
        reason = _failure_reason(status)
        if phase == Phase.SUCCEEDED:
            add(run, E.SUCCEEDED, status.get("finishedAt"), output=_cut((status.get("result") or {}).get("output")))
        else:
            add(run, E.FAILED, status.get("finishedAt"), reason=reason)
            if reason == Reason.BUDGET_EXCEEDED:
                add(run, E.BUDGET_EXCEEDED, status.get("finishedAt"), reason=reason)
    return out


def quota_notices(quota: Body, console_url: str = "") -> list[Notice]:
    """The event a FlowQuota's status holds now: QuotaExhausted while its Exhausted condition is True,
    else QuotaWarning while its Warning condition is True. Each transition to True is one event: its
    id names the condition's lastTransitionTime, which the operator keeps across restarts (a condition
    that stays True keeps its time), so a restart or a new leader sees the same event."""
    meta, status = quota.get("metadata") or {}, quota.get("status") or {}
    uid, ns, name = meta.get("uid", ""), meta.get("namespace", ""), meta.get("name", "")
    if not ns:
        return []  # a ClusterFlowQuota: no namespace, no default sinks (alert on its metrics instead)
    conditions = {x.get("type"): x for x in status.get("conditions") or [] if isinstance(x, dict)}
    ctype = next((t for t in ("Exhausted", "Warning") if (conditions.get(t) or {}).get("status") == "True"), None)
    if ctype is None:
        return []
    etype, cond = E.QUOTA_EXHAUSTED if ctype == "Exhausted" else E.QUOTA_WARNING, conditions[ctype]
    since = str(cond.get("lastTransitionTime") or "")
    caps = {x.get("name"): x for x in (quota.get("spec") or {}).get("limits") or [] if isinstance(x, dict)}
    limits = []
    for lim in status.get("limits") or []:
        if not isinstance(lim, dict):
            continue
        cap = caps.get(lim.get("name")) or {}
        used = lim.get("used") or {}
        limits.append({"name": lim.get("name"),
                       "used": {"totalTokens": used.get("totalTokens", 0), "cost": used.get("cost")},
                       "limit": {k: cap[k] for k in ("maxTotalTokens", "maxCost") if cap.get(k) is not None},
                       "windowStart": lim.get("windowStart"), "resetsAt": lim.get("resetsAt")})
    data: Body = {"event": str(etype), "quota": {"namespace": ns, "name": name, "uid": uid},
                  "message": _cut(cond.get("message")), "limits": limits}
    if console_url:
        data["consoleUrl"] = f"{console_url.rstrip('/')}/quotas?namespace={quote(ns, safe='')}"
    return [Notice(f"{uid}/{ctype}-{since}/{etype}", etype, ns, name, parse_time(since or None), data,
                   kind=c.QUOTA_KIND)]


def _request(req: Body) -> Body:
    return {"id": req.get("id"), "method": req.get("method"), "message": _cut(req.get("message")),
            "outcomes": req.get("emit") or [], "defaultOutcome": req.get("defaultOutcome"),
            "deadline": req.get("deadline"), "output": _cut(req.get("output"))}


def wanted(sink: Sink, found: Sequence[Notice]) -> list[Notice]:
    """What ``sink`` is told of ``found``: a Flow that failed on its budget is BudgetExceeded to a sink
    that asks for that, Failed to one that does not."""
    types = {n.type for n in found}
    out = []
    for n in found:
        if n.type not in sink.events:
            continue
        if n.type == E.FAILED and E.BUDGET_EXCEEDED in types and E.BUDGET_EXCEEDED in sink.events:
            continue
        out.append(n)
    return out


def due(flow: Body, sinks: Sequence[Sink], console_url: str = "") -> list[tuple[Sink, Notice]]:
    """(sink, event) pairs not yet handled according to the Flow's status."""
    return pending(flow, sinks, notices(flow, console_url) if sinks else [])


def pending(obj: Body, sinks: Sequence[Sink], found: Sequence[Notice]) -> list[tuple[Sink, Notice]]:
    """(sink, event) pairs of ``found`` (the events the object's status holds) not yet handled
    according to its status.notifications: a Flow's or a FlowQuota's alike."""
    if not sinks or not found:
        return []
    records = {r.get("name"): r for r in (obj.get("status") or {}).get("notifications") or []}
    out = []
    for sink in sinks:
        handled = set((records.get(sink.name) or {}).get("handled") or [])
        out += [(sink, n) for n in wanted(sink, found) if n.id not in handled]
    return out


# -- retries ----------------------------------------------------------------------------------------------

BACKOFF_FIRST = 1.0
BACKOFF_CAP = 60.0


def backoff(attempt: int, first: float = BACKOFF_FIRST, cap: float = BACKOFF_CAP) -> float:
    """Seconds before the try after ``attempt`` (1-based) failed: 1, 2, 4, ... 60, 60."""
    return float(min(cap, first * 2 ** (attempt - 1)))


def retry_after(value: str | None, cap: float = BACKOFF_CAP) -> float:
    """A receiver's Retry-After in seconds (Slack sends it with 429), at most ``cap``; 0 when absent or
    an HTTP date (the backoff then decides)."""
    try:
        return min(cap, max(0.0, float(value))) if value else 0.0
    except ValueError:
        return 0.0


def retryable(code: int | None) -> bool:
    """A timeout or a connection error (None), a 5xx, 408 or 429 is tried again; any other answer is final."""
    return code is None or code >= 500 or code in (408, 429)


# -- the record in status ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """How one event's delivery to one sink ended."""

    sink: str
    notice_id: str
    event: E
    delivered: bool
    reason: str  # Delivered, Rejected, GaveUp, Refused, Misconfigured
    attempts: int
    time: dt.datetime
    code: int | None = None
    message: str = ""


class Recorded(Protocol):
    """A status that records deliveries: a Flow's, a FlowQuota's."""

    notifications: list[NotificationRecord] | None


def record(status: Recorded, outcomes: Iterable[Outcome], current: Iterable[str] = ()) -> list[tuple[str, str, str]]:
    """Fold finished deliveries into ``status.notifications``; returns the Events to post for them.
    ``current``: the ids of the events the status holds now (`notices`), which are kept in `handled`
    before older ones (an event still current must never be forgotten, or it would be sent again)."""
    records = {r.name: r for r in status.notifications or []}
    keep = set(current)
    events = []
    for o in outcomes:
        r = records.get(o.sink) or NotificationRecord(name=o.sink)
        handled = [i for i in (r.handled or []) if i != o.notice_id] + [o.notice_id]
        while len(handled) > c.NOTIFICATION_HANDLED_KEPT:
            old = next((i for i in handled if i not in keep), handled[0])
            handled.remove(old)
        records[o.sink] = NotificationRecord(
            name=o.sink, event=o.event, event_id=o.notice_id, time=o.time,
            outcome="Delivered" if o.delivered else "Failed", reason=o.reason, attempts=o.attempts, code=o.code,
            message=_cut(o.message, MESSAGE_LIMIT) or None, handled=handled)
        if not o.delivered:
            events.append(("Warning", "NotificationFailed",
                           f"{o.event} to sink {o.sink}: {o.reason} after {o.attempts} attempt(s): {o.message}"))
    status.notifications = [records[k] for k in sorted(records)] or None
    return events


def record_quota(quota: Body, outcomes: Iterable[Outcome], console_url: str = "") -> list[tuple[str, str, str]]:
    """`record` for a FlowQuota as JSON (the quota service writes its status as a merge patch): the
    outcomes of this quota (by uid) are folded into ``quota["status"]["notifications"]``, the events
    its status holds now kept in `handled` first; returns the Events to post."""
    status = quota.setdefault("status", {})
    ours = [o for o in outcomes if of_object(o.notice_id, quota)]
    if not ours:
        return []
    held = FlowQuotaStatus.model_validate({"notifications": status.get("notifications")})
    events = record(held, ours, [n.id for n in quota_notices(quota)])
    status["notifications"] = held.dump().get("notifications")
    return events
