"""The inbox rules: when a feedback answer or a conversation message written to the status is
refused. The admission webhook refuses it at `kubectl` time; the reconcile refuses what got past a
webhook that was down (the feedback webhook fails open). Pure. (The patches people send are
`flowkube_api.inbox`'s.)"""

from __future__ import annotations

from flowkube_api import constants as c
from flowkube_api.constants import Phase
from flowkube_api.models import ConversationStatus, FeedbackRequest


def validate_message(conv: ConversationStatus | None, phase: Phase | str | None, text: str | None) -> str | None:
    """Why a conversation message must be refused, or None. ``phase`` is the flow's when it arrived."""
    if conv is None or not conv.session_id:
        return (f"this Flow is not a conversation, or its session is not open yet (phase {phase or 'Pending'}); "
                "messages go only to a Flow that is AwaitingMessage")
    if conv.ended or phase in c.TERMINAL_PHASES:
        return "the conversation has ended"
    if phase != Phase.AWAITING_MESSAGE or conv.pending is not None:
        return (f"a turn is in progress (phase {phase}); send the next message when the Flow is "
                "AwaitingMessage")
    if text is None or not text.strip():
        return "inbox.text must be a non-empty string"
    if len(text) > c.MESSAGE_LIMIT:
        return f"inbox.text has {len(text)} characters, more than the {c.MESSAGE_LIMIT} a message may have"
    return None


def validate_response(request: FeedbackRequest | None, text: str | None, request_id: str | None) -> str | None:
    """Why a feedback response must be refused, or None when it is acceptable."""
    if request is None:
        return "no feedback request is pending"
    if request_id and request_id != request.id:
        return f"requestId {request_id!r} is not the pending request {request.id!r}"
    if text is None or not text.strip():
        return "response.text must be a non-empty string"
    return None
