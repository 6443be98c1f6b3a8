"""A Flow's spec (and the fields a template or a CronFlow gives a Flow)."""

from __future__ import annotations

from decimal import Decimal
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from flowkube_api.base import Model, Money, money_text
from flowkube_api.constants import (
    CHECKPOINTS_KEPT_LIMIT,
    DEFAULT_CHECKPOINTS_KEPT,
    DEFAULT_DISRUPTION_LIMIT,
    DEFAULT_KEEP_WARM_SECONDS,
    ENV_LIMIT,
    ENV_PREFIX,
    NOTIFICATION_SINKS_LIMIT,
    NotificationEvent,
)
from flowkube_api.models.common import (
    DNS_SUBDOMAIN,
    IMAGE_REFERENCE_PATTERN,
    FlowRef,
    FreeObject,
    FreeObjectList,
    IntOrString,
    cel,
)

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
    keep_tasks: bool = Field(
        default=True,
        description="Keep each finished task of a crew in the flow's state, so a replacement that runs its "
        "method again skips the tasks finished before (their model calls are not made, nor paid, again). "
        "false: a replacement runs the whole method again.",
    )


class CheckpointsSpec(Model):
    keep: int = Field(
        default=DEFAULT_CHECKPOINTS_KEPT, ge=0, le=CHECKPOINTS_KEPT_LIMIT,
        description="How many of the Flow's latest checkpoints are kept to fork from (one after each completed "
        "method and each pause for feedback; each holds the flow's state then, in a ConfigMap of its own). "
        "0: none is taken.")


FORK_OUTPUTS_LIMIT = 16  # methods whose output one fork edits
FORK_TEXT_LIMIT = 65536  # characters of one edited output


class ForkFrom(Model):
    """A fork: this Flow starts from a checkpoint of another Flow (its origin), with edits, instead of
    from its start methods. The checkpoint is copied into this Flow's own state at its first reconcile:
    from then on the fork does not depend on the origin."""

    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="The origin Flow.")
    namespace: str | None = Field(default=None, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
                                  description="The origin's namespace; unset: this Flow's. Creating the fork "
                                  "needs get on the origin.")
    uid: str | None = Field(default=None, max_length=64, description="The origin's uid: set, a Flow of the same "
                            "name made since is not taken for it.")
    checkpoint: int = Field(ge=1, le=1 << 53, description="The id of one of the origin's status.checkpoints.")
    inputs: FreeObject | None = Field(
        default=None, description="State fields set to these values before the fork runs on (a flow's "
        "kickoff inputs are its first state).")
    outputs: dict[str, Annotated[str, Field(max_length=FORK_TEXT_LIMIT)]] | None = Field(
        default=None, max_length=FORK_OUTPUTS_LIMIT,
        description="method name -> the text its output is replaced with (an agent's or crew's raw answer). "
        "Methods that completed after it run again, as does a feedback request pending at the checkpoint.")


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
        description="What to send; unset: FeedbackRequested, FeedbackTimedOut, Failed and BudgetExceeded. "
        "(QuotaWarning and QuotaExhausted are a FlowQuota's, told to its namespace's default sinks only: a "
        "Flow's own sink never hears of them.)")
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
    checkpoints: CheckpointsSpec | None = Field(
        default=None, description="The Flow's own (a template does not set it): how many checkpoints are kept "
        "to fork from.")


class FlowSpec(NewFlowSpec):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _ONE_OF,
                cel("has(self.templateRef) == has(oldSelf.templateRef) && "
                    "(!has(self.templateRef) || self.templateRef == oldSelf.templateRef)",
                    "spec.templateRef is immutable: a Flow runs the template it was created with"),
                cel("has(self.forkFrom) == has(oldSelf.forkFrom) && "
                    "(!has(self.forkFrom) || self.forkFrom == oldSelf.forkFrom)",
                    "spec.forkFrom is immutable: a fork starts once, from the checkpoint it was created with"),
            ]
        }
    )

    fork_from: ForkFrom | None = Field(
        default=None, description="Start from a checkpoint of another Flow, with edits (a fork), instead of "
        "from the start methods. Its spec (definition, flowRef or templateRef) is the origin's, as "
        "`kubectl flow fork` copies it.")
