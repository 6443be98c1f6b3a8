"""The base of every API model, and the one time type of the API.

Field names are camelCase on the wire (``startedAt``) and snake_case in Python (``started_at``).
Times are timezone-aware ``datetime`` objects in Python and RFC 3339 UTC to the second on the wire
(``2026-11-23T16:22:45Z``), the way Kubernetes writes its own timestamps.
"""

from __future__ import annotations

import datetime as dt
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, PlainSerializer, WithJsonSchema
from pydantic.alias_generators import to_camel

_ZERO = dt.timedelta(0)


def _utc_second(t: dt.datetime) -> dt.datetime:
    if not t.microsecond and t.utcoffset() == _ZERO:
        return t  # already UTC to the second (every time read off an object): the common case
    aware = t if t.tzinfo is not None else t.replace(tzinfo=dt.UTC)
    return aware.astimezone(dt.UTC).replace(microsecond=0)


def _rfc3339(t: dt.datetime) -> str:
    return t.isoformat(timespec="seconds")[:19] + "Z"  # the fields as given, like strftime, faster


Time = Annotated[dt.datetime, AfterValidator(_utc_second), PlainSerializer(_rfc3339, return_type=str, when_used="json")]


# Money: a decimal amount in USD, exact (never a float), a string on the wire ("0.00042").
MONEY_PATTERN = r"^[0-9]+(\.[0-9]+)?$"
MONEY_PLACES = Decimal("1e-12")  # finer than any price per token


def _money_text(d: Decimal) -> str:
    text = format(d.quantize(MONEY_PLACES), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def _money_value(d: Decimal) -> Decimal:
    if not d.is_finite() or d < 0:
        raise ValueError("an amount of money is a decimal number >= 0")
    return d


Money = Annotated[
    Decimal, AfterValidator(_money_value), PlainSerializer(_money_text, return_type=str, when_used="json"),
    WithJsonSchema({"type": "string", "pattern": MONEY_PATTERN}),
]


def parse_money(text: str) -> Decimal:
    """An amount written as text ("" is zero); ``ValueError`` when it is not a decimal number >= 0."""
    try:
        amount = Decimal(text.strip() or "0")
    except InvalidOperation:
        raise ValueError(f"not a decimal number: {text!r}") from None
    try:
        return _money_value(amount)
    except ValueError as e:
        raise ValueError(f"{e}, got {text!r}") from None


def money_text(d: Decimal) -> str:
    """An amount as written in the status and in messages ("0.00042")."""
    return _money_text(d)


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
