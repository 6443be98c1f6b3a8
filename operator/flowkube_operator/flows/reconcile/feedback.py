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


class Feedback:
    """The pause for a person of one reconcile's Flow (``status.feedback``)."""

    def __init__(self, s: FlowState) -> None:
        self.s = s

    def requested(self, fr: FeedbackRequest) -> None:
        """The flow paused on ``fr``: it is pending in status (once: a warm pod's request is there already)."""
        s = self.s
        if s.fb.request is None or s.fb.request.id != fr.id:
            timeout = s.spec.feedback.timeout_seconds if s.spec.feedback else None
            s.fb.request = PendingFeedback(
                **fr.model_dump(exclude={"output", "requested_at"}), output=excerpt(fr.output or ""),
                requested_at=s.now, deadline=s.now + dt.timedelta(seconds=timeout) if timeout else None,
            )
            s.plan.event(Reason.FEEDBACK_REQUESTED,
                         f"{fr.method} asks for feedback (request {fr.id}): {excerpt(fr.message, 256)}")
        s.st.phase = Phase.AWAITING_FEEDBACK

    def answered(self, request_id: str) -> bool:
        """Has an answer to this request been accepted (it is in the history)?"""
        return any(h.request_id == request_id for h in self.s.fb.history or [])

    def note_applied(self, rep: RunReport) -> None:
        applied = rep.feedback_applied
        for h in self.s.fb.history or []:
            if applied is not None and h.request_id == applied.request_id and not h.outcome:
                h.outcome = applied.outcome  # the outcome crewAI collapsed the answer to

    def await_answer(self, warm: Run | None = None) -> None:
        """Take the answer: a new run resumes the flow, or the ``warm`` run whose pod waits for it."""
        s = self.s
        req = s.fb.request
        assert req is not None
        s.st.phase = Phase.AWAITING_FEEDBACK
        resp = s.fb.response
        if resp is not None:
            problem = validate_response(req, resp.text, resp.request_id)
            s.fb.response = None
            if problem is not None:
                self._refuse(problem)
            else:
                self._answer(req, text=resp.text or "", outcome=None, timed_out=False,
                             by=resp.responded_by, warm=warm)
            return
        deadline = req.deadline
        if deadline is None:
            return
        if s.now < deadline:
            s.plan.later((deadline - s.now).total_seconds())
            return
        if req.default_outcome:
            self._answer(req, text="", outcome=req.default_outcome, timed_out=True, by=None, warm=warm)
            return
        if warm is not None:
            s.close_warm(warm, f"no answer to request {req.id} came", RunResult.PAUSED)
        s.fb.request = None
        s.terminal(Phase.FAILED, Reason.FEEDBACK_TIMED_OUT,
                   f"no feedback for request {req.id} ({req.method}) before {req.deadline}, "
                   "and the step has no default outcome")

    def _answer(self, req: FeedbackRequest, *, text: str, outcome: str | None, timed_out: bool,
                by: str | None, warm: Run | None = None) -> None:
        s = self.s
        history = list(s.fb.history or [])
        history.append(FeedbackRecord(
            request_id=req.id, method=req.method, response=text or None, outcome=outcome,
            requested_at=req.requested_at, responded_at=s.now, responded_by=by, timed_out=timed_out,
        ))
        s.fb.history = history
        s.fb.request = None
        if timed_out:
            s.plan.event(Reason.FEEDBACK_TIMED_OUT,
                         f"request {req.id} timed out; resuming with default outcome {outcome!r}")
        else:
            who = f" from {by}" if by else ""
            s.plan.event(Reason.FEEDBACK_RECEIVED, f"feedback{who} accepted for request {req.id}")
        if warm is None:
            s.start(Trigger.RESUME)
        else:  # the pod that paused takes the answer through the state API's long poll
            s.add_warm_wait(warm, s.now, since=req.requested_at)
            s.st.phase = Phase.RUNNING

    def _refuse(self, problem: str) -> None:
        s = self.s
        s.refusal = f"feedback response refused: {problem}"
        s.plan.event(Reason.FEEDBACK_REFUSED, s.refusal, warning=True)

    def refuse_stray_response(self) -> None:
        s = self.s
        if s.fb.response is not None:
            s.fb.response = None
            self._refuse(validate_response(None, None, None) or "")
