"""The state one reconcile works on (`FlowState`), what it produces (`Plan`, `RunIntent`), and the
moves shared by every concern."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.limits import spec_problem, template_problem
from flowkube_api.models import (
    FeedbackStatus,
    FlowSpec,
    FlowStatus,
    ForkedFrom,
    Run,
    TemplateStatus,
)
from flowkube_api.report import RunReport, TokenUsage, excerpt
from flowkube_api.runspec import spec_error_text
from flowkube_api.templates import describe_ref, effective_spec, snapshot, snapshot_object, snapshot_ref, taken_spec
from flowkube_api.templates import problems as template_problems
from flowkube_operator.flows.reconcile.forks import ForkSource
from flowkube_operator.flows.reconcile.rules import POD_FIRST_TRIGGERS, budget_spent, running_seconds, total_usage
from flowkube_operator.meta import Doomed, PodView

Body = dict[str, Any]
QUOTA_RECHECK_SECONDS = 30  # a run held by an exhausted FlowQuota is looked at again this often


@dataclass(frozen=True)
class RunIntent:
    """A runner pod that should exist (the edge creates it; AlreadyExists is success)."""

    index: int
    trigger: Trigger
    feedback: Body | None
    prior: TokenUsage  # what the earlier runs used (the budget is the flow's)
    active_deadline_seconds: int | None
    message: Body | None = None  # the conversation message this run answers: {"turn", "text", "sender"}
    keep_warm_seconds: int = 0  # a conversation's pod waits this long for its next message (see _keep_warm)
    feedback_keep_warm_seconds: int = 0  # a paused run's pod waits this long for the answer
    # Create the pod before the status write that records the run (and write its startedAt with it):
    # everything the pod carries is durable already. See the module's docstring.
    first: bool = False


@dataclass(frozen=True)
class Taken:
    """What the controller read for a Flow that took its template already: the template spec from
    the snapshot its status.template names, or why that snapshot cannot be used."""

    spec: Body | None = None
    problem: str | None = None


@dataclass
class Plan:
    status: FlowStatus
    create_pod: RunIntent | None = None
    # What the plan decided to delete, each with the uid it saw: the edge deletes exactly that object.
    delete_pods: list[Doomed] = field(default_factory=list)
    delete_flow: Doomed | None = None  # the Flow itself (TTL)
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None
    need_report: bool = False  # plan again with the active run's report: it ends without one
    prune_reports: list[str] = field(default_factory=list)  # pods whose report keys may be deleted
    # The template snapshot (a ControllerRevision) to ensure before the status write that names it.
    snapshot: Body | None = None
    template_spec: Body | None = None  # the template spec the Flow runs (taken now, or loaded for it)
    # A fork's first reconcile: the checkpoint it copies into its own state, before the status write
    # that records status.forkedFrom.
    fork_state: bytes | None = None
    # The spec the Flow runs, resolved and validated once, here: its own, or (a Flow of a template)
    # the template's with the Flow's own fields over it. Its pods and notifications are made from it.
    spec: FlowSpec | None = None

    def runs_as(self, flow: Body) -> Body:
        """The Flow as it runs: as written, with the resolved spec (the same Flow when it has no
        template, or has not taken it)."""
        if self.spec is None or self.template_spec is None:
            return flow
        return {**flow, "spec": self.spec.model_dump(mode="json", by_alias=True, exclude_unset=True)}

    def later(self, seconds: float) -> None:
        seconds = max(seconds, 0.05)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(("Warning" if warning else "Normal", reason, message))


class NeedReport(Exception):
    pass


class FlowState:
    """One reconcile's view of one Flow, and the moves every concern makes: start a run, stop a pod,
    end the flow, keep a warm pod's waiting time. The concerns (feedback, conversation, warm, runs)
    each hold it, in their own modules; `reconcile.plan` runs them."""

    def __init__(self, flow: Body, pods: dict[str, PodView], report: RunReport | None,
                 now: dt.datetime, backoff_cap: int, report_checked: bool,
                 late: Mapping[str, RunReport | None], template: Body | Taken | None = None) -> None:
        self.report_checked = report_checked or report is not None
        self.late = late
        self.meta: Body = flow.get("metadata") or {}
        self.own_spec: Body = flow.get("spec") or {}
        # The template a Flow that has not taken one yet names (None: not there); or what was read for
        # one that took it (a Taken).
        self.template = None if isinstance(template, Taken) else template
        self.fork: ForkSource | None = None  # a fork's origin checkpoint, when it has not copied it yet
        taken = template if isinstance(template, Taken) else None
        # A Flow of a template runs the template as it took it (flowkube_api.templates): its snapshot,
        # read by the controller, or the copy an older operator wrote into its status.
        self.template_spec, self.taken_problem = self._taken(flow, taken or Taken())
        self.spec = FlowSpec.model_validate(
            effective_spec(self.template_spec, self.own_spec) if self.template_spec is not None else self.own_spec)
        # Two validations, not a deep copy of one: pydantic's validator is several times faster than
        # copy.deepcopy, which was most of a reconcile's cost.
        self.old = FlowStatus.model_validate(flow.get("status") or {})
        self.st = FlowStatus.model_validate(flow.get("status") or {})
        self.pods = pods
        self.report = report
        self.now = now
        self.backoff_cap = backoff_cap
        self.plan = Plan(status=self.st)
        self.runs: list[Run] = list(self.st.runs or [])
        self.fb = self.st.feedback or FeedbackStatus()
        self.conv = self.st.conversation  # a conversation once its session is open; else None (or just an inbox)
        self.refusal: str | None = None
        self.message_refusal: str | None = None
        self.failure: tuple[Reason | str, str] | None = None
        self.resume_now = False  # a warm paused pod ended with its request answered but not taken
        # Why no run may start now: a FlowQuota covering the Flow is exhausted (None: none is).
        self.quota: str | None = None
        self.plan.template_spec = self.template_spec
        self.plan.spec = self.spec

    def _taken(self, flow: Body, taken: Taken) -> tuple[Body | None, str | None]:
        """(the template spec the Flow took, why it cannot be had): None, None before the take."""
        status_template = (flow.get("status") or {}).get("template")
        if not self.own_spec.get("templateRef") or not isinstance(status_template, Mapping):
            return None, None
        spec = taken_spec(status_template, taken.spec)
        if spec is not None:
            return spec, None
        return None, taken.problem or f"template snapshot {status_template.get('snapshot')!r} was not read"

    def take_template(self) -> bool:
        """A Flow of a template that has not taken it yet takes it now: its spec goes into
        status.template (a later change of the template changes nothing here) and the Flow runs it.
        False while the template is not there (the Flow waits: a watch event brings it), and when the
        Flow's inputs do not fit its parameters (the Flow fails, as with invalid inputs)."""
        ref = self.own_spec.get("templateRef") or {}
        what = describe_ref(str(self.meta.get("namespace") or ""), ref)
        if self.template is None:
            message = f"{what} not found: the Flow starts once it exists"
            self.st.phase = Phase.PENDING
            self.failure = (Reason.TEMPLATE_NOT_FOUND, message)
            if self.old.message != message:
                self.plan.event(Reason.TEMPLATE_NOT_FOUND, message, warning=True)
            return False
        data = snapshot(self.template)
        too_big = template_problem(data["spec"], what)
        if too_big:  # admitted while the webhook was off: its copy would not fit
            self.terminal(Phase.FAILED, Reason.INVALID_SPEC, too_big)
            return False
        # Stored once per generation (a snapshot all its Flows name), made before the status write.
        ref = snapshot_ref(data)
        self.st.template = TemplateStatus.model_validate(ref)
        self.plan.snapshot = snapshot_object(str(self.meta.get("namespace") or ""), data, name=ref["snapshot"])
        self.template_spec = self.plan.template_spec = data["spec"]
        effective, problems = template_problems(self.template, str(self.meta.get("namespace") or ""), self.own_spec)
        if problems:
            self.terminal(Phase.FAILED, Reason.INVALID_INPUTS, "; ".join(problems))
            return False
        try:
            self.spec = self.plan.spec = FlowSpec.model_validate(effective)
        except ValidationError as e:
            self.terminal(Phase.FAILED, Reason.INVALID_SPEC, f"{what}: {spec_error_text(e)}")
            return False
        self.plan.event(Reason.TEMPLATE_RESOLVED, f"runs {what} (generation {self.st.template.generation})")
        return True

    def take_fork(self) -> bool:
        """A fork that has not copied its checkpoint yet copies it now (``plan.fork_state``, written
        before the status that records ``status.forkedFrom``); its first run starts in the next reconcile,
        after that write. False when it cannot: the Flow fails, naming why."""
        source = self.fork
        if source is None or source.problem is not None or source.data is None or source.entry is None:
            why = source.problem if source is not None and source.problem else "the checkpoint was not read"
            self.terminal(Phase.FAILED, Reason.FORK_SOURCE_UNAVAILABLE, why)
            return False
        entry = source.entry
        self.st.forked_from = ForkedFrom(namespace=source.namespace, name=source.name, uid=source.uid,
                                         checkpoint=entry.id, method=entry.method, kind=entry.kind)
        self.st.inherited_usage = entry.usage
        self.st.phase = Phase.PENDING
        self.plan.fork_state = source.data
        self.plan.later(0)
        self.plan.event(Reason.FORKED, f"forked from checkpoint {entry.id} of Flow {source.namespace}/{source.name} "
                        f"({entry.kind.lower()} {entry.method}); it runs on from there")
        return True

    def start(self, trigger: Trigger) -> None:
        spent = budget_spent(self.spec, total_usage(self.runs))
        if spent is not None:
            self.terminal(Phase.FAILED, Reason.BUDGET_EXCEEDED, spent)
            return
        too_big = spec_problem(self.spec.model_dump(mode="json", by_alias=True, exclude_none=True))
        if too_big is not None:  # admitted while the webhook was off: no pod that could not start
            self.terminal(Phase.FAILED, Reason.INVALID_SPEC, too_big)
            return
        first = trigger in POD_FIRST_TRIGGERS
        if first and self.quota is not None:
            self.hold_for_quota()  # nothing is recorded: the next reconcile starts it, or holds it again
            return
        index = len(self.runs)
        self.runs.append(Run(pod=c.run_pod_name(str(self.meta.get("name")), index), trigger=trigger))
        if self.quota is not None:
            # A resume or a turn is recorded (its answer or message moved out of the inbox), and its
            # pod is made once the quota has room again (`Reconciler._follow`).
            self.hold_for_quota()
            return
        self.plan.create_pod = self.intent(index, trigger, first=first)
        self.st.phase = Phase.PENDING

    def hold_for_quota(self) -> None:
        """A run that would start now waits: a FlowQuota covering the Flow is exhausted. Looked at
        again every QUOTA_RECHECK_SECONDS (a window resets, a limit is raised, spend leaves a
        rolling window)."""
        assert self.quota is not None
        self.st.phase = Phase.PENDING
        self.failure = (Reason.QUOTA_EXHAUSTED, self.quota)
        if self.old.message != self.quota:
            self.plan.event(Reason.QUOTA_EXHAUSTED, self.quota, warning=True)
        self.plan.later(QUOTA_RECHECK_SECONDS)

    def intent(self, index: int, trigger: Trigger, *, first: bool) -> RunIntent:
        feedback = None
        # A retry of a failed resume carries the same answer: the runner applies it if the request
        # is still pending in the saved state, and ignores it if the flow had already moved on.
        origin = next((r.trigger for r in reversed(self.runs[:index]) if r.trigger != Trigger.RETRY), None)
        if (trigger == Trigger.RESUME or (trigger == Trigger.RETRY and origin == Trigger.RESUME)) and self.fb.history:
            h = self.fb.history[-1]
            feedback = {"requestId": h.request_id, "text": h.response or "", "timedOut": h.timed_out}
            if h.outcome:
                feedback["outcome"] = h.outcome
        left = None
        if self.spec.active_deadline_seconds is not None:
            left = int(self.spec.active_deadline_seconds - running_seconds(self.runs[:index], self.now)) + 1
        message = None
        pending = self.conv.pending if self.conv is not None else None
        if pending is not None and trigger != Trigger.KICKOFF:
            message = {"turn": pending.turn, "text": pending.text, "sender": pending.sent_by}
        fb_spec = self.spec.feedback
        return RunIntent(index=index, trigger=trigger, feedback=feedback,
                         prior=total_usage(self.runs[:index]).totals(),
                         active_deadline_seconds=left, message=message, keep_warm_seconds=self._keep_warm(),
                         feedback_keep_warm_seconds=(fb_spec.keep_warm_seconds or 0) if fb_spec else 0,
                         first=first)

    def _keep_warm(self) -> int:
        """How long a run's pod may wait warm for a conversation's next message: for a Flow known to be
        a conversation (an inline ``conversational`` block, a session open, or ``spec.conversation``)."""
        conv_spec = self.spec.conversation
        definition = self.spec.definition
        block = (definition.model_extra or {}).get("conversational") if definition is not None else None
        known = (conv_spec is not None or (self.conv is not None and bool(self.conv.session_id))
                 or (isinstance(block, dict) and block.get("enabled", True) is not False))
        if not known:
            return 0
        if conv_spec is not None and conv_spec.keep_warm_seconds is not None:
            return conv_spec.keep_warm_seconds
        return c.DEFAULT_KEEP_WARM_SECONDS

    def stop_pod(self, name: str) -> None:
        """Delete a runner pod that still runs (once: not one already stopping)."""
        pod = self.pods.get(name)
        if pod is not None and not pod.terminated and not pod.deleting:
            self.plan.delete_pods.append(Doomed(name, pod.uid))

    def waiting_warm(self, run: Run) -> bool:
        """Is ``run`` (active) a warm pod waiting for a message or an answer? Status alone says so: a
        cold run is never active while a request pends, nor while an open session has nothing pending."""
        if run.finished_at is not None:
            return False
        if self.fb.request is not None:
            return True
        conv = self.conv
        return conv is not None and bool(conv.session_id) and conv.pending is None and not conv.ended

    def add_warm_wait(self, run: Run, until: dt.datetime, since: dt.datetime | None = None) -> None:
        if since is None:
            since = self.fb.request.requested_at if self.fb.request is not None else (
                self.conv.idle_since if self.conv is not None else None)
        if since is not None and until > since:
            run.warm_seconds = round((run.warm_seconds or 0.0) + (until - since).total_seconds(), 3)

    def close_warm(self, run: Run, message: str, result: RunResult = RunResult.SUCCEEDED) -> None:
        """End a warm run nobody will answer any more, and stop its pod."""
        if self.waiting_warm(run):
            self.add_warm_wait(run, self.now)
        reason = Reason.RUN_PAUSED if result == RunResult.PAUSED else Reason.RUN_SUCCEEDED
        run.result, run.reason, run.message = result, str(reason), message
        run.finished_at = self.now
        self.stop_pod(run.pod)

    def terminal(self, phase: Phase, reason: Reason | str, message: str) -> None:
        self.st.phase = phase
        self.st.finished_at = self.st.finished_at or self.now
        self.failure = (reason, message)  # the Succeeded condition's reason and message
        if phase == Phase.FAILED:
            self.fb.request = None
            self.plan.event(str(reason), f"the flow failed: {excerpt(message, 512)}", warning=True)
