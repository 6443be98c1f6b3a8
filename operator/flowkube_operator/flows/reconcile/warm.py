"""Warm runners: a pod that answered a turn, or paused for feedback, and stays up waiting for the
next message or the answer. Its warm reports are folded while it runs."""

from __future__ import annotations

from typing import Any

from flowkube_api import constants as c
from flowkube_api.constants import Phase, RunResult
from flowkube_api.models import (
    Run,
)
from flowkube_api.report import Usage, matching_charges
from flowkube_operator.flows.reconcile.conversation import Conversation
from flowkube_operator.flows.reconcile.feedback import Feedback
from flowkube_operator.flows.reconcile.rules import _more
from flowkube_operator.flows.reconcile.state import FlowState

Body = dict[str, Any]


class Warm:
    """The warm pod of one reconcile's Flow: what it reported while it stays up, and what it waits for."""

    def __init__(self, s: FlowState, feedback: Feedback, conversation: Conversation) -> None:
        self.s, self.feedback, self.conversation = s, feedback, conversation

    def follow(self, run: Run) -> bool:
        """A running pod that may be warm: fold what it reported (a turn answered, a pause for
        feedback); True when that settles the run for now (the session ended with that turn, or the
        pod waits for a message or an answer: that is the user's time, not the deadline's)."""
        s = self.s
        self._fold(run)
        if run.finished_at is not None:
            return True
        if not s.waiting_warm(run):
            return False
        if s.fb.request is not None:
            self.feedback.await_answer(warm=run)
        else:
            s.st.phase = Phase.AWAITING_MESSAGE
            self.conversation.await_message(warm=run)
        return True

    def _fold(self, run: Run) -> None:
        """The active run's pod reported and stays up (a warm report): fold the turn it answered or
        the request it paused on into status, and let the run go on."""
        s = self.s
        rep = s.report
        if rep is None or rep.pod != run.pod or not rep.warm:
            return
        if _more(rep.usage, run.usage or Usage()):
            run.usage = rep.usage  # a run's reports are cumulative: everything it did so far
            run.charges = matching_charges(rep.usage, rep.charges)
        if rep.flow_id:
            s.st.flow_id = rep.flow_id
        self.feedback.note_applied(rep)
        if rep.result == RunResult.PAUSED and rep.feedback_request is not None:
            if not self.feedback.answered(rep.feedback_request.id):
                self.feedback.requested(rep.feedback_request)
            return
        if rep.result != RunResult.SUCCEEDED or rep.conversation is None:
            return
        self.conversation.turn_done(rep.conversation.model_copy(), rep.output)  # nothing new if it was folded before
        if s.st.phase in c.TERMINAL_PHASES:  # the session ended with that turn (maxTurns)
            s.close_warm(run, f"run {run.pod} answered the conversation's last message")
