"""`kubectl flow say` and `chat`: a message patched into a conversation, its reply read back."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any

from flowkube_api.constants import (
    SINGULAR,
    Phase,
    Reason,
)
from flowkube_api.inbox import message_patch
from flowkube_kubectl.kube import KubectlError, kubectl_json, patch_status
from flowkube_kubectl.show import _feedback_lines, when

POLL_INTERVAL = 0.3  # seconds between reads of a Flow while `say` waits for its reply


HISTORY = 6  # messages `chat` shows when it starts


@dataclass
class Turn:
    outcome: str  # reply | feedback | failed | refused | timeout
    detail: str = ""  # the reply, the feedback request, or why not
    ended: bool = False


def _conversation(flow: dict[str, Any]) -> dict[str, Any]:
    conv: dict[str, Any] = (flow.get("status") or {}).get("conversation") or {}
    return conv


def _outcome(flow: dict[str, Any], turns_before: int, phase_before: str | None) -> Turn | None:
    """What the Flow says about the message sent after `turns_before` turns; None while it is undecided."""
    st, conv = flow.get("status") or {}, _conversation(flow)
    phase, turns, taken = st.get("phase"), conv.get("turns") or 0, not conv.get("inbox")
    if turns > turns_before and taken and not conv.get("pending"):
        return Turn("reply", conv.get("lastReply") or "", bool(conv.get("ended")))
    req = (st.get("feedback") or {}).get("request")
    if phase == Phase.AWAITING_FEEDBACK and req and taken and (conv.get("pending") or phase_before != phase):
        name = flow["metadata"]["name"]
        return Turn("feedback", "\n".join(_feedback_lines(name, req)))
    if phase == Phase.FAILED:
        return Turn("failed", f"Flow failed: {st.get('message') or 'no message'}")
    if taken and not conv.get("pending") and turns == turns_before and phase not in (Phase.RUNNING, Phase.PENDING):
        return Turn("refused")
    return None


def _refusal(name: str, kube: list[str]) -> str:
    try:
        selector = f"involvedObject.name={name},reason={Reason.MESSAGE_REFUSED}"
        events = kubectl_json(["get", "events", "--field-selector", selector], kube).get("items") or []
    except KubectlError:
        events = []
    if not events:
        return f"message refused: the operator did not take it (see kubectl flow get {name})"
    newest = max(events, key=lambda e: when(e.get("lastTimestamp") or e.get("eventTime")
                                             or e["metadata"].get("creationTimestamp")))
    return f"message refused: {newest.get('message', '')}"


def send(name: str, text: str, kube: list[str], timeout: float) -> Turn:
    """Send one message and wait for what becomes of it: a reply, a feedback request, a failure or a refusal."""
    before = kubectl_json(["get", SINGULAR, name], kube)
    turns_before = _conversation(before).get("turns") or 0
    out = patch_status(name, message_patch(text), kube)
    if out.returncode != 0:
        return Turn("refused", out.stderr.strip() or f"kubectl patch exited with {out.returncode}")
    deadline = time.monotonic() + timeout
    while True:
        now = kubectl_json(["get", SINGULAR, name], kube)
        turn = _outcome(now, turns_before, (before.get("status") or {}).get("phase"))
        if turn:
            return Turn("refused", _refusal(name, kube)) if turn.outcome == "refused" else turn
        left = deadline - time.monotonic()
        if left <= 0:
            return Turn("timeout", f"no reply within {timeout:g}s; the message may still be answered: "
                                   f"kubectl flow get {name}")
        time.sleep(min(POLL_INTERVAL, left))


def report(turn: Turn, reply_prefix: str = "") -> int:
    if turn.outcome in ("reply", "feedback"):
        print(reply_prefix + turn.detail if turn.outcome == "reply" else turn.detail, flush=True)
        if turn.ended:
            print("The conversation has ended.", file=sys.stderr)
        return 0
    print(turn.detail, file=sys.stderr)
    return 1


def chat(name: str, kube: list[str], timeout: float) -> int:
    conv = _conversation(kubectl_json(["get", SINGULAR, name], kube))
    for m in (conv.get("messages") or [])[-HISTORY:]:
        who = "flow" if m.get("role") == "assistant" else m.get("sender") or "you"
        print(f"{who}> {m.get('content', '')}")
    if conv.get("ended"):
        print("The conversation has ended.", file=sys.stderr)
        return 0
    tty = sys.stdin.isatty()
    while True:
        if tty:
            print("you> ", end="", file=sys.stderr, flush=True)
        line = sys.stdin.readline()
        if not line:
            print(f"\nThe session stays open: continue with `kubectl flow chat {name}` "
                  f'or `kubectl flow say {name} "<text>"`.', file=sys.stderr)
            return 0
        if not line.strip():
            continue
        turn = send(name, line.strip(), kube, timeout)
        rc = report(turn, "flow> ")
        if turn.outcome == "feedback":
            print(f"Answer it, then continue with `kubectl flow chat {name}`.", file=sys.stderr)
        if not (turn.outcome == "refused" or (turn.outcome == "reply" and not turn.ended)):
            return rc
