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

from pydantic import Field, ValidationError, model_validator

from flowkube_api.base import Model, Money, Time
from flowkube_api.constants import CHECKPOINTS_KEPT_LIMIT, EXCERPT_LIMIT, Reason, RunResult, Trigger

Count = Annotated[int, Field(ge=0)]
TERMINATION_MESSAGE_LIMIT = 4096  # kubelet truncates the termination message beyond this
_SUMMARY_MESSAGE_LIMIT = 1024
# A report's JSON, decompressed. A real one is a few kB (outputs and messages are excerpts); the
# bound is what a run report can never need, and what an operator replica can decode at once.
REPORT_LIMIT = 1 << 20


# Every field of a report that reaches status or metrics has a bound, checked where the operator decodes
# the bytes (the state API, the termination message), so a report over one is refused naming the field.
# Free text is clipped by the runner's own encoder (``RunReport.bounded``), so its reports never exceed
# them; names are a flow's own (crewAI method names, its routers' outcomes, model names) and are refused,
# not clipped, when longer: a clipped name would route or price the wrong thing. docs/api.md lists them.
NAME_LIMIT = 253  # characters of a pod's or a Flow's name (a DNS subdomain)
ID_LIMIT = 240  # characters of flowId, sessionId, a method name, an outcome (emit item, defaultOutcome)
# Characters of a feedback request's id ("<method>-<count>"): what the feedback inbox's requestId
# takes (status.feedback.response.requestId), so every request can be answered by its id.
REQUEST_ID_LIMIT = 253
MODEL_NAME_LIMIT = 512  # characters of a model name in usage.byModel (bedrock ARNs, azure deployments)
MODELS_LIMIT = 64  # models in one report's usage.byModel; the runner folds the rest into "other"
EMIT_LIMIT = 64  # outcomes of one feedback request (feedbackRequest.emit)
TEXT_LIMIT = EXCERPT_LIMIT  # characters of message, feedback message, response, output and reply
COUNT_LIMIT = 1 << 53  # any token or request count (exact as a float, which is what metrics hold)
COST_LIMIT = Decimal(10) ** 9  # USD of one report's cost, or one model's in it
OTHER_MODEL = "other"


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

    @classmethod
    def read(cls, raw: Any) -> Usage:
        """``status.usage`` (or a run's) as a reader gets it back from a Flow: what does not validate
        (an object written by something else than the operator) reads as no usage, never an error."""
        try:
            return cls.model_validate(raw or {})
        except ValidationError:
            return cls()


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


# Checkpoint entries in one report: the last ones (status keeps at most spec.checkpoints.keep of them).
CHECKPOINTS_REPORTED = CHECKPOINTS_KEPT_LIMIT


class SpentSoFar(Model):
    """The Flow's spend over all its runs up to a moment: at a checkpoint, or what a fork inherited."""

    total_tokens: Count = 0
    cost: Money = Decimal(0)


CHARGES_LIMIT = 1024  # (quarter hour, model) entries in one report; the runner merges the oldest beyond it


class Charge(Model):
    """What a run's model calls of one model used in one quarter hour (UTC): what a quota window
    charges, at the time the calls were made (``flowkube_api.windows``)."""

    at: Time = Field(description="The quarter hour's start.")
    model: str = Field(max_length=MODEL_NAME_LIMIT)
    total_tokens: Count = 0
    cost: Money = Decimal(0)


def matching_charges(usage: TokenUsage, charges: list[Charge] | None) -> list[Charge] | None:
    """``charges`` when they add up to ``usage`` (tokens and cost), else None: a report whose charges
    say something else than its usage is charged by its usage, at the run's end."""
    if not charges:
        return None
    tokens = sum(c.total_tokens for c in charges)
    cost = sum((c.cost for c in charges), Decimal(0))
    return charges if (tokens, cost) == (usage.total_tokens, usage.cost) else None


class CheckpointEntry(Model):
    """One checkpoint of a Flow, as ``status.checkpoints[]`` lists it: the runner took it right after
    a method completed (``Completed``) or paused for feedback (``Paused``); its snapshot is kept by
    the operator (``Flow.spec.checkpoints.keep``) for forks."""

    id: int = Field(ge=1, le=COUNT_LIMIT, description="Numbered from 1 over the Flow's life (a fork goes on "
                    "from its origin's number).")
    method: str = Field(max_length=ID_LIMIT)
    kind: Literal["Completed", "Paused"]
    time: Time
    usage: SpentSoFar = Field(default_factory=SpentSoFar, description="The Flow's spend up to this checkpoint, "
                              "over all its runs.")


class TurnReport(Model):
    """A conversation's state after a run: the session it holds and the turn it answered (0 when the
    run only opened the session), with the reply. ``ended``: the flow's ``end`` route or an exit
    command ended the session."""

    session_id: str
    turn: int = 0
    reply: str | None = Field(default=None, description=f"excerpt, at most {EXCERPT_LIMIT} bytes")
    ended: bool = False


class SpansLost(Model):
    """The run's spans that never reached the collector, by reason (flowkube_api.otlp)."""

    queue_full: int = Field(default=0, ge=0)
    export_failed: int = Field(default=0, ge=0)
    unflushed: int = Field(default=0, ge=0)


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
    charges: list[Charge] | None = Field(
        default=None, max_length=CHARGES_LIMIT,
        description="usage by quarter hour and model, oldest first: what spend quotas charge, and when.")
    checkpoints: list[CheckpointEntry] | None = Field(
        default=None, max_length=CHECKPOINTS_REPORTED,
        description="The checkpoints this run took (the last ones), oldest first.")
    spans_lost: SpansLost | None = Field(
        default=None, description="The run's trace spans lost (tracing on): counted in the operator's metric.")
    # The pod answered its turn and stays up for the next message: the run goes on (a conversation's
    # warm runner). The operator folds the turn in without ending the run.
    warm: bool = False
    # The runner's last word (written as it ends, after everything the run did is saved and counted):
    # nothing later can change the run, so the operator ends the run when it has this report, without
    # waiting for the pod to end.
    final: bool = False
    started_at: Time | None = None
    finished_at: Time | None = None

    @model_validator(mode="after")
    def _within_bounds(self) -> RunReport:
        """Refuse a report with any field over its bound (see ``NAME_LIMIT`` and after), naming it."""
        problem = report_problem(self)
        if problem is not None:
            raise ValueError(problem)
        return self

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True)

    def bounded(self) -> RunReport:
        """This report with its free text clipped to ``TEXT_LIMIT`` bytes and the models beyond the
        first ``MODELS_LIMIT - 1`` folded into ``other``, so what the runner sends is never refused for
        them (names are not clipped: see ``NAME_LIMIT``)."""
        update: dict[str, Any] = {"message": excerpt(self.message, TEXT_LIMIT), "output": _clip(self.output)}
        if len(self.usage.by_model) > MODELS_LIMIT:
            update["usage"] = _folded_models(self.usage)
        if (req := self.feedback_request) is not None:
            update["feedback_request"] = req.model_copy(
                update={"message": excerpt(req.message, TEXT_LIMIT), "output": _clip(req.output)})
        if (applied := self.feedback_applied) is not None:
            update["feedback_applied"] = applied.model_copy(update={"response": excerpt(applied.response, TEXT_LIMIT)})
        if (turn := self.conversation) is not None:
            update["conversation"] = turn.model_copy(update={"reply": _clip(turn.reply)})
        return self.model_copy(update=update)

    def encode(self) -> bytes:
        """The binaryData value: gzip JSON (mtime 0 so identical reports are identical bytes), bounded."""
        return gzip.compress(self.bounded().to_json().encode("utf-8"), mtime=0)

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
        summary = self.bounded().model_copy(
            update={
                "message": excerpt(self.message, _SUMMARY_MESSAGE_LIMIT),
                "output": None,
                "usage": Usage(**self.usage.totals().model_dump()),
                "charges": None,  # the quotas then charge the run's usage when it ended
                "checkpoints": None,
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


def _clip(text: str | None) -> str | None:
    return excerpt(text, TEXT_LIMIT) if text is not None else None


def _folded_models(usage: Usage) -> Usage:
    """``usage`` with the models past the first ``MODELS_LIMIT - 1`` (by name) summed as ``other``."""
    names = sorted(usage.by_model)
    kept = {name: usage.by_model[name] for name in names[: MODELS_LIMIT - 1] if name != OTHER_MODEL}
    rest = TokenUsage()
    for name in names:
        if name not in kept:
            rest = rest.plus_tokens(usage.by_model[name])
    return usage.model_copy(update={"by_model": {**kept, OTHER_MODEL: rest}})


def _text_problem(path: str, value: str | None, limit: int) -> str | None:
    if value is not None and len(value) > limit:
        return f"{path} is {len(value)} characters; the limit is {limit}"
    return None


def _usage_problem(path: str, usage: TokenUsage) -> str | None:
    for name in TokenUsage.model_fields:
        value = getattr(usage, name)
        limit = COST_LIMIT if name == "cost" else COUNT_LIMIT
        if value > limit:
            return f"{path}.{_camel(name)} is over its limit of {limit}"
    return None


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _texts(report: RunReport) -> list[tuple[str, str | None, int]]:
    """(wire path, value, limit) of every string field of ``report``."""
    out: list[tuple[str, str | None, int]] = [
        ("pod", report.pod, NAME_LIMIT), ("flow", report.flow, NAME_LIMIT), ("message", report.message, TEXT_LIMIT),
        ("flowId", report.flow_id, ID_LIMIT), ("output", report.output, TEXT_LIMIT)]
    if (req := report.feedback_request) is not None:
        out += [("feedbackRequest.id", req.id, REQUEST_ID_LIMIT), ("feedbackRequest.method", req.method, ID_LIMIT),
                ("feedbackRequest.message", req.message, TEXT_LIMIT),
                ("feedbackRequest.defaultOutcome", req.default_outcome, ID_LIMIT),
                ("feedbackRequest.output", req.output, TEXT_LIMIT)]
        out += [(f"feedbackRequest.emit[{i}]", item, ID_LIMIT) for i, item in enumerate(req.emit or ())]
    if (applied := report.feedback_applied) is not None:
        out += [("feedbackApplied.requestId", applied.request_id, REQUEST_ID_LIMIT),
                ("feedbackApplied.method", applied.method, ID_LIMIT),
                ("feedbackApplied.response", applied.response, TEXT_LIMIT),
                ("feedbackApplied.outcome", applied.outcome, ID_LIMIT)]
    if (turn := report.conversation) is not None:
        out += [("conversation.sessionId", turn.session_id, ID_LIMIT), ("conversation.reply", turn.reply, TEXT_LIMIT)]
    return out


def report_problem(report: RunReport) -> str | None:
    """The first field of ``report`` over its bound, as a refusal naming it; None when all are within.

    Counts before texts: ``feedbackRequest.emit`` could otherwise list a million names to check."""
    if report.feedback_request is not None and len(report.feedback_request.emit or ()) > EMIT_LIMIT:
        return f"feedbackRequest.emit has {len(report.feedback_request.emit or ())} items; the limit is {EMIT_LIMIT}"
    if len(report.usage.by_model) > MODELS_LIMIT:
        return f"usage.byModel has {len(report.usage.by_model)} models; the limit is {MODELS_LIMIT}"
    if report.conversation is not None and not 0 <= report.conversation.turn <= COUNT_LIMIT:
        return f"conversation.turn is {report.conversation.turn}; it is a count from 0 to {COUNT_LIMIT}"
    if not -(1 << 31) <= report.exit_code < 1 << 31:
        return f"exitCode is {report.exit_code}; an exit code is a 32-bit integer"
    for path, value, limit in _texts(report):
        if (problem := _text_problem(path, value, limit)) is not None:
            return problem
    for model in report.usage.by_model:
        if (problem := _text_problem("usage.byModel key", model, MODEL_NAME_LIMIT)) is not None:
            return problem
    if (problem := _usage_problem("usage", report.usage)) is not None:
        return problem
    for model, tokens in report.usage.by_model.items():
        if (problem := _usage_problem(f"usage.byModel[{model}]", tokens)) is not None:
            return problem
    return None
