"""The runner's durable record of a flow, under the state object's ``STATE_KEY``. crewAI-free.

crewAI persists only a flow's ``state``; the document also keeps the runtime a new process needs
(``runtime.py`` fills and reads it), the pending feedback request and who wrote it last.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from flowkube_api.constants import STATE_KEY

from ..store import StateCorrupt, StateStore, decode_json, encode_json

STATE_VERSION = 1


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class PendingRequest(_Camel):
    """A feedback request the flow paused on. ``context`` is crewAI's own serialised
    ``PendingFeedbackContext``; the properties read the fields the runner acts on."""

    request_id: str
    context: dict[str, Any]

    @property
    def method(self) -> str:
        return str(self.context.get("method_name", ""))

    @property
    def message(self) -> str:
        return str(self.context.get("message", ""))

    @property
    def emit(self) -> list[str] | None:
        emit = self.context.get("emit")
        return [str(e) for e in emit] if isinstance(emit, list) else None

    @property
    def default_outcome(self) -> str | None:
        outcome = self.context.get("default_outcome")
        return str(outcome) if outcome is not None else None

    @property
    def requested_at(self) -> datetime | None:
        value = self.context.get("requested_at")
        return datetime.fromisoformat(value) if isinstance(value, str) else None


class StateDocument(_Camel):
    """The runner's durable record of a flow: crewAI state plus what crewAI does not persist."""

    version: int = STATE_VERSION
    flow_id: str
    state: dict[str, Any]
    runtime: dict[str, Any] = Field(default_factory=dict)
    pending: PendingRequest | None = None
    last_method: str | None = None
    feedback_count: int = 0
    # Conversations only: the last message whose turn is saved in full. A turn is saved once, when it
    # is answered (or pauses for feedback), so a run lost mid-turn leaves the previous turn's state.
    conversation_turn: int | None = None
    # The finished tasks of the crews of the methods running when this was written (tasks.py), by
    # slot: a retry after a lost pod does not run them again. Dropped when their method completes.
    tasks: dict[str, list[dict[str, Any]]] = Field(default_factory=dict)
    # The number of the last checkpoint taken (checkpoints.py): this document, when it was taken.
    checkpoint: int = 0
    # A fork's state once its edits are applied: "<namespace>/<origin>#<checkpoint>" (never applied twice).
    forked: str | None = None
    pod: str = ""
    updated_at: datetime | None = None

    @property
    def has_completed_methods(self) -> bool:
        return bool(self.runtime.get("completedMethods"))

    def encode(self) -> bytes:
        return encode_json(self.model_dump(mode="json", by_alias=True))

    @classmethod
    def load(cls, store: StateStore) -> StateDocument | None:
        data = store.get(STATE_KEY)
        if data is None:
            return None
        raw = decode_json(data, f"state key {STATE_KEY}")
        try:
            document = cls.model_validate(raw)
        except ValidationError as e:
            raise StateCorrupt(f"state key {STATE_KEY} does not hold a flow state: {e}") from e
        if document.version != STATE_VERSION:
            raise StateCorrupt(f"state version {document.version} is not supported (expected {STATE_VERSION})")
        return document
