"""The run report: what one runner pod tells the operator about its run.

Each run has one report in the Flow's state ConfigMap (binaryData key ``report_key(pod)``,
gzip-compressed JSON); the runner also writes a shortened copy to the pod's termination message.
While the run is going, that key holds an interim report (``Failed``/``RunInterrupted`` with the
tokens counted so far, refreshed after every model call), so a runner killed without warning still
leaves its tokens behind; the final report replaces it.
The operator is the only writer of Flow status; it folds reports into ``status.runs[]``,
``status.usage``, ``status.feedback`` and ``status.result``. Field names match docs/api.md.

Pydantic only: this module is imported by both sides and must not pull in crewAI.
"""

from __future__ import annotations

import gzip
import json
import zlib
from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import Field

from flowkube_api.base import Model, Money, Time
from flowkube_api.constants import EXCERPT_LIMIT, Reason, RunResult, Trigger

Count = Annotated[int, Field(ge=0)]
TERMINATION_MESSAGE_LIMIT = 4096  # kubelet truncates the termination message beyond this
_SUMMARY_MESSAGE_LIMIT = 1024
# A report's JSON, decompressed. A real one is a few kB (outputs and messages are excerpts); the
# bound is what a run report can never need, and what an operator replica can decode at once.
REPORT_LIMIT = 1 << 20


class ReportTooLarge(ValueError):
    """A report that decompresses past ``REPORT_LIMIT`` (a gzip bomb, or not a report at all)."""


def gunzip(data: bytes, limit: int = REPORT_LIMIT) -> bytes:
    """``gzip.decompress`` that stops at ``limit`` bytes of output: 900 KiB of gzip can expand to
    about 900 MiB, and every report is bytes a runner pod (or a ConfigMap editor) chose."""
    d = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)  # gzip framing, one member (what encode writes)
    try:
        out = d.decompress(data, limit + 1)
    except zlib.error as e:
        raise ValueError(f"the report is not gzip: {e}") from None
    if len(out) > limit:
        raise ReportTooLarge(f"the report decompresses to more than {limit} bytes")
    if not d.eof or d.unused_data:
        raise ValueError("the report is not one whole gzip member")
    return out


def excerpt(text: str, limit: int = EXCERPT_LIMIT) -> str:
    """At most ``limit`` UTF-8 bytes of ``text``, never splitting a character."""
    raw = text.encode("utf-8")
    if len(raw) <= limit:
        return text
    return raw[:limit].decode("utf-8", errors="ignore")


class TokenUsage(Model):
    """Token counters and spend of one model, or the totals of a run/flow (``status.usage`` fields).

    ``cost`` is what the priced calls cost, in USD, priced by the runner at the time of each call;
    ``unpriced_tokens`` are the tokens of calls whose model has no price (never silently zero).
    """

    # Counts are never negative: a report is bytes a runner pod chose, and a negative count would
    # take spend off the Flow's usage, its budget and its metrics.
    total_tokens: Count = 0
    prompt_tokens: Count = 0
    completion_tokens: Count = 0
    cached_prompt_tokens: Count = 0
    reasoning_tokens: Count = 0
    cache_creation_tokens: Count = 0
    successful_requests: Count = 0
    cost: Money = Decimal(0)
    unpriced_tokens: Count = 0

    def _summed(self, other: TokenUsage) -> dict[str, Any]:
        return {name: getattr(self, name) + getattr(other, name) for name in TokenUsage.model_fields}

    def plus_tokens(self, other: TokenUsage) -> TokenUsage:
        return TokenUsage(**self._summed(other))


class Usage(TokenUsage):
    """Totals plus ``byModel``; runs add up to the flow's usage with ``+``."""

    currency: Literal["USD"] = "USD"
    by_model: dict[str, TokenUsage] = Field(default_factory=dict)

    def plus(self, other: Usage) -> Usage:
        by_model = dict(self.by_model)
        for model, tokens in other.by_model.items():
            mine = by_model.get(model)
            by_model[model] = tokens.model_copy() if mine is None else mine.plus_tokens(tokens)
        return Usage(**self._summed(other), by_model=by_model)

    def __add__(self, other: Usage) -> Usage:
        return self.plus(other)

    def totals(self) -> TokenUsage:
        return TokenUsage(**{name: getattr(self, name) for name in TokenUsage.model_fields})

    def at_least(self, totals: TokenUsage) -> Usage:
        """These counts, raised field by field to ``totals`` where those are higher; what is added
        goes to the one model (or ``unknown`` when there are several), so ``byModel`` still sums up.
        For a run whose last reports reached only its termination message, which carries totals."""
        extra = {name: max(getattr(totals, name) - getattr(self, name), 0) for name in TokenUsage.model_fields}
        if not any(extra.values()):
            return self
        added = TokenUsage(**extra)
        model = next(iter(self.by_model)) if len(self.by_model) == 1 else "unknown"
        return self.plus(Usage(**added.model_dump(), by_model={model: added}))


class FeedbackRequest(Model):
    """A human-feedback request as the runner reports it; ``status.feedback.request`` adds its deadline."""

    id: str
    method: str
    message: str = ""
    emit: list[str] | None = None
    default_outcome: str | None = None
    output: str | None = Field(default=None, description=f"excerpt, at most {EXCERPT_LIMIT} bytes")
    requested_at: Time | None = None


class FeedbackApplied(Model):
    """The feedback a resumed run consumed, for ``status.feedback.history[]``."""

    request_id: str
    method: str
    response: str = ""
    outcome: str | None = None
    timed_out: bool = False


class TurnReport(Model):
    """A conversation's state after a run: the session it holds and the turn it answered (0 when the
    run only opened the session), with the reply. ``ended``: the flow's ``end`` route or an exit
    command ended the session."""

    session_id: str
    turn: int = 0
    reply: str | None = Field(default=None, description=f"excerpt, at most {EXCERPT_LIMIT} bytes")
    ended: bool = False


class RunReport(Model):
    pod: str
    flow: str = ""
    trigger: Trigger
    result: RunResult
    reason: Reason
    message: str = ""
    exit_code: int
    flow_id: str | None = None
    usage: Usage = Field(default_factory=Usage)
    output: str | None = Field(default=None, description=f"excerpt, at most {EXCERPT_LIMIT} bytes")
    feedback_request: FeedbackRequest | None = None
    feedback_applied: FeedbackApplied | None = None
    conversation: TurnReport | None = None
    # The pod answered its turn and stays up for the next message: the run goes on (a conversation's
    # warm runner). The operator folds the turn in without ending the run.
    warm: bool = False
    # The runner's last word (written as it ends, after everything the run did is saved and counted):
    # nothing later can change the run, so the operator ends the run when it has this report, without
    # waiting for the pod to end.
    final: bool = False
    started_at: Time | None = None
    finished_at: Time | None = None

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)

    def encode(self) -> bytes:
        """The binaryData value: gzip JSON (mtime 0 so identical reports are identical bytes)."""
        return gzip.compress(self.to_json().encode("utf-8"), mtime=0)

    @classmethod
    def decode(cls, data: bytes) -> RunReport:
        return cls.model_validate_json(gunzip(data))

    def further_than(self, other: RunReport) -> bool:
        """Whether this report says more happened than ``other`` (more calls or tokens counted, a
        later turn, or an outcome where ``other`` is an interim report)."""
        mine, theirs = self.usage, other.usage
        if (mine.successful_requests, mine.total_tokens) != (theirs.successful_requests, theirs.total_tokens):
            return (mine.successful_requests, mine.total_tokens) > (theirs.successful_requests, theirs.total_tokens)
        turn, other_turn = (self.conversation.turn if self.conversation else 0,
                            other.conversation.turn if other.conversation else 0)
        if turn != other_turn:
            return turn > other_turn
        return other.reason == Reason.RUN_INTERRUPTED and self.reason != Reason.RUN_INTERRUPTED

    def termination_summary(self) -> str:
        """A copy small enough for the termination message (``RunReport``-parseable).

        It backs up the ConfigMap report when that write failed; outputs and the per-model
        breakdown are dropped to stay under the kubelet's limit.
        """
        summary = self.model_copy(
            update={
                "message": excerpt(self.message, _SUMMARY_MESSAGE_LIMIT),
                "output": None,
                "usage": Usage(**self.usage.totals().model_dump()),
                "feedback_request": (
                    self.feedback_request.model_copy(
                        update={"output": "", "message": excerpt(self.feedback_request.message, 512)}
                    )
                    if self.feedback_request
                    else None
                ),
                "feedback_applied": (
                    self.feedback_applied.model_copy(update={"response": excerpt(self.feedback_applied.response, 512)})
                    if self.feedback_applied
                    else None
                ),
                "conversation": (
                    self.conversation.model_copy(update={"reply": excerpt(self.conversation.reply or "", 512)})
                    if self.conversation
                    else None
                ),
            }
        )
        text = summary.to_json()
        if len(text.encode("utf-8")) > TERMINATION_MESSAGE_LIMIT:
            minimal: dict[str, Any] = json.loads(text)
            for key in ("feedbackRequest", "feedbackApplied", "message"):
                minimal.pop(key, None)
            if "conversation" in minimal:
                minimal["conversation"].pop("reply", None)
            text = json.dumps(minimal, separators=(",", ":"))
        return text
