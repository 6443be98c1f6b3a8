"""The engine's vocabulary the run names before crewAI is loaded: crewAI-free."""

from __future__ import annotations

from dataclasses import dataclass


class InvalidFlow(Exception):
    """The flow cannot be loaded or built: the definition or the flowRef class is at fault."""


class InvalidInputs(Exception):
    """``spec.inputs`` do not fit the flow's state."""


@dataclass(frozen=True)
class Ending:
    """How a kickoff, resume or retry returned: paused on a feedback request, or finished."""

    paused: bool
    output: str | None = None  # a finished flow's output as text
