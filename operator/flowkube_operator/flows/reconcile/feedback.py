"""Human feedback: a run paused on a request; the answer (or its timeout) is taken from the
status inbox and resumes the flow, in a new run or in the warm pod that paused."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.models import (
    FeedbackRecord,
    FeedbackRequest,
    PendingFeedback,
    Run,
)
from flowkube_api.report import RunReport, excerpt
from flowkube_operator.flows.reconcile.state import FlowState
from flowkube_operator.flows.refusals import validate_response

Body = dict[str, Any]


class FeedbackSteps(FlowState):
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

    def _answered(self, request_id: str) -> bool:
        """Has an answer to this request been accepted (it is in the history)?"""
        return any(h.request_id == request_id for h in self.fb.history or [])

    def _note_applied(self, rep: RunReport) -> None:
        applied = rep.feedback_applied
        for h in self.fb.history or []:
            if applied is not None and h.request_id == applied.request_id and not h.outcome:
                h.outcome = applied.outcome  # the outcome crewAI collapsed the answer to

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
