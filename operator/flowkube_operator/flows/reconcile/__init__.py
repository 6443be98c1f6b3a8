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

The package, one concern per module, each building on the ones before it:

- `rules`: the arithmetic of runs (usage, the budget, time run, backoff) and which ends are final;
- `state`: what one reconcile works on (`FlowState`), what it produces (`Plan`, `RunIntent`), and the
  moves every concern makes (start a run, stop a pod, end the flow);
- `feedback` and `conversation`: a pause for a person and its answer; a session and its messages;
- `warm`: a pod that stays up for the next message or the answer, and its warm reports;
- `runs`: the active run followed to its end, and what comes next;
- here: `plan()` and `Reconciler`, the order of one reconcile.

The inbox rules (when an answer or a message is refused) are in `flowkube_operator.flows.refusals`, shared
with the admission webhook; the conditions every plan ends with in `conditions`; pod views in
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
from flowkube_api.constants import Phase, Reason
from flowkube_api.report import RunReport
from flowkube_operator.flows.conditions import describe
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
from flowkube_operator.flows.reconcile.runs import RunSteps
from flowkube_operator.flows.reconcile.state import NeedReport, Plan, RunIntent, Taken
from flowkube_operator.flows.refusals import validate_message, validate_response
from flowkube_operator.flows.resources import definition_name
from flowkube_operator.meta import Doomed, PodView

__all__ = [
    "DISRUPTION_REASONS", "PERMANENT_REASONS", "POD_FIRST_TRIGGERS", "REPORTS_KEPT", "STOP_GRACE_SECONDS",
    "Plan", "RunIntent", "Taken", "backoff_seconds", "budget_spent", "late_pods", "plan", "running_seconds",
    "total_usage", "trailing_failures", "validate_message", "validate_response",
]

Body = dict[str, Any]


def plan(flow: Body, pods: dict[str, PodView], report: RunReport | None = None, *,
         now: dt.datetime | None = None, backoff_cap: int = 3600, report_checked: bool = False,
         late: Mapping[str, RunReport | None] | None = None, template: Body | Taken | None = None) -> Plan:
    """The status the Flow should have and the actions that make it so.

    `report` is the active run's report when the caller has read it (`report_checked`); a plan
    that needs it to end a run says so with `need_report`, and changes nothing until then.
    `late` holds the reports of closed runs whose pods outlived them (see `late_pods`), by pod,
    None where the pod left none. `template` is the FlowTemplate or ClusterFlowTemplate a Flow that has
    not taken one yet names, None when it is not there; for a Flow that took one already, a `Taken`:
    what the caller read (the spec of the snapshot its status.template names, or why it cannot be had).
    """
    return Reconciler(flow, pods, report, now or now_utc(), backoff_cap, report_checked, late or {},
                      template).run()


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


class Reconciler(RunSteps):
    """The order of one reconcile: late reports first, then the active run, then what comes next,
    then the endings (TTL, old reports) and the conditions."""

    def run(self) -> Plan:
        try:
            return self._run()
        except NeedReport:
            return Plan(status=self.old, need_report=True)

    def _run(self) -> Plan:
        st = self.st
        st.observed_generation = self.meta.get("generation")
        if (self.own_spec.get("templateRef") and st.template is None and st.phase not in c.TERMINAL_PHASES
                and not self._take_template()):
            self._finish()
            return self.plan
        if self.taken_problem is not None and st.phase not in c.TERMINAL_PHASES:
            # Never run anything but what it took: the Flow fails, naming the snapshot.
            self._terminal(Phase.FAILED, Reason.TEMPLATE_SNAPSHOT_UNUSABLE, self.taken_problem)
            for name in list(self.pods):
                self._stop_pod(name)
            self._finish()
            return self.plan
        if self.taken_problem is None:  # (an ended Flow whose snapshot is gone keeps the name it had)
            st.definition = definition_name(self.spec.model_dump(by_alias=True, exclude_none=True))
        st.started_at = st.started_at or self.now
        self._fold_late_reports()
        if self.fb.request is None:
            self._refuse_stray_response()  # answered before anything asked: never applied to a later request
        self._refuse_untimely_message()
        reported = self._lingering_after_report()
        if st.phase in c.TERMINAL_PHASES:
            # A runner pod still alive after the end (the operator stopped between the final status
            # write and the delete) is stopped now: nothing it does can count any more. A pod whose
            # run ended on its final report is ending by itself.
            self.plan.delete_pods += [Doomed(n, v.uid) for n, v in self.pods.items()
                                      if not v.terminated and not v.deleting and n not in reported]
            self._expire()
        else:
            active = self.runs[-1] if self.runs and self.runs[-1].finished_at is None else None
            if active is not None:
                self._follow(active)
            if st.phase not in c.TERMINAL_PHASES and (not self.runs or self.runs[-1].finished_at):
                self._next()
        self._finish()
        return self.plan

    def _lingering_after_report(self) -> set[str]:
        """Pods whose run ended on their final report: each is ending by itself, and is stopped only
        if it is still running STOP_GRACE_SECONDS later (it hangs on its way out)."""
        pods = set()
        for r in self.runs:
            pod = self.pods.get(r.pod)
            if not r.closed_on_report or r.finished_at is None or pod is None or pod.terminated or pod.deleting:
                continue
            pods.add(r.pod)
            left = (r.finished_at - self.now).total_seconds() + STOP_GRACE_SECONDS
            if left <= 0:
                self.plan.delete_pods.append(Doomed(r.pod, pod.uid))
            else:
                self.plan.later(left)
        return pods

    def _expire(self) -> None:
        ttl = self.spec.ttl_seconds_after_finished
        finished = self.st.finished_at
        if ttl is None or finished is None:
            return
        left = (finished + dt.timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.plan.delete_flow = Doomed(self.meta.get("name", ""), self.meta.get("uid", ""))
        else:
            self.plan.later(left)

    def _prune_reports(self) -> None:
        """Old runs' reports, once a new run starts at a multiple of REPORTS_KEPT: only closed runs
        whose pods are gone or ended (a late report of theirs was folded when their pod ended)."""
        intent, n = self.plan.create_pod, len(self.runs)
        if intent is None or intent.index != n - 1 or n < 2 * REPORTS_KEPT or intent.index % REPORTS_KEPT:
            return
        for r in self.runs[n - 2 * REPORTS_KEPT - 1:n - REPORTS_KEPT - 1]:
            pod = self.pods.get(r.pod)
            if r.finished_at is not None and (pod is None or pod.terminated):
                self.plan.prune_reports.append(r.pod)

    def _finish(self) -> None:
        self._prune_reports()
        st = self.st
        st.runs = self.runs or None
        usage = total_usage(self.runs)
        st.usage = usage if self.runs else st.usage
        st.feedback = self.fb if (self.fb.request or self.fb.history or self.fb.response) else None
        if st.phase is None:
            st.phase = Phase.PENDING
        if st.conversation is not None and st.conversation.session_id is None and st.conversation.inbox is None:
            st.conversation = None  # only a refused message's inbox was there
        describe(st, self.old, self.failure, self.refusal, message_refusal=self.message_refusal,
                 generation=self.meta.get("generation"), now=self.now)
