"""What an exception means for a run: a ``RunFailure`` says why the run ended, and whether a retry
can help (``permanent``: an invalid flow, inputs or state, a budget spent) or not."""

from __future__ import annotations

from collections.abc import Iterator

from flowkube_api import constants as c

from .engine.api import InvalidFlow, InvalidInputs
from .store import StateCorrupt, StateTooLarge, StoreError


class RunFailure(Exception):
    def __init__(self, reason: c.Reason, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent


def permanent(reason: c.Reason, message: str) -> RunFailure:
    return RunFailure(reason, message, permanent=True)


def chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    pending: list[BaseException] = []
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
        current = pending.pop(0) if pending else None


_CONNECTION_ERRORS = {
    ("openai", "APIConnectionError"),
    ("openai", "APITimeoutError"),
    ("httpx", "TransportError"),
    ("httpcore", "ConnectError"),
}


def is_connection_error(error: BaseException) -> bool:
    for cls in type(error).__mro__:
        if (cls.__module__.split(".")[0], cls.__name__) in _CONNECTION_ERRORS:
            return True
    return isinstance(error, ConnectionError)


def is_api_error(error: BaseException) -> bool:
    providers = ("openai", "anthropic", "litellm")
    return any(cls.__module__.split(".")[0] in providers for cls in type(error).__mro__)


def known_failure(cause: BaseException, inline: bool) -> RunFailure | None:
    """What the runner's own exceptions, and the engine's and the store's, mean for the run
    (``inline``: the flow is an inline definition, not a flowRef class)."""
    if isinstance(cause, RunFailure):
        return cause
    if isinstance(cause, InvalidFlow):
            return permanent(c.Reason.INVALID_DEFINITION if inline else c.Reason.INVALID_FLOW_REF, str(cause))
    if isinstance(cause, InvalidInputs):
        return permanent(c.Reason.INVALID_INPUTS, str(cause))
    if isinstance(cause, StateTooLarge):
        return permanent(c.Reason.STATE_TOO_LARGE, str(cause))
    if isinstance(cause, StateCorrupt):
        return permanent(c.Reason.STATE_CORRUPT, str(cause))
    if isinstance(cause, StoreError):
        return RunFailure(c.Reason.INTERNAL_ERROR, f"state store: {cause}", permanent=False)
    return None


def fallback_failure(error: BaseException) -> RunFailure:
    if isinstance(error, RunFailure):
        return error
    return RunFailure(c.Reason.INTERNAL_ERROR, f"{type(error).__name__}: {error}", permanent=False)
