"""What the pages show, computed from Flows as the API server returns them. Pure: no I/O.

A Flow is summarised into a small ``Summary`` (the inbox and the list hold only these: 10,000 Flows
in view cost a few MB, not their full objects); a single Flow's page is built from the whole object.
Text a flow produced is passed on as text: the templates escape it, and nothing here builds HTML.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

from flowkube_api import forks, templates
from flowkube_api.base import money_text
from flowkube_api.constants import Phase
from flowkube_api.report import TokenUsage, Usage

Body = dict[str, Any]
SHOWN_LIMIT = 65536  # characters of one text shown on a page; the rest is cut with a note
LINE_LIMIT = 280  # characters of a message in the inbox's list


def when(ts: str | None) -> datetime | None:
    if not ts:
        return None
    try:
        t = datetime.fromisoformat(ts)
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def age(ts: str | None, now: datetime) -> str:
    """How long ago, as kubectl prints ages: 45s, 12m, 3h, 2d."""
    t = when(ts)
    if t is None:
        return "-"
    s = max(0, int((now - t).total_seconds()))
    for unit, size, below in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if s < below:
            return f"{s // size}{unit}"
    return f"{s // 86400}d"


def line(text: str | None, limit: int = LINE_LIMIT) -> str:
    """One line of at most ``limit`` characters."""
    flat = " ".join(str(text or "").split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


@dataclass(frozen=True)
class Shown:
    """A text to show, cut to SHOWN_LIMIT characters; ``cut`` is how many were left out."""

    text: str
    cut: int = 0


def shown(text: Any, limit: int = SHOWN_LIMIT) -> Shown:
    s = text if isinstance(text, str) else ("" if text is None else str(text))
    return Shown(s, 0) if len(s) <= limit else Shown(s[:limit], len(s) - limit)


def cost_text(u: TokenUsage) -> str:
    """The cost as the status writes it (exact; "" when nothing was priced)."""
    return money_text(u.cost) if u.cost else ""


def _usage(st: Body) -> tuple[int, str]:
    """Total tokens, and the cost (`cost_text`) of a Flow's or a run's ``usage``."""
    u = Usage.read(st.get("usage"))
    return u.total_tokens, cost_text(u)


@dataclass(frozen=True, slots=True)
class Summary:
    """One Flow as the inbox and the list show it."""

    namespace: str
    name: str
    uid: str
    phase: str
    definition: str
    created: str
    tokens: int
    cost: str
    message: str  # status.message, one line
    waiting: str = ""  # "feedback" | "message" | "" (nobody is needed)
    asked: str = ""  # the request's message, one line
    method: str = ""
    outcomes: tuple[str, ...] = ()
    deadline: str = ""
    since: str = ""  # when the request (or the wait for a message) began
    request_id: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.namespace, self.name


def summarise(flow: Body) -> Summary:
    meta, st = flow.get("metadata") or {}, flow.get("status") or {}
    phase = str(st.get("phase") or Phase.PENDING)
    tokens, cost = _usage(st)
    base = Summary(namespace=str(meta.get("namespace") or ""), name=str(meta.get("name") or ""),
                   uid=str(meta.get("uid") or ""), phase=phase, definition=str(st.get("definition") or ""),
                   created=str(meta.get("creationTimestamp") or ""), tokens=tokens, cost=cost,
                   message=line(st.get("message"), 200))
    req = (st.get("feedback") or {}).get("request")
    if phase == Phase.AWAITING_FEEDBACK and isinstance(req, dict):
        return replace(base, waiting="feedback", asked=line(req.get("message")), method=str(req.get("method") or ""),
                       outcomes=tuple(str(o) for o in req.get("emit") or ()), deadline=str(req.get("deadline") or ""),
                       since=str(req.get("requestedAt") or ""), request_id=str(req.get("id") or ""))
    conv = st.get("conversation") or {}
    if phase == Phase.AWAITING_MESSAGE and not conv.get("ended") and not conv.get("inbox"):
        last = next((m for m in reversed(conv.get("messages") or []) if m.get("role") == "assistant"), None)
        return replace(base, waiting="message", asked=line((last or {}).get("content") or conv.get("lastReply")),
                       since=str(conv.get("idleSince") or ""))
    return base


@dataclass(frozen=True)
class Filters:
    namespace: str = ""
    definition: str = ""

    def keep(self, s: Summary) -> bool:
        return (not self.namespace or s.namespace == self.namespace) and (
            not self.definition or s.definition == self.definition)


def inbox(summaries: list[Summary], filters: Filters) -> list[Summary]:
    """Flows waiting for a person, newest request first."""
    waiting = [s for s in summaries if s.waiting and filters.keep(s)]
    waiting.sort(key=lambda s: (when(s.since or s.created) or datetime.min.replace(tzinfo=UTC), s.key), reverse=True)
    return waiting


def listing(summaries: list[Summary], filters: Filters) -> list[Summary]:
    """Every Flow in view, as `kubectl get flows -A` orders them (namespace, then name)."""
    return sorted((s for s in summaries if filters.keep(s)), key=lambda s: s.key)


def choices(summaries: list[Summary]) -> tuple[list[str], list[str]]:
    """The namespaces and definitions the filters offer."""
    return sorted({s.namespace for s in summaries}), sorted({s.definition for s in summaries if s.definition})


# ------------------------------------------------------------------------------------------ one Flow


@dataclass
class RunRow:
    index: int
    pod: str
    trigger: str
    started: str
    finished: str
    result: str
    reason: str
    message: str
    tokens: int
    cost: str


@dataclass
class Detail:
    """A Flow's page: what it is, where it stands, what it asks, what it cost."""

    summary: Summary
    inputs: Shown
    request: Body | None
    request_output: Shown
    result: Shown
    history: list[Body]
    conversation: Body | None
    transcript: list[Body]
    conditions: list[Body]
    runs: list[RunRow]
    by_model: list[tuple[str, TokenUsage]]
    usage: Usage
    pending_message: Body | None = None
    queued_message: Body | None = None
    template_note: str = ""  # why the inputs shown lack the template's part (its snapshot could not be read)


@dataclass
class CheckpointRow:
    """One checkpoint of a Flow's timeline, and the name a fork from it gets by default."""

    id: int
    kind: str
    method: str
    time: str
    tokens: int
    cost: str
    fork_name: str


@dataclass
class ForkOrigin:
    """Where a fork came from, and what its origin had spent up to there (counted by the origin)."""

    namespace: str
    name: str
    checkpoint: int
    kind: str
    method: str
    tokens: int
    cost: str


def checkpoint_rows(flow: Body) -> list[CheckpointRow]:
    name = str((flow.get("metadata") or {}).get("name") or "")
    rows = []
    for e in (flow.get("status") or {}).get("checkpoints") or []:
        if not isinstance(e, dict) or not isinstance(e.get("id"), int):
            continue
        tokens, cost = _usage(e)
        rows.append(CheckpointRow(id=e["id"], kind=str(e.get("kind") or ""), method=str(e.get("method") or ""),
                                  time=str(e.get("time") or ""), tokens=tokens, cost=cost,
                                  fork_name=forks.fork_name(name, e["id"])))
    return rows


def fork_origin(flow: Body) -> ForkOrigin | None:
    st = flow.get("status") or {}
    origin = st.get("forkedFrom")
    if not isinstance(origin, dict):
        return None
    tokens, cost = _usage({"usage": st.get("inheritedUsage")})
    return ForkOrigin(namespace=str(origin.get("namespace") or ""), name=str(origin.get("name") or ""),
                      checkpoint=int(origin.get("checkpoint") or 0), kind=str(origin.get("kind") or ""),
                      method=str(origin.get("method") or ""), tokens=tokens, cost=cost)


def fork_edits(inputs: str, output: str, method: str) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """A fork form's edits: ``inputs`` a JSON object of state fields (empty: none), ``output`` the text
    the checkpoint's ``method`` output is replaced with (empty: unchanged). ValueError says what is wrong."""
    values = None
    if inputs.strip():
        try:
            values = json.loads(inputs)
        except ValueError as e:
            raise ValueError(f"the inputs are not JSON: {e}") from None
        if not isinstance(values, dict):
            raise ValueError('the inputs must be a JSON object of state fields, like {"topic": "operators"}')
    return values or None, ({method: output} if output.strip() else None)


def _pretty(value: Any) -> str:
    return json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False) if value else ""


def taken_snapshot(flow: Body) -> str | None:
    """The template snapshot (a ControllerRevision in the Flow's namespace) whose spec the Flow runs,
    when the console must read it to show the Flow's inputs; None when there is none to read."""
    taken = (flow.get("status") or {}).get("template")
    if not (flow.get("spec") or {}).get("templateRef") or not isinstance(taken, dict) or "spec" in taken:
        return None
    return str(taken.get("snapshot") or "") or None


def snapshot_spec(flow: Body, obj: Body | None) -> tuple[Body | None, str]:
    """(the template spec of the snapshot read for the Flow, "") or (None, why it is not shown)."""
    taken = (flow.get("status") or {}).get("template") or {}
    problem = templates.snapshot_problem(taken, obj)
    if problem is not None or obj is None:
        return None, f"the template's inputs are not shown: {problem}"
    return dict(obj["data"].get("spec") or {}), ""


def detail(flow: Body, template_spec: Body | None = None, template_note: str = "") -> Detail:
    """``template_spec``: the spec of the template snapshot the Flow took, read with the signed-in
    person's token (None: not needed, or not readable, and ``template_note`` says why)."""
    # A Flow of a template shows the inputs it runs with: its own over the template's and the defaults.
    st, spec = flow.get("status") or {}, templates.effective_flow(flow, template_spec).get("spec") or {}
    fb, conv = st.get("feedback") or {}, st.get("conversation")
    s = summarise(flow)
    req = fb.get("request") if s.waiting == "feedback" else None
    runs = []
    for i, r in enumerate(st.get("runs") or []):
        tokens, cost = _usage(r)
        runs.append(RunRow(index=i, pod=str(r.get("pod") or ""), trigger=str(r.get("trigger") or ""),
                           started=str(r.get("startedAt") or ""), finished=str(r.get("finishedAt") or ""),
                           result=str(r.get("result") or ("Running" if not r.get("finishedAt") else "")),
                           reason=str(r.get("reason") or ""), message=line(r.get("message"), 400),
                           tokens=tokens, cost=cost))
    usage = Usage.read(st.get("usage"))
    return Detail(
        summary=s, inputs=shown(_pretty(spec.get("inputs"))), request=req,
        request_output=shown((req or {}).get("output")), result=shown((st.get("result") or {}).get("output")),
        history=list(reversed(fb.get("history") or [])), conversation=conv,
        transcript=list((conv or {}).get("messages") or []),
        conditions=list(st.get("conditions") or []), runs=runs,
        by_model=sorted(usage.by_model.items()), usage=usage,
        pending_message=(conv or {}).get("pending"), queued_message=(conv or {}).get("inbox"),
        template_note=template_note,
    )


def event_rows(events: list[Body], limit: int = 30) -> list[Body]:
    """The Flow's Events, newest first, as `kubectl describe` lists them."""
    def stamp(e: Body) -> str:
        return str(e.get("lastTimestamp") or e.get("eventTime") or (e.get("metadata") or {}).get("creationTimestamp")
                   or "")

    rows = [{"type": e.get("type") or "", "reason": e.get("reason") or "", "time": stamp(e),
             "count": e.get("count") or 1, "message": line(e.get("message"), 600)} for e in events]
    rows.sort(key=lambda r: str(r["time"]), reverse=True)
    return rows[:limit]



_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def trace_link(template: str, flow: dict[str, Any]) -> str:
    """The Flow's trace in the trace backend (``console.traceUrl``: ``{traceId}``, ``{namespace}``,
    ``{name}``); none without a template or a trace id of 32 hex digits (the CRD's pattern)."""
    trace_id = str(((flow.get("status") or {}).get("trace") or {}).get("traceId") or "")
    if not template or not _TRACE_ID.fullmatch(trace_id):
        return ""
    meta = flow.get("metadata") or {}
    return template.format(traceId=trace_id, namespace=quote(str(meta.get("namespace") or "")),
                           name=quote(str(meta.get("name") or "")))
