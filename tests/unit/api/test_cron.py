"""Cron schedules: CronJob's five fields, names, macros, the day-of-month/day-of-week rule, time zones."""

from __future__ import annotations

import datetime as dt

import pytest

from flowkube_api import cron


def at(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=dt.UTC)


@pytest.mark.parametrize(("schedule", "after", "expected"), [
    ("* * * * *", "2026-11-27T10:00:30", "2026-11-27T10:01:00"),
    ("*/15 * * * *", "2026-11-27T10:00:00", "2026-11-27T10:15:00"),
    ("0 2 * * *", "2026-11-27T02:00:00", "2026-11-28T02:00:00"),
    ("30 9-17/4 * * mon-fri", "2026-11-27T17:31:00", "2026-11-30T09:30:00"),  # Friday evening: Monday
    ("0 0 1 jan,jul *", "2026-11-27T00:00:00", "2027-01-01T00:00:00"),
    ("0 0 13 * 5", "2026-11-01T00:00:00", "2026-11-06T00:00:00"),  # both restricted: the 13th OR a Friday
    ("0 0 * * 7", "2026-11-27T00:00:00", "2026-11-29T00:00:00"),  # 7 is Sunday too
    ("0 0 ? * sun", "2026-11-27T00:00:00", "2026-11-29T00:00:00"),
    ("@hourly", "2026-11-27T10:59:59", "2026-11-27T11:00:00"),
    ("@monthly", "2026-11-27T10:00:00", "2026-12-01T00:00:00"),
    ("@yearly", "2026-11-27T10:00:00", "2027-01-01T00:00:00"),
    ("0 0 29 2 *", "2026-11-27T00:00:00", "2028-02-29T00:00:00"),
])
def test_next_times(schedule: str, after: str, expected: str) -> None:
    assert cron.parse(schedule).next_after(at(after)) == at(expected)


def test_a_time_zone_and_its_daylight_saving_changes() -> None:
    berlin = cron.parse("30 2 * * *", "Europe/Berlin")
    # 2026-03-29: 02:00 becomes 03:00, 02:30 does not exist that day and does not run.
    assert berlin.next_after(at("2026-03-28T12:00:00")) == at("2026-03-30T00:30:00")
    # 2026-10-25: 03:00 becomes 02:00 again, 02:30 happens twice and runs once, the first time.
    first = berlin.next_after(at("2026-10-24T12:00:00"))
    assert first == at("2026-10-25T00:30:00")
    assert berlin.next_after(first) == at("2026-10-26T01:30:00")
    assert cron.parse("0 9 * * *", "America/New_York").next_after(at("2026-11-27T00:00:00")) == at(
        "2026-11-27T14:00:00")


def test_the_latest_time_missed_is_found_cheaply_however_long_ago() -> None:
    every = cron.parse("* * * * *")
    now = at("2026-11-27T10:00:30")
    assert every.latest_at_or_before(now, now - dt.timedelta(days=365)) == at("2026-11-27T10:00:00")
    assert every.count_between(now - dt.timedelta(days=365), now) == 100, "counted to 100 at most"
    assert every.latest_at_or_before(now, at("2026-11-27T10:00:00")) is None, "(since, now]: since excluded"
    leap = cron.parse("0 0 29 2 *")
    assert leap.latest_at_or_before(now, at("2020-01-01T00:00:00")) == at("2024-02-29T00:00:00")


@pytest.mark.parametrize(("schedule", "zone", "message"), [
    ("* * * *", None, "4 fields; a schedule has five"),
    ("60 * * * *", None, "minute: 60 is out of range 0-59"),
    ("* * * foo *", None, "month: 'foo' is not a number or a name"),
    ("*/0 * * * *", None, "minute: step '0' must be a positive number"),
    ("5-1 * * * *", None, "minute: range '5-1' runs backwards"),
    ("0 0 30 2 *", None, "never runs"),
    ("@every 5m", None, "unknown macro"),
    ("* * * * *", "Mars/Olympus", "unknown time zone 'Mars/Olympus'"),
])
def test_bad_schedules_say_what_is_wrong(schedule: str, zone: str | None, message: str) -> None:
    with pytest.raises(cron.ScheduleError, match=message):
        cron.parse(schedule, zone)


def test_a_scheduled_times_flow_name_is_the_same_every_time() -> None:
    t = at("2026-11-27T02:00:00")
    assert cron.flow_name("nightly", t) == cron.flow_name("nightly", t) == f"nightly-{int(t.timestamp()) // 60}"
    assert len(cron.flow_name("x" * 52, at("2160-01-01T00:00:00"))) <= 63


def test_a_stepped_day_field_is_restricted_as_in_cronjob_and_odd_input_is_a_schedule_error() -> None:
    # */2 in day-of-month is restricted: the odd days OR Mondays (CronJob's parser agrees).
    s = cron.parse("0 0 */2 * mon")
    assert s.next_after(at("2026-11-27T00:00:00")) == at("2026-11-29T00:00:00")  # Sunday the 29th: odd
    assert s.next_after(at("2026-11-29T00:00:00")) == at("2026-11-30T00:00:00")  # Monday the 30th
    for schedule, zone in (("² * * * *", None), ("*/² * * * *", None), ("* * * * *", "America")):
        with pytest.raises(cron.ScheduleError):
            cron.parse(schedule, zone)
