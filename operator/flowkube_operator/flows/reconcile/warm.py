"""Warm runners: a pod that answered a turn, or paused for feedback, and stays up waiting for the
next message or the answer. Its warm reports are folded while it runs."""

from __future__ import annotations

from typing import Any

from flowkube_api import constants as c
from flowkube_api.constants import Phase, RunResult
from flowkube_api.models import (
    Run,
)
from flowkube_api.report import Usage
from flowkube_operator.flows.reconcile.conversation import ConversationSteps
from flowkube_operator.flows.reconcile.feedback import FeedbackSteps
from flowkube_operator.flows.reconcile.rules import _more

Body = dict[str, Any]


class WarmSteps(FeedbackSteps, ConversationSteps):
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
