"""The operator's own health metrics (prefix flowkube_operator_), kept apart from per-flow metrics."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from flowkube_operator.labels import DEFAULT_LABEL_VALUES, LabelBudget

REGISTRY = CollectorRegistry(auto_describe=True)

RECONCILE_SECONDS = Histogram(
    "flowkube_operator_reconcile_duration_seconds", "Time to reconcile one Flow, by outcome.",
    ["result"], registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)
RECONCILE_ERRORS = Counter(
    "flowkube_operator_reconcile_errors_total", "Reconciles that failed and were retried, by reason.",
    ["reason"], registry=REGISTRY,
)
API_LATENCY = Histogram(
    "flowkube_operator_api_request_duration_seconds", "Latency of the operator's API server requests.",
    ["verb", "resource", "code"], registry=REGISTRY,
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10),
)
API_CONNECTIONS = Counter(
    "flowkube_operator_api_connections_opened_total",
    "Connections (TLS handshakes) the operator opened for its API server requests; watches not counted.",
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge("flowkube_operator_workqueue_depth", "Flows waiting to be reconciled.", registry=REGISTRY)
IN_FLIGHT = Gauge("flowkube_operator_reconciles_in_flight", "Reconciles running now.", registry=REGISTRY)
DELAYED = Gauge("flowkube_operator_workqueue_delayed", "Flows scheduled for a later reconcile.",
                registry=REGISTRY)
FLOWS_CACHED = Gauge("flowkube_operator_flows_cached", "Flow objects held in the operator's cache.",
                     registry=REGISTRY)
RUN_PODS_CREATED = Counter("flowkube_operator_runner_pods_created_total", "Runner pods created.",
                           ["trigger"], registry=REGISTRY)
STATE_REQUESTS = Counter("flowkube_operator_state_requests_total",
                         "Runner pods' requests to the state API, by method and HTTP status.",
                         ["method", "code"], registry=REGISTRY)
LEADER = Gauge("flowkube_operator_leader",
               "1 while this replica reconciles (holds the Lease, or runs without leader election), else 0. "
               "Only the leader exports the per-flow series.", registry=REGISTRY)

TRACE_SPANS = Counter(
    "flowkube_operator_trace_spans_total",
    "Trace spans handed to the collector (result=exported) or lost (queue_full: the bounded queue was full; "
    "export_failed: the collector refused or could not be reached; unflushed: still queued when the "
    "process had to end), by source: the operator's own spans, or a runner pod's (counted when its run ends).",
    ["source", "result"], registry=REGISTRY,
)

class _ByDefinition:
    """A histogram by namespace and definition whose definitions, a tenant's own names, are capped per
    namespace like the per-flow metrics' (``LabelBudget``: the first ``limit``, then ``other``): its
    series outlive the Flows, so without the cap made-up names would add series for ever."""

    def __init__(self, histogram: Histogram, limit: int = DEFAULT_LABEL_VALUES) -> None:
        self._histogram = histogram
        self._budget = LabelBudget(limit)

    def limit(self, limit: int) -> None:
        """Set the cap (the operator's ``metrics_label_values``) before anything is observed."""
        self._budget = LabelBudget(limit)

    def labels(self, namespace: str, definition: str) -> Histogram:
        return self._histogram.labels(namespace, self._budget.value(namespace, "definition", definition))


# Named for the conversation, not the operator: a user-facing latency. Observed once, by the replica
# whose status write put the reply in place (so a dashboard sums replicas without double counting).
TURN_SECONDS = _ByDefinition(Histogram(
    "flowkube_conversation_turn_seconds",
    "Time from a conversation message accepted to its reply in the Flow's status.",
    ["namespace", "definition"], registry=REGISTRY,
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
))

# Notifications (notifier.py): counted by the leader that ended the delivery.
NOTIFICATIONS = Counter(
    "flowkube_notifications_total",
    "Notification deliveries ended, by result: Delivered, Rejected (4xx, a redirect), GaveUp (retries ran out), "
    "Refused (destination policy), Misconfigured (the Secret or its URL).",
    ["result"], registry=REGISTRY,
)
NOTIFICATION_SECONDS = Histogram(
    "flowkube_notification_delivery_seconds",
    "Time from the event in the Flow's status (a request made, a flow ended) to its receiver's 2xx.",
    ["event"], registry=REGISTRY,
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900),
)
CACHE_SYNCED = Gauge(
    "flowkube_operator_cache_synced",
    "1 once a watched collection's first list is in this replica's cache (no sample before it), "
    "by the collection's API path (the operator's own configuration: its watched namespaces).",
    ["resource"], registry=REGISTRY,
)
