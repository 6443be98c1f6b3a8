"""The Flow resource (flowkube.io/v1alpha1) as pydantic models: the single source of the CRD schema.

Field names follow the contract in docs/api.md. Pod-shaped fields (env, envFrom, tolerations, affinity, ...)
keep Kubernetes' own shapes and are validated by the API server again when the runner pod is created.
"""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, JsonValue, SerializerFunctionWrapHandler, model_serializer

from flowkube_api.base import Model, Money, Time, money_text
from flowkube_api.constants import (
    DEFAULT_DISRUPTION_LIMIT,
    DEFAULT_KEEP_WARM_SECONDS,
    ENV_LIMIT,
    ENV_PREFIX,
    MESSAGE_LIMIT,
    NOTIFICATION_HANDLED_KEPT,
    NOTIFICATION_SINKS_LIMIT,
    TEMPLATE_PARAMETERS_LIMIT,
    ConditionType,
    NotificationEvent,
    Phase,
    RunResult,
    Trigger,
)
from flowkube_api.report import FeedbackRequest, TokenUsage, Usage

_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
FLOW_REF_PATTERN = f"^{_DOTTED}:{_DOTTED}$"
FlowRef = Annotated[str, Field(pattern=FLOW_REF_PATTERN, max_length=512)]
# A container image reference, by the grammar of the distribution project's `reference` package (the
# one the kubelet parses with): an optional registry host (and port), lower-case path components, an
# optional tag and an optional digest. Anything else ("../../etc", a NUL byte, upper-case paths) would
# be admitted and then wait forever on the node as InvalidImageName.
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)(?:\.(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?))*(?::[0-9]+)?"
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
IMAGE_REFERENCE_PATTERN = (rf"^(?:{_DOMAIN}/)?{_COMPONENT}(?:/{_COMPONENT})*(?::[a-zA-Z0-9_][a-zA-Z0-9_.-]{{0,127}})?"
                           r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?$")

# Marker for "any JSON object, kept as is" (x-kubernetes-preserve-unknown-fields in the CRD).
FreeObject = Annotated[
    dict[str, Any], Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})
]
FreeObjectList = list[FreeObject]
# Any JSON value, kept as is (a parameter's default).
AnyJson = Annotated[Any, Field(json_schema_extra={"x-kubernetes-preserve-unknown-fields": True,
                                                  "x-flowkube-any": True})]
ParameterType = Literal["string", "integer", "number", "boolean", "object", "array"]
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
IntOrString = Annotated[int | str, Field(json_schema_extra={"x-kubernetes-int-or-string": True})]


def cel(rule: str, message: str, field_path: str | None = None) -> dict[str, JsonValue]:
    r: dict[str, JsonValue] = {"rule": rule, "message": message}
    if field_path:
        r["fieldPath"] = field_path
    return r


# ---------------------------------------------------------------------------------------------- spec


class ResourceRequirements(Model):
    limits: dict[str, IntOrString] | None = None
    requests: dict[str, IntOrString] | None = None


class PodTemplateMetadata(Model):
    labels: dict[str, str] | None = None
    annotations: dict[str, str] | None = None


class LocalObjectReference(Model):
    name: str


_RESERVED = f"{ENV_PREFIX} is reserved for the variables the operator sets in runner pods"


class EnvVar(Model):
    """One variable of the runner container, as in a Pod; FLOWKUBE_ names are the operator's."""

    # FLOWKUBE_ names carry the run's identity, state endpoint and budget: refused here, and the
    # operator sets every one the runner reads, so `envFrom` cannot supply them either.

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel(f"!self.name.startsWith('{ENV_PREFIX}')", f"env name prefix {_RESERVED}", ".name")]})

    name: str = Field(min_length=1, max_length=253)
    value: str | None = None
    value_from: FreeObject | None = None


class EnvFromSource(Model):
    """As in a Pod; a prefix may not make names in the operator's FLOWKUBE_ namespace."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel(f"!has(self.prefix) || !self.prefix.startsWith('{ENV_PREFIX}')", f"envFrom prefix {_RESERVED}",
            ".prefix")]})

    prefix: str | None = Field(default=None, max_length=253)
    config_map_ref: FreeObject | None = None
    secret_ref: FreeObject | None = None


class PodTemplate(Model):
    """The parts of runner pods a user may shape; the operator owns the rest (security, volumes)."""

    metadata: PodTemplateMetadata | None = None
    node_selector: dict[str, str] | None = None
    tolerations: FreeObjectList | None = None
    affinity: FreeObject | None = None
    priority_class_name: str | None = Field(default=None, max_length=253)
    image_pull_secrets: list[LocalObjectReference] | None = None


class Retries(Model):
    limit: int = Field(default=0, ge=0, le=100, description="Failed runner pods replaced at most this often.")
    disruption_limit: int = Field(
        default=DEFAULT_DISRUPTION_LIMIT, ge=0, le=1000,
        description="Runner pods lost to a disruption (eviction, preemption, a lost node, deletion by "
        "someone other than the operator) are replaced without counting against limit, at most this "
        "often over the flow's life; then the flow fails with DisruptionsExhausted.",
    )
    backoff_seconds: int = Field(
        default=10, ge=0, le=86400,
        description="Delay before the first replacement; doubles with each further failure (capped at 1h).",
    )


class FeedbackSpec(Model):
    timeout_seconds: int | None = Field(
        default=None, ge=1,
        description="How long a feedback request may wait; then the step's default outcome is used, "
        "or the flow fails with FeedbackTimedOut.",
    )
    keep_warm_seconds: int | None = Field(
        default=None, ge=0, le=86400,
        description="A paused run's pod stays up this long waiting for the answer, and resumes the flow in the "
        "same process (well under a second, against a new pod's start-up). Unset or 0: the pod exits when it "
        "pauses and the answer starts a new one. Waiting does not count toward activeDeadlineSeconds.",
    )


class ConversationSpec(Model):
    """Bounds of a conversation (a Flow whose definition or class is conversational)."""

    idle_timeout_seconds: int | None = Field(
        default=None, ge=1,
        description="No message for this long ends the session: Succeeded, reason ConversationIdle. "
        "Unset: a session waits for its next message as long as the Flow exists.",
    )
    max_turns: int | None = Field(
        default=None, ge=1, le=100000,
        description="The session ends (Succeeded, reason MaxTurnsReached) after this many answered messages.",
    )
    keep_warm_seconds: int | None = Field(
        default=None, ge=0, le=86400,
        description="After a turn, the runner pod stays up this long waiting for the next message, and answers "
        "it in the same process (a warm turn takes well under a second; a new pod pays Python's and crewAI's "
        f"start-up, about ten seconds). 0: every message starts a new pod. Unset: {DEFAULT_KEEP_WARM_SECONDS}. "
        "Waiting warm does not count toward activeDeadlineSeconds.",
    )


BudgetLimit = Literal["maxTotalTokens", "maxCost"]


class Budget(Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        cel("has(self.maxTotalTokens) || has(self.maxCost)", "budget sets maxTotalTokens, maxCost or both"),
    ]})

    max_total_tokens: int | None = Field(default=None, ge=1, description="Hard cap on total tokens across all runs.")
    max_cost: Money | None = Field(
        default=None,
        description='Hard cap on the flow\'s spend across all runs, in USD, as a decimal string ("2.50"); '
        "checked after every LLM call like maxTotalTokens.")

    def exceeded_by(self, total_tokens: int, cost: Decimal, *, starting: bool = True) -> BudgetLimit | None:
        """The budget rule, the one both the operator and the runner apply: which limit the flow's
        usage over all its runs (``total_tokens``, ``cost``) is past, or None.

        A limit *reached* (usage equal to it) stops whatever would start next, a run or a model call,
        since anything that starts adds to it (``starting``, the default). After a model call
        (``starting=False``) only a limit *crossed* (usage over it) ends the run in progress at once: a
        run that lands exactly on its budget may finish without another call (docs/api.md: "The runner
        stops at the model call that crosses it, and no new run starts once it is reached")."""

        def past(used: Decimal | int, limit: Decimal | int) -> bool:
            return used >= limit if starting else used > limit

        if self.max_total_tokens is not None and past(total_tokens, self.max_total_tokens):
            return "maxTotalTokens"
        if self.max_cost is not None and past(cost, self.max_cost):
            return "maxCost"
        return None

    def figure(self, limit: BudgetLimit, total_tokens: int, cost: Decimal) -> str:
        """What ``limit`` stands at, as every budget message names it: ``USD 2.5031 spent of budget.maxCost=2.5``."""
        if limit == "maxCost":
            assert self.max_cost is not None
            return f"USD {money_text(cost)} spent of budget.maxCost={money_text(self.max_cost)}"
        return f"{total_tokens} tokens used of budget.maxTotalTokens={self.max_total_tokens}"


_SECRET_KEY = r"^[-._a-zA-Z0-9]+$"  # noqa: S105 - the pattern of a key in a Secret


class NotificationSecretRef(Model):
    """A Secret of the Flow's namespace labelled flowkube.io/notifications (URLs carry tokens)."""

    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")
    url_key: str = Field(default="url", max_length=253, pattern=_SECRET_KEY,
                         description="Key of the URL (http or https) in the Secret.")
    signing_key_key: str = Field(
        default="signingKey", max_length=253, pattern=_SECRET_KEY,
        description="Key of the HMAC-SHA256 signing key; when the Secret has it, every request carries "
        "X-Flowkube-Signature (docs/api.md says how a receiver checks it).")
    ca_key: str = Field(default="ca", max_length=253, pattern=_SECRET_KEY,
                        description="Key of a PEM CA bundle that an https receiver's certificate must chain to; "
                        "without it, the system's CAs.")


class NotificationSink(Model):
    """Where to tell people about this Flow, and what."""

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                      description="The sink's name in status.notifications; a namespace default of the same "
                      "name is replaced by this one.")
    events: list[NotificationEvent] | None = Field(
        default=None, min_length=1, max_length=len(NotificationEvent),
        json_schema_extra={"x-kubernetes-list-type": "set"},
        description="What to send; unset: FeedbackRequested, FeedbackTimedOut, Failed and BudgetExceeded.")
    format: Literal["cloudevents", "slack"] = Field(
        default="cloudevents", description="cloudevents: a CloudEvents 1.0 JSON body (structured mode); "
        "slack: a Slack incoming-webhook body (text and blocks).")
    secret_ref: NotificationSecretRef


class FlowDefinitionSpec(Model):
    """The inline definition: `name` is checked here; the rest by crewAI's own FlowDefinition model."""

    model_config = ConfigDict(
        extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True}
    )

    name: str = Field(min_length=1, max_length=253, description="The flow's own name.")

    @model_serializer(mode="wrap")
    def _as_written(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        # ``exclude_none`` leaves out the API's own unset fields; the rest of a definition is crewAI's,
        # passed on as written, a null included (crewAI may tell a null from a missing field).
        data: dict[str, Any] = handler(self)
        for key, value in (self.model_extra or {}).items():
            if value is None:
                data.setdefault(key, None)
        return data


class FlowFields(Model):
    """Every field of a Flow's spec a FlowTemplate may set too (`FlowSpec` adds `templateRef`)."""

    definition: FlowDefinitionSpec | None = Field(
        default=None,
        description="Inline crewAI flow definition (crewai.flow/v1: name, state, methods, ...).",
    )
    flow_ref: FlowRef | None = Field(
        default=None,
        description='"package.module:ClassName" of a crewAI Flow subclass importable in the runner image.',
    )
    inputs: FreeObject | None = Field(default=None, description="Passed to kickoff(inputs=...).")
    image: str | None = Field(default=None, max_length=1024, pattern=IMAGE_REFERENCE_PATTERN,
                              description="Runner image (a container image reference: [registry[:port]/]"
                              "path[:tag][@digest]); defaults to the operator's runner image.")
    env: list[EnvVar] | None = Field(
        default=None, max_length=ENV_LIMIT,
        description=f"As in a Pod container; names starting with {ENV_PREFIX} are the operator's.")
    env_from: list[EnvFromSource] | None = Field(default=None, max_length=ENV_LIMIT,
                                                 description="As in a Pod container.")
    resources: ResourceRequirements | None = None
    pod_template: PodTemplate | None = None
    retries: Retries | None = None
    active_deadline_seconds: int | None = Field(
        default=None, ge=1,
        description="Bound on running time; time awaiting feedback does not count.",
    )
    feedback: FeedbackSpec | None = None
    conversation: ConversationSpec | None = Field(
        default=None, description="Only for conversations: an idle timeout and a turn limit.")
    budget: Budget | None = None
    ttl_seconds_after_finished: int | None = Field(default=None, ge=0)
    suspend: bool | None = Field(default=None, description="true stops creating runner pods.")
    notifications: list[NotificationSink] | None = Field(
        default=None, max_length=NOTIFICATION_SINKS_LIMIT,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="Sinks told when the flow needs a person or ends, besides its namespace's defaults "
        "(Secrets labelled flowkube.io/notifications=defaults).")


class TemplateRef(Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN,
                      description="The FlowTemplate (in the Flow's namespace) or ClusterFlowTemplate.")
    kind: Literal["FlowTemplate", "ClusterFlowTemplate"] = Field(
        default="FlowTemplate", description="FlowTemplate (the default) or ClusterFlowTemplate.")


_ONE_OF = cel("(has(self.definition) ? 1 : 0) + (has(self.flowRef) ? 1 : 0) + (has(self.templateRef) ? 1 : 0) == 1",
              "exactly one of spec.definition, spec.flowRef or spec.templateRef must be set")


class NewFlowSpec(FlowFields):
    """A Flow's spec as a CronFlow holds it for the Flows it starts (`FlowSpec` less the rule that a
    Flow's `templateRef` never changes: a CronFlow may be changed to another template)."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [_ONE_OF]})

    template_ref: TemplateRef | None = Field(
        default=None, description="Run a FlowTemplate or ClusterFlowTemplate: its spec, with this Flow's own "
        "fields over it and spec.inputs checked against its parameters.")


class FlowSpec(NewFlowSpec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _ONE_OF,
                cel("has(self.templateRef) == has(oldSelf.templateRef) && "
                    "(!has(self.templateRef) || self.templateRef == oldSelf.templateRef)",
                    "spec.templateRef is immutable: a Flow runs the template it was created with"),
            ]
        }
    )


# ---------------------------------------------------------------------------------------- templates


class TemplateParameter(Model):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
                      description="The input's key in spec.inputs (and in the flow's kickoff inputs).")
    description: str | None = Field(default=None, max_length=1024)
    required: bool | None = Field(default=None, description="A Flow must set it (unless it has a default).")
    default: AnyJson = Field(default=None, description="The value when a Flow does not set it.")
    type: ParameterType | None = Field(
        default=None, description="The JSON Schema type a value must have: string, integer, number, boolean, "
        "object or array.")


class TemplateFlowSpec(FlowFields):
    """A FlowTemplate's `spec.template`: a Flow's spec without `templateRef`."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel("has(self.definition) != has(self.flowRef)",
                    "exactly one of spec.template.definition or spec.template.flowRef must be set"),
            ]
        }
    )


class FlowTemplateSpec(Model):
    description: str | None = Field(default=None, max_length=4096)
    parameters: list[TemplateParameter] | None = Field(
        default=None, max_length=TEMPLATE_PARAMETERS_LIMIT,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description="The inputs a Flow gives; when any are declared, a Flow's spec.inputs may hold only these.")
    template: TemplateFlowSpec = Field(description="The Flow spec every Flow of this template starts from.")


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
    warm_seconds: float | None = Field(
        default=None, description="Time the run's pod waited warm for a conversation's next message or a "
        "feedback answer; not counted toward activeDeadlineSeconds.")
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


class Flow(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "Flow"
    metadata: FreeObject = Field(default_factory=dict)
    spec: FlowSpec
    status: FlowStatus | None = None


class CronFlowTemplate(Model):
    metadata: PodTemplateMetadata | None = Field(default=None, description="Labels and annotations of each Flow.")
    spec: NewFlowSpec = Field(description="The spec of each Flow the CronFlow starts.")


class CronFlowSpec(Model):
    schedule: str = Field(min_length=1, max_length=256, description="Cron syntax, five fields as in a CronJob "
                          "(minute hour day-of-month month day-of-week), or @hourly, @daily, @weekly, @monthly, "
                          "@yearly.")
    time_zone: str | None = Field(default=None, max_length=64,
                                  description="IANA time zone of the schedule (default UTC), e.g. Europe/Berlin.")
    flow_template: CronFlowTemplate
    concurrency_policy: Literal["Allow", "Forbid", "Replace"] | None = Field(
        default=None, description="While a Flow it started still runs: Allow (the default) starts the next one "
        "too; Forbid skips the new time; Replace deletes the running Flow and starts the new one.")
    starting_deadline_seconds: int | None = Field(
        default=None, ge=0, description="A time missed by more than this (the operator was down, Forbid waited) "
        "is skipped. No value: a missed time is started however late.")
    successful_flows_history_limit: int | None = Field(
        default=None, ge=0, le=1000, description="Succeeded Flows kept (default 3); older ones are deleted.")
    failed_flows_history_limit: int | None = Field(
        default=None, ge=0, le=1000, description="Failed Flows kept (default 1); older ones are deleted.")
    suspend: bool | None = Field(default=None, description="true: no new Flows; times that pass meanwhile are "
                                 "missed (started when resumed only within startingDeadlineSeconds).")


class CronFlowSkip(Model):
    time: Time = Field(description="The scheduled time that did not start a Flow.")
    reason: str = Field(description="ConcurrencyForbidden, MissedDeadline or FailedCreate.")
    message: str = ""


class CronFlowStatus(Model):
    observed_generation: int | None = None
    last_schedule_time: Time | None = Field(default=None, description="The latest time a Flow was started for.")
    last_successful_time: Time | None = Field(default=None, description="When a Flow it started last Succeeded.")
    active: list[str] | None = Field(default=None, description="Its Flows that have not ended.")
    last_skipped: CronFlowSkip | None = None
    usage: Usage | None = Field(default=None, description="Every Flow it started, summed: those that exist and "
                                "those its history limits deleted.")
    pruned_usage: Usage | None = Field(default=None, description="The part of usage from Flows the history "
                                       "limits deleted.")
    pruning: list[str] | None = Field(default=None, description="uids of Flows being deleted by the history "
                                      "limits, whose usage is in prunedUsage already.")


class CronFlow(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "CronFlow"
    metadata: FreeObject = Field(default_factory=dict)
    spec: CronFlowSpec
    status: CronFlowStatus | None = None


class FlowTemplate(Model):
    api_version: str = "flowkube.io/v1alpha1"
    kind: str = "FlowTemplate"
    metadata: FreeObject = Field(default_factory=dict)
    spec: FlowTemplateSpec


class ClusterFlowTemplate(FlowTemplate):
    kind: str = "ClusterFlowTemplate"


__all__ = [
    "Budget",
    "BudgetLimit",
    "ClusterFlowTemplate",
    "Condition",
    "ConversationMessage",
    "ConversationSpec",
    "ConversationStatus",
    "CronFlow",
    "CronFlowSpec",
    "CronFlowStatus",
    "FeedbackRecord",
    "FeedbackRequest",
    "FeedbackResponse",
    "FeedbackSpec",
    "FeedbackStatus",
    "Flow",
    "FlowSpec",
    "FlowStatus",
    "FlowTemplate",
    "FlowTemplateSpec",
    "MessageInbox",
    "Model",
    "NotificationRecord",
    "NotificationSecretRef",
    "NotificationSink",
    "PendingFeedback",
    "PendingMessage",
    "PodTemplate",
    "ResourceRequirements",
    "Result",
    "Retries",
    "Run",
    "TemplateFlowSpec",
    "TemplateParameter",
    "TemplateRef",
    "TemplateStatus",
    "TokenUsage",
    "Usage",
]
