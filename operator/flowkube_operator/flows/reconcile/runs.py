"""Runs and retries: how the active run's pod ends (its report, the deadline, a pod gone), and what
follows a failure (a retry after backoff, a replacement after a disruption). Which of these moves a
reconcile makes is `Reconciler`'s phase switch (`_follow`, `_next`)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api import constants as c
from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.models import (
    Result,
    Run,
)
from flowkube_api.report import RunReport, Usage, excerpt, matching_charges
from flowkube_operator.flows.reconcile import forks
from flowkube_operator.flows.reconcile.conversation import Conversation
from flowkube_operator.flows.reconcile.feedback import Feedback
from flowkube_operator.flows.reconcile.rules import (
    DISRUPTION_REASONS,
    PERMANENT_REASONS,
    POD_FIRST_TRIGGERS,
    STOP_GRACE_SECONDS,
    _more,
    backoff_seconds,
    running_seconds,
    trailing_failures,
)
from flowkube_operator.flows.reconcile.state import FlowState, NeedReport
from flowkube_operator.meta import Doomed, PodView

Body = dict[str, Any]


SPANS_LOST_LIMIT = 10**9  # trace spans a run's report may say its pod lost (tracing on)


class Runs:
    """The runs of one reconcile's Flow: how the active one ends, and what follows a failure."""

    def __init__(self, s: FlowState, feedback: Feedback, conversation: Conversation) -> None:
        self.s, self.feedback, self.conversation = s, feedback, conversation

    def fold_late_reports(self) -> None:
        """A closed run's pod that kept going reports what it did after the close: those calls were
        answered and billed, so they count, once, in that run's entry (a run's reports are
        cumulative, so the latest replaces the entry's usage). Its end is when its pod ended, unless
        it was closed on its final report: then the pod's end changes nothing, but a report written
        after the final one (which the runner never writes) still counts, whoever wrote it."""
        s = self.s
        for run in s.runs:
            if run.finished_at is None or run.pod not in s.late:
                continue
            rep, pod = s.late[run.pod], s.pods.get(run.pod)
            counted = run.usage or Usage()
            if rep is not None and rep.pod == run.pod and _more(rep.usage, counted):
                added = rep.usage.total_tokens - counted.total_tokens
                run.usage = rep.usage
                run.charges = matching_charges(rep.usage, rep.charges)
                s.plan.event(Reason.LATE_REPORT, f"run {run.pod} reported {added} more tokens after it was "
                             f"closed; they count in its entry")
            if (pod is not None and pod.terminated and pod.finished_at and pod.finished_at > run.finished_at
                    and not run.closed_on_report):
                run.finished_at = pod.finished_at

    def final_report(self, run: Run) -> RunReport | None:
        """The run's final report, when the state API handed it over before the pod ended and it
        says the run succeeded or paused. A failure waits for the pod's end, which says whose it was
        (a disruption, the deadline) and how it exited."""
        rep = self.s.report
        if rep is None or rep.pod != run.pod or not rep.final or rep.warm or rep.result == RunResult.FAILED:
            return None
        return rep

    def follow_reported(self, run: Run, final: RunReport) -> None:
        """The pod wrote its final report and is ending: the run ends now, as the report says (its
        exit code is the one the runner exits with). The pod's end, a second or two later, changes
        nothing (``closed_on_report``)."""
        run.exit_code = final.exit_code
        run.closed_on_report = True
        self._end_run(run, final, final.result, final.reason, final.message, finished_at=final.finished_at)

    def _over_deadline(self, ended: dt.datetime | None) -> float | None:
        """Seconds past activeDeadlineSeconds (None without one), judged at the moment the run ended
        if it did (``ended``), not when we look."""
        s = self.s
        limit = s.spec.active_deadline_seconds
        return None if limit is None else running_seconds(s.runs, ended or s.now) - limit

    def _end_at_deadline(self, run: Run, exit_code: int | None, finished_at: dt.datetime | None) -> None:
        """Over the deadline, and the pod stopped (or will not stop): the run ends only now, so the
        report read has every LLM call the pod completed before it was stopped."""
        s = self.s
        s.stop_pod(run.pod)
        run.exit_code = exit_code
        self._end_run(run, self._report_of(run), RunResult.FAILED, Reason.DEADLINE_EXCEEDED,
                      f"the flow ran longer than activeDeadlineSeconds={s.spec.active_deadline_seconds}",
                      finished_at=finished_at)

    def follow_gone(self, run: Run) -> None:
        """The pod is gone without our seeing it end: it may have left its final report."""
        rep = self._report_of(run)
        final = rep if rep is not None and rep.reason != Reason.RUN_INTERRUPTED else None
        over = self._over_deadline(final.finished_at if final is not None else None)
        # A run that finished on its own just as time ran out stands as it finished.
        if over is not None and over >= 0 and (final is None or final.exit_code != 0):
            self._end_at_deadline(run, None, final.finished_at if final is not None else None)
        elif final is not None:
            # It finished and reported; its pod was deleted before we saw it end (the operator
            # was down). The run stands as reported: running it again would repeat its work.
            run.exit_code = final.exit_code
            self._end_run(run, final, final.result, final.reason, final.message, finished_at=final.finished_at)
        else:
            self._end_run(run, rep, RunResult.FAILED, Reason.POD_DELETED,
                          f"runner pod {run.pod} disappeared before it finished")

    def follow_ended(self, run: Run, pod: PodView) -> None:
        over = self._over_deadline(pod.finished_at)
        if over is not None and over >= 0 and pod.exit_code != 0:
            self._end_at_deadline(run, pod.exit_code, pod.finished_at)
        else:
            self._end_from_pod(run, pod)

    def follow_running(self, run: Run, pod: PodView) -> None:
        s = self.s
        s.st.phase = Phase.RUNNING if pod.phase == "Running" else Phase.PENDING
        if pod.waiting is not None and s.st.phase == Phase.PENDING:
            # Not scheduled, or its image or a Secret it needs is missing: say so in Kubernetes'
            # words, where `kubectl get flows` shows it (the pod's own Events have the details).
            reason, why = pod.waiting
            message = excerpt(f"runner pod {pod.name} is waiting ({reason}): {why}", 1024)
            if reason == Reason.INVALID_IMAGE_NAME:  # the pod's image cannot change: it would wait forever
                s.stop_pod(run.pod)
                self._end_run(run, None, RunResult.FAILED, Reason.INVALID_IMAGE_NAME, message)
                return
            s.failure = (reason, message)
        over = self._over_deadline(None)
        if over is None:
            return
        if over > STOP_GRACE_SECONDS:  # asked to stop, and not stopped (its node is down): end it anyway
            self._end_at_deadline(run, pod.exit_code, pod.finished_at)
        elif over >= 0:  # stop the pod; the run ends when it has stopped (_follow_ended)
            if not pod.deleting:
                s.plan.delete_pods.append(Doomed(run.pod, pod.uid))
            s.plan.later(STOP_GRACE_SECONDS - over + 0.5)
        else:
            s.plan.later(-over)

    def _report_of(self, run: Run) -> RunReport | None:
        """The run's report, when it ends without its pod telling (deleted, or over the deadline):
        the tokens of the LLM calls it made are in its interim report and must still count."""
        s = self.s
        if not s.report_checked:
            raise NeedReport
        return s.report if s.report is not None and s.report.pod == run.pod else None

    def _end_from_pod(self, run: Run, pod: PodView) -> None:
        rep = self.s.report
        reason: Reason | str
        if pod.reason == "DeadlineExceeded":
            # Killed by its activeDeadlineSeconds: whatever the interim report says, that is why.
            result, reason = RunResult.FAILED, Reason.DEADLINE_EXCEEDED
            message = "the runner pod exceeded its activeDeadlineSeconds"
        elif rep is not None and rep.pod == run.pod:
            result = rep.result
            if rep.warm:
                pass  # its last word: every message it took is answered and saved, and it waited; then it was stopped
            elif pod.exit_code not in (None, 0) and result != RunResult.FAILED and not rep.final:
                result = RunResult.FAILED  # the process died after writing an optimistic report
            # (After its final report, nothing the process does changes the run: its work is saved.)
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
        s = self.s
        if s.waiting_warm(run):
            s.add_warm_wait(run, finished_at or s.now)
        run.result, run.reason, run.message = result, str(reason), excerpt(message, 1024)
        if rep is not None:
            run.usage = rep.usage  # every LLM call the run made counts, however it ended
            run.charges = matching_charges(rep.usage, rep.charges)
            if rep.spans_lost is not None:  # a pod's word: bounded, so a pod cannot inflate the metric past it
                lost = rep.spans_lost
                run.spans_lost = min(lost.queue_full + lost.export_failed + lost.unflushed, SPANS_LOST_LIMIT)
            if rep.flow_id:
                s.st.flow_id = rep.flow_id
            s.st.checkpoints = forks.fold(s.st.checkpoints, rep.checkpoints, forks.kept(s.own_spec))
            self.feedback.note_applied(rep)
        run.finished_at = finished_at or s.now
        if run.started_at is None:
            run.started_at = run.finished_at
        if result == RunResult.SUCCEEDED and rep is not None and rep.conversation is not None:
            self.conversation.turn_done(rep.conversation.model_copy(), rep.output)
        elif result == RunResult.SUCCEEDED:
            s.st.result = Result(output=rep.output if rep else None)
            s.terminal(Phase.SUCCEEDED, Reason.RUN_SUCCEEDED, "the flow finished")
            s.plan.event(Reason.RUN_SUCCEEDED, f"run {run.pod} succeeded; the flow finished")
        elif result == RunResult.PAUSED and rep is not None and rep.feedback_request is not None:
            if self.feedback.answered(rep.feedback_request.id):
                # Its warm pod waited for the answer and ended before it took it: a new pod resumes.
                s.resume_now = True
            else:
                self.feedback.requested(rep.feedback_request)
        else:
            if result != RunResult.FAILED:  # Paused without a request: nothing could ever resume it
                run.result, reason = RunResult.FAILED, Reason.INTERNAL_ERROR
                message = "the run paused but reported no feedback request"
            self._after_failure(run, reason, message)

    def _after_failure(self, run: Run, reason: Reason | str, message: str) -> None:
        s = self.s
        if reason in DISRUPTION_REASONS:
            self._after_disruption(run, message)
            return
        permanent = reason in PERMANENT_REASONS or run.exit_code == c.EXIT_PERMANENT
        limit = s.spec.retries.limit if s.spec.retries else 0
        failures = trailing_failures(s.runs)
        s.plan.event(str(reason), f"run {run.pod} failed: {excerpt(message, 512)}", warning=True)
        if reason == Reason.QUOTA_EXHAUSTED and s.quota is not None:
            # The quota service says the Flow waits (an ``action: Queue`` quota refused the call for
            # room it may have later): no failure of the flow's, a retry once there is room.
            s.hold_for_quota()
        elif permanent:
            s.terminal(Phase.FAILED, reason, message)
        elif failures > limit:
            why = f"{failures} failed run(s), retries.limit={limit}; last: {message}"
            s.terminal(Phase.FAILED, Reason.RETRIES_EXHAUSTED, why)
        else:
            s.st.phase = Phase.PENDING

    def _after_disruption(self, run: Run, message: str) -> None:
        s = self.s
        limit = s.spec.retries.disruption_limit if s.spec.retries else c.DEFAULT_DISRUPTION_LIMIT
        lost = sum(1 for r in s.runs if r.reason in DISRUPTION_REASONS)
        if lost > limit:
            why = f"{lost} runner pods lost to disruptions, retries.disruptionLimit={limit}; last: {message}"
            s.terminal(Phase.FAILED, Reason.DISRUPTIONS_EXHAUSTED, why)
            return
        s.plan.event(Reason.DISRUPTED, f"{excerpt(message, 512)}; replacing it ({lost} of "
                     f"retries.disruptionLimit={limit}; retries.limit is not used)", warning=True)
        s.st.phase = Phase.PENDING

    def retry(self, last: Run) -> None:
        """The last run failed: a replacement at once after a disruption (like a Job's pod lost to
        one), a retry once the backoff has passed after a failure."""
        s = self.s
        if last.reason == Reason.QUOTA_EXHAUSTED and s.quota is not None:
            s.hold_for_quota()  # stopped by a Queue quota for room: it starts when there is room
            return
        if last.reason not in DISRUPTION_REASONS:
            due = last.finished_at or s.now
            wait = backoff_seconds(s.spec, trailing_failures(s.runs), s.backoff_cap)
            left = (due + dt.timedelta(seconds=wait) - s.now).total_seconds()
            if left > 0:
                s.st.phase = Phase.PENDING
                s.plan.later(left)
                s.failure = (Reason.RETRY_BACKOFF, f"retrying in {left:.0f}s after: {last.message}")
                return
        s.start(Trigger.RETRY)

    def adopt(self) -> bool:
        """A pod under the next run's name exists, made by a start whose status write was lost (the
        operator stopped, or the Flow changed under it): record it as that run, started when it was."""
        s = self.s
        name = c.run_pod_name(str(s.meta.get("name")), len(s.runs))
        pod = s.pods.get(name)
        if pod is None or pod.trigger not in POD_FIRST_TRIGGERS:
            return False
        s.runs.append(Run(pod=name, trigger=Trigger(pod.trigger), started_at=pod.created_at or s.now))
        s.st.phase = Phase.RUNNING if pod.phase == "Running" else Phase.PENDING
        if pod.terminated:
            s.plan.later(0)  # follow it to its end with its report, in the next reconcile
        return True
