"""Cron schedules for CronFlows: the five fields of Kubernetes CronJobs, in a time zone.

    minute hour day-of-month month day-of-week        e.g. "0 2 * * *", "*/15 9-17 * * mon-fri"

Each field takes `*` (or `?`), numbers, ranges `a-b`, steps `*/n`, `a-b/n` and `a/n`, and lists of
them separated by commas; months and weekdays also by name (`jan`, `mon`), Sunday is 0 or 7. The
macros `@yearly` (`@annually`), `@monthly`, `@weekly`, `@daily` (`@midnight`) and `@hourly` stand for
their usual schedules. As in cron (and CronJob), when both day-of-month and day-of-week are
restricted (anything but `*` or `?`: `*/2` is restricted), a day matching either runs.

Times are wall-clock times in the CronFlow's `timeZone` (IANA, default UTC): across a daylight-saving
change, a time that does not exist that day (the hour skipped in spring) does not run, and a time
that happens twice (the hour repeated in autumn) runs once, the first time.

Pure and standard library only: the webhook, the operator and `kubectl flow` share it.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from flowkube_api import constants as c

MACROS = {"@yearly": "0 0 1 1 *", "@annually": "0 0 1 1 *", "@monthly": "0 0 1 * *",
          "@weekly": "0 0 * * 0", "@daily": "0 0 * * *", "@midnight": "0 0 * * *", "@hourly": "0 * * * *"}
_MONTHS = {n: i + 1 for i, n in enumerate(("jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct",
                                           "nov", "dec"))}
_DAYS = {n: i for i, n in enumerate(("sun", "mon", "tue", "wed", "thu", "fri", "sat"))}
# (name, lowest, highest, names)
_NONE: dict[str, int] = {}
_FIELDS = (("minute", 0, 59, _NONE), ("hour", 0, 23, _NONE), ("day of month", 1, 31, _NONE), ("month", 1, 12, _MONTHS),
           ("day of week", 0, 7, _DAYS))
SEARCH_YEARS = 5  # a schedule with no time in the next five years never runs (Feb 30): refused


class ScheduleError(ValueError):
    pass


def _value(text: str, lo: int, hi: int, names: dict[str, int], field: str) -> int:
    v = names.get(text.lower()) if names else None
    if v is None:
        if not (text.isascii() and text.isdigit()):
            raise ScheduleError(f"{field}: {text!r} is not a number" + (" or a name" if names else ""))
        v = int(text)
    if not lo <= v <= hi:
        raise ScheduleError(f"{field}: {v} is out of range {lo}-{hi}")
    return v


def _field(text: str, lo: int, hi: int, names: dict[str, int], field: str) -> frozenset[int]:
    out: set[int] = set()
    for part in text.split(","):
        if not part:
            raise ScheduleError(f"{field}: an empty list item")
        base, _, step_text = part.partition("/")
        step = 1
        if step_text:
            if not (step_text.isascii() and step_text.isdigit()) or int(step_text) == 0:
                raise ScheduleError(f"{field}: step {step_text!r} must be a positive number")
            step = int(step_text)
        if base in ("*", "?"):
            first, last = lo, hi
        elif "-" in base:
            a, _, b = base.partition("-")
            first, last = _value(a, lo, hi, names, field), _value(b, lo, hi, names, field)
            if first > last:
                raise ScheduleError(f"{field}: range {base!r} runs backwards")
        else:
            first = _value(base, lo, hi, names, field)
            last = hi if step_text else first
        out.update(range(first, last + 1, step))
    return frozenset(out)


@dataclass(frozen=True)
class Schedule:
    minutes: frozenset[int]
    hours: frozenset[int]
    days: frozenset[int]
    months: frozenset[int]
    weekdays: frozenset[int]  # 0 = Sunday
    day_restricted: bool
    weekday_restricted: bool
    zone: ZoneInfo

    def _day_matches(self, d: dt.date) -> bool:
        if d.month not in self.months:
            return False
        in_days, in_weekdays = d.day in self.days, (d.isoweekday() % 7) in self.weekdays
        if self.day_restricted and self.weekday_restricted:
            return in_days or in_weekdays
        return in_days and in_weekdays

    def next_after(self, after: dt.datetime) -> dt.datetime | None:
        """The first scheduled time strictly after ``after`` (aware), in UTC; None within SEARCH_YEARS."""
        utc_after = after.astimezone(dt.UTC)
        local = utc_after.astimezone(self.zone).replace(tzinfo=None, second=0, microsecond=0)
        day, hours, minutes = local.date(), sorted(self.hours), sorted(self.minutes)
        for _ in range(366 * SEARCH_YEARS + 2):
            if self._day_matches(day):
                for h in hours:
                    if day == local.date() and h < local.hour:
                        continue
                    for m in minutes:
                        wall = dt.datetime(day.year, day.month, day.day, h, m)
                        if wall < local:
                            continue
                        at = wall.replace(tzinfo=self.zone)  # fold=0: the first of a repeated time
                        if at.astimezone(dt.UTC).astimezone(self.zone).replace(tzinfo=None) != wall:
                            continue  # skipped by a daylight-saving change: it does not exist that day
                        utc = at.astimezone(dt.UTC)
                        if utc > utc_after:
                            return utc
            day += dt.timedelta(days=1)
        return None

    def latest_at_or_before(self, now: dt.datetime, since: dt.datetime) -> dt.datetime | None:
        """The latest scheduled time in (since, now]. Cheap however long ago `since` is: only the last
        stretch that has a time in it is walked (an hour, a day, a month, a year, five years)."""
        for window in (dt.timedelta(hours=1), dt.timedelta(days=1), dt.timedelta(days=32),
                       dt.timedelta(days=367), dt.timedelta(days=366 * SEARCH_YEARS)):
            start, latest = max(since, now - window), None
            t = self.next_after(start)
            while t is not None and t <= now:
                latest, t = t, self.next_after(t)
            if latest is not None or start == since:
                return latest
        return None

    def count_between(self, since: dt.datetime, now: dt.datetime, cap: int = 100) -> int:
        """How many scheduled times fall in (since, now], counting at most `cap`."""
        n, t = 0, self.next_after(since)
        while t is not None and t <= now and n < cap:
            n, t = n + 1, self.next_after(t)
        return n


def parse(schedule: str, time_zone: str | None = None) -> Schedule:
    """The schedule, or ScheduleError saying what is wrong with it."""
    try:
        zone = ZoneInfo(time_zone or "UTC")
    except (ZoneInfoNotFoundError, ValueError, OSError):  # OSError: a directory of zones ("America")
        raise ScheduleError(f"unknown time zone {time_zone!r} (an IANA name such as Europe/Berlin)") from None
    text = MACROS.get(schedule.strip().lower(), schedule.strip())
    if text.startswith("@"):
        raise ScheduleError(f"unknown macro {text!r} (known: {', '.join(sorted(MACROS))})")
    parts = text.split()
    if len(parts) != 5:
        raise ScheduleError(f"{len(parts)} fields; a schedule has five: minute hour day-of-month month day-of-week")
    values = [_field(p, lo, hi, names, name) for p, (name, lo, hi, names) in zip(parts, _FIELDS, strict=True)]
    weekdays = frozenset(d % 7 for d in values[4])
    # As CronJob's parser: a field is unrestricted only as `*` or `?` (a step makes it restricted).
    everything = ("*", "?", "*/1", "?/1")
    s = Schedule(values[0], values[1], values[2], values[3], weekdays,
                 day_restricted=parts[2] not in everything, weekday_restricted=parts[4] not in everything,
                 zone=zone)
    if s.next_after(dt.datetime(2000, 1, 1, tzinfo=dt.UTC)) is None:
        raise ScheduleError(f"{schedule!r} never runs (no such day in {SEARCH_YEARS} years)")
    return s


def flow_name(cronflow: str, scheduled: dt.datetime) -> str:
    """The Flow a CronFlow starts for a scheduled time: `<cronflow>-<minutes since the epoch>`, as
    CronJob names its Jobs. The same time always gives the same name, so a restart or a new leader
    never starts one time twice."""
    return f"{cronflow}-{int(scheduled.timestamp()) // 60}"


def cronflow_flow(cronflow: dict[str, Any], scheduled: dt.datetime, *, name: str | None = None,
                  triggered_by: str | None = None) -> dict[str, Any]:
    """The Flow a CronFlow starts for ``scheduled``: its flowTemplate, labelled with the CronFlow,
    annotated with the time, owned by it. The operator's (``name``: `flow_name`, the one Flow of that
    time) owns it with blockOwnerDeletion; `kubectl flow trigger`'s (``triggered_by``; ``name`` or a
    generated `<cronflow>-manual-...`) without, which needs the update permission on
    cronflows/finalizers that a user may lack, and says who started it."""
    meta, spec = cronflow["metadata"], cronflow.get("spec") or {}
    template = spec.get("flowTemplate") or {}
    tmeta = template.get("metadata") or {}
    annotations = {**(tmeta.get("annotations") or {}),
                   c.ANNOTATION_SCHEDULED: scheduled.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")}
    owner = {"apiVersion": c.API_VERSION, "kind": c.CRONFLOW_KIND, "name": meta["name"], "uid": meta["uid"],
             "controller": True}
    if triggered_by:
        annotations[c.ANNOTATION_TRIGGERED_BY] = triggered_by
    else:
        owner["blockOwnerDeletion"] = True
    return {
        "apiVersion": c.API_VERSION, "kind": c.KIND,
        "metadata": {
            **({"name": name} if name else {"generateName": f"{meta['name']}-manual-"}),
            "namespace": meta["namespace"],
            "labels": {**(tmeta.get("labels") or {}), c.LABEL_CRONFLOW: meta["name"]},
            "annotations": annotations,
            "ownerReferences": [owner],
        },
        "spec": template.get("spec") or {},
    }


__all__ = ["MACROS", "Schedule", "ScheduleError", "cronflow_flow", "flow_name", "parse"]
