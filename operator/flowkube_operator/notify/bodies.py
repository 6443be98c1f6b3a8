"""What a notification sends: the body in the sink's format (CloudEvents 1.0, or Slack, where
every text a flow, its model or a tenant (a quota's and its limits' names) wrote is plain text),
and its signature (HMAC-SHA256 over the timestamp and the body, as docs/api.md tells receivers to
check it). Pure."""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
from collections.abc import Callable

import orjson

from flowkube_api import constants as c
from flowkube_api.constants import NotificationEvent as E
from flowkube_operator.notify.notices import Body, Notice, Sink, _cut

SIGNATURE_HEADER = "X-Flowkube-Signature"
EVENT_ID_HEADER = "X-Flowkube-Event-Id"


# -- bodies -----------------------------------------------------------------------------------------------

TITLES = {
    E.FEEDBACK_REQUESTED: "needs feedback", E.MESSAGE_AWAITED: "waits for a message",
    E.FEEDBACK_TIMED_OUT: "stopped waiting for feedback", E.SUCCEEDED: "succeeded", E.FAILED: "failed",
    E.BUDGET_EXCEEDED: "ran out of budget", E.QUOTA_EXHAUSTED: "is exhausted",
    E.QUOTA_WARNING: "passed a warning threshold",
}
# Whose event, as CloudEvents names it: the type's middle part and the source's collection.
KINDS = {c.KIND: ("flow", c.PLURAL), c.QUOTA_KIND: ("quota", c.QUOTA_PLURAL)}


def _rfc3339(t: dt.datetime | None) -> str | None:
    return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ") if t else None


def cloudevent(n: Notice) -> bytes:
    """CloudEvents 1.0, structured mode (Content-Type application/cloudevents+json)."""
    subject = n.id.split("/", 2)[1] if n.id.count("/") >= 2 else None
    kind, plural = KINDS[n.kind]
    event: Body = {
        "specversion": "1.0", "id": n.id, "type": f"io.flowkube.{kind}.{n.type}",
        "source": f"/apis/{c.API_VERSION}/namespaces/{n.namespace}/{plural}/{n.name}",
        "subject": subject, "time": _rfc3339(n.time), "datacontenttype": "application/json", "data": n.data,
    }
    return orjson.dumps({k: v for k, v in event.items() if v is not None})


def mrkdwn_escape(text: str) -> str:
    """Slack's three control characters: with them escaped, no text can make a link or a mention."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def slack(n: Notice) -> bytes:
    """A Slack incoming-webhook body. Every text a flow, its model or a tenant wrote is plain_text,
    which Slack renders as it is: no links, no mentions, no formatting."""
    d = n.data
    title = f"{n.kind} {n.namespace}/{n.name} {TITLES[n.type]}"
    blocks: list[Body] = [{"type": "header", "text": {"type": "plain_text", "text": _cut(title, 150)}}]

    def text(t: str) -> None:
        if t:
            blocks.append({"type": "section", "text": {"type": "plain_text", "text": _cut(t), "emoji": False}})

    if n.kind == c.QUOTA_KIND:
        text(d.get("message") or "")
        facts = [_limit_fact(lim) for lim in d.get("limits") or []]
        label = "Open in the console"
    else:
        facts, label = _flow_facts(n, text)
    if facts:
        blocks.append({"type": "context", "elements": [
            {"type": "plain_text", "text": _cut(" · ".join(facts), 2000)}]})
    if d.get("consoleUrl"):
        blocks.append({"type": "actions", "elements": [
            {"type": "button", "text": {"type": "plain_text", "text": label}, "url": d["consoleUrl"]}]})
    return orjson.dumps({"text": mrkdwn_escape(title), "blocks": blocks})


def _limit_fact(lim: Body) -> str:
    """One limit of a quota, for the context line: ``daily: 100 tokens of 100, USD 0 of 5, resets ...``."""
    used, cap = lim.get("used") or {}, lim.get("limit") or {}
    parts = [f"{used.get('totalTokens', 0)} tokens" + (f" of {cap['maxTotalTokens']}" if "maxTotalTokens" in cap
                                                          else "")]
    if "maxCost" in cap or used.get("cost") not in (None, "0"):
        parts.append(f"USD {used.get('cost') or 0}" + (f" of {cap['maxCost']}" if "maxCost" in cap else ""))
    if lim.get("resetsAt"):
        parts.append(f"resets {lim['resetsAt']}")
    elif lim.get("windowStart"):
        parts.append(f"window from {lim['windowStart']}")
    return f"{lim.get('name')}: " + ", ".join(parts)


def _flow_facts(n: Notice, text: Callable[[str], None]) -> tuple[list[str], str]:
    """A Flow's texts (added by ``text``), its context line's facts and its button's label."""
    d = n.data
    facts = [f"definition: {d['flow'].get('definition') or '-'}"]
    req = d.get("request") or {}
    if n.type == E.FEEDBACK_REQUESTED:
        text(req.get("message") or "")
        text(req.get("output") or "")
        if req.get("outcomes"):
            facts.append("outcomes: " + ", ".join(str(o) for o in req["outcomes"]))
        if req.get("deadline"):
            facts.append(f"deadline: {req['deadline']}")
        facts.append(f"method: {req.get('method')}")
    elif n.type == E.FEEDBACK_TIMED_OUT:
        facts.append(f"request {req.get('id')} ({req.get('method')}): outcome {req.get('outcome') or 'none'}")
    elif n.type == E.MESSAGE_AWAITED:
        text((d.get("conversation") or {}).get("lastReply") or "")
    elif n.type == E.SUCCEEDED:
        text(d.get("output") or "")
    else:
        text(d.get("message") or "")
        facts.append(f"reason: {d.get('reason') or '-'}")
    facts.append(f"tokens: {d['usage'].get('totalTokens', 0)}")
    waits = n.type in (E.FEEDBACK_REQUESTED, E.MESSAGE_AWAITED)
    return facts, "Answer in the console" if waits else "Open in the console"


def body(sink: Sink, n: Notice) -> tuple[bytes, str]:
    """(the body, its Content-Type) in the sink's format."""
    if sink.format == "slack":
        return slack(n), "application/json"
    return cloudevent(n), "application/cloudevents+json"


# -- signatures -------------------------------------------------------------------------------------------


def sign(key: bytes, payload: bytes, timestamp: int) -> str:
    """``t=<unix seconds>,v1=<hex HMAC-SHA256 of "<t>." + body>``: the timestamp is signed with the body,
    so a receiver that refuses old timestamps refuses replays."""
    mac = hmac.new(key, str(timestamp).encode() + b"." + payload, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


def verify(key: bytes, payload: bytes, header: str, now: float, tolerance: float = 300.0) -> bool:
    """The receiver's check, as docs/api.md writes it: the signature over the raw body, and a timestamp
    no further than ``tolerance`` seconds from the receiver's clock."""
    parts = dict(p.split("=", 1) for p in header.split(",") if "=" in p)
    try:
        t = int(parts.get("t", ""))
    except ValueError:
        return False
    if abs(now - t) > tolerance:
        return False
    expected = sign(key, payload, t).split("v1=", 1)[1]
    return hmac.compare_digest(expected, parts.get("v1", ""))
