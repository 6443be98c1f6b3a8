"""`kubectl flow get`: the table of Flows and one Flow described."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from flowkube_api.constants import Phase
from flowkube_api.usagecounts import usage_counts


def short(text: str, width: int = 100) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


def _feedback_lines(name: str, req: dict[str, Any]) -> list[str]:
    lines = [f"Feedback requested by {req['method']} (request {req['id']}):", f"  {req.get('message', '')}"]
    if req.get("emit"):
        lines.append(f"  outcomes: {', '.join(req['emit'])}"
                     + (f" (default {req['defaultOutcome']})" if req.get("defaultOutcome") else ""))
    if req.get("deadline"):
        lines.append(f"  deadline: {req['deadline']}")
    if req.get("output"):
        lines.append("  output:\n    " + req["output"].replace("\n", "\n    "))
    lines.append(f'  answer: kubectl flow feedback {name} "<text>" --request-id {req["id"]}')
    return lines


def _conversation_lines(name: str, conv: dict[str, Any]) -> list[str]:
    lines = [f"\nConversation (session {conv.get('sessionId') or '-'}): {conv.get('turns') or 0} turns, "
             f"ended: {'yes' if conv.get('ended') else 'no'}"]
    for m in conv.get("messages") or []:
        who = m.get("role", "?") + (f" ({m['sender']})" if m.get("sender") else "")
        lines.append(f"  {m.get('time', ''):<20} {who:<24} {short(m.get('content', ''))}")
    if not conv.get("messages") and conv.get("lastReply"):
        lines.append(f"  last reply: {short(conv['lastReply'])}")
    for label, m in (("queued", conv.get("inbox")), ("pending", conv.get("pending"))):
        if m:
            turn = f" turn {m['turn']}" if m.get("turn") else ""
            lines.append(f"  {label}{turn} from {m.get('sentBy') or '?'}"
                         f"{' at ' + m['sentAt'] if m.get('sentAt') else ''}: {short(m.get('text', ''))}")
    if not conv.get("ended"):
        lines.append(f'  send: kubectl flow say {name} "<text>"   (or: kubectl flow chat {name})')
    return lines


def describe(flow: dict[str, Any]) -> str:
    st = flow.get("status") or {}
    name = flow["metadata"]["name"]
    lines = [f"Flow {flow['metadata'].get('namespace', '')}/{name}: {st.get('phase', Phase.PENDING)}"
             f" ({st.get('definition', '')}) - {st.get('message', '')}"]
    if st.get("forkedFrom"):
        lines.append(_forked_from_line(st["forkedFrom"], st.get("inheritedUsage")))
    if (st.get("trace") or {}).get("traceId"):
        lines.append(f"Trace: {st['trace']['traceId']}  (every run, wait and model call of this Flow)")
    req = (st.get("feedback") or {}).get("request")
    if req:
        lines += ["", *_feedback_lines(name, req)]
    if st.get("conversation"):
        lines += _conversation_lines(name, st["conversation"])
    runs = st.get("runs") or []
    if runs:
        lines.append("\nRuns:")
        for r in runs:
            tokens = usage_counts(r.get("usage")).total_tokens
            lines.append(f"  {r['pod']:<30} {r['trigger']:<8} {r.get('result', 'Running'):<10} "
                         f"{tokens:>8} tokens  {r.get('reason', '')}")
    if st.get("usage"):
        usage = usage_counts(st["usage"])
        lines.append(f"\nUsage: {usage.total_tokens} tokens ({usage.prompt_tokens} prompt, "
                     f"{usage.completion_tokens} completion), {usage.successful_requests} requests")
        for model, u in sorted(usage.by_model.items()):
            lines.append(f"  {model}: {u.total_tokens} tokens, {u.successful_requests} requests")
    for h in (st.get("feedback") or {}).get("history") or []:
        who = f" by {h['respondedBy']}" if h.get("respondedBy") else ""
        what = "timed out" if h.get("timedOut") else repr(h.get("response"))
        lines.append(f"  answered {h['requestId']} ({h['method']}){who}: {what}")
    lines += _checkpoint_lines(name, st.get("checkpoints") or [])
    lines += _notification_lines(st.get("notifications") or [])
    return "\n".join(lines)


def _spent(usage: Any) -> tuple[int, str]:
    """(tokens, USD) of a SpentSoFar (a checkpoint's usage, a fork's inheritedUsage)."""
    raw = usage if isinstance(usage, dict) else {}
    return usage_counts(raw).total_tokens, str(raw.get("cost") or "0")


def _forked_from_line(origin: dict[str, Any], inherited: Any) -> str:
    """status.forkedFrom, and what the origin spent up to the checkpoint (status.inheritedUsage)."""
    what = " ".join(str(origin[k]) for k in ("kind", "method") if origin.get(k))
    line = (f"Forked from: {origin.get('namespace', '')}/{origin.get('name', '')} at checkpoint "
            f"{origin.get('checkpoint', '?')}" + (f" ({what})" if what else ""))
    if inherited:
        tokens, cost = _spent(inherited)
        line += f"; inherited usage: {tokens} tokens, USD {cost} (not counted in usage)"
    return line


def _checkpoint_lines(name: str, entries: list[dict[str, Any]]) -> list[str]:
    """status.checkpoints, oldest first: each with the Flow's spend up to it."""
    if not entries:
        return []
    lines = [f"\nCheckpoints (fork one: kubectl flow fork {name} --at ID):"]
    for e in entries:
        tokens, cost = _spent(e.get("usage"))
        lines.append(f"  {e.get('id', '?'):>4}  {e.get('kind', ''):<9} {e.get('method', ''):<24} "
                     f"{e.get('time', ''):<20} {tokens:>8} tokens  USD {cost}")
    return lines


def _notification_lines(records: list[dict[str, Any]]) -> list[str]:
    """Each sink's last delivery (status.notifications)."""
    if not records:
        return []
    lines = ["\nNotifications (last delivery per sink):"]
    for r in records:
        code = f" HTTP {r['code']}" if r.get("code") else ""
        lines.append(f"  {r['name']:<20} {r.get('event', ''):<18} {r.get('outcome', ''):<9} "
                     f"{r.get('reason', '')}{code}, {r.get('attempts', 0)} attempt(s) at {r.get('time', '?')}")
        if r.get("outcome") == "Failed" and r.get("message"):
            lines.append(f"  {'':<20} {short(r['message'])}")
    return lines


def when(ts: str | None) -> datetime:
    try:
        t = datetime.fromisoformat(ts) if ts else datetime.min
    except ValueError:
        t = datetime.min
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def _age(ts: str | None, now: datetime) -> str:
    if not ts:
        return "<unknown>"
    s = max(0, int((now - when(ts)).total_seconds()))
    for unit, size, below in (("s", 1, 120), ("m", 60, 7200), ("h", 3600, 172800)):
        if s < below:
            return f"{s // size}{unit}"
    return f"{s // 86400}d"


def flow_table(flows: list[dict[str, Any]], all_namespaces: bool, now: datetime) -> str:
    rows = [["NAMESPACE"] * all_namespaces + ["NAME", "PHASE", "DEFINITION", "TOKENS", "AGE"]]
    for f in flows:
        st, meta = f.get("status") or {}, f["metadata"]
        tokens = str(usage_counts(st["usage"]).total_tokens) if st.get("usage") else ""
        rows.append([meta.get("namespace", "")] * all_namespaces
                    + [meta["name"], st.get("phase") or Phase.PENDING, st.get("definition") or "", tokens,
                       _age(meta.get("creationTimestamp"), now)])
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    return "\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows)
