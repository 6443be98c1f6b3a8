"""The base of every API model, and the one time type of the API.

Field names are camelCase on the wire (``startedAt``) and snake_case in Python (``started_at``).
Times are timezone-aware ``datetime`` objects in Python and RFC 3339 UTC to the second on the wire
(``2026-11-23T16:22:45Z``), the way Kubernetes writes its own timestamps.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainSerializer
from pydantic.alias_generators import to_camel


def _utc_second(t: dt.datetime) -> dt.datetime:
    aware = t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)
    return aware.astimezone(dt.UTC).replace(microsecond=0)


def _rfc3339(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


Time = Annotated[dt.datetime, AfterValidator(_utc_second), PlainSerializer(_rfc3339, return_type=str, when_used="json")]


def now() -> dt.datetime:
    """The current time as the API holds it (UTC, whole seconds)."""
    return _utc_second(dt.datetime.now(dt.UTC))


def parse_time(text: str | None) -> dt.datetime | None:
    """A timestamp read off a Kubernetes object (``creationTimestamp``, ``finishedAt``, ...)."""
    return _utc_second(dt.datetime.fromisoformat(text)) if text else None


class Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")

    def dump(self) -> dict[str, Any]:
        """JSON-ready dict with the API's camelCase names, unset fields left out."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")
