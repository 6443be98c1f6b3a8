"""Names shared by the operator and the runner: one place, imported by both sides."""

from __future__ import annotations

from enum import StrEnum

GROUP = "flowkube.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "Flow"
PLURAL = "flows"
SINGULAR = "flow"
SHORT_NAMES = ("fl",)
CATEGORIES = ("flowkube", "all")

# The templates a Flow may run (spec.templateRef.kind); a ClusterFlowTemplate is cluster-scoped.
TEMPLATE_KIND = "FlowTemplate"
TEMPLATE_PLURAL = "flowtemplates"
CLUSTER_TEMPLATE_KIND = "ClusterFlowTemplate"
CLUSTER_TEMPLATE_PLURAL = "clusterflowtemplates"
TEMPLATE_PARAMETERS_LIMIT = 64
# A template's spec as JSON, at most: each generation its Flows take is stored whole in a snapshot.
TEMPLATE_SPEC_LIMIT = 256 * 1024
LABEL_TEMPLATE = "flowkube.io/template"  # on a template snapshot (a ControllerRevision): the template's name
# CronFlows start Flows on a schedule; each Flow carries the CronFlow's name and its scheduled time.
CRONFLOW_KIND = "CronFlow"
CRONFLOW_PLURAL = "cronflows"
CRONFLOW_NAME_LIMIT = 52  # + "-" + minutes since the epoch (8 digits until 2160) fits a Flow's 63
# FlowQuotas: a team's spend and token limits over time windows (issue 41).
QUOTA_KIND = "FlowQuota"
QUOTA_PLURAL = "flowquotas"
QUOTAS_PER_NAMESPACE_LIMIT = 16  # FlowQuotas one namespace's Flows are held to (more: the rest are not used)
QUOTA_LABEL_KEYS_LIMIT = 8  # label keys one namespace's quota selectors may name (Flow caches keep those labels);
# the ClusterFlowQuotas together have the same budget for Flows' keys, and another for namespaces' keys
CLUSTER_QUOTA_KIND = "ClusterFlowQuota"  # a team's quota across the namespaces its namespaceSelector picks
CLUSTER_QUOTA_PLURAL = "clusterflowquotas"
CLUSTER_QUOTAS_LIMIT = 64  # ClusterFlowQuotas the operator uses (the oldest first)

PREFIX = GROUP  # label / annotation key prefix

# Labels put on every object the operator creates for a Flow.
LABEL_FLOW = f"{PREFIX}/flow"
LABEL_RUN = f"{PREFIX}/run"
LABEL_TRIGGER = f"{PREFIX}/trigger"
LABEL_COMPONENT = f"{PREFIX}/component"
LABEL_CRONFLOW = f"{PREFIX}/cronflow"  # on a Flow a CronFlow started: the CronFlow's name
ANNOTATION_SCHEDULED = f"{PREFIX}/scheduled-at"  # on such a Flow: the scheduled time it was started for
ANNOTATION_TRIGGERED_BY = f"{PREFIX}/triggered-by"  # on one `kubectl flow trigger` started: "kubectl-flow"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "flowkube"
COMPONENT_RUNNER = "runner"
COMPONENT_STATE = "state"
COMPONENT_CHECKPOINT = "checkpoint"

# A Secret the operator may use for notifications carries this label (any value); the value `defaults`
# makes it a sink for every Flow of its namespace.
LABEL_NOTIFICATIONS = f"{PREFIX}/notifications"
NOTIFICATION_DEFAULTS = "defaults"

class Phase(StrEnum):
    PENDING = "Pending"
    RUNNING = "Running"
    AWAITING_FEEDBACK = "AwaitingFeedback"
    AWAITING_MESSAGE = "AwaitingMessage"  # a conversation between turns
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


TERMINAL_PHASES = frozenset({Phase.SUCCEEDED, Phase.FAILED})


class ConditionType(StrEnum):
    ACCEPTED = "Accepted"
    RUNNING = "Running"
    AWAITING_FEEDBACK = "AwaitingFeedback"
    AWAITING_MESSAGE = "AwaitingMessage"
    SUCCEEDED = "Succeeded"


class NotificationEvent(StrEnum):
    """What a notification sink may ask to be told of (spec.notifications[].events)."""

    # The quota events are a FlowQuota's, told to its namespace's default sinks only (a defaults
    # Secret's `events`); a Flow's notices never hold them.

    FEEDBACK_REQUESTED = "FeedbackRequested"
    MESSAGE_AWAITED = "MessageAwaited"
    FEEDBACK_TIMED_OUT = "FeedbackTimedOut"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    BUDGET_EXCEEDED = "BudgetExceeded"
    QUOTA_WARNING = "QuotaWarning"
    QUOTA_EXHAUSTED = "QuotaExhausted"


# A sink that names no events hears of these: the ones where a person has something to do.
DEFAULT_NOTIFICATION_EVENTS = (
    NotificationEvent.FEEDBACK_REQUESTED, NotificationEvent.FEEDBACK_TIMED_OUT, NotificationEvent.FAILED,
    NotificationEvent.BUDGET_EXCEEDED, NotificationEvent.QUOTA_WARNING, NotificationEvent.QUOTA_EXHAUSTED,
)
NOTIFICATION_SINKS_LIMIT = 8  # entries of spec.notifications
NOTIFICATION_HANDLED_KEPT = 16  # event ids status.notifications[].handled keeps per sink


class Trigger(StrEnum):
    KICKOFF = "kickoff"
    RESUME = "resume"
    RETRY = "retry"
    TURN = "turn"  # one message of a conversation
    FORK = "fork"  # a fork's first run: from the checkpoint it copied, with its edits


class RunResult(StrEnum):
    SUCCEEDED = "Succeeded"
    PAUSED = "Paused"
    FAILED = "Failed"


class Reason(StrEnum):
    """CamelCase reasons used in conditions, runs[] and Events."""

    ACCEPTED = "Accepted"
    INVALID_DEFINITION = "InvalidDefinition"
    INVALID_FLOW_REF = "InvalidFlowRef"
    INVALID_INPUTS = "InvalidInputs"
    TEMPLATE_NOT_FOUND = "TemplateNotFound"  # spec.templateRef names a template that is not there (yet)
    TEMPLATE_RESOLVED = "TemplateResolved"  # the Flow took its template's spec (status.template)
    QUOTA_EXHAUSTED = "QuotaExhausted"  # a spend quota refused a model call (issue 41; permanent)
    FORKED = "Forked"  # a fork copied its origin's checkpoint into its own state (status.forkedFrom)
    FORK_SOURCE_UNAVAILABLE = "ForkSourceUnavailable"  # the origin or its checkpoint is not there (permanent)
    # The snapshot (ControllerRevision) status.template names is gone or not what the Flow took
    TEMPLATE_SNAPSHOT_UNUSABLE = "TemplateSnapshotUnusable"
    INVALID_SPEC = "InvalidSpec"  # over a bound of flowkube_api.limits (a Flow the webhook did not see)
    # The runner pod's image is not a valid reference (the kubelet's InvalidImageName): it can never start
    INVALID_IMAGE_NAME = "InvalidImageName"
    STATE_CORRUPT = "StateCorrupt"
    STATE_TOO_LARGE = "StateTooLarge"
    RUN_PENDING = "RunPending"
    RUN_STARTED = "RunStarted"
    RUN_FAILED = "RunFailed"
    RUN_SUCCEEDED = "RunSucceeded"
    RUN_PAUSED = "RunPaused"
    RUN_INTERRUPTED = "RunInterrupted"
    POD_DELETED = "PodDeleted"
    DISRUPTED = "Disrupted"
    DISRUPTIONS_EXHAUSTED = "DisruptionsExhausted"
    LATE_REPORT = "LateReport"
    RETRY_BACKOFF = "RetryBackoff"
    RETRIES_EXHAUSTED = "RetriesExhausted"
    DEADLINE_EXCEEDED = "DeadlineExceeded"
    BUDGET_EXCEEDED = "BudgetExceeded"
    FEEDBACK_REQUESTED = "FeedbackRequested"
    FEEDBACK_RECEIVED = "FeedbackReceived"
    FEEDBACK_REFUSED = "FeedbackRefused"
    FEEDBACK_TIMED_OUT = "FeedbackTimedOut"
    SUSPENDED = "Suspended"
    SESSION_OPENED = "SessionOpened"
    MESSAGE_RECEIVED = "MessageReceived"
    MESSAGE_REFUSED = "MessageRefused"
    TURN_COMPLETED = "TurnCompleted"
    CONVERSATION_ENDED = "ConversationEnded"
    CONVERSATION_IDLE = "ConversationIdle"
    MAX_TURNS_REACHED = "MaxTurnsReached"
    MODEL_UNREACHABLE = "ModelUnreachable"
    FLOW_ERROR = "FlowError"
    INTERNAL_ERROR = "InternalError"


# Runner process exit codes: the operator retries only what is worth retrying.
# Runner pods lost to disruptions that are replaced, over a flow's life, when retries.disruptionLimit is
# not set (a Job with a podFailurePolicy that ignores DisruptionTarget has no such cap).
DEFAULT_DISRUPTION_LIMIT = 10

EXIT_OK = 0  # the run ended Succeeded or Paused; the report says which
EXIT_PERMANENT = 2  # invalid definition, import error, bad inputs, corrupt state, budget: never retried
EXIT_RETRYABLE = 3  # lost model connection, API errors: a retry may succeed
# Anything else (137 = SIGKILL, 143 = SIGTERM, ...) is treated as retryable: the pod was lost.

# Environment the operator gives a runner pod.
ENV_PREFIX = "FLOWKUBE_"  # every name with it is the operator's: refused in spec.env, set in every runner pod
ENV_LIMIT = 256  # entries of spec.env and of spec.envFrom
ENV_FLOW_NAME = "FLOWKUBE_FLOW"
ENV_NAMESPACE = "FLOWKUBE_NAMESPACE"
ENV_POD_NAME = "FLOWKUBE_POD"
ENV_TRIGGER = "FLOWKUBE_TRIGGER"
ENV_SPEC = "FLOWKUBE_SPEC"  # JSON of flowkube_api.runspec.RunnerSpec: {"definition"|"flowRef", "inputs", "budget"}
ENV_STATE_URL = "FLOWKUBE_STATE_URL"  # the operator's state API (HTTPS), the runner's only way to its state
ENV_STATE_CA = "FLOWKUBE_STATE_CA"  # PEM of the CA that signed the state API's certificate
ENV_STATE_TOKEN_FILE = "FLOWKUBE_STATE_TOKEN_FILE"  # noqa: S105 - default STATE_TOKEN_DIR/token
ENV_STATE_RETRY_SECONDS = "FLOWKUBE_STATE_RETRY_SECONDS"  # how long a runner waits out an operator restart
ENV_FEEDBACK = "FLOWKUBE_FEEDBACK"  # JSON: {"requestId", "text", "timedOut", "outcome"}
ENV_MESSAGE = "FLOWKUBE_MESSAGE"  # JSON: {"turn", "text", "sender"}: the conversation message this run answers
# Seconds a conversation's runner pod stays up after a turn, waiting for the next message (0: it exits).
ENV_KEEP_WARM_SECONDS = "FLOWKUBE_KEEP_WARM_SECONDS"
# Seconds a paused run's pod stays up waiting for the feedback answer (0: it exits).
ENV_FEEDBACK_KEEP_WARM_SECONDS = "FLOWKUBE_FEEDBACK_KEEP_WARM_SECONDS"
ENV_PRIOR_TOTAL_TOKENS = "FLOWKUBE_PRIOR_TOTAL_TOKENS"
ENV_PRIOR_COST = "FLOWKUBE_PRIOR_COST"  # USD spent by earlier runs, a decimal string ("0.0123")
ENV_QUOTAS = "FLOWKUBE_QUOTAS"  # "true": every model request is reserved at the quota desk first (issue 41)
# Seconds between a pod's reminders of the reservations it holds while a call is in flight (a new
# leader learns of a long call within them, before its recovery ends): a third of quotas.recoverySeconds.
ENV_QUOTA_HEARTBEAT_SECONDS = "FLOWKUBE_QUOTA_HEARTBEAT_SECONDS"
ENV_PRICES = "FLOWKUBE_PRICES"  # JSON: price overrides by model (flowkube_api.prices), set by the operator
ENV_TERMINATION_LOG = "FLOWKUBE_TERMINATION_LOG"  # default /dev/termination-log
ENV_STATE_DIR = "FLOWKUBE_STATE_DIR"  # development only: a directory instead of the ConfigMap
# Tracing (set only when the operator traces): the W3C traceparent of the pod's run span (the Flow's
# trace, flowkube_api.traces), the OTLP/HTTP traces URL its spans go to, and "true" to keep message
# content in them. flowkube's own names, not OTEL_*: a Flow's spec.env cannot point them elsewhere.
ENV_TRACEPARENT = "FLOWKUBE_TRACEPARENT"
ENV_TRACES_ENDPOINT = "FLOWKUBE_TRACES_ENDPOINT"
ENV_TRACES_CONTENT = "FLOWKUBE_TRACES_CONTENT"
# Every FLOWKUBE_ variable a runner reads. The operator sets each in every runner pod (empty when it
# has nothing to say: the runner reads empty as unset), so neither spec.env nor envFrom (a container's
# env wins over its envFrom) can give one another value; only the chart's runner.defaultEnv may set
# the two a runner reads for itself (RUNNER_TUNABLE_ENV).
RUNNER_ENV = (
    ENV_FLOW_NAME, ENV_NAMESPACE, ENV_POD_NAME, ENV_TRIGGER, ENV_SPEC, ENV_STATE_URL, ENV_STATE_CA,
    ENV_STATE_TOKEN_FILE, ENV_STATE_RETRY_SECONDS, ENV_FEEDBACK, ENV_MESSAGE, ENV_KEEP_WARM_SECONDS,
    ENV_FEEDBACK_KEEP_WARM_SECONDS, ENV_PRIOR_TOTAL_TOKENS, ENV_PRIOR_COST, ENV_PRICES, ENV_TERMINATION_LOG,
    ENV_STATE_DIR, ENV_QUOTAS, ENV_QUOTA_HEARTBEAT_SECONDS, ENV_TRACEPARENT, ENV_TRACES_ENDPOINT,
    ENV_TRACES_CONTENT,
)
RUNNER_TUNABLE_ENV = (ENV_STATE_RETRY_SECONDS, ENV_STATE_TOKEN_FILE)

# Keys inside the per-Flow state ConfigMap (binaryData, gzip-compressed JSON).
STATE_KEY = "state.json.gz"
REPORT_KEY_PREFIX = "report."  # + pod name + ".json.gz": one key per run, written only by that run

# Runner pods hold no Kubernetes API credentials: only a pod-bound token for this audience, which
# the API server itself refuses and the operator's state API accepts (TokenReview) for that pod's Flow.
STATE_AUDIENCE = "flowkube.io/state"
STATE_TOKEN_DIR = "/var/run/secrets/flowkube.io/state"  # noqa: S105 - a path
STATE_API_PREFIX = "/v1/state/"  # + key: GET and PUT of one binaryData key of the caller's Flow
STATE_KEY_PATTERN = r"[-._a-zA-Z0-9]{1,253}"  # what a ConfigMap key may be
# + the number of the last message the caller answered: a warm runner's long poll for the next one.
MESSAGE_API_PREFIX = "/v1/message/"
# On a 503 of the state API: "true" when the value was stored, by a replica that does not reconcile.
HEADER_STORED = "Flowkube-Stored"
# + reserve or settle: a runner's model call under spend quotas (issue 41): its worst case reserved
# before it is sent ({"model", "tokens", "cost"} -> {"id"}, or 402 and why), settled after
# ({"id", "charges"}: the run's charges so far).
QUOTA_API_PREFIX = "/v1/quota/"
ANSWER_API_PREFIX = "/v1/answer/"  # + the feedback request id: a warm paused runner's long poll for its answer
MESSAGE_POLL_SECONDS = 20  # the longest one long poll is held before "nothing yet" (204)
DEFAULT_KEEP_WARM_SECONDS = 120  # spec.conversation.keepWarmSeconds when unset

MESSAGE_LIMIT = 65536  # characters of one conversation message (status.conversation.inbox.text)
MESSAGE_EXCERPT_LIMIT = 1024  # bytes kept of each message in status.conversation.messages[]
RECENT_MESSAGES = 20  # messages kept in status.conversation.messages[]; the transcript is in the state
EXIT_COMMANDS = ("exit", "quit")  # crewAI's default; a Flow class may set its own `exit_commands`
EXCERPT_LIMIT = 4096  # bytes kept of outputs in status (result.output, feedback.request.output)
STATE_LIMIT = 900 * 1024  # compressed bytes per state object; beyond it the run fails StateTooLarge


def state_configmap_name(flow: str) -> str:
    return f"{flow}-state"


DEFAULT_CHECKPOINTS_KEPT = 5  # spec.checkpoints.keep when unset
CHECKPOINTS_KEPT_LIMIT = 10  # the most spec.checkpoints.keep may say: each is up to STATE_LIMIT bytes
CHECKPOINT_KEY_PREFIX = "checkpoint."  # + the checkpoint's number: a runner's PUT of a snapshot
CHECKPOINT_ANNOTATION = "flowkube.io/checkpoint"  # on a checkpoint's ConfigMap: the number it holds now


def checkpoint_key(checkpoint: int) -> str:
    return f"{CHECKPOINT_KEY_PREFIX}{checkpoint}"


def checkpoint_configmap_name(flow: str, checkpoint: int, keep: int) -> str:
    """Checkpoints are kept in a ring of ``keep`` ConfigMaps per Flow: checkpoint n in slot n mod keep,
    so however many a runner sends, a Flow never has more than ``keep`` of them."""
    return f"{flow}-cp-{checkpoint % keep}"


def run_pod_name(flow: str, index: int) -> str:
    """Deterministic per attempt: a restarted operator finds the pod instead of making another."""
    return f"{flow}-{index}"


def report_key(pod: str) -> str:
    return f"{REPORT_KEY_PREFIX}{pod}.json.gz"
