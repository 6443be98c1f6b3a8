"""Quota windows across time zones, daylight-saving changes and month ends (issue 41's FlowQuota)."""

from __future__ import annotations

import datetime as dt
from zoneinfo import ZoneInfo

import pytest

from flowkube_api.windows import BUCKET, WindowError, WindowSpec, bucket_of, resets_at, window_at

UTC = dt.UTC


def at(zone: str, year: int, month: int, day: int, hour: int = 0, minute: int = 0, fold: int = 0) -> dt.datetime:
    return dt.datetime(year, month, day, hour, minute, tzinfo=ZoneInfo(zone), fold=fold)


def hours(w: tuple[dt.datetime | None, dt.datetime | None]) -> float:
    start, end = w
    assert start is not None and end is not None
    return (end - start).total_seconds() / 3600


def test_a_calendar_day_in_a_zone_is_23_or_25_hours_across_daylight_saving_changes() -> None:
    berlin = WindowSpec("Day", "Europe/Berlin")
    spring = window_at(berlin, at("Europe/Berlin", 2026, 3, 29, 12))
    assert spring.start == dt.datetime(2026, 3, 28, 23, tzinfo=UTC) and hours((spring.start, spring.end)) == 23
    autumn = window_at(berlin, at("Europe/Berlin", 2026, 10, 25, 2, 30, fold=1))  # the repeated hour, second time
    assert autumn.start == dt.datetime(2026, 10, 24, 22, tzinfo=UTC) and hours((autumn.start, autumn.end)) == 25
    assert autumn.holds(at("Europe/Berlin", 2026, 10, 25, 2, 30, fold=0).astimezone(UTC))
    assert resets_at(berlin, at("Europe/Berlin", 2026, 10, 25, 23, 59)) == dt.datetime(2026, 10, 25, 23, tzinfo=UTC)


def test_a_day_whose_midnight_does_not_exist_starts_at_the_change() -> None:
    # Chile moves its clocks from 24:00 to 01:00 on the first Sunday of September.
    santiago = WindowSpec("Day", "America/Santiago")
    w = window_at(santiago, at("America/Santiago", 2026, 9, 6, 1, 30))
    assert w.start == dt.datetime(2026, 9, 6, 4, tzinfo=UTC)  # 00:00 at -04, the instant of the change
    assert hours((w.start, w.end)) == 23
    before = window_at(santiago, w.start - dt.timedelta(seconds=1))
    assert before.end == w.start, "no gap and no overlap between consecutive windows"


def test_weeks_and_months_end_where_the_calendar_says() -> None:
    week = window_at(WindowSpec("Week", "UTC"), dt.datetime(2026, 11, 28, 9, tzinfo=UTC))  # a Saturday
    assert (week.start, week.end) == (dt.datetime(2026, 11, 23, tzinfo=UTC), dt.datetime(2026, 11, 30, tzinfo=UTC))
    sunday = window_at(WindowSpec("Week", "UTC", week_starts="Sunday"), dt.datetime(2026, 11, 28, 9, tzinfo=UTC))
    assert sunday.start == dt.datetime(2026, 11, 22, tzinfo=UTC)
    feb = window_at(WindowSpec("Month", "Europe/Berlin"), at("Europe/Berlin", 2028, 2, 29, 23, 59))
    assert (feb.start, feb.end) == (dt.datetime(2028, 1, 31, 23, tzinfo=UTC), dt.datetime(2028, 2, 29, 23, tzinfo=UTC))
    dec = window_at(WindowSpec("Month", "America/New_York"), at("America/New_York", 2026, 12, 31, 20))
    assert dec.end == dt.datetime(2027, 1, 1, 5, tzinfo=UTC)


def test_every_calendar_edge_falls_on_a_quarter_hour_bucket_and_rolling_windows_move_in_quarters() -> None:
    now = dt.datetime(2026, 11, 28, 7, 44, 10, tzinfo=UTC)
    for zone in ("Asia/Kathmandu", "Asia/Kolkata", "Australia/Eucla", "Pacific/Chatham", "America/St_Johns", "UTC"):
        for kind in ("Day", "Week", "Month"):  # type: Kind
            w = window_at(WindowSpec(kind, zone), now)
            assert w.start is not None and w.end is not None
            assert bucket_of(w.start) == w.start and bucket_of(w.end) == w.end, (zone, kind)
    assert bucket_of(now) == dt.datetime(2026, 11, 28, 7, 30, tzinfo=UTC)
    rolling = window_at(WindowSpec("Rolling", hours=24), now)
    assert rolling.start == dt.datetime(2026, 11, 27, 7, 30, tzinfo=UTC) and rolling.end is None
    # A charge 23 h 57 min old still counts (its quarter hour is in); one 24 h 15 min old does not.
    assert rolling.holds(bucket_of(now - dt.timedelta(hours=23, minutes=57))) and rolling.holds(bucket_of(now))
    assert not rolling.holds(bucket_of(now - dt.timedelta(hours=24, minutes=15)))
    assert resets_at(WindowSpec("Rolling", hours=24), now) is None
    assert window_at(WindowSpec("Lifetime"), now).holds(dt.datetime(1999, 1, 1, tzinfo=UTC))
    assert dt.timedelta(minutes=15) == BUCKET


@pytest.mark.parametrize(("spec", "field"), [
    (WindowSpec("Day", "Mars/Olympus"), "window.timeZone"),
    (WindowSpec("Day", "America"), "window.timeZone"),
    (WindowSpec("Rolling"), "window.hours"),
    (WindowSpec("Rolling", hours=10_000), "window.hours"),
    (WindowSpec("Day", hours=3), "window.hours"),
    (WindowSpec("Fortnight"), "window.kind"),  # type: ignore[arg-type]
    (WindowSpec("Week", week_starts="Caturday"), "window.weekStarts"),
])
def test_a_window_that_cannot_be_used_is_refused_naming_its_field(spec: WindowSpec, field: str) -> None:
    with pytest.raises(WindowError, match=field):
        spec.check()
