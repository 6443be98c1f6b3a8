"""Conversations: a session opens with the first run; each message accepted from the status inbox
is answered by a run (or by the warm pod waiting for it); the session ends by the flow, by
maxTurns or by idleTimeoutSeconds."""

from __future__ import annotations

import datetime as dt
from typing import Any

from flowkube_api import constants as c
from flowkube_api.constants import Phase, Reason, Trigger
from flowkube_api.models import (
    ConversationMessage,
    ConversationStatus,
    PendingMessage,
    Result,
    Run,
)
from flowkube_api.report import TurnReport, excerpt
from flowkube_operator.flows.reconcile.state import FlowState
from flowkube_operator.flows.refusals import validate_message

Body = dict[str, Any]


class Conversation:
    """The session of one reconcile's Flow (``status.conversation``)."""

    def __init__(self, s: FlowState) -> None:
        self.s = s

    def turn_done(self, turn: TurnReport, output: str | None) -> None:
        """A conversation's run ended well: the session is open (turn 0) or a message is answered."""
        s = self.s
        conv = s.conv = s.st.conversation = s.conv or ConversationStatus()
        opened = conv.session_id is None
        if not opened and turn.turn <= conv.turns and not (turn.ended and not conv.ended):
            # Reported again (a retry, or a warm pod's last word after the turn was folded from its
            # warm report): nothing new. A message accepted since is answered by the next run.
            if conv.pending is None:
                s.st.phase = Phase.AWAITING_MESSAGE
            return
        conv.session_id = turn.session_id
        if turn.turn > conv.turns:  # the first report of this turn
            conv.turns = turn.turn
            conv.last_reply = excerpt(turn.reply or "")
            self._remember("assistant", turn.reply or "", turn.turn)
        if conv.pending is not None and conv.pending.turn <= turn.turn:
            conv.pending = None
        conv.ended = conv.ended or turn.ended
        conv.idle_since = s.now
        if opened:
            s.plan.event(Reason.SESSION_OPENED, f"conversation session {turn.session_id} is open; "
                         "send a message with a patch of status.conversation.inbox")
        else:
            s.plan.event(Reason.TURN_COMPLETED, f"message {turn.turn} answered")
        limit = s.spec.conversation.max_turns if s.spec.conversation else None
        if conv.ended:
            self._end(Reason.CONVERSATION_ENDED, f"the conversation ended after {conv.turns} message(s)")
        elif limit is not None and conv.turns >= limit:
            self._end(Reason.MAX_TURNS_REACHED,
                      f"{conv.turns} message(s) answered, conversation.maxTurns={limit}")
        else:
            s.st.phase = Phase.AWAITING_MESSAGE

    def _end(self, reason: Reason, message: str) -> None:
        """The session is over, well: its last reply is the flow's result."""
        s = self.s
        assert s.conv is not None
        s.st.result = Result(output=s.conv.last_reply)
        s.terminal(Phase.SUCCEEDED, reason, message)

    def _remember(self, role: str, text: str, turn: int, sender: str | None = None) -> None:
        s = self.s
        assert s.conv is not None
        message = ConversationMessage(role=role, content=excerpt(text, c.MESSAGE_EXCERPT_LIMIT), turn=turn,
                                      time=s.now, sender=sender)
        s.conv.messages = [*(s.conv.messages or []), message][-c.RECENT_MESSAGES:]

    def await_message(self, warm: Run | None = None) -> None:
        """Take the next message: a new run answers it, or the ``warm`` run whose pod waits for it
        (it takes the message through the state API's long poll)."""
        s = self.s
        conv = s.conv
        assert conv is not None
        if conv.pending is not None:
            # Accepted, not answered, and no run is at it. A run started for it that ended well without
            # the reply would only do so again: say so rather than loop. A warm pod that ended before it
            # took the message (its window passed, it was stopped) did not start for it: a new run answers
            # it (the runner's state says whether it already was).
            last = s.runs[-1] if s.runs else None
            came = conv.pending.sent_at.replace(microsecond=0) if conv.pending.sent_at else None
            if last is not None and last.trigger != Trigger.KICKOFF and (
                    came is None or last.started_at is None or last.started_at >= came):
                s.terminal(Phase.FAILED, Reason.INTERNAL_ERROR,
                           f"run {last.pod} ended without answering message {conv.pending.turn}")
                return
            s.start(Trigger.TURN)
            return
        s.st.phase = Phase.AWAITING_MESSAGE
        inbox, conv.inbox = conv.inbox, None
        if inbox is not None:
            problem = validate_message(conv, Phase.AWAITING_MESSAGE, inbox.text)
            if problem is not None:
                self._refuse(problem)
            else:
                text = inbox.text or ""
                conv.pending = PendingMessage(turn=conv.turns + 1, text=text, sent_by=inbox.sent_by, sent_at=s.now)
                self._remember("user", text, conv.pending.turn, sender=inbox.sent_by)
                who = f" from {inbox.sent_by}" if inbox.sent_by else ""
                s.plan.event(Reason.MESSAGE_RECEIVED, f"message {conv.pending.turn}{who} accepted")
                if warm is None:
                    s.start(Trigger.TURN)
                else:
                    s.add_warm_wait(warm, s.now)
                    s.st.phase = Phase.RUNNING
                return
        timeout = s.spec.conversation.idle_timeout_seconds if s.spec.conversation else None
        if timeout is None or conv.idle_since is None:
            return
        left = (conv.idle_since + dt.timedelta(seconds=timeout) - s.now).total_seconds()
        if left > 0:
            s.plan.later(left)
            return
        self._end(Reason.CONVERSATION_IDLE, f"no message for conversation.idleTimeoutSeconds="
                  f"{timeout}; the session ended after {conv.turns} message(s)")
        if warm is not None:
            s.close_warm(warm, "the conversation ended while the pod waited warm")

    def refuse_untimely_message(self) -> None:
        """A message that arrived while the flow could not take one (checked against the phase it had
        when the message came) is refused now, never kept for later: a later turn must not answer it."""
        s = self.s
        conv = s.st.conversation
        if conv is None or conv.inbox is None:
            return
        problem = validate_message(conv, s.old.phase, conv.inbox.text)
        if problem is not None:
            conv.inbox = None
            self._refuse(problem)

    def _refuse(self, problem: str) -> None:
        s = self.s
        s.message_refusal = f"message refused: {problem}"
        s.plan.event(Reason.MESSAGE_REFUSED, s.message_refusal, warning=True)
