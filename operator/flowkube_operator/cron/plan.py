"""The level-based reconcile of one CronFlow, as a pure function: which Flow to start, which to delete.

`plan()` looks at the CronFlow (spec and the status it wrote before), the Flows it started (from the
operator's Flow cache: label `flowkube.io/cronflow`, owned by the CronFlow's uid) and the time; it
returns the status the CronFlow should have and the few actions that bring the world there. As for
Flows, it never assumes it saw every event:

- **One Flow per scheduled time.** A time's Flow is named `<cronflow>-<minutes since the epoch>`
  (`flowkube_api.cron.flow_name`): an operator restart, a new leader or a status write lost after a
  create finds it instead of starting another. Only the latest time since `lastScheduleTime` is
  considered, as CronJob does: while the operator was down, the times it missed are not all started
  one after another; the most recent is, if it is within `startingDeadlineSeconds`.
- **Concurrency:** `Forbid` with a Flow still running starts nothing (`lastSkipped`, an Event); the
  time is taken up when the running Flow ends, if still within the starting deadline. `Replace`
  deletes the running Flows and starts the new one.
- **The order of writes** (`cron.controller.CronFlows`): the new Flow is created first, then the
  Events of the plan's decisions are posted, then the status (`lastScheduleTime`, the usage folded
  in) is written, then Flows are deleted. A crash after the create finds the Flow by its name; a
  crash before the status write decides again and posts its Events again (at least once); a crash
  after the status write finds the uids in `pruning` and deletes without folding again.
- **History:** the newest `successfulFlowsHistoryLimit` (3) Succeeded and `failedFlowsHistoryLimit`
  (1) Failed Flows are kept, older ones deleted. A Flow's usage goes into `status.prunedUsage` in the
  status write before its delete (its uid in `status.pruning` until it is gone), so the CronFlow's
  `status.usage` keeps every token of every Flow it started, each once, whatever is interrupted.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from flowkube_api import cron
from flowkube_api.base import parse_time
from flowkube_api.models import CronFlowSkip, CronFlowSpec, CronFlowStatus, Usage
from flowkube_operator.meta import Doomed, owner_uid

Body = dict[str, Any]
DEFAULT_SUCCEEDED_KEPT = 3
DEFAULT_FAILED_KEPT = 1
ENDED = ("Succeeded", "Failed")


@dataclass(frozen=True)
class Child:
    """A Flow the CronFlow started, as the plan needs it."""

    name: str
    uid: str
    phase: str
    scheduled: dt.datetime | None
    created: dt.datetime | None
    finished_at: dt.datetime | None
    usage: Usage | None
    deleting: bool = False
    owner: str = ""  # the uid of the CronFlow that controls it

    @classmethod
    def of(cls, flow: Body) -> Child:
        meta, st = flow.get("metadata") or {}, flow.get("status") or {}
        usage = st.get("usage")
        return cls(name=meta.get("name", ""), uid=meta.get("uid", ""), phase=st.get("phase") or "Pending",
                   scheduled=parse_time((meta.get("annotations") or {}).get("flowkube.io/scheduled-at")),
                   created=parse_time(meta.get("creationTimestamp")), finished_at=parse_time(st.get("finishedAt")),
                   usage=Usage.model_validate(usage) if usage else None,
                   deleting=bool(meta.get("deletionTimestamp")), owner=owner_uid(meta))

    @property
    def ended(self) -> bool:
        return self.phase in ENDED

    @property
    def when(self) -> dt.datetime:
        return self.scheduled or self.created or dt.datetime.min.replace(tzinfo=dt.UTC)


@dataclass
class CronPlan:
    status: CronFlowStatus
    old: CronFlowStatus  # the status before: what was said already
    create: tuple[str, dt.datetime] | None = None  # (Flow name, scheduled time)
    delete: list[Doomed] = field(default_factory=list)  # Flows, by the uid seen: Replace's running ones, pruned
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None


def plan(cronflow: Body, children: list[Child], now: dt.datetime, refused: str | None = None) -> CronPlan:
    """``refused``: why the API server refused the Flow an earlier plan of this reconcile would start
    (that time is then skipped for now, and nothing is replaced for it)."""
    meta = cronflow.get("metadata") or {}
    spec = CronFlowSpec.model_validate(cronflow.get("spec") or {})
    old = CronFlowStatus.model_validate(cronflow.get("status") or {})
    st = CronFlowStatus.model_validate(cronflow.get("status") or {})
    p = CronPlan(status=st, old=old)
    st.observed_generation = meta.get("generation")
    _prune(spec, st, children, p)
    doomed = {d.name for d in p.delete}
    live = [ch for ch in children if not ch.deleting and ch.name not in doomed]
    succeeded = [ch.finished_at for ch in children if ch.phase == "Succeeded" and ch.finished_at]
    if succeeded:
        st.last_successful_time = max([*succeeded, *([st.last_successful_time] if st.last_successful_time else [])])
    try:
        schedule = cron.parse(spec.schedule, spec.time_zone)
    except cron.ScheduleError as e:  # refused at apply by the webhook; without it, said here
        _skip(p, now, "InvalidSchedule", f"spec.schedule: {e}")
        _finish(st, live, p)
        return p
    if not spec.suspend:
        since = st.last_schedule_time or parse_time(meta.get("creationTimestamp")) or now
        _schedule(str(meta.get("name", "")), spec, schedule, (children, live), p, (now, since), refused)
        following = schedule.next_after(now)
        if following is not None:
            p.requeue_after = max((following - now).total_seconds(), 0.05)
    _finish(st, live, p)
    return p


def _schedule(name: str, spec: CronFlowSpec, schedule: cron.Schedule, flows: tuple[list[Child], list[Child]],
              p: CronPlan, times: tuple[dt.datetime, dt.datetime], refused: str | None) -> None:
    """Start the latest time due, if it may start. ``flows``: (all its Flows, those not being deleted);
    ``times``: (now, the time after which times are due)."""
    (children, live), (now, since), st = flows, times, p.status
    due = schedule.latest_at_or_before(now, since)
    if due is None:
        return
    flow = cron.flow_name(name, due)
    policy = spec.concurrency_policy or "Allow"
    if any(ch.name == flow for ch in children):  # started already (the status write after its create was lost)
        st.last_schedule_time = due
        if policy == "Replace":  # and the Flows it replaces may not have been deleted
            _replace(p, [ch for ch in live if not ch.ended and ch.name != flow])
        return
    late = (now - due).total_seconds()
    if spec.starting_deadline_seconds is not None and late > spec.starting_deadline_seconds:
        _skip(p, due, "MissedDeadline", f"{due:%Y-%m-%dT%H:%M:%SZ} was missed by {late:.0f} s, over "
              f"startingDeadlineSeconds={spec.starting_deadline_seconds}")
        return
    if refused is not None:
        _skip(p, due, "FailedCreate", f"Flow {flow}: {refused}")
        return
    running = [ch for ch in live if not ch.ended]
    if running and policy == "Forbid":
        _skip(p, due, "ConcurrencyForbidden", f"{', '.join(ch.name for ch in running)} still running "
              "(concurrencyPolicy: Forbid)")
        return
    missed = schedule.count_between(since, now)
    if missed > 1:
        p.events.append(("Warning", "MissedSchedules", f"{missed if missed < 100 else 'over 100'} scheduled times "
                         f"passed since {since:%Y-%m-%dT%H:%M:%SZ}; starting only the latest, "
                         f"{due:%Y-%m-%dT%H:%M:%SZ}"))
    if policy == "Replace":
        _replace(p, running)
    p.create = (flow, due)
    st.last_schedule_time = due
    p.events.append(("Normal", "Started", f"Flow {flow} for {due:%Y-%m-%dT%H:%M:%SZ}"))


def _replace(p: CronPlan, running: list[Child]) -> None:
    """concurrencyPolicy Replace: the running Flows are deleted, with the usage they have now (folded in once)."""
    if not running:
        return
    for ch in running:
        _fold(p.status, ch)
    p.delete += [Doomed(ch.name, ch.uid) for ch in running]
    p.events.append(("Normal", "Replaced", f"deleted {', '.join(ch.name for ch in running)} "
                     "(concurrencyPolicy: Replace)"))


def _skip(p: CronPlan, when: dt.datetime, reason: str, message: str) -> None:
    p.status.last_skipped = CronFlowSkip(time=when, reason=reason, message=message)
    old = p.old.last_skipped
    if old is None or (old.time, old.reason) != (when, reason):
        p.events.append(("Warning", reason, message))


def _fold(st: CronFlowStatus, ch: Child) -> None:
    """A Flow the CronFlow deletes: its usage into prunedUsage, once (its uid in `pruning` until it is gone)."""
    pruning = set(st.pruning or [])
    if ch.uid in pruning:
        return
    st.pruning = sorted(pruning | {ch.uid})
    if ch.usage is not None:
        st.pruned_usage = (st.pruned_usage or Usage()) + ch.usage


def _prune(spec: CronFlowSpec, st: CronFlowStatus, children: list[Child], p: CronPlan) -> None:
    """Ended Flows over the history limits are deleted, newest kept, each one's usage folded in once."""
    present = {ch.uid for ch in children}
    st.pruning = sorted(set(st.pruning or []) & present) or None  # gone: nothing more to remember
    limits = {"Succeeded": spec.successful_flows_history_limit, "Failed": spec.failed_flows_history_limit}
    defaults = {"Succeeded": DEFAULT_SUCCEEDED_KEPT, "Failed": DEFAULT_FAILED_KEPT}
    for phase, limit in limits.items():
        ended = sorted((ch for ch in children if ch.phase == phase), key=lambda ch: ch.when, reverse=True)
        for ch in ended[defaults[phase] if limit is None else limit:]:
            _fold(st, ch)
    # Every Flow decided on (pruned, or replaced by an earlier reconcile whose delete was lost) goes.
    decided = set(st.pruning or [])
    p.delete += [Doomed(ch.name, ch.uid) for ch in children if ch.uid in decided and not ch.deleting]


def _finish(st: CronFlowStatus, live: list[Child], p: CronPlan) -> None:
    doomed = {d.name for d in p.delete}
    active = {ch.name for ch in live if not ch.ended and ch.name not in doomed}
    if p.create is not None:
        active.add(p.create[0])
    st.active = sorted(active) or None
    pruning = set(st.pruning or [])
    total = st.pruned_usage or Usage()
    for ch in live:
        if ch.uid not in pruning and ch.usage is not None:
            total = total + ch.usage
    st.usage = total if total != Usage() else None
