"""The two status patches a person sends, as docs/api.md documents them: an answer to a feedback
request and a conversation message. Standard library only: the kubectl plugin and the console both
build them here."""

from __future__ import annotations

from typing import Any


def feedback_patch(text: str, request_id: str | None = None) -> dict[str, Any]:
    """``status.feedback.response``; ``request_id`` (when given) pins the answer to the request read."""
    response: dict[str, Any] = {"text": text}
    if request_id:
        response["requestId"] = request_id
    return {"status": {"feedback": {"response": response}}}


def message_patch(text: str) -> dict[str, Any]:
    """``status.conversation.inbox``: the next message of a conversation."""
    return {"status": {"conversation": {"inbox": {"text": text}}}}
