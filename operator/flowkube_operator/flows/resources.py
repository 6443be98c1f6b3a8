"""Pure builders of the objects the operator creates for a Flow: no I/O, tested without a cluster."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api import traces
from flowkube_api.base import money_text
from flowkube_api.models import FlowSpec
from flowkube_api.prices import prices_json
from flowkube_api.report import TokenUsage
from flowkube_api.runspec import runner_spec_env
from flowkube_operator.settings import Settings

Body = dict[str, Any]

# What the restricted Pod Security Standard requires, and what we would want anyway.
CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "runAsNonRoot": True,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


STATE_TOKEN_VOLUME = "flowkube-state-token"  # noqa: S105 - a volume name


def quota_heartbeat(settings: Settings) -> float:
    """Seconds between a runner pod's reminders of the reservations it holds: three within a new
    leader's recovery, so a call in flight that long is heard of before its reservations could be lost."""
    recovery = settings.quota_recovery_seconds
    return max(0.2, recovery / 3) if recovery > 0 else 0.0


def owner_reference(flow: Body) -> Body:
    return {
        "apiVersion": c.API_VERSION,
        "kind": c.KIND,
        "name": flow["metadata"]["name"],
        "uid": flow["metadata"]["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _labels(flow: Body, component: str) -> dict[str, str]:
    return {
        c.LABEL_MANAGED_BY: c.MANAGED_BY,
        c.LABEL_FLOW: flow["metadata"]["name"],
        c.LABEL_COMPONENT: component,
    }


def _meta(flow: Body, name: str, component: str) -> Body:
    return {
        "name": name,
        "namespace": flow["metadata"]["namespace"],
        "labels": _labels(flow, component),
        "ownerReferences": [owner_reference(flow)],
    }


def state_configmap(flow: Body) -> Body:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _meta(flow, c.state_configmap_name(flow["metadata"]["name"]), c.COMPONENT_STATE),
    }


def checkpoint_configmap(flow: Body, checkpoint: int, keep: int, data: bytes) -> Body:
    """The ConfigMap of the ring of a Flow's checkpoints that holds ``checkpoint`` (its ``state.json.gz``)."""
    name = c.checkpoint_configmap_name(flow["metadata"]["name"], checkpoint, keep)
    meta = _meta(flow, name, c.COMPONENT_CHECKPOINT)
    meta["annotations"] = {c.CHECKPOINT_ANNOTATION: str(checkpoint)}
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "binaryData": {c.STATE_KEY: base64.b64encode(data).decode("ascii")}}


def definition_name(spec: Body) -> str:
    """The flow's own name: spec.definition.name, or the class name of spec.flowRef."""
    if isinstance(spec.get("definition"), dict):
        return str(spec["definition"].get("name", ""))
    ref = str(spec.get("flowRef") or "")
    return ref.rsplit(":", 1)[-1].rsplit(".", 1)[-1]


SCRIPTS_ENV = "CREWAI_ALLOW_FLOW_SCRIPT_EXECUTION"  # crewAI's switch for `script` steps


def _allowed(name: str, allowed: list[str]) -> bool:
    return "*" in allowed or name in allowed or any(p.endswith("*") and name.startswith(p[:-1]) for p in allowed)


def _kept(items: Any, path: str, refusal: Callable[[Body], str | None], problems: list[str]) -> list[Any]:
    """The entries of a list field the policy allows; each other one adds its refusal to ``problems``."""
    kept = []
    for i, item in enumerate(items or []):
        why = refusal(item) if isinstance(item, dict) else None
        if why is None:
            kept.append(item)
        else:
            problems.append(f"{path}[{i}]{why}")
    return kept


# Domains under a reserved one that Kubernetes gives to applications: its recommended labels
# (app.kubernetes.io/name, /instance, /version, /component, /part-of) describe the user's workload.
USER_DOMAINS = frozenset({"app.kubernetes.io"})


def reserved_prefix(key: str, prefixes: list[str]) -> str | None:
    """The entry of ``prefixes`` (domains written ``istio.io/``) that reserves this label or annotation
    key: its prefix is that domain or a subdomain of it (``sidecar.istio.io/inject``). Keys without a
    prefix are the user's."""
    if "/" not in key:
        return None
    domain = key.split("/", 1)[0].lower()
    if domain in USER_DOMAINS:
        return None
    return next((p for p in prefixes if domain == p.rstrip("/") or domain.endswith("." + p.rstrip("/"))), None)


def _metadata_kept(metadata: Any, prefixes: list[str], problems: list[str]) -> Body:
    """A podTemplate's labels and annotations without the reserved keys, each of which adds its refusal."""
    kept: Body = {}
    for part in ("labels", "annotations"):
        values = (metadata or {}).get(part) if isinstance(metadata, dict) else None
        if not isinstance(values, dict):
            continue
        kept[part] = {}
        for key, value in values.items():
            entry = reserved_prefix(str(key), prefixes)
            if entry is None:
                kept[part][key] = value
                continue
            domain = str(key).split("/", 1)[0] + "/"
            problems.append(f"spec.podTemplate.metadata.{part}[{json.dumps(key)}]: the prefix {domain} is reserved "
                            f"(runnerPolicy.reservedMetadataPrefixes: {entry}"
                            f"{' and its subdomains' if domain != entry else ''}): other controllers act on it "
                            "for a pod, and a Flow may not set it on the pods the operator makes")
    return kept


def _enforced_env_problems(spec: Body, settings: Settings) -> list[str]:
    """The variables of spec.env the chart enforces (runner.enforcedEnv), each named: a Flow cannot
    override them, e.g. the model endpoint of a metering gateway."""
    enforced = settings.runner_enforced_env
    return [f"spec.env[{i}].name: {e['name']} is set by the operator in every runner pod (runner.enforcedEnv) "
            "and a Flow may not override it"
            for i, e in enumerate(spec.get("env") or []) if isinstance(e, dict) and e.get("name") in enforced]


def _apply_policy(spec: Body, settings: Settings) -> tuple[list[str], Body]:
    """What the runner pod policy refuses in a Flow spec (each naming its field), and the spec with
    it left out. Creating a Flow is not creating a pod: without this, whoever may create Flows could
    name any Secret of the namespace, take any PriorityClass or tolerate the control plane's taints.
    One pass serves both the webhook (the refusals) and the pod builder (what is left)."""
    if not settings.runner_policy:
        return [], spec
    problems: list[str] = []
    kept = dict(spec)
    image = spec.get("image")
    if image and not _allowed(str(image), settings.runner_images):
        problems.append(f"spec.image: {image!r} is not an image Flows may run (runnerPolicy.images: "
                        f"{settings.runner_images}); only the operator's runner image reports usage you can trust")
        del kept["image"]
    template: Body = dict(spec.get("podTemplate") or {})
    priority = template.get("priorityClassName")
    if priority and not _allowed(str(priority), settings.runner_priority_class_names):
        problems.append(f"spec.podTemplate.priorityClassName: {priority!r} is not allowed by the operator's "
                        f"runner policy (runnerPolicy.priorityClassNames: {settings.runner_priority_class_names})")
        del template["priorityClassName"]

    def toleration(t: Body) -> str | None:
        key = str(t.get("key") or "")
        return None if _allowed(key or "*", settings.runner_toleration_keys) else (
            f": tolerating {key or 'every taint'!r} is not allowed by the operator's runner policy "
            f"(runnerPolicy.tolerationKeys: {settings.runner_toleration_keys})")

    def secret(ref: Any) -> str | None:
        name = str((ref or {}).get("name", "")) if isinstance(ref, dict) else ""
        return None if _allowed(name, settings.runner_secret_names) else (
            f": Secret {name!r} is not one Flows may use (runnerPolicy.secretNames: {settings.runner_secret_names})")

    def env(e: Body) -> str | None:
        value_from = e.get("valueFrom")
        why = secret(value_from["secretKeyRef"]) if isinstance(value_from, dict) and "secretKeyRef" in value_from \
            else None
        if why:
            return f".valueFrom.secretKeyRef.name{why}"
        if not settings.runner_allow_scripts and e.get("name") == SCRIPTS_ENV:
            return (f": {SCRIPTS_ENV} is not allowed (runnerPolicy.allowScripts: false): a script step runs the "
                    "Flow author's own code")
        return None

    def env_from(e: Body) -> str | None:
        why = secret(e["secretRef"]) if "secretRef" in e else None
        return f".secretRef.name{why}" if why else None

    template["tolerations"] = _kept(template.get("tolerations"), "spec.podTemplate.tolerations", toleration,
                                    problems)
    kept["env"] = _kept(spec.get("env"), "spec.env", env, problems)
    kept["envFrom"] = _kept(spec.get("envFrom"), "spec.envFrom", env_from, problems)
    template["imagePullSecrets"] = _kept(template.get("imagePullSecrets"), "spec.podTemplate.imagePullSecrets",
                                         lambda s: f".name{why}" if (why := secret(s)) else None, problems)
    template["metadata"] = _metadata_kept(template.get("metadata"), settings.runner_reserved_metadata_prefixes,
                                          problems)
    return (problems, {**kept, "podTemplate": template}) if problems else ([], spec)


def pod_policy_problems(spec: Body, settings: Settings) -> list[str]:
    """What a Flow asks of its pod that the runner pod policy does not allow, or that overrides an
    enforced variable, each naming its field."""
    return _apply_policy(spec, settings)[0] + _enforced_env_problems(spec, settings)


def _with_flow_env(env: list[Body], spec: Body, settings: Settings) -> list[Body]:
    """The operator's variables (``env``), then the chart's enforced ones, its defaults, and the
    Flow's own: each name once, the first of these that sets it winning."""
    # The chart's enforced variables: a Flow's own of those names are dropped (the webhook refuses
    # them; a Flow admitted before they were enforced, or while the webhook was down, may hold one).
    own = {e["name"] for e in env}
    env = env + [{"name": k, "value": v} for k, v in sorted(settings.runner_enforced_env.items()) if k not in own]
    own |= set(settings.runner_enforced_env)
    # FLOWKUBE_ names are the operator's: a Flow's own are dropped (the CRD refuses them; a Flow
    # stored before that rule may still hold one), the chart's defaults may tune two, and every
    # other one the runner reads is set here, empty, so that envFrom cannot supply it.
    user_env: list[Body] = [e for e in spec.get("env") or []
                            if isinstance(e, dict) and not str(e.get("name", "")).startswith(c.ENV_PREFIX)]
    user_names = {e.get("name") for e in user_env}
    defaults = {k: v for k, v in settings.runner_default_env.items()
                if k not in own and k not in user_names
                and (not k.startswith(c.ENV_PREFIX) or k in c.RUNNER_TUNABLE_ENV)}
    env += [{"name": k, "value": v} for k, v in sorted(defaults.items())]
    env += [{"name": k, "value": ""} for k in c.RUNNER_ENV if k not in own and k not in defaults]
    return env + [e for e in user_env if e.get("name") not in own]


def _trace_env(meta: Body, index: int, settings: Settings) -> list[Body]:
    """Tracing on: the pod's run span in the Flow's trace (both from its uid) and where to send spans."""
    uid = str(meta.get("uid") or "")
    if not settings.runner_traces_url or not uid:
        return []
    parent = traces.traceparent(traces.trace_id(uid), traces.run_span_id(uid, index))
    return [{"name": c.ENV_TRACEPARENT, "value": parent},
            {"name": c.ENV_TRACES_ENDPOINT, "value": settings.runner_traces_url},
            {"name": c.ENV_TRACES_CONTENT, "value": "true" if settings.tracing_capture_content else ""}]


def runner_pod(  # noqa: PLR0913 - keyword-only: every input of the pod spec, each named
    flow: Body,
    flow_spec: FlowSpec,
    *,
    index: int,
    trigger: c.Trigger,
    settings: Settings,
    feedback: Body | None = None,
    message: Body | None = None,
    state_ca: str = "",
    prior: TokenUsage | None = None,
    active_deadline_seconds: int | None = None,
    keep_warm_seconds: int = 0,
    feedback_keep_warm_seconds: int = 0,
) -> Body:
    """The runner pod of attempt `index`. Its name is deterministic, so re-creating it is a no-op.

    It holds no Kubernetes API credentials: only a token bound to the pod for the audience of the
    operator's state API (see stateapi), and that API's URL and CA.

    The price overrides (``FLOWKUBE_PRICES``) are the operator's, set even when empty: the variables
    the operator sets win over a Flow's ``spec.env``, and a container's ``env`` over its ``envFrom``,
    so a Flow cannot price its own calls (and so dodge its ``budget.maxCost``) by setting them. The
    chart's enforced variables (``runner_enforced_env``, e.g. a metering gateway's URL) win the same way.

    The pod policy is applied here again (not only by the webhook): a Flow admitted before a rule,
    or while the webhook was down, still gets no reserved label or annotation and no refused field.

    ``flow_spec`` is the spec the Flow runs, resolved and validated by the reconcile (`Plan.spec`);
    of ``flow``, only its metadata is read. ``FLOWKUBE_SPEC`` is written from it (``runspec.RunnerSpec``,
    the model the runner reads it with); the pod policy touches none of its fields.
    """
    meta = flow["metadata"]
    spec: Body = _apply_policy(flow_spec.model_dump(mode="json", by_alias=True, exclude_unset=True), settings)[1]
    name = meta["name"]
    template: Body = spec.get("podTemplate") or {}
    tmeta: Body = template.get("metadata") or {}
    pod_name = c.run_pod_name(name, index)

    env: list[Body] = [
        {"name": c.ENV_FLOW_NAME, "value": name},
        {"name": c.ENV_NAMESPACE, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
        {"name": c.ENV_POD_NAME, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": c.ENV_TRIGGER, "value": trigger.value},
        {"name": c.ENV_SPEC, "value": runner_spec_env(flow_spec)},
        {"name": c.ENV_STATE_URL, "value": settings.state_endpoint},
        {"name": c.ENV_STATE_CA, "value": state_ca},
        # What earlier runs used: the budget (tokens and money) is the flow's, checked per call.
        {"name": c.ENV_PRIOR_TOTAL_TOKENS, "value": str(prior.total_tokens if prior else 0)},
        {"name": c.ENV_PRIOR_COST, "value": money_text(prior.cost) if prior else "0"},
        {"name": c.ENV_PRICES, "value": prices_json(settings.runner_prices)},
        # The root filesystem is read-only; crewAI and friends write their caches under HOME.
        {"name": "HOME", "value": "/tmp"},
        {"name": "CREWAI_DISABLE_TELEMETRY", "value": "true"},
        {"name": "OTEL_SDK_DISABLED", "value": "true"},
        # Spend quotas enforced: every model request is reserved at the state API before it is sent.
        *([{"name": c.ENV_QUOTAS, "value": "true"},
           {"name": c.ENV_QUOTA_HEARTBEAT_SECONDS, "value": f"{quota_heartbeat(settings):g}"}]
          if settings.quotas_enabled else []),
        *_trace_env(meta, index, settings),
    ]
    if settings.runner_policy and not settings.runner_allow_scripts:
        env.append({"name": SCRIPTS_ENV, "value": "false"})  # set here: envFrom cannot turn it on
    if feedback is not None:
        env.append({"name": c.ENV_FEEDBACK, "value": json.dumps(feedback, separators=(",", ":"))})
    if keep_warm_seconds > 0:
        env.append({"name": c.ENV_KEEP_WARM_SECONDS, "value": str(keep_warm_seconds)})
    if feedback_keep_warm_seconds > 0:
        env.append({"name": c.ENV_FEEDBACK_KEEP_WARM_SECONDS, "value": str(feedback_keep_warm_seconds)})
    if message is not None:
        env.append({"name": c.ENV_MESSAGE, "value": json.dumps(message, separators=(",", ":"), ensure_ascii=False)})
    env = _with_flow_env(env, spec, settings)

    container: Body = {
        "name": "runner",
        "image": spec.get("image") or settings.runner_image,
        "command": list(settings.runner_command),
        "env": env,
        "securityContext": CONTAINER_SECURITY,
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"},
                         {"name": STATE_TOKEN_VOLUME, "mountPath": c.STATE_TOKEN_DIR, "readOnly": True}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    if settings.runner_image_pull_policy:
        container["imagePullPolicy"] = settings.runner_image_pull_policy
    if spec.get("envFrom"):
        container["envFrom"] = spec["envFrom"]
    if spec.get("resources") or settings.runner_default_resources:
        container["resources"] = spec.get("resources") or settings.runner_default_resources

    annotations = dict(tmeta.get("annotations") or {})
    labels = {**(tmeta.get("labels") or {}), **_labels(flow, c.COMPONENT_RUNNER),
              c.LABEL_RUN: str(index), c.LABEL_TRIGGER: trigger.value}
    pod_spec: Body = {
        "restartPolicy": "Never",
        # The namespace's default ServiceAccount, without its API token: the only token in the pod
        # is bound to the pod and valid for the state API alone (the API server refuses it).
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.runner_run_as_user,
            "runAsGroup": settings.runner_run_as_user,
            "fsGroup": settings.runner_run_as_user,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": [
            {"name": "tmp", "emptyDir": {}},
            {"name": STATE_TOKEN_VOLUME, "projected": {"sources": [{"serviceAccountToken": {
                "audience": c.STATE_AUDIENCE, "expirationSeconds": 3600, "path": "token"}}]}},
        ],
    }
    if active_deadline_seconds is not None and keep_warm_seconds <= 0 and feedback_keep_warm_seconds <= 0:
        # A pod that may wait warm for a message or an answer has none: the kubelet would count the wait. The
        # operator stops it at the deadline itself (reconcile), counting only its working time.
        pod_spec["activeDeadlineSeconds"] = max(1, active_deadline_seconds)
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        if template.get(key):
            pod_spec[key] = template[key]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod_name,
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(flow)],
        },
        "spec": pod_spec,
    }
