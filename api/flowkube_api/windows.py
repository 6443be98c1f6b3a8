"""The time windows a spend quota counts over (issue 41's FlowQuota): a calendar day, week or month in a
time zone, a rolling number of hours, or the whole lifetime. Pure: no I/O, standard library only.

A calendar window starts at the first instant whose local date is its first day, so the days of a
daylight-saving change are 23 or 25 hours long, and a day whose midnight does not exist (a change at
00:00, as in America/Santiago) starts at the change. ``resets_at`` is when a calendar window ends;
a rolling window never resets at once: each charge leaves it ``hours`` after it was made.

Charges are counted in quarter-hour buckets (``bucket_of``): every time zone in use has an offset
that is a whole number of quarter hours, so a calendar window's edges always fall on a bucket's
edge and a bucket lies wholly inside or outside it. A rolling window counts the buckets that begin
within its span, the one its trailing edge falls in included: a charge leaves it up to a quarter
hour after ``hours`` have passed, never before.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Literal
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

Kind = Literal["Day", "Week", "Month", "Rolling", "Lifetime"]
KINDS: tuple[Kind, ...] = ("Day", "Week", "Month", "Rolling", "Lifetime")
BUCKET = dt.timedelta(minutes=15)
ROLLING_HOURS_LIMIT = 24 * 366
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


class WindowError(ValueError):
    """A window that cannot be computed; the message names the field."""


@dataclass(frozen=True)
class Window:
    """``[start, end)``: None at an open side (a lifetime window has neither; a rolling one no end)."""

    start: dt.datetime | None
    end: dt.datetime | None

    def holds(self, t: dt.datetime) -> bool:
        return (self.start is None or t >= self.start) and (self.end is None or t < self.end)


@dataclass(frozen=True)
class WindowSpec:
    kind: Kind
    time_zone: str = "UTC"
    hours: int | None = None  # Rolling only
    week_starts: str = "Monday"  # Week only

    def zone(self) -> ZoneInfo:
        try:
            return ZoneInfo(self.time_zone)
        except (ZoneInfoNotFoundError, ValueError, OSError):
            raise WindowError(f"window.timeZone: {self.time_zone!r} is not an IANA time zone") from None

    def check(self) -> None:
        """Raise ``WindowError`` naming the field when the spec cannot be used."""
        if self.kind not in KINDS:
            raise WindowError(f"window.kind: {self.kind!r} is not one of {', '.join(KINDS)}")
        self.zone()
        if self.kind == "Rolling" and not (self.hours and 1 <= self.hours <= ROLLING_HOURS_LIMIT):
            raise WindowError(f"window.hours: a Rolling window needs 1-{ROLLING_HOURS_LIMIT} hours")
        if self.kind != "Rolling" and self.hours is not None:
            raise WindowError("window.hours: only a Rolling window has hours")
        if self.week_starts not in WEEKDAYS:
            raise WindowError(f"window.weekStarts: {self.week_starts!r} is not a day of the week")


def _local_midnight(day: dt.date, zone: ZoneInfo) -> dt.datetime:
    """The first instant of ``day`` in ``zone`` (fold 0: the earlier of a repeated midnight, and for a
    midnight in a gap the instant of the change itself), in UTC."""
    return dt.datetime(day.year, day.month, day.day, tzinfo=zone).astimezone(dt.UTC)


def _first_day(spec: WindowSpec, day: dt.date) -> dt.date:
    if spec.kind == "Week":
        back = (day.weekday() - WEEKDAYS.index(spec.week_starts)) % 7
        return day - dt.timedelta(days=back)
    if spec.kind == "Month":
        return day.replace(day=1)
    return day


def _next_first_day(spec: WindowSpec, first: dt.date) -> dt.date:
    if spec.kind == "Week":
        return first + dt.timedelta(days=7)
    if spec.kind == "Month":
        return (first.replace(day=28) + dt.timedelta(days=4)).replace(day=1)
    return first + dt.timedelta(days=1)


def window_at(spec: WindowSpec, now: dt.datetime) -> Window:
    """The window ``now`` (aware) falls in."""
    spec.check()
    if spec.kind == "Lifetime":
        return Window(None, None)
    if spec.kind == "Rolling":
        assert spec.hours is not None
        # The quarter hour the window's edge falls in counts whole: a charge leaves up to a quarter hour
        # late, never early (no overspend).
        return Window(bucket_of(now - dt.timedelta(hours=spec.hours)), None)
    zone = spec.zone()
    local = now.astimezone(zone).date()
    first = _first_day(spec, local)
    start, end = _local_midnight(first, zone), _local_midnight(_next_first_day(spec, first), zone)
    if now < start:  # a local date whose midnight came after a gap: still the previous window
        first = _first_day(spec, first - dt.timedelta(days=1))
        start, end = _local_midnight(first, zone), _local_midnight(_next_first_day(spec, first), zone)
    return Window(start, end)


def resets_at(spec: WindowSpec, now: dt.datetime) -> dt.datetime | None:
    """When the window ``now`` falls in ends and a new one starts from nothing (None: rolling, lifetime)."""
    return window_at(spec, now).end if spec.kind not in ("Rolling", "Lifetime") else None


def bucket_of(t: dt.datetime) -> dt.datetime:
    """The quarter hour (UTC) a charge made at ``t`` is counted in."""
    quarters = (t.astimezone(dt.UTC) - _EPOCH) // BUCKET
    return _EPOCH + quarters * BUCKET
