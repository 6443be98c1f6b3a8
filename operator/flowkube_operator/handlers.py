"""kopf, as an adapter: what kopf does for the operator, and the handlers that call into `app.App`.

kopf's part, and all of it:
- **login**: it finds credentials (in-cluster ServiceAccount or kubeconfig) and logs in again when
  they expire; `App.login` gets each new client;
- **admission**: its webhook server (aiohttp, with our TLS files) decodes AdmissionReviews and
  calls the three admission handlers below, whose decisions are `webhook`'s pure functions;
- **lifecycle**: signals, startup and cleanup (`App.start`, `App.stop`).

It watches nothing and reconciles nothing: the watches (informer.py), the queue and workers
(controller.py), leader election (leader.py) and the API client (kube.py) are the operator's own,
because they must keep every replica's caches warm while only the leader writes (kopf's peering
pauses followers), and because they cost less per Flow (docs/architecture.md, "Home-made parts").

`register` makes a registry per App: nothing here runs at import time.
"""

from __future__ import annotations

import logging
from typing import Any

import kopf

from flowkube_api import constants as c
from flowkube_api import limits
from flowkube_operator.app import App
from flowkube_operator.flows import resources
from flowkube_operator.kube import reviews
from flowkube_operator.kube.client import ApiError, Kube
from flowkube_operator.serve import webhook


def register(app: App) -> kopf.OperatorRegistry:
    """kopf's handlers for ``app``, in a registry of their own (given to `kopf.run`)."""
    registry = kopf.OperatorRegistry()

    @kopf.on.startup(registry=registry)
    async def startup(settings: kopf.OperatorSettings, **_: Any) -> None:
        # kopf watches nothing: only the Events we post on purpose; operator logs stay logs.
        settings.posting.level = logging.CRITICAL + 1
        # Serving named namespaces, kopf need not look for namespaces and CRDs coming and going (it serves
        # only the webhooks): without this it lists namespaces, which a namespaced install may not.
        settings.scanning.disabled = bool(app.settings.watch_namespaces)
        settings.networking.request_timeout = 30
        if app.webhook_server is not None:
            settings.admission.server = app.webhook_server
        await app.start()

    @kopf.on.login(registry=registry)
    async def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is not None:
            await app.login(Kube(info))
        return info

    @kopf.on.cleanup(registry=registry)
    async def cleanup(**_: Any) -> None:
        await app.stop()

    if app.settings.webhook_enabled:
        _register_admission(registry, app)
    return registry


def _register_admission(registry: kopf.OperatorRegistry, app: App) -> None:
    # The webhook configurations come from the chart, which sets the failure policies (documented
    # there): Flow writes fail closed, feedback fails open and the operator then refuses bad answers
    # asynchronously. The status handlers are pure checks on the answer's hot path.

    _register_spec_checks(registry, app)

    @kopf.on.validate(c.GROUP, c.VERSION, c.PLURAL, id="validate-flows-status", subresource="status",
                      operations=["UPDATE"], side_effects=False, registry=registry)
    async def validate_status(*, userinfo: kopf.UserInfo, **kwargs: Any) -> None:
        user = str(userinfo.get("username", ""))
        problem = webhook.review_status_write(kwargs.get("old"), kwargs.get("new"),
                                              by_operator=app.by_operator(user), username=user)
        if problem:
            raise kopf.AdmissionError(problem, code=422)

    @kopf.on.mutate(c.GROUP, c.VERSION, c.PLURAL, id="mutate-flows-status", subresource="status",
                    operations=["UPDATE"], side_effects=False, registry=registry)
    async def record_responder(*, userinfo: kopf.UserInfo, patch: kopf.Patch, **kwargs: Any) -> None:
        user = str(userinfo.get("username", ""))
        if app.by_operator(user):
            return
        status = webhook.recorded_senders(kwargs.get("old"), kwargs.get("new"), user)
        if status:
            patch["status"] = status


def _register_spec_checks(registry: kopf.OperatorRegistry, app: App) -> None:
    """Flows (the spec they run) and templates (the Flow spec they hold), refused at apply."""

    @kopf.on.validate(c.GROUP, c.VERSION, c.PLURAL, id="validate-flows", operations=["CREATE", "UPDATE"],
                      side_effects=False, registry=registry)
    async def validate_flow(*, spec: kopf.Spec, body: kopf.Body, namespace: str | None, userinfo: kopf.UserInfo,
                            operation: str | None = None, **_: Any) -> None:
        problem = await _flow_problem(app, dict(spec), namespace or "", body.get("status"))
        if problem:
            raise kopf.AdmissionError(problem, code=422)
        if operation == "CREATE" and isinstance(spec.get("forkFrom"), dict):
            await _may_fork(app, dict(spec["forkFrom"]), namespace or "", userinfo)
        if operation == "CREATE" and app.quotas is not None:
            labels = {str(k): str(v) for k, v in ((body.get("metadata") or {}).get("labels") or {}).items()}
            refused = app.quotas.refuses(namespace or "", labels)
            if refused:
                raise kopf.AdmissionError(refused, code=403)

    @kopf.on.validate(c.GROUP, c.VERSION, c.CRONFLOW_PLURAL, id="validate-cronflows",
                      operations=["CREATE", "UPDATE"], side_effects=False, registry=registry)
    async def validate_cronflow(*, spec: kopf.Spec, namespace: str | None, **_: Any) -> None:
        # The Flows it starts are checked now, as each would be at its time.
        own = await _flow_problem(app, dict((spec.get("flowTemplate") or {}).get("spec") or {}), namespace or "", None)
        problem = webhook.schedule_problem(spec) or (own.replace("spec.", "spec.flowTemplate.spec.") if own else None)
        if problem:
            raise kopf.AdmissionError(problem, code=422)

    for plural in (c.TEMPLATE_PLURAL, c.CLUSTER_TEMPLATE_PLURAL):
        @kopf.on.validate(c.GROUP, c.VERSION, plural, id=f"validate-{plural}", operations=["CREATE", "UPDATE"],
                          side_effects=False, registry=registry)
        async def validate_template(*, spec: kopf.Spec, **_: Any) -> None:
            # The template's Flow spec as a Flow's: its messages name spec.template.<field>.
            own = await _spec_problem(app, dict(spec.get("template") or {}))
            problem = (webhook.template_spec_problem(dict(spec))
                       or (own.replace("spec.", "spec.template.") if own else None))
            if problem:
                raise kopf.AdmissionError(problem, code=422)


async def _may_fork(app: App, ref: dict[str, Any], namespace: str, userinfo: kopf.UserInfo) -> None:
    """A fork copies its origin's checkpoint, so making one needs ``get`` on the origin: refused
    otherwise, as the API server would refuse the person reading it."""
    origin_ns, name = str(ref.get("namespace") or namespace), str(ref.get("name") or "")
    if app.kube is None:
        raise kopf.AdmissionError("the operator is not connected to the API server; retry", code=503)
    try:
        allowed = await reviews.may(app.kube, dict(userinfo), "get", origin_ns, c.PLURAL, name)
    except ApiError as e:
        raise kopf.AdmissionError(f"spec.forkFrom: could not check access to the origin: {e}", code=503) from e
    if not allowed:
        raise kopf.AdmissionError(
            f"spec.forkFrom: user {userinfo.get('username', '')!r} may not get Flow {origin_ns}/{name}, so may "
            "not fork it (a fork copies the origin's state)", code=403)


async def _flow_problem(app: App, spec: dict[str, Any], namespace: str, status: Any) -> str | None:
    """Why a Flow spec (a CronFlow's flowTemplate.spec too) is refused, naming the field, or None."""
    if spec.get("templateRef"):  # the spec it runs is checked: its template's, with its own over it
        own = limits.spec_problem(spec, own=True)  # the Flow's own bytes first, before anything reads them
        if own:
            return own
        effective, refused = await webhook.template_problem(spec, namespace, status, app.template,
                                                            app.taken_template)
        if refused or effective is None:  # None: what it took cannot be read now (the reconcile says so)
            return refused
        spec = effective
    return await _spec_problem(app, spec)


async def _spec_problem(app: App, spec: dict[str, Any]) -> str | None:
    """The checks of a spec a runner pod would run: the bounds, the runner pod policy, the definition."""
    return (limits.spec_problem(spec) or "; ".join(resources.pod_policy_problems(spec, app.settings))
            or await app.validator.problem(spec))
