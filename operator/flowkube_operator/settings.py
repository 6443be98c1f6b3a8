"""Operator configuration: environment variables with the prefix FLOWKUBE_.

docs/configuration.md is generated from this class.
"""

from __future__ import annotations

import ipaddress
import shlex
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from flowkube_api import constants as c
from flowkube_api.prices import PriceOverrides

# Label and annotation key prefixes (domains, with their subdomains) other controllers act on for a pod.
RESERVED_METADATA_PREFIXES = (
    "kubernetes.io/", "k8s.io/", "flowkube.io/", "istio.io/", "linkerd.io/", "kuma.io/", "consul.hashicorp.com/",
    "cni.cncf.io/", "projectcalico.org/", "cilium.io/", "vault.hashicorp.com/", "karpenter.sh/",
)


# Denied by default (`notifications.deniedCIDRs`): the private ranges, where a cluster's pods,
# Services and nodes live, and other private networks a tenant should not reach through the operator.
DEFAULT_DENIED_CIDRS = ("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7")


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FLOWKUBE_", extra="ignore", populate_by_name=True)

    watch_namespaces: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Namespaces to watch (comma-separated); empty means all."
    )
    runner_image: str = Field(default="ghcr.io/flowkube/flowkube-runner:0.1.0",
                              description="Image of runner pods when a Flow sets no spec.image.")
    runner_image_pull_policy: Literal["", "Always", "IfNotPresent", "Never"] = Field(
        default="", description="imagePullPolicy of runner containers; empty: the Kubernetes default.")
    runner_command: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["flowkube-runner"], description="Command of the runner container (shell words)."
    )
    runner_default_env: dict[str, str] = Field(
        default_factory=dict,
        description="JSON object of env vars every runner pod gets (a Flow's own spec.env wins).",
    )
    runner_enforced_env: dict[str, str] = Field(
        default_factory=dict,
        description="JSON object of env vars every runner pod gets that a Flow cannot override, e.g. "
        '`{"OPENAI_BASE_URL": "http://metering-gateway.llm:8080/v1"}`: a Flow setting one in spec.env is '
        "refused at apply (naming the variable), and the operator's value wins in the pod (env wins over "
        "envFrom). Applies whether or not the runner policy is on. FLOWKUBE_ names other than the two a runner "
        "reads for itself (FLOWKUBE_STATE_RETRY_SECONDS, FLOWKUBE_STATE_TOKEN_FILE) are refused at start-up.",
    )
    runner_prices: PriceOverrides = Field(
        default_factory=dict,
        description='JSON object: USD prices per million tokens by model name (as status.usage.byModel names it), '
        'for models the bundled genai-prices table lacks or that you pay differently for, e.g. '
        '`{"my-llama": {"prompt": "0.20", "completion": "0.60", "cachedPrompt": "0.05", "cacheCreation": "0.25"}}` '
        '(decimal strings; cachedPrompt and cacheCreation default to prompt). An override wins over the table; '
        "a model priced nowhere counts as unpriced tokens. Checked at start-up; runner pods get it as "
        "FLOWKUBE_PRICES, which a Flow cannot override.",
    )
    runner_default_resources: dict[str, dict[str, str]] = Field(
        default_factory=dict,
        description="JSON object: resources (requests/limits) of runner containers whose Flow sets no spec.resources.",
    )
    runner_run_as_user: int = Field(default=65532, ge=1, description="UID of runner pods (non-root).")
    runner_policy: bool = Field(
        default=True, description="Enforce the runner pod policy (the three settings below) on what a Flow puts "
        "in its pod: refused at apply by the webhook, and left out of the pod by the operator. false: a "
        "Flow's podTemplate, env and envFrom are copied into its pod as they are.")
    runner_priority_class_names: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="PriorityClasses a Flow may give its pods "
        "(spec.podTemplate.priorityClassName; comma-separated, `*` any); empty: none.")
    runner_toleration_keys: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Taint keys a Flow's pods may tolerate (spec.podTemplate.tolerations; "
        "comma-separated, `*` any); empty: none. A toleration without a key (tolerating every taint) needs `*`.")
    runner_images: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"], description="Images a Flow may run in spec.image (comma-separated; `*` any, "
        "`registry/team/*` a prefix); empty: only the operator's runner image. A Flow running its own image "
        "reports its own usage.")
    runner_allow_scripts: bool = Field(
        default=False, description="Let a Flow turn on crewAI's script steps (CREWAI_ALLOW_FLOW_SCRIPT_EXECUTION "
        "in spec.env). Off: refused at apply, and runner pods get it set to false (envFrom cannot turn it on): "
        "a script runs the Flow author's code, which could report less usage than it spent.")
    runner_reserved_metadata_prefixes: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(RESERVED_METADATA_PREFIXES), description="Label and annotation key "
        "prefixes a Flow may not put on its pods (spec.podTemplate.metadata; comma-separated, e.g. `istio.io/`; "
        "each reserves that domain and its subdomains): by default Kubernetes' own (kubernetes.io/, k8s.io/: "
        "AppArmor, seccomp, the autoscaler; its recommended app.kubernetes.io/ labels stay the user's), "
        "service meshes' (istio.io/, linkerd.io/, kuma.io/, "
        "consul.hashicorp.com/), network plugins' (cni.cncf.io/, projectcalico.org/, cilium.io/), Vault's "
        "injector (vault.hashicorp.com/), Karpenter's (karpenter.sh/) and flowkube's (flowkube.io/): keys "
        "that other controllers act on for a pod, which whoever may create pods could set but a Flow "
        "editor may not. Refused at apply, naming the key, and left out of the pod. Empty: none.")
    runner_secret_names: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: ["*"], description="Secrets a Flow may reference (env valueFrom.secretKeyRef, "
        "envFrom secretRef, podTemplate.imagePullSecrets; comma-separated names, `*` any): a Flow's pod runs "
        "with the operator's rights to create it, so a Secret it names is read into a process whose output "
        "lands in status.")
    retry_backoff_cap_seconds: int = Field(
        default=3600, ge=1, description="Longest delay between retries: the doubling backoff stops here.")
    workers: int = Field(
        default=32, ge=1, le=256,
        description="Flows reconciled concurrently. A reconcile spends most of its time waiting on the API server "
        "(a pod create, a status write), so this bounds a burst: 8 held one at about 100 Flows/s here.")
    pod_recheck_seconds: int = Field(
        default=60, ge=5, le=3600,
        description="A running runner pod the watch has said nothing about for this long is read from the API "
        "server again (at most 50 per half period): the guard against a watch that stays connected but silent.")

    template_snapshot_sweep_seconds: int = Field(
        default=60, ge=1, le=3600,
        description="How often the leader deletes the template snapshots (ControllerRevisions) no Flow names any "
        "more; one is deleted once seen unreferenced at two sweeps in a row.")
    template_snapshot_cache_entries: int = Field(
        default=64, ge=1, le=100_000,
        description="Template specs (read from their snapshots) kept in memory, least recently used dropped first. "
        "Every Flow of one template generation shares one entry.")
    template_snapshot_cache_mib: int = Field(
        default=64, ge=1, le=4096,
        description="Bound on the memory of the template specs kept (each counted as an upper estimate of "
        "its parsed size).")

    cron_clock_rate: float = Field(
        default=1.0, ge=1.0, le=60.0, description="For tests and demos only: CronFlows' clock runs this many "
        "times faster than the real one, from FLOWKUBE_CRON_CLOCK_EPOCH (3: a schedule's minute passes in 20 "
        "real seconds; the Flows it starts are named and annotated with that clock's times). 1, the default: "
        "the real clock.")
    cron_clock_epoch: float = Field(
        default=0.0, ge=0.0, description="For tests and demos only: the Unix time at which CronFlows' clock "
        "and the real one agree, when FLOWKUBE_CRON_CLOCK_RATE is not 1. Every replica needs the same value, "
        "so that a new leader starts each scheduled time once.")

    leader_election: bool = Field(
        default=False, description="Reconcile only while holding a coordination.k8s.io Lease, so that of "
        "several replicas exactly one writes Flow status (all of them watch and serve the state API and "
        "the webhooks); the chart turns it on. Off: this process reconciles from the start.")
    leader_election_namespace: str = Field(
        default="", description="Namespace of the Lease; empty: the namespace of the in-cluster service "
        "account, else `default`.")
    leader_election_lease: str = Field(default="flowkube-operator", description="Name of the Lease.")
    leader_election_lease_duration_seconds: float = Field(
        default=10.0, gt=0, description="How long a follower waits, from the last change of the Lease it "
        "saw, before it takes the Lease over from a holder that stopped renewing.")
    leader_election_renew_deadline_seconds: float = Field(
        default=7.0, gt=0, description="How long the leader keeps trying to renew before it gives up "
        "leading and exits (the kubelet restarts it); shorter than the lease duration.")
    leader_election_retry_period_seconds: float = Field(
        default=1.0, gt=0, description="Time between attempts to acquire or renew the Lease. A follower "
        "sees the leader's last renewal at most this late, so it takes over at most the lease duration "
        "plus this after the leader's last renewal.")

    health_port: int = Field(default=8080, description=(
        "Port of /healthz (liveness) and /readyz (readiness: logged in, the CA in the webhook "
        "configurations, the webhook server listening); 0 disables both."))
    metrics_port: int = Field(default=9090, description="Port of /metrics (0 disables it).")
    metrics_auth: bool = Field(
        default=False, description="/metrics only for a bearer token whose user may `get` the non-resource "
        "URL /metrics (a TokenReview and a SubjectAccessReview, cached for a minute, as kube-rbac-proxy does); "
        "the chart turns it on and makes the metrics-reader ClusterRole to bind to Prometheus.")
    metrics_per_flow: bool = Field(
        default=True,
        description="Export per-flow series; false keeps only namespace/definition/model rollups.",
    )
    metrics_label_values: int = Field(
        default=20, ge=1, le=1000,
        description="Per namespace, how many (definition, template, cronflow) combinations and how many model "
        "names keep their own label values in the metrics; later ones are counted under `other` (docs/api.md).",
    )
    bind_address: str = Field(default="0.0.0.0", description="Address the HTTP endpoints listen on.")  # noqa: S104

    state_port: int = Field(default=8443, ge=1, le=65535,
                            description="Port of the state API (HTTPS) through which runner pods reach their state.")
    state_url: str = Field(
        default="", description="URL runner pods use for the state API; empty: derived from "
        "FLOWKUBE_WEBHOOK_SERVICE (https://<name>.<namespace>.svc:<state port>) or FLOWKUBE_WEBHOOK_HOST.")
    state_client_rate: float = Field(
        default=50.0, gt=0, le=10000, description="Requests a second the state API takes from one source "
        "address, before it looks at the token (HTTP 429 beyond, which runners retry); a runner makes a few. "
        "Where the network plugin rewrites pod-to-Service sources to the node's address, one node's runners "
        "share it.")
    state_client_burst: int = Field(
        default=100, ge=1, le=100000, description="Requests one source address may send at once after a quiet "
        "spell (the size of its token bucket, refilled at FLOWKUBE_STATE_CLIENT_RATE).")
    state_client_authenticating: int = Field(
        default=8, ge=1, le=1024, description="Requests of one source address being authenticated at once "
        "(waiting for the issuer's keys or a TokenReview); more are told 429.")
    state_token_reviews: int = Field(
        default=16, ge=1, le=64, description="TokenReviews the state API has in flight at once, on the API "
        "client's own review connections (the reconcile's requests never wait for them, nor they for it). "
        "Only a token whose signature, expiry and audience check out with the cluster's service-account "
        "issuer keys gets one.")

    webhook_enabled: bool = Field(
        default=False, description="Serve the admission webhooks (Flow validation, feedback answers); the "
        "chart turns it on and registers them.")
    webhook_flows_fail_closed: bool = Field(
        default=True, description="The Flow webhook's failurePolicy is Fail, so no Flow is created without its "
        "checks; the chart sets it from webhook.failurePolicy.flows. Only then are forks of another "
        "namespace's Flows taken (the webhook checked their creator may get the origin).")
    webhook_port: int = Field(default=9443, description="Port of the admission webhook server (HTTPS).")
    webhook_host: str = Field(default="127.0.0.1",
                              description="Name or IP the API server and runner pods use to reach the operator.")
    webhook_service: str = Field(default="",
                                 description="namespace/name of the operator's Service (in-cluster); its DNS "
                                 "names go into the serving certificate of the webhooks and the state API.")
    webhook_configuration: str = Field(
        default="flowkube", description="Name of the (Validating|Mutating)WebhookConfiguration to patch."
    )
    webhook_body_seconds: float = Field(
        default=3.0, gt=0, le=30, description="Deadline to receive an admission review's whole body (the "
        "API server sends it at once); a request that misses it is answered 408 and its connection "
        "closed. A review over 256 KiB waits at most twice this for its share of "
        "FLOWKUBE_WEBHOOK_BODY_BUDGET_MIB, so keep three times this under the webhooks' timeoutSeconds (10).")
    webhook_body_budget_mib: int = Field(
        default=24, ge=16, le=1024, description="MiB of admission reviews over 256 KiB (or without a "
        "Content-Length, counted as the 8 MiB a review may be) being received at once; one source address "
        "gets at most all but 8 MiB of it. Two such reviews are decoded at once, once wholly received.")
    webhook_cert_dir: str = Field(default="/tmp/flowkube-webhook",
                                  description="Where the self-managed TLS material (webhooks, state API) is written.")
    tls_secret: str = Field(
        default="", description="namespace/name of the Secret keeping the operator's CA across restarts; "
        "empty: the CA is kept in FLOWKUBE_WEBHOOK_CERT_DIR.")
    validator_url: str = Field(
        default="", description="URL of the definition validator (runner image sidecar); empty: none."
    )

    quotas_enabled: bool = Field(
        default=False, description="Enforce FlowQuotas (spend and token limits over time windows): the operator "
        "watches FlowQuotas, keeps their book, writes their status, and every runner pod reserves each model "
        "request's worst case at the state API before it is sent. false: FlowQuotas are not read.")
    quota_status_seconds: float = Field(
        default=5.0, ge=0.2, le=300, description="A FlowQuota's status is written at most once per this period "
        "(only when it changed): its used, reserved and conditions lag its book by at most this long.")
    quota_recovery_seconds: float = Field(
        default=30.0, ge=0, le=600, description="A new leader (a restart, a failover) lets no model call through "
        "until each running pod under a FlowQuota has told it what it holds, or for at most this long (a pod "
        "silent that long has no call in flight): the calls in flight at the change are counted, not overspent.")
    notifications_enabled: bool = Field(
        default=True, description="Send notifications (spec.notifications, namespace defaults): the operator "
        "watches the Secrets labelled flowkube.io/notifications. false: no notification is sent.")
    notifications_allowed_cidrs: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Address ranges a receiver may be in although they are denied "
        "(comma-separated CIDRs), e.g. an in-cluster receiver's Service IP. Allowed wins over denied.")
    notifications_denied_cidrs: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_DENIED_CIDRS), description="Address ranges no receiver may be in "
        "(comma-separated CIDRs): by default the private ranges, where the cluster's pods, Services and nodes "
        "are. Loopback, link-local (cloud metadata), multicast and unspecified addresses are always denied, and "
        "so are the cluster's ServiceCIDRs and nodes' pod CIDRs when the operator may list them.")
    notifications_timeout_seconds: float = Field(
        default=10.0, gt=0, le=300, description="Deadline of one delivery attempt (connect, send, answer).")
    notifications_retry_seconds: float = Field(
        default=600.0, ge=0, le=86400, description="How long a delivery is tried again after 5xx, 408, 429, "
        "timeouts and connection errors (backoff 1, 2, 4 ... 60 s); then it is recorded as GaveUp.")
    notifications_max_in_flight: int = Field(
        default=64, ge=1, le=4096, description="Deliveries in flight at once, across receivers.")
    notifications_per_namespace: int = Field(
        default=16, ge=1, le=4096, description="Deliveries in flight at once for the Flows of one namespace: "
        "one tenant's receivers (however many host names they use) never take every slot.")
    notifications_per_host: int = Field(
        default=4, ge=1, le=256, description="Deliveries in flight at once to one receiver (host and port): a "
        "receiver that hangs holds only these.")
    console_url: str = Field(
        default="", description="The console's external URL (https://flowkube.example.com): notifications "
        "link to a Flow's page there. Empty: no link.")

    otel_exporter_otlp_endpoint: str = Field(
        default="", validation_alias="OTEL_EXPORTER_OTLP_ENDPOINT", description="OpenTelemetry's standard "
        "setting: the collector's OTLP/HTTP base URL (http://collector:4318). Set (or the traces endpoint): "
        "every Flow is one trace (status.trace), the operator's spans and its runner pods' go there. The SDK "
        "reads the other OTEL_EXPORTER_OTLP_* settings (headers, timeout in seconds, compression, certificate) "
        "for the operator's export; runner pods get only the URL. Empty: no traces.")
    otel_exporter_otlp_traces_endpoint: str = Field(
        default="", validation_alias="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", description="OpenTelemetry's "
        "standard setting: the whole traces URL (http://collector:4318/v1/traces); wins over the base URL.")
    tracing_runner_endpoint: str = Field(
        default="", description="The OTLP/HTTP traces URL runner pods send their spans to, when it is not the "
        "operator's (a collector reached by another name from the Flows' namespaces). Empty: the operator's.")
    tracing_capture_content: bool = Field(
        default=False, description="Keep message content in spans (prompts, answers, tool arguments, flow "
        "inputs and results, feedback text). Off: spans carry names, models, token counts and cost only.")

    log_format: Literal["json", "text"] = Field(default="json", description="Log lines as JSON or as text.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(default="INFO", description="Lowest level logged.")

    @property
    def traces_url(self) -> str:
        """Where the operator's spans go (empty: tracing off)."""
        if self.otel_exporter_otlp_traces_endpoint:
            return self.otel_exporter_otlp_traces_endpoint
        if self.otel_exporter_otlp_endpoint:
            return self.otel_exporter_otlp_endpoint.rstrip("/") + "/v1/traces"
        return ""

    @property
    def runner_traces_url(self) -> str:
        """Where runner pods' spans go (empty: tracing off)."""
        return (self.tracing_runner_endpoint or self.traces_url) if self.traces_url else ""

    @property
    def state_endpoint(self) -> str:
        if self.state_url:
            return self.state_url.rstrip("/")
        if self.webhook_service:
            ns, name = self.webhook_service.split("/", 1)
            return f"https://{name}.{ns}.svc:{self.state_port}"
        host = f"[{self.webhook_host}]" if ":" in self.webhook_host else self.webhook_host
        return f"https://{host}:{self.state_port}"

    @field_validator("watch_namespaces", "runner_priority_class_names", "runner_toleration_keys",
                     "runner_secret_names", "runner_images", "runner_reserved_metadata_prefixes",
                     "notifications_allowed_cidrs",
                     "notifications_denied_cidrs", mode="before")
    @classmethod
    def _split_commas(cls, v: Any) -> Any:
        return [p.strip() for p in v.split(",") if p.strip()] if isinstance(v, str) else v

    @field_validator("runner_command", mode="before")
    @classmethod
    def _split_words(cls, v: Any) -> Any:
        return shlex.split(v) if isinstance(v, str) else v

    @model_validator(mode="after")
    def _cidrs(self) -> Settings:
        for cidr in [*self.notifications_allowed_cidrs, *self.notifications_denied_cidrs]:
            ipaddress.ip_network(cidr, strict=False)  # its ValueError names the bad one
        return self

    @field_validator("runner_reserved_metadata_prefixes")
    @classmethod
    def _domains(cls, v: list[str]) -> list[str]:
        """``istio.io/`` and ``istio.io`` alike, lower case (as Kubernetes requires of key prefixes)."""
        return [p.lower().rstrip("/") + "/" for p in v if p.strip("/")]

    @field_validator("runner_enforced_env")
    @classmethod
    def _enforced_names(cls, v: dict[str, str]) -> dict[str, str]:
        operators = [k for k in v if k.startswith(c.ENV_PREFIX) and k not in c.RUNNER_TUNABLE_ENV]
        if operators:
            raise ValueError(f"{operators}: the operator sets {c.ENV_PREFIX} variables itself")
        return v

    @model_validator(mode="after")
    def _lease_timing(self) -> Settings:
        if not (self.leader_election_retry_period_seconds < self.leader_election_renew_deadline_seconds
                < self.leader_election_lease_duration_seconds):
            raise ValueError("leader election needs retry period < renew deadline < lease duration")
        return self
