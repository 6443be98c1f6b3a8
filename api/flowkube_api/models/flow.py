"""A Flow's status, and the Flow resource."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from flowkube_api.base import Model, Time
from flowkube_api.constants import (
    MESSAGE_LIMIT,
    NOTIFICATION_HANDLED_KEPT,
    ConditionType,
    NotificationEvent,
    Phase,
    RunResult,
    Trigger,
)
from flowkube_api.models.common import (
    FreeObject,
)
from flowkube_api.models.spec import (
    FlowSpec,
)
from flowkube_api.report import Charge, CheckpointEntry, FeedbackRequest, SpentSoFar, Usage

# -------------------------------------------------------------------------------------------- status


class Condition(Model):
    type: ConditionType
    status: str = Field(pattern="^(True|False|Unknown)$")
    reason: str
    message: str = ""
    last_transition_time: Time
    observed_generation: int | None = None


class Run(Model):
    pod: str
    trigger: Trigger
    started_at: Time | None = None
    finished_at: Time | None = None
    result: RunResult | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    usage: Usage | None = None
    charges: list[Charge] | None = Field(
        default=None, description="The run's usage by quarter hour (UTC) and model: what spend quotas charge, "
        "at the time the calls were made. Absent: charged at finishedAt.")
    warm_seconds: float | None = Field(
        default=None, description="Time the run's pod waited warm for a conversation's next message or a "
        "feedback answer; not counted toward activeDeadlineSeconds.")
    spans_lost: int | None = Field(
        default=None, ge=0, le=10**9, description="Trace spans the run's pod could not deliver to the collector "
        "(tracing on): a full queue, a failed export, or still queued when the pod ended.")
    closed_on_report: bool | None = Field(
        default=None, description="The run ended when its pod wrote its final report, before the pod itself "
        "ended; the pod's end changes nothing in it.")


class PendingFeedback(FeedbackRequest):
    """``status.feedback.request``: the runner's request plus the deadline the operator set."""

    deadline: Time | None = None


class FeedbackResponse(Model):
    """The inbox: the only status field humans write."""

    text: str | None = Field(default=None, max_length=65536)
    request_id: str | None = Field(default=None, max_length=253)
    responded_by: str | None = Field(
        default=None, description="Set by the admission webhook to the user who patched; not user-settable."
    )


class FeedbackRecord(Model):
    request_id: str
    method: str
    response: str | None = None
    outcome: str | None = None
    requested_at: Time | None = None
    responded_at: Time | None = None
    responded_by: str | None = None
    timed_out: bool = False


class FeedbackStatus(Model):
    request: PendingFeedback | None = None
    response: FeedbackResponse | None = None
    history: list[FeedbackRecord] | None = None


class MessageInbox(Model):
    """``status.conversation.inbox``: where a person puts the next message (one at a time)."""

    text: str | None = Field(default=None, max_length=MESSAGE_LIMIT)
    sent_by: str | None = Field(
        default=None, description="Set by the admission webhook to the user who patched; not user-settable."
    )


class PendingMessage(Model):
    """A message the operator accepted and a run is answering: its full text until the reply lands."""

    turn: int
    text: str = Field(max_length=MESSAGE_LIMIT)
    sent_by: str | None = None
    sent_at: Time | None = None


class ConversationMessage(Model):
    role: str = Field(description="user or assistant")
    content: str = Field(default="", description="excerpt, at most 1 KiB")
    turn: int = 0
    time: Time | None = None
    sender: str | None = Field(default=None, description="Who sent a user message (the patching user).")


class ConversationStatus(Model):
    session_id: str | None = None
    turns: int = Field(default=0, description="Messages answered.")
    ended: bool = False
    last_reply: str | None = Field(default=None, description="excerpt of the latest reply")
    idle_since: Time | None = Field(default=None, description="When the session last became AwaitingMessage.")
    messages: list[ConversationMessage] | None = Field(
        default=None, description="The most recent messages, shortened; the transcript is in the flow's state.")
    pending: PendingMessage | None = None
    inbox: MessageInbox | None = None


class Result(Model):
    output: str | None = None


class NotificationRecord(Model):
    """``status.notifications[]``: a sink's last delivery, and the events it is done with."""

    name: str
    event: NotificationEvent | None = None
    event_id: str | None = Field(default=None, description="The id the receiver saw (CloudEvents id).")
    time: Time | None = Field(default=None, description="When the last attempt ended.")
    outcome: Literal["Delivered", "Failed"] | None = None
    reason: str | None = Field(
        default=None, description="Delivered; Rejected (the receiver answered 4xx or a redirect); GaveUp (5xx, "
        "timeouts or connection errors until the retry time ran out); Refused (the destination is not allowed); "
        "Misconfigured (the Secret or its URL).")
    attempts: int = 0
    code: int | None = Field(default=None, description="The receiver's last HTTP status.")
    message: str | None = None
    handled: list[str] | None = Field(
        default=None, max_length=NOTIFICATION_HANDLED_KEPT,
        description=f"Ids of the last {NOTIFICATION_HANDLED_KEPT} events this sink is done with, delivered or "
        "not: an operator restart or a new leader sends none of them again.")


class TemplateStatus(Model):
    """``status.template``: the template as the Flow took it at its first reconcile, kept for its life.
    Its spec is stored once per generation in the snapshot this names (a ControllerRevision in the
    Flow's namespace), not in every Flow."""

    kind: str
    name: str
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    snapshot: str | None = Field(default=None, description="The ControllerRevision in the Flow's namespace "
                                 "that holds the template's spec as it was then: a later change does not "
                                 "change this Flow.")
    hash: str | None = Field(default=None, description="sha256 (hex) of the snapshot's data, checked at "
                             "every read.")
    spec: FreeObject | None = Field(default=None, description="Deprecated: the template's spec, as operators "
                                    "before snapshots wrote it; a Flow that has it runs from it.")


class ForkedFrom(Model):
    """``status.forkedFrom``: the checkpoint a fork copied into its own state, at its first reconcile."""

    namespace: str
    name: str
    uid: str
    checkpoint: int
    method: str | None = None
    kind: str | None = None


class TraceStatus(Model):
    """``status.trace``: the Flow's one trace (tracing on), derived from its uid (flowkube_api.traces)."""

    trace_id: str = Field(pattern=r"^[0-9a-f]{32}$", description="The W3C trace id of every span of the Flow.")


class FlowStatus(Model):
    phase: Phase | None = None
    conditions: list[Condition] | None = None
    observed_generation: int | None = None
    started_at: Time | None = None
    finished_at: Time | None = None
    message: str | None = None
    definition: str | None = Field(default=None, description="The flow's own name (printer column).")
    flow_id: str | None = None
    runs: list[Run] | None = None
    feedback: FeedbackStatus | None = None
    conversation: ConversationStatus | None = None
    usage: Usage | None = None
    result: Result | None = None
    notifications: list[NotificationRecord] | None = None
    template: TemplateStatus | None = None
    checkpoints: list[CheckpointEntry] | None = Field(
        default=None, description="The checkpoints kept to fork from (spec.checkpoints.keep), oldest first.")
    forked_from: ForkedFrom | None = None
    trace: TraceStatus | None = None
    inherited_usage: SpentSoFar | None = Field(
        default=None, description="A fork's origin's spend up to the checkpoint it forked from: shown, never "
        "added to usage, budgets or metrics (the origin counts it).")


class Flow(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "Flow"
    metadata: FreeObject = Field(default_factory=dict)
    spec: FlowSpec
    status: FlowStatus | None = None
