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

Read top to bottom: `plan()`, then the reconciler in the order it works (the active run, what comes
next, the endings), then the arithmetic of runs. The conditions and message every plan ends with are
in `conditions`; pod views, owner references and time formats in `meta`. All three are pure (an
import-linter contract in pyproject.toml keeps kopf, aiohttp and the I/O modules out of them);
`controller` reads the world and applies the plan.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flowkube_api import constants as c
from flowkube_api.base import now as now_utc
from flowkube_api.base import parse_time
from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.limits import spec_problem
from flowkube_api.models import (
    ConversationMessage,
    ConversationStatus,
    FeedbackRecord,
    FeedbackRequest,
    FeedbackStatus,
    FlowSpec,
    FlowStatus,
    PendingFeedback,
    PendingMessage,
    Result,
    Run,
)
from flowkube_api.report import RunReport, TokenUsage, TurnReport, Usage, excerpt
from flowkube_operator.conditions import describe
from flowkube_operator.meta import PodView
from flowkube_operator.resources import definition_name

Body = dict[str, Any]

# A run that failed for one of these reasons is not retried: running it again cannot help.
PERMANENT_REASONS = frozenset({
    Reason.INVALID_DEFINITION, Reason.INVALID_FLOW_REF, Reason.INVALID_INPUTS, Reason.INVALID_SPEC,
    Reason.STATE_CORRUPT,
    Reason.STATE_TOO_LARGE, Reason.BUDGET_EXCEEDED, Reason.DEADLINE_EXCEEDED,
})

# A run that ended for one of these reasons was taken away by Kubernetes or by someone else, not
# failed by the flow: it is replaced at once, counted against retries.disruptionLimit, not limit.
DISRUPTION_REASONS = frozenset({Reason.DISRUPTED, Reason.POD_DELETED})

# Run reports kept in the state ConfigMap: every REPORTS_KEPT-th run drops the reports of the
# REPORTS_KEPT runs before the last REPORTS_KEPT (their usage is in status.runs[]), so a long
# conversation, one run per message, stays under a ConfigMap's 1 MiB.
REPORTS_KEPT = 20

# Runs whose pod is created before the status write that records them: everything they carry is
# durable already (a resume or a turn takes an answer or a message out of an inbox: recorded first).
POD_FIRST_TRIGGERS = frozenset({Trigger.KICKOFF, Trigger.RETRY})

# How long a pod stopped at the deadline gets to be gone before its run is ended anyway (a node that
# is down never confirms the deletion). Pods are deleted with their default 30 s grace period.
STOP_GRACE_SECONDS = 60.0


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


@dataclass
class Plan:
    status: FlowStatus
    create_pod: RunIntent | None = None
    delete_pods: list[str] = field(default_factory=list)
    delete_flow: bool = False
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    requeue_after: float | None = None
    need_report: bool = False  # plan again with the active run's report: it ends without one
    prune_reports: list[str] = field(default_factory=list)  # pods whose report keys may be deleted

    def later(self, seconds: float) -> None:
        seconds = max(seconds, 0.05)
        self.requeue_after = seconds if self.requeue_after is None else min(self.requeue_after, seconds)

    def event(self, reason: str, message: str, warning: bool = False) -> None:
        self.events.append(("Warning" if warning else "Normal", reason, message))


def plan(flow: Body, pods: dict[str, PodView], report: RunReport | None = None, *,
         now: dt.datetime | None = None, backoff_cap: int = 3600, report_checked: bool = False,
         late: Mapping[str, RunReport | None] | None = None) -> Plan:
    """The status the Flow should have and the actions that make it so.

    `report` is the active run's report when the caller has read it (`report_checked`); a plan
    that needs it to end a run says so with `need_report`, and changes nothing until then.
    `late` holds the reports of closed runs whose pods outlived them (see `late_pods`), by pod,
    None where the pod left none.
    """
    return _Reconciler(flow, pods, report, now or now_utc(), backoff_cap, report_checked, late or {}).run()


def late_pods(status: Body, pods: Mapping[str, PodView]) -> list[str]:
    """Pods of closed runs that ended after their run was closed (stopped at the deadline, or still
    finishing a model call): their final report may hold calls the run's entry does not have yet."""
    out = []
    for r in (status.get("runs") or []):
        pod = pods.get(r.get("pod", ""))
        closed = parse_time(r.get("finishedAt"))
        if pod is not None and closed is not None and pod.terminated and pod.finished_at and pod.finished_at > closed:
            out.append(pod.name)
    return out


class _NeedReport(Exception):
    pass


class _Reconciler:
    def __init__(self, flow: Body, pods: dict[str, PodView], report: RunReport | None,
                 now: dt.datetime, backoff_cap: int, report_checked: bool,
                 late: Mapping[str, RunReport | None]) -> None:
        self.report_checked = report_checked or report is not None
        self.late = late
        self.meta: Body = flow.get("metadata") or {}
        self.spec = FlowSpec.model_validate(flow.get("spec") or {})
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

    # -- entry --------------------------------------------------------------------------------------

    def run(self) -> Plan:
        try:
            return self._run()
        except _NeedReport:
            return Plan(status=self.old, need_report=True)

    def _run(self) -> Plan:
        st = self.st
        st.observed_generation = self.meta.get("generation")
        st.definition = definition_name(self.spec.model_dump(by_alias=True, exclude_none=True))
        st.started_at = st.started_at or self.now
        self._fold_late_reports()
        if self.fb.request is None:
            self._refuse_stray_response()  # answered before anything asked: never applied to a later request
        self._refuse_untimely_message()
        if st.phase in c.TERMINAL_PHASES:
            # A runner pod still alive after the end (the operator stopped between the final status
            # write and the delete) is stopped now: nothing it does can count any more.
            self.plan.delete_pods += [n for n, v in self.pods.items() if not v.terminated and not v.deleting]
            self._expire()
        else:
            active = self.runs[-1] if self.runs and self.runs[-1].finished_at is None else None
            if active is not None:
                self._follow(active)
            if st.phase not in c.TERMINAL_PHASES and (not self.runs or self.runs[-1].finished_at):
                self._next()
        self._finish()
        return self.plan

    def _fold_late_reports(self) -> None:
        """A closed run's pod that kept going reports what it did after the close: those calls were
        answered and billed, so they count, once, in that run's entry (a run's reports are
        cumulative, so the latest replaces the entry's usage). Its end is when its pod ended."""
        for run in self.runs:
            if run.finished_at is None or run.pod not in self.late:
                continue
            rep, pod = self.late[run.pod], self.pods.get(run.pod)
            counted = run.usage or Usage()
            if rep is not None and rep.pod == run.pod and _more(rep.usage, counted):
                added = rep.usage.total_tokens - counted.total_tokens
                run.usage = rep.usage
                self.plan.event(Reason.LATE_REPORT, f"run {run.pod} reported {added} more tokens after it was "
                                f"closed; they count in its entry")
            if pod is not None and pod.terminated and pod.finished_at and pod.finished_at > run.finished_at:
                run.finished_at = pod.finished_at

    # -- the active run -----------------------------------------------------------------------------

    def _follow(self, run: Run) -> None:
        pod = self.pods.get(run.pod)
        if pod is not None and run.started_at is None:
            run.started_at = pod.created_at or self.now
        if pod is None and run.started_at is None:
            # Recorded but never seen: the pod was not created yet (or the cache lags). Ensure it;
            # the record holds everything it carries, so its startedAt comes in the same write.
            self.plan.create_pod = self._intent(len(self.runs) - 1, run.trigger, first=True)
            self.st.phase = Phase.PENDING
            return
        if pod is not None and not pod.terminated and self._follow_warm(run):
            return
        final = None  # a pod gone without our seeing it end may have left its final report
        if pod is None:
            rep = self._report_of(run)
            final = rep if rep is not None and rep.reason != Reason.RUN_INTERRUPTED else None
        # The deadline is judged at the moment the run ended, if it did, not when we look.
        ended = pod.finished_at if pod is not None and pod.terminated else (final.finished_at if final else None)
        limit = self.spec.active_deadline_seconds
        over = running_seconds(self.runs, ended or self.now) - limit if limit is not None else None
        # A run that finished on its own just as time ran out stands as it finished.
        finished_ok = ((pod is not None and pod.terminated and pod.exit_code == 0)
                       or (pod is None and final is not None and final.exit_code == 0))
        if over is not None and over >= 0 and not finished_ok and (
                pod is None or pod.terminated or over > STOP_GRACE_SECONDS):
            # Over the deadline, and the pod stopped (or will not stop): end the run only now, so the
            # report read below has every LLM call the pod completed before it was stopped.
            self._stop_pod(run.pod)
            run.exit_code = pod.exit_code if pod is not None else None
            self._end_run(run, self._report_of(run), RunResult.FAILED, Reason.DEADLINE_EXCEEDED,
                          f"the flow ran longer than activeDeadlineSeconds={limit}",
                          finished_at=pod.finished_at if pod is not None else (
                              final.finished_at if final is not None else None))
            return
        if pod is None:
            if final is not None:
                # It finished and reported; its pod was deleted before we saw it end (the operator
                # was down). The run stands as reported: running it again would repeat its work.
                run.exit_code = final.exit_code
                self._end_run(run, final, final.result, final.reason, final.message,
                              finished_at=final.finished_at)
                return
            self._end_run(run, self._report_of(run), RunResult.FAILED, Reason.POD_DELETED,
                          f"runner pod {run.pod} disappeared before it finished")
            return
        if pod.terminated:
            self._end_from_pod(run, pod)
            return
        self.st.phase = Phase.RUNNING if pod.phase == "Running" else Phase.PENDING
        if over is not None:
            if over >= 0:  # stop the pod; the run ends when it has stopped (above)
                if not pod.deleting:
                    self.plan.delete_pods.append(run.pod)
                self.plan.later(STOP_GRACE_SECONDS - over + 0.5)
            else:
                self.plan.later(-over)

    def _report_of(self, run: Run) -> RunReport | None:
        """The run's report, when it ends without its pod telling (deleted, or over the deadline):
        the tokens of the LLM calls it made are in its interim report and must still count."""
        if not self.report_checked:
            raise _NeedReport
        return self.report if self.report is not None and self.report.pod == run.pod else None

    def _end_from_pod(self, run: Run, pod: PodView) -> None:
        rep = self.report
        reason: Reason | str
        if pod.reason == "DeadlineExceeded":
            # Killed by its activeDeadlineSeconds: whatever the interim report says, that is why.
            result, reason = RunResult.FAILED, Reason.DEADLINE_EXCEEDED
            message = "the runner pod exceeded its activeDeadlineSeconds"
        elif rep is not None and rep.pod == run.pod:
            result = rep.result
            if rep.warm:
                pass  # its last word: every message it took is answered and saved, and it waited; then it was stopped
            elif pod.exit_code not in (None, 0) and result != RunResult.FAILED:
                result = RunResult.FAILED  # the process died after writing an optimistic report
            reason, message = rep.reason, rep.message
        else:
            result, reason = RunResult.FAILED, Reason.RUN_FAILED
            message = (f"runner pod {pod.name} ended ({pod.phase}, exit code {pod.exit_code}, "
                       f"{pod.reason or 'no reason'}) without a report")
            if pod.message:
                message += f": {excerpt(pod.message, 512)}"
        if pod.exit_code == c.EXIT_PERMANENT and result == RunResult.FAILED and reason not in PERMANENT_REASONS:
            reason = Reason.FLOW_ERROR if reason in (Reason.RUN_FAILED, "") else reason
        elif result == RunResult.FAILED and reason not in PERMANENT_REASONS and (pod.disruption or pod.deleting):
            # Evicted, preempted, its node lost or drained, or deleted by someone: not the flow's fault.
            reason = Reason.DISRUPTED
            message = f"runner pod {pod.name} was stopped by a disruption ({pod.disruption or 'deleted'}): {message}"
        run.exit_code = pod.exit_code
        self._end_run(run, rep if rep is not None and rep.pod == run.pod else None, result, reason, message,
                      finished_at=pod.finished_at)

    def _end_run(self, run: Run, rep: RunReport | None, result: RunResult, reason: Reason | str,
                 message: str, finished_at: dt.datetime | None = None) -> None:
        if self._waiting_warm(run):
            self._add_warm_wait(run, finished_at or self.now)
        run.result, run.reason, run.message = result, str(reason), excerpt(message, 1024)
        if rep is not None:
            run.usage = rep.usage  # every LLM call the run made counts, however it ended
            if rep.flow_id:
                self.st.flow_id = rep.flow_id
            self._note_applied(rep)
        run.finished_at = finished_at or self.now
        if run.started_at is None:
            run.started_at = run.finished_at
        if result == RunResult.SUCCEEDED and rep is not None and rep.conversation is not None:
            self._turn_done(rep.conversation.model_copy(), rep.output)
        elif result == RunResult.SUCCEEDED:
            self.st.result = Result(output=rep.output if rep else None)
            self._terminal(Phase.SUCCEEDED, Reason.RUN_SUCCEEDED, "the flow finished")
            self.plan.event(Reason.RUN_SUCCEEDED, f"run {run.pod} succeeded; the flow finished")
        elif result == RunResult.PAUSED and rep is not None and rep.feedback_request is not None:
            if self._answered(rep.feedback_request.id):
                # Its warm pod waited for the answer and ended before it took it: a new pod resumes.
                self.resume_now = True
            else:
                self._feedback_requested(rep.feedback_request)
        else:
            if result != RunResult.FAILED:  # Paused without a request: nothing could ever resume it
                run.result, reason = RunResult.FAILED, Reason.INTERNAL_ERROR
                message = "the run paused but reported no feedback request"
            self._after_failure(run, reason, message)

    def _answered(self, request_id: str) -> bool:
        """Has an answer to this request been accepted (it is in the history)?"""
        return any(h.request_id == request_id for h in self.fb.history or [])

    def _note_applied(self, rep: RunReport) -> None:
        applied = rep.feedback_applied
        for h in self.fb.history or []:
            if applied is not None and h.request_id == applied.request_id and not h.outcome:
                h.outcome = applied.outcome  # the outcome crewAI collapsed the answer to

    def _feedback_requested(self, fr: FeedbackRequest) -> None:
        """The flow paused on ``fr``: it is pending in status (once: a warm pod's request is there already)."""
        if self.fb.request is None or self.fb.request.id != fr.id:
            timeout = self.spec.feedback.timeout_seconds if self.spec.feedback else None
            self.fb.request = PendingFeedback(
                **fr.model_dump(exclude={"output", "requested_at"}), output=excerpt(fr.output or ""),
                requested_at=self.now, deadline=self.now + dt.timedelta(seconds=timeout) if timeout else None,
            )
            self.plan.event(Reason.FEEDBACK_REQUESTED,
                            f"{fr.method} asks for feedback (request {fr.id}): {excerpt(fr.message, 256)}")
        self.st.phase = Phase.AWAITING_FEEDBACK

    def _after_failure(self, run: Run, reason: Reason | str, message: str) -> None:
        if reason in DISRUPTION_REASONS:
            self._after_disruption(run, message)
            return
        permanent = reason in PERMANENT_REASONS or run.exit_code == c.EXIT_PERMANENT
        limit = self.spec.retries.limit if self.spec.retries else 0
        failures = trailing_failures(self.runs)
        self.plan.event(str(reason), f"run {run.pod} failed: {excerpt(message, 512)}", warning=True)
        if permanent:
            self._terminal(Phase.FAILED, reason, message)
        elif failures > limit:
            why = f"{failures} failed run(s), retries.limit={limit}; last: {message}"
            self._terminal(Phase.FAILED, Reason.RETRIES_EXHAUSTED, why)
        else:
            self.st.phase = Phase.PENDING

    def _after_disruption(self, run: Run, message: str) -> None:
        limit = self.spec.retries.disruption_limit if self.spec.retries else c.DEFAULT_DISRUPTION_LIMIT
        lost = sum(1 for r in self.runs if r.reason in DISRUPTION_REASONS)
        if lost > limit:
            why = f"{lost} runner pods lost to disruptions, retries.disruptionLimit={limit}; last: {message}"
            self._terminal(Phase.FAILED, Reason.DISRUPTIONS_EXHAUSTED, why)
            return
        self.plan.event(Reason.DISRUPTED, f"{excerpt(message, 512)}; replacing it ({lost} of "
                        f"retries.disruptionLimit={limit}; retries.limit is not used)", warning=True)
        self.st.phase = Phase.PENDING

    # -- what comes next when no run is active ------------------------------------------------------

    def _next(self) -> None:
        if self._adopt():
            return
        if self.spec.suspend:
            if self.fb.request is None:
                self.st.phase = Phase.SUSPENDED
            return
        if self.fb.request is not None:
            self._await_feedback()
            return
        if not self.runs:
            self._start(Trigger.KICKOFF)
            return
        last = self.runs[-1]
        if last.result == RunResult.FAILED and last.reason in DISRUPTION_REASONS:
            self._start(Trigger.RETRY)  # a replacement, at once, like a Job's pod lost to a disruption
        elif last.result == RunResult.FAILED:
            due = last.finished_at or self.now
            wait = backoff_seconds(self.spec, trailing_failures(self.runs), self.backoff_cap)
            left = (due + dt.timedelta(seconds=wait) - self.now).total_seconds()
            if left > 0:
                self.st.phase = Phase.PENDING
                self.plan.later(left)
                self.failure = (Reason.RETRY_BACKOFF, f"retrying in {left:.0f}s after: {last.message}")
                return
            self._start(Trigger.RETRY)
        elif last.result == RunResult.PAUSED and self.resume_now:
            self._start(Trigger.RESUME)
        elif last.result == RunResult.PAUSED:
            # Paused run whose request was already answered: a resume run is recorded right away,
            # so this only happens when the resume was refused; nothing to do until a new answer.
            self.st.phase = Phase.AWAITING_FEEDBACK
        elif self.conv is not None and self.conv.session_id:
            self._await_message()

    def _await_feedback(self, warm: Run | None = None) -> None:
        """Take the answer: a new run resumes the flow, or the ``warm`` run whose pod waits for it."""
        req = self.fb.request
        assert req is not None
        self.st.phase = Phase.AWAITING_FEEDBACK
        resp = self.fb.response
        if resp is not None:
            problem = validate_response(req, resp.text, resp.request_id)
            self.fb.response = None
            if problem is not None:
                self._refuse(problem)
            else:
                self._answer(req, text=resp.text or "", outcome=None, timed_out=False,
                             by=resp.responded_by, warm=warm)
            return
        deadline = req.deadline
        if deadline is None:
            return
        if self.now < deadline:
            self.plan.later((deadline - self.now).total_seconds())
            return
        if req.default_outcome:
            self._answer(req, text="", outcome=req.default_outcome, timed_out=True, by=None, warm=warm)
            return
        if warm is not None:
            self._close_warm(warm, f"no answer to request {req.id} came", RunResult.PAUSED)
        self.fb.request = None
        self._terminal(Phase.FAILED, Reason.FEEDBACK_TIMED_OUT,
                       f"no feedback for request {req.id} ({req.method}) before {req.deadline}, "
                       "and the step has no default outcome")

    def _answer(self, req: FeedbackRequest, *, text: str, outcome: str | None, timed_out: bool,
                by: str | None, warm: Run | None = None) -> None:
        history = list(self.fb.history or [])
        history.append(FeedbackRecord(
            request_id=req.id, method=req.method, response=text or None, outcome=outcome,
            requested_at=req.requested_at, responded_at=self.now, responded_by=by, timed_out=timed_out,
        ))
        self.fb.history = history
        self.fb.request = None
        if timed_out:
            self.plan.event(Reason.FEEDBACK_TIMED_OUT,
                            f"request {req.id} timed out; resuming with default outcome {outcome!r}")
        else:
            who = f" from {by}" if by else ""
            self.plan.event(Reason.FEEDBACK_RECEIVED, f"feedback{who} accepted for request {req.id}")
        if warm is None:
            self._start(Trigger.RESUME)
        else:  # the pod that paused takes the answer through the state API's long poll
            self._add_warm_wait(warm, self.now, since=req.requested_at)
            self.st.phase = Phase.RUNNING

    def _refuse(self, problem: str) -> None:
        self.refusal = f"feedback response refused: {problem}"
        self.plan.event(Reason.FEEDBACK_REFUSED, self.refusal, warning=True)

    def _refuse_stray_response(self) -> None:
        if self.fb.response is not None:
            self.fb.response = None
            self._refuse(validate_response(None, None, None) or "")

    # -- conversations ------------------------------------------------------------------------------

    def _turn_done(self, turn: TurnReport, output: str | None) -> None:
        """A conversation's run ended well: the session is open (turn 0) or a message is answered."""
        conv = self.conv = self.st.conversation = self.conv or ConversationStatus()
        opened = conv.session_id is None
        if not opened and turn.turn <= conv.turns and not (turn.ended and not conv.ended):
            # Reported again (a retry, or a warm pod's last word after the turn was folded from its
            # warm report): nothing new. A message accepted since is answered by the next run.
            if conv.pending is None:
                self.st.phase = Phase.AWAITING_MESSAGE
            return
        conv.session_id = turn.session_id
        if turn.turn > conv.turns:  # the first report of this turn
            conv.turns = turn.turn
            conv.last_reply = excerpt(turn.reply or "")
            self._remember("assistant", turn.reply or "", turn.turn)
        if conv.pending is not None and conv.pending.turn <= turn.turn:
            conv.pending = None
        conv.ended = conv.ended or turn.ended
        conv.idle_since = self.now
        if opened:
            self.plan.event(Reason.SESSION_OPENED, f"conversation session {turn.session_id} is open; "
                            "send a message with a patch of status.conversation.inbox")
        else:
            self.plan.event(Reason.TURN_COMPLETED, f"message {turn.turn} answered")
        limit = self.spec.conversation.max_turns if self.spec.conversation else None
        if conv.ended:
            self._end_conversation(Reason.CONVERSATION_ENDED, f"the conversation ended after {conv.turns} message(s)")
        elif limit is not None and conv.turns >= limit:
            self._end_conversation(Reason.MAX_TURNS_REACHED,
                                   f"{conv.turns} message(s) answered, conversation.maxTurns={limit}")
        else:
            self.st.phase = Phase.AWAITING_MESSAGE

    def _end_conversation(self, reason: Reason, message: str) -> None:
        """The session is over, well: its last reply is the flow's result."""
        assert self.conv is not None
        self.st.result = Result(output=self.conv.last_reply)
        self._terminal(Phase.SUCCEEDED, reason, message)

    def _remember(self, role: str, text: str, turn: int, sender: str | None = None) -> None:
        assert self.conv is not None
        message = ConversationMessage(role=role, content=excerpt(text, c.MESSAGE_EXCERPT_LIMIT), turn=turn,
                                      time=self.now, sender=sender)
        self.conv.messages = [*(self.conv.messages or []), message][-c.RECENT_MESSAGES:]

    def _await_message(self, warm: Run | None = None) -> None:
        """Take the next message: a new run answers it, or the ``warm`` run whose pod waits for it
        (it takes the message through the state API's long poll)."""
        conv = self.conv
        assert conv is not None
        if conv.pending is not None:
            # Accepted, not answered, and no run is at it. A run started for it that ended well without
            # the reply would only do so again: say so rather than loop. A warm pod that ended before it
            # took the message (its window passed, it was stopped) did not start for it: a new run answers
            # it (the runner's state says whether it already was).
            last = self.runs[-1] if self.runs else None
            came = conv.pending.sent_at.replace(microsecond=0) if conv.pending.sent_at else None
            if last is not None and last.trigger != Trigger.KICKOFF and (
                    came is None or last.started_at is None or last.started_at >= came):
                self._terminal(Phase.FAILED, Reason.INTERNAL_ERROR,
                               f"run {last.pod} ended without answering message {conv.pending.turn}")
                return
            self._start(Trigger.TURN)
            return
        self.st.phase = Phase.AWAITING_MESSAGE
        inbox, conv.inbox = conv.inbox, None
        if inbox is not None:
            problem = validate_message(conv, Phase.AWAITING_MESSAGE, inbox.text)
            if problem is not None:
                self._refuse_message(problem)
            else:
                text = inbox.text or ""
                conv.pending = PendingMessage(turn=conv.turns + 1, text=text, sent_by=inbox.sent_by, sent_at=self.now)
                self._remember("user", text, conv.pending.turn, sender=inbox.sent_by)
                who = f" from {inbox.sent_by}" if inbox.sent_by else ""
                self.plan.event(Reason.MESSAGE_RECEIVED, f"message {conv.pending.turn}{who} accepted")
                if warm is None:
                    self._start(Trigger.TURN)
                else:
                    self._add_warm_wait(warm, self.now)
                    self.st.phase = Phase.RUNNING
                return
        timeout = self.spec.conversation.idle_timeout_seconds if self.spec.conversation else None
        if timeout is None or conv.idle_since is None:
            return
        left = (conv.idle_since + dt.timedelta(seconds=timeout) - self.now).total_seconds()
        if left > 0:
            self.plan.later(left)
            return
        self._end_conversation(Reason.CONVERSATION_IDLE, f"no message for conversation.idleTimeoutSeconds="
                               f"{timeout}; the session ended after {conv.turns} message(s)")
        if warm is not None:
            self._close_warm(warm, "the conversation ended while the pod waited warm")

    # -- warm runners -------------------------------------------------------------------------------

    def _follow_warm(self, run: Run) -> bool:
        """A running pod that may be warm: fold what it reported (a turn answered, a pause for
        feedback); True when that settles the run for now (the session ended with that turn, or the
        pod waits for a message or an answer: that is the user's time, not the deadline's)."""
        self._fold_warm(run)
        if run.finished_at is not None:
            return True
        if not self._waiting_warm(run):
            return False
        if self.fb.request is not None:
            self._await_feedback(warm=run)
        else:
            self.st.phase = Phase.AWAITING_MESSAGE
            self._await_message(warm=run)
        return True

    def _fold_warm(self, run: Run) -> None:
        """The active run's pod reported and stays up (a warm report): fold the turn it answered or
        the request it paused on into status, and let the run go on."""
        rep = self.report
        if rep is None or rep.pod != run.pod or not rep.warm:
            return
        if _more(rep.usage, run.usage or Usage()):
            run.usage = rep.usage  # a run's reports are cumulative: everything it did so far
        if rep.flow_id:
            self.st.flow_id = rep.flow_id
        self._note_applied(rep)
        if rep.result == RunResult.PAUSED and rep.feedback_request is not None:
            if not self._answered(rep.feedback_request.id):
                self._feedback_requested(rep.feedback_request)
            return
        if rep.result != RunResult.SUCCEEDED or rep.conversation is None:
            return
        self._turn_done(rep.conversation.model_copy(), rep.output)  # nothing new if it was folded before
        if self.st.phase in c.TERMINAL_PHASES:  # the session ended with that turn (maxTurns)
            self._close_warm(run, f"run {run.pod} answered the conversation's last message")

    def _waiting_warm(self, run: Run) -> bool:
        """Is ``run`` (active) a warm pod waiting for a message or an answer? Status alone says so: a
        cold run is never active while a request pends, nor while an open session has nothing pending."""
        if run.finished_at is not None:
            return False
        if self.fb.request is not None:
            return True
        conv = self.conv
        return conv is not None and bool(conv.session_id) and conv.pending is None and not conv.ended

    def _add_warm_wait(self, run: Run, until: dt.datetime, since: dt.datetime | None = None) -> None:
        if since is None:
            since = self.fb.request.requested_at if self.fb.request is not None else (
                self.conv.idle_since if self.conv is not None else None)
        if since is not None and until > since:
            run.warm_seconds = round((run.warm_seconds or 0.0) + (until - since).total_seconds(), 3)

    def _close_warm(self, run: Run, message: str, result: RunResult = RunResult.SUCCEEDED) -> None:
        """End a warm run nobody will answer any more, and stop its pod."""
        if self._waiting_warm(run):
            self._add_warm_wait(run, self.now)
        reason = Reason.RUN_PAUSED if result == RunResult.PAUSED else Reason.RUN_SUCCEEDED
        run.result, run.reason, run.message = result, str(reason), message
        run.finished_at = self.now
        self._stop_pod(run.pod)

    def _stop_pod(self, name: str) -> None:
        """Delete a runner pod that still runs (once: not one already stopping)."""
        pod = self.pods.get(name)
        if pod is not None and not pod.terminated and not pod.deleting:
            self.plan.delete_pods.append(name)

    def _refuse_untimely_message(self) -> None:
        """A message that arrived while the flow could not take one (checked against the phase it had
        when the message came) is refused now, never kept for later: a later turn must not answer it."""
        conv = self.st.conversation
        if conv is None or conv.inbox is None:
            return
        problem = validate_message(conv, self.old.phase, conv.inbox.text)
        if problem is not None:
            conv.inbox = None
            self._refuse_message(problem)

    def _refuse_message(self, problem: str) -> None:
        self.message_refusal = f"message refused: {problem}"
        self.plan.event(Reason.MESSAGE_REFUSED, self.message_refusal, warning=True)

    def _adopt(self) -> bool:
        """A pod under the next run's name exists, made by a start whose status write was lost (the
        operator stopped, or the Flow changed under it): record it as that run, started when it was."""
        name = c.run_pod_name(str(self.meta.get("name")), len(self.runs))
        pod = self.pods.get(name)
        if pod is None or pod.trigger not in POD_FIRST_TRIGGERS:
            return False
        self.runs.append(Run(pod=name, trigger=Trigger(pod.trigger), started_at=pod.created_at or self.now))
        self.st.phase = Phase.RUNNING if pod.phase == "Running" else Phase.PENDING
        if pod.terminated:
            self.plan.later(0)  # follow it to its end with its report, in the next reconcile
        return True

    def _start(self, trigger: Trigger) -> None:
        spent = budget_spent(self.spec, total_usage(self.runs))
        if spent is not None:
            self._terminal(Phase.FAILED, Reason.BUDGET_EXCEEDED, spent)
            return
        too_big = spec_problem(self.spec.model_dump(mode="json", by_alias=True, exclude_none=True))
        if too_big is not None:  # admitted while the webhook was off: no pod that could not start
            self._terminal(Phase.FAILED, Reason.INVALID_SPEC, too_big)
            return
        index = len(self.runs)
        self.runs.append(Run(pod=c.run_pod_name(str(self.meta.get("name")), index), trigger=trigger))
        self.plan.create_pod = self._intent(index, trigger, first=trigger in POD_FIRST_TRIGGERS)
        self.st.phase = Phase.PENDING

    def _intent(self, index: int, trigger: Trigger, *, first: bool) -> RunIntent:
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

    # -- endings ------------------------------------------------------------------------------------

    def _terminal(self, phase: Phase, reason: Reason | str, message: str) -> None:
        self.st.phase = phase
        self.st.finished_at = self.st.finished_at or self.now
        self.failure = (reason, message)  # the Succeeded condition's reason and message
        if phase == Phase.FAILED:
            self.fb.request = None
            self.plan.event(str(reason), f"the flow failed: {excerpt(message, 512)}", warning=True)

    def _expire(self) -> None:
        ttl = self.spec.ttl_seconds_after_finished
        finished = self.st.finished_at
        if ttl is None or finished is None:
            return
        left = (finished + dt.timedelta(seconds=ttl) - self.now).total_seconds()
        if left <= 0:
            self.plan.delete_flow = True
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


# -- the arithmetic of runs and answers ------------------------------------------------------------


def _more(reported: Usage, counted: Usage) -> bool:
    """A run's reports are cumulative: is this one further along than what its entry counts?"""
    return (reported.successful_requests, reported.total_tokens) > (counted.successful_requests,
                                                                    counted.total_tokens)


def total_usage(runs: list[Run]) -> Usage:
    total = Usage()
    for r in runs:
        if r.usage is not None:
            total = total + r.usage
    return total


def budget_spent(spec: FlowSpec, usage: Usage) -> str | None:
    """Why no further run may start (the budget is used up), naming the figure; None while it is not."""
    budget = spec.budget  # one rule with the runner's (Budget.exceeded_by): once reached, no run starts
    if budget is None or (limit := budget.exceeded_by(usage.total_tokens, usage.cost)) is None:
        return None
    return budget.figure(limit, usage.total_tokens, usage.cost)


def running_seconds(runs: list[Run], now: dt.datetime) -> float:
    """Time runner pods existed: waiting for feedback, in retry backoff, or warm for a message does not count."""
    spent = 0.0
    for r in runs:
        start = r.started_at
        if start is not None:
            spent += ((r.finished_at or now) - start).total_seconds() - (r.warm_seconds or 0.0)
    return spent


def trailing_failures(runs: list[Run]) -> int:
    """Failed runs since the last one that did not fail; disruptions are not the flow's failures."""
    n = 0
    for r in reversed(runs):
        if r.result == RunResult.FAILED and r.reason in DISRUPTION_REASONS:
            continue
        if r.result != RunResult.FAILED:
            break
        n += 1
    return n


def backoff_seconds(spec: FlowSpec, failures: int, cap: int) -> float:
    base = spec.retries.backoff_seconds if spec.retries else 10
    return float(min(cap, base * (2 ** max(failures - 1, 0))))


def validate_message(conv: ConversationStatus | None, phase: Phase | str | None, text: str | None) -> str | None:
    """Why a conversation message must be refused, or None. ``phase`` is the flow's when it arrived."""
    if conv is None or not conv.session_id:
        return (f"this Flow is not a conversation, or its session is not open yet (phase {phase or 'Pending'}); "
                "messages go only to a Flow that is AwaitingMessage")
    if conv.ended or phase in c.TERMINAL_PHASES:
        return "the conversation has ended"
    if phase != Phase.AWAITING_MESSAGE or conv.pending is not None:
        return (f"a turn is in progress (phase {phase}); send the next message when the Flow is "
                "AwaitingMessage")
    if text is None or not text.strip():
        return "inbox.text must be a non-empty string"
    if len(text) > c.MESSAGE_LIMIT:
        return f"inbox.text has {len(text)} characters, more than the {c.MESSAGE_LIMIT} a message may have"
    return None


def validate_response(request: FeedbackRequest | None, text: str | None, request_id: str | None) -> str | None:
    """Why a feedback response must be refused, or None when it is acceptable."""
    if request is None:
        return "no feedback request is pending"
    if request_id and request_id != request.id:
        return f"requestId {request_id!r} is not the pending request {request.id!r}"
    if text is None or not text.strip():
        return "response.text must be a non-empty string"
    return None
