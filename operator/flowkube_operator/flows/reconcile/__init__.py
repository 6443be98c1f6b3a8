"""The level-based reconcile of one Flow, as a pure function: the state machine.

`plan()` looks at the Flow (spec and the status it wrote before), the runner pods that exist, and
the report of a run that just ended; it returns the status the Flow should have and the few
actions that bring the world there. It never assumes it saw every event: after an operator
restart, a missed watch event or a conflict it is simply called again and reaches the same plan.

Runs have deterministic pod names (`<flow>-<index>`), so a crash between creating a pod and
recording it is repaired by looking. A kickoff or a retry takes its inputs from what is already
durable (the spec, the earlier runs, recorded answers), so its pod is created first and the run is
recorded with its `startedAt` in one status write; a pod found under the next run's name was made
by such a start whose write was lost, and is adopted. A resume or a turn moves an answer or a
message out of an inbox, so the run is recorded first and its pod created after: the pod can only
carry what the status records (an "AlreadyExists" answer means the pod is already there).

The package, one concern per module; each concern is an object over the one `FlowState` of the
reconcile, given the concerns it calls (composed, not inherited):

- `rules`: the arithmetic of runs (usage, the budget, time run, backoff) and which ends are final;
- `state`: what one reconcile works on (`FlowState`), what it produces (`Plan`, `RunIntent`), and the
  moves every concern makes (start a run, stop a pod, end the flow);
- `feedback` and `conversation` (`Feedback`, `Conversation`): a pause for a person and its answer; a
  session and its messages;
- `warm` (`Warm`): a pod that stays up for the next message or the answer, and its warm reports;
- `runs` (`Runs`): how the active run ends, and what follows a failure or a disruption;
- here: `plan()` and `Reconciler`, the order of one reconcile and its phase switch (`_follow`: where
  the active run's pod stands; `_next`: what the Flow waits for, or which run starts next).

The inbox rules (when an answer or a message is refused) are in `flowkube_operator.flows.refusals`,
shared with the admission webhook; the conditions every plan ends with in `conditions`; pod views in
`meta`. All of it is pure (an import-linter contract in pyproject.toml keeps kopf, aiohttp and the
I/O modules out); `controller` reads the world and applies the plan.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from flowkube_api import constants as c
from flowkube_api.base import now as now_utc
from flowkube_api.base import parse_time
from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.models import Run
from flowkube_api.report import RunReport
from flowkube_operator.flows.conditions import describe
from flowkube_operator.flows.reconcile.conversation import Conversation
from flowkube_operator.flows.reconcile.feedback import Feedback
from flowkube_operator.flows.reconcile.forks import ForkSource
from flowkube_operator.flows.reconcile.rules import (
    DISRUPTION_REASONS,
    PERMANENT_REASONS,
    POD_FIRST_TRIGGERS,
    REPORTS_KEPT,
    STOP_GRACE_SECONDS,
    backoff_seconds,
    budget_spent,
    running_seconds,
    total_usage,
    trailing_failures,
)
from flowkube_operator.flows.reconcile.runs import Runs
from flowkube_operator.flows.reconcile.state import FlowState, NeedReport, Plan, RunIntent, Taken
from flowkube_operator.flows.reconcile.warm import Warm
from flowkube_operator.flows.refusals import validate_message, validate_response
from flowkube_operator.flows.resources import definition_name
from flowkube_operator.meta import Doomed, PodView

__all__ = [
    "DISRUPTION_REASONS", "PERMANENT_REASONS", "POD_FIRST_TRIGGERS", "REPORTS_KEPT", "STOP_GRACE_SECONDS",
    "Plan", "RunIntent", "Taken", "backoff_seconds", "budget_spent", "late_pods", "plan", "running_seconds",
    "total_usage", "trailing_failures", "validate_message", "validate_response",
]

Body = dict[str, Any]


def plan(flow: Body, pods: dict[str, PodView], report: RunReport | None = None, *,  # noqa: PLR0913 - keyword-only: what the caller read, each named
         now: dt.datetime | None = None, backoff_cap: int = 3600, report_checked: bool = False,
         late: Mapping[str, RunReport | None] | None = None, template: Body | Taken | None = None,
         fork: ForkSource | None = None, quota: str | None = None) -> Plan:
    """The status the Flow should have and the actions that make it so.

    `report` is the active run's report when the caller has read it (`report_checked`); a plan
    that needs it to end a run says so with `need_report`, and changes nothing until then.
    `late` holds the reports of closed runs whose pods outlived them (see `late_pods`), by pod,
    None where the pod left none. `template` is the FlowTemplate or ClusterFlowTemplate a Flow that has
    not taken one yet names, None when it is not there; for a Flow that took one already, a `Taken`:
    what the caller read (the spec of the snapshot its status.template names, or why it cannot be had).
    `fork`: for a fork that has not copied its checkpoint yet (`spec.forkFrom`, no `status.forkedFrom`),
    what the caller read of its origin. `quota`: why no run may start now (a FlowQuota covering the Flow
    is exhausted), None when one may.
    """
    state = FlowState(flow, pods, report, now or now_utc(), backoff_cap, report_checked, late or {}, template)
    state.fork = fork
    state.quota = quota
    return Reconciler(state).run()


def late_pods(status: Body, pods: Mapping[str, PodView]) -> list[str]:
    """Pods of closed runs that ended after their run was closed (stopped at the deadline, still
    finishing a model call, or ending after the final report the run was closed on): their stored
    report may hold calls the run's entry does not have yet. The runner writes nothing after its
    final report, but a runner image is the tenant's: a report written later is read here too, in
    case the state API's hint of it was lost with an operator restart (the same report again
    changes nothing)."""
    out = []
    for r in (status.get("runs") or []):
        pod = pods.get(r.get("pod", ""))
        closed = parse_time(r.get("finishedAt"))
        if pod is not None and closed is not None and pod.terminated and pod.finished_at and pod.finished_at > closed:
            out.append(pod.name)
    return out


class Reconciler:
    """The order of one reconcile: late reports first, then the active run, then what comes next,
    then the endings (TTL, old reports) and the conditions. The phase switch is here: `_follow` (a
    run is active: where its pod stands) and `_next` (none is: what the Flow waits for, or the next
    run). The concerns it calls are composed over one `FlowState`, each in its own module."""

    def __init__(self, s: FlowState) -> None:
        self.s = s
        self.feedback = Feedback(s)
        self.conversation = Conversation(s)
        self.warm = Warm(s, self.feedback, self.conversation)
        self.runs = Runs(s, self.feedback, self.conversation)

    def run(self) -> Plan:
        try:
            return self._run()
        except NeedReport:
            return Plan(status=self.s.old, need_report=True)

    def _run(self) -> Plan:
        s = self.s
        st = s.st
        st.observed_generation = s.meta.get("generation")
        if (s.own_spec.get("templateRef") and st.template is None and st.phase not in c.TERMINAL_PHASES
                and not s.take_template()):
            self._finish()
            return s.plan
        if s.taken_problem is not None and st.phase not in c.TERMINAL_PHASES:
            # Never run anything but what it took: the Flow fails, naming the snapshot.
            s.terminal(Phase.FAILED, Reason.TEMPLATE_SNAPSHOT_UNUSABLE, s.taken_problem)
            for name in list(s.pods):
                s.stop_pod(name)
            self._finish()
            return s.plan
        if (s.spec.fork_from is not None and st.forked_from is None and not s.runs
                and st.phase not in c.TERMINAL_PHASES):
            s.take_fork()
            self._finish()
            return s.plan
        if s.taken_problem is None:  # (an ended Flow whose snapshot is gone keeps the name it had)
            st.definition = definition_name(s.spec.model_dump(by_alias=True, exclude_none=True))
        st.started_at = st.started_at or s.now
        self.runs.fold_late_reports()
        if s.fb.request is None:
            self.feedback.refuse_stray_response()  # answered before anything asked: never applied to a later request
        self.conversation.refuse_untimely_message()
        reported = self._lingering_after_report()
        if st.phase in c.TERMINAL_PHASES:
            # A runner pod still alive after the end (the operator stopped between the final status
            # write and the delete) is stopped now: nothing it does can count any more. A pod whose
            # run ended on its final report is ending by itself.
            s.plan.delete_pods += [Doomed(n, v.uid) for n, v in s.pods.items()
                                   if not v.terminated and not v.deleting and n not in reported]
            self._expire()
        else:
            active = s.runs[-1] if s.runs and s.runs[-1].finished_at is None else None
            if active is not None:
                self._follow(active)
            if st.phase not in c.TERMINAL_PHASES and (not s.runs or s.runs[-1].finished_at):
                self._next()
        self._finish()
        return s.plan

    def _follow(self, run: Run) -> None:
        """The active run: its pod is still to be made, gone, ended, waiting warm, or running."""
        s = self.s
        pod = s.pods.get(run.pod)
        if pod is not None and run.started_at is None:
            run.started_at = pod.created_at or s.now
        if pod is None and run.started_at is None:
            # Recorded but never seen: the pod was not created yet (or the cache lags). Ensure it;
            # the record holds everything it carries, so its startedAt comes in the same write. A
            # run held by an exhausted quota waits for it.
            if s.quota is not None:
                s.hold_for_quota()
                return
            s.plan.create_pod = s.intent(len(s.runs) - 1, run.trigger, first=True)
            s.st.phase = Phase.PENDING
        elif pod is None:
            self.runs.follow_gone(run)
        elif pod.terminated:
            self.runs.follow_ended(run, pod)
        elif (final := self.runs.final_report(run)) is not None:
            self.runs.follow_reported(run, final)
        elif not self.warm.follow(run):
            self.runs.follow_running(run, pod)

    def _next(self) -> None:
        """No run is active: adopt a pod made by a lost start, wait, or start the next run."""
        s = self.s
        if self.runs.adopt():
            return
        if s.spec.suspend:
            if s.fb.request is None:
                s.st.phase = Phase.SUSPENDED
        elif s.fb.request is not None:
            self.feedback.await_answer()
        elif not s.runs:
            s.start(Trigger.FORK if s.st.forked_from is not None else Trigger.KICKOFF)
        elif s.runs[-1].result == RunResult.FAILED:
            self.runs.retry(s.runs[-1])
        elif s.runs[-1].result == RunResult.PAUSED:
            # Paused run whose request was already answered: a resume run is recorded right away, so
            # this only happens when its warm pod ended before taking the answer (resume now) or the
            # resume was refused (nothing to do until a new answer).
            if s.resume_now:
                s.start(Trigger.RESUME)
            else:
                s.st.phase = Phase.AWAITING_FEEDBACK
        elif s.conv is not None and s.conv.session_id:
            self.conversation.await_message()

    def _lingering_after_report(self) -> set[str]:
        """Pods whose run ended on their final report: each is ending by itself, and is stopped only
        if it is still running STOP_GRACE_SECONDS later (it hangs on its way out)."""
        s = self.s
        pods = set()
        for r in s.runs:
            pod = s.pods.get(r.pod)
            if not r.closed_on_report or r.finished_at is None or pod is None or pod.terminated or pod.deleting:
                continue
            pods.add(r.pod)
            left = (r.finished_at - s.now).total_seconds() + STOP_GRACE_SECONDS
            if left <= 0:
                s.plan.delete_pods.append(Doomed(r.pod, pod.uid))
            else:
                s.plan.later(left)
        return pods

    def _expire(self) -> None:
        s = self.s
        ttl = s.spec.ttl_seconds_after_finished
        finished = s.st.finished_at
        if ttl is None or finished is None:
            return
        left = (finished + dt.timedelta(seconds=ttl) - s.now).total_seconds()
        if left <= 0:
            s.plan.delete_flow = Doomed(s.meta.get("name", ""), s.meta.get("uid", ""))
        else:
            s.plan.later(left)

    def _prune_reports(self) -> None:
        """Old runs' reports, once a new run starts at a multiple of REPORTS_KEPT: only closed runs
        whose pods are gone or ended (a late report of theirs was folded when their pod ended)."""
        s = self.s
        intent, n = s.plan.create_pod, len(s.runs)
        if intent is None or intent.index != n - 1 or n < 2 * REPORTS_KEPT or intent.index % REPORTS_KEPT:
            return
        for r in s.runs[n - 2 * REPORTS_KEPT - 1:n - REPORTS_KEPT - 1]:
            pod = s.pods.get(r.pod)
            if r.finished_at is not None and (pod is None or pod.terminated):
                s.plan.prune_reports.append(r.pod)

    def _finish(self) -> None:
        s = self.s
        self._prune_reports()
        st = s.st
        st.runs = s.runs or None
        usage = total_usage(s.runs)
        st.usage = usage if s.runs else st.usage
        st.feedback = s.fb if (s.fb.request or s.fb.history or s.fb.response) else None
        if st.phase is None:
            st.phase = Phase.PENDING
        if st.conversation is not None and st.conversation.session_id is None and st.conversation.inbox is None:
            st.conversation = None  # only a refused message's inbox was there
        describe(st, s.old, s.failure, s.refusal, message_refusal=s.message_refusal,
                 generation=s.meta.get("generation"), now=s.now)
