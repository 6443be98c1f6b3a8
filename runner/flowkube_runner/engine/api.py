"""The engine's vocabulary the run names before crewAI is loaded: crewAI-free."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidFlow(Exception):
    """The flow cannot be loaded or built: the definition or the flowRef class is at fault."""


class InvalidInputs(Exception):
    """``spec.inputs`` do not fit the flow's state."""


@dataclass(frozen=True)
class Turn:
    """A conversation after a run: its session, the message answered (0: the session was only
    opened), the reply, and whether the session ended."""

    session_id: str
    turn: int
    reply: str | None = None
    ended: bool = False


@dataclass(frozen=True)
class Ending:
    """How a kickoff, resume, retry or turn returned: paused on a feedback request, or finished
    (for a conversation: the session waits for its next message, or ended)."""

    paused: bool
    output: str | None = None  # a finished flow's output as text
    turn: Turn | None = None
