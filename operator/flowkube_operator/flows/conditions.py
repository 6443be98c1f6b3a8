"""The conditions and the message of a Flow's status: what `kubectl get` and `kubectl describe` show.

`describe()` is the last step of every reconcile (`reconcile.plan`). From the status the state
machine arrived at it derives the four conditions, always in this order, and the one-line message:

- Accepted: False only when the flow can never run (invalid definition, flowRef or inputs).
- Running: whether a runner pod is at work, and if not, why (pending, retry backoff, paused, ...).
- AwaitingFeedback: a pending feedback request, or a refused answer, or how the last one was answered.
- Succeeded: Unknown until the flow is Succeeded or Failed.
- AwaitingMessage (conversations only, last): True while the session waits for its next message.

Pure, like the reconcile. A condition keeps its lastTransitionTime while its status stays the same,
so the status the Flow had before the reconcile is an input too.
"""

from __future__ import annotations

import datetime as dt

from flowkube_api.constants import ConditionType, Phase, Reason
from flowkube_api.models import Condition, FeedbackStatus, FlowStatus
from flowkube_api.report import excerpt

# (type, status, reason, message) of one condition, before it gets its times
_Entry = tuple[ConditionType, str, str, str]

_INVALID = (Reason.INVALID_DEFINITION, Reason.INVALID_FLOW_REF, Reason.INVALID_INPUTS, Reason.INVALID_SPEC)


def describe(st: FlowStatus, old: FlowStatus, failure: tuple[str, str] | None, refusal: str | None, *,
             generation: int | None, now: dt.datetime, message_refusal: str | None = None) -> None:
    """Set `st.conditions` and `st.message` from the rest of `st`.

    `failure` is the (reason, message) the reconcile ended the flow with (Succeeded too, for a
    conversation that ended), or put its retry off for;
    `refusal` is why it refused a feedback response, `message_refusal` a conversation message. They
    are None when this reconcile decided none of them: a Failed flow then keeps the failure its
    previous Succeeded condition recorded.
    """
    d = _Description(st, old, failure, refusal, generation, now)
    d.message_refusal = message_refusal
    d.write()


class _Description:
    def __init__(self, st: FlowStatus, old: FlowStatus, failure: tuple[str, str] | None, refusal: str | None,
                 generation: int | None, now: dt.datetime) -> None:
        self.st, self.old = st, old
        self._old_conditions = {x.type: x for x in old.conditions or []}
        self.generation, self.now = generation, now
        self.phase = st.phase
        self.last = st.runs[-1] if st.runs else None
        feedback = st.feedback or FeedbackStatus()
        self.request, self.history = feedback.request, feedback.history
        self.refusal = refusal
        self.message_refusal: str | None = None
        reason, self.failure_msg = failure or (None, "")
        if self.phase in (Phase.FAILED, Phase.SUCCEEDED) and reason is None:
            reason, self.failure_msg = self._previous_failure()
        self.failure_reason: str | None = reason

    def write(self) -> None:
        entries = [self._accepted(), self._running(), self._awaiting_feedback(), self._succeeded()]
        if self.st.conversation is not None:
            entries.append(self._awaiting_message())
        self.st.conditions = [self._condition(*e) for e in entries]
        self.st.message = self._message()  # after AwaitingFeedback: that may bring a refusal back

    # -- the conditions ------------------------------------------------------------------------------

    def _accepted(self) -> _Entry:
        if self.failure_reason in _INVALID:
            return ConditionType.ACCEPTED, "False", str(self.failure_reason), self.failure_msg
        return ConditionType.ACCEPTED, "True", Reason.ACCEPTED, "the flow was accepted"

    def _running(self) -> _Entry:
        phase, last, reason = self.phase, self.last, self.failure_reason
        if phase == Phase.RUNNING:
            return ConditionType.RUNNING, "True", Reason.RUN_STARTED, f"run {last.pod if last else ''}"
        if phase == Phase.PENDING and reason == Reason.RETRY_BACKOFF:
            return ConditionType.RUNNING, "False", Reason.RETRY_BACKOFF, self.failure_msg
        if phase == Phase.PENDING and reason is not None:  # its pod waits: not scheduled, no image, ...
            return ConditionType.RUNNING, "Unknown", str(reason), self.failure_msg
        if phase == Phase.PENDING:
            return (ConditionType.RUNNING, "Unknown", Reason.RUN_PENDING,
                    f"waiting for runner pod {last.pod}" if last else "waiting for a runner pod")
        if phase == Phase.SUSPENDED:
            return ConditionType.RUNNING, "False", Reason.SUSPENDED, "spec.suspend is true"
        if phase == Phase.AWAITING_FEEDBACK:
            return ConditionType.RUNNING, "False", Reason.RUN_PAUSED, "waiting for feedback"
        if phase == Phase.AWAITING_MESSAGE:
            return ConditionType.RUNNING, "False", Reason.TURN_COMPLETED, "waiting for the next message"
        if phase == Phase.SUCCEEDED:
            return ConditionType.RUNNING, "False", Reason.RUN_SUCCEEDED, "the flow finished"
        return ConditionType.RUNNING, "False", str(reason or Reason.RUN_FAILED), self.failure_msg

    def _awaiting_feedback(self) -> _Entry:
        req, prev = self.request, self._previous(ConditionType.AWAITING_FEEDBACK)
        if req is not None:
            if self.refusal:
                msg = f"{self.refusal}; still waiting for request {req.id}. {req.method}: {req.message}"
                return ConditionType.AWAITING_FEEDBACK, "True", Reason.FEEDBACK_REFUSED, excerpt(msg, 1024)
            if (prev is not None and prev.status == "True" and prev.reason == Reason.FEEDBACK_REFUSED
                    and f"request {req.id}." in prev.message):
                # The refusal stays visible until the request is answered or replaced.
                self.refusal = prev.message.split("; still waiting", 1)[0]
                return ConditionType.AWAITING_FEEDBACK, "True", prev.reason, prev.message
            return (ConditionType.AWAITING_FEEDBACK, "True", Reason.FEEDBACK_REQUESTED,
                    excerpt(f"{req.method}: {req.message}", 1024))
        if self.refusal:
            return ConditionType.AWAITING_FEEDBACK, "False", Reason.FEEDBACK_REFUSED, self.refusal
        if prev is not None and prev.status == "True" and self.history:
            h = self.history[-1]
            reason = Reason.FEEDBACK_TIMED_OUT if h.timed_out else Reason.FEEDBACK_RECEIVED
            return ConditionType.AWAITING_FEEDBACK, "False", reason, f"request {h.request_id} answered"
        if prev is not None and prev.reason != Reason.FEEDBACK_REFUSED:
            return ConditionType.AWAITING_FEEDBACK, prev.status, prev.reason, prev.message
        return ConditionType.AWAITING_FEEDBACK, "False", "NoRequest", "no feedback request is pending"

    def _succeeded(self) -> _Entry:
        if self.phase == Phase.SUCCEEDED:
            if self.failure_reason not in (None, Reason.RUN_FAILED, Reason.RUN_SUCCEEDED):  # a conversation's end
                return ConditionType.SUCCEEDED, "True", self.failure_reason, self.failure_msg
            return ConditionType.SUCCEEDED, "True", Reason.RUN_SUCCEEDED, "the flow finished"
        if self.phase == Phase.FAILED:
            return ConditionType.SUCCEEDED, "False", str(self.failure_reason), self.failure_msg
        return ConditionType.SUCCEEDED, "Unknown", "NotFinished", f"phase {self.phase}"

    def _awaiting_message(self) -> _Entry:
        conv = self.st.conversation
        assert conv is not None
        if self.phase == Phase.AWAITING_MESSAGE:
            msg = f"session {conv.session_id}: {conv.turns} message(s) answered; send the next one"
            if self.message_refusal:
                return (ConditionType.AWAITING_MESSAGE, "True", Reason.MESSAGE_REFUSED,
                        f"{self.message_refusal}; {msg}")
            return ConditionType.AWAITING_MESSAGE, "True", Reason.TURN_COMPLETED, msg
        if conv.pending is not None:
            return (ConditionType.AWAITING_MESSAGE, "False", Reason.MESSAGE_RECEIVED,
                    f"answering message {conv.pending.turn}")
        if self.phase in (Phase.SUCCEEDED, Phase.FAILED):
            return (ConditionType.AWAITING_MESSAGE, "False", str(self.failure_reason or self.phase),
                    "the conversation is over")
        return ConditionType.AWAITING_MESSAGE, "False", Reason.RUN_PENDING, "the session is not open yet"

    # -- the message ---------------------------------------------------------------------------------

    def _message(self) -> str:
        phase, last, req = self.phase, self.last, self.request
        if phase == Phase.FAILED:
            return self.failure_msg
        if phase == Phase.AWAITING_FEEDBACK and req is not None:
            return excerpt(self.refusal or f"awaiting feedback: {req.message or req.method}", 512)
        if phase == Phase.PENDING and self.failure_reason is not None:  # a retry's backoff, a waiting pod
            return excerpt(self.failure_msg, 512)
        if phase == Phase.SUCCEEDED:
            ended = self.failure_reason not in (None, Reason.RUN_FAILED, Reason.RUN_SUCCEEDED)
            return self.failure_msg if ended and self.failure_msg else "finished"
        if phase == Phase.AWAITING_MESSAGE:
            return excerpt(self.message_refusal or "awaiting the next message", 512)
        if phase == Phase.SUSPENDED:
            return "suspended"
        if phase == Phase.RUNNING and last is not None:
            return f"running {last.pod} ({last.trigger})"
        if self.refusal:
            return self.refusal
        return f"waiting for runner pod {last.pod}" if last is not None else "waiting for a runner pod"

    # -- the previous status -------------------------------------------------------------------------

    def _previous(self, ctype: ConditionType) -> Condition | None:
        return self._old_conditions.get(ctype)

    def _previous_failure(self) -> tuple[str, str]:
        prev = self._previous(ConditionType.SUCCEEDED)
        if self.phase == Phase.SUCCEEDED:
            return (prev.reason, prev.message) if prev and prev.status == "True" else (Reason.RUN_SUCCEEDED, "")
        return (prev.reason, prev.message) if prev else (Reason.RUN_FAILED, self.st.message or "")

    def _condition(self, ctype: ConditionType, status: str, reason: str, message: str) -> Condition:
        prev = self._previous(ctype)
        since = prev.last_transition_time if prev is not None and prev.status == status else self.now
        return Condition(type=ctype, status=status, reason=str(reason), message=excerpt(message, 1024),
                         last_transition_time=since, observed_generation=self.generation)
