"""kopf registration: every handler is a thin shim over the Controller (registration apart from logic)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web
from prometheus_client import generate_latest

from flowkube_api import constants as c
from flowkube_api import limits
from flowkube_operator import resources, selfmetrics, tls, webhook
from flowkube_operator.controller import Controller
from flowkube_operator.kube import Kube
from flowkube_operator.leader import LeaderElector, LeaseConfig
from flowkube_operator.metrics import FlowMetrics
from flowkube_operator.reviews import MetricsAuth
from flowkube_operator.settings import Settings
from flowkube_operator.stateapi import StateApi

log = logging.getLogger("flowkube.operator")

SETTINGS = Settings()
FLOW_METRICS = FlowMetrics(per_flow=SETTINGS.metrics_per_flow)
CONTROLLER = Controller(SETTINGS, on_flow_change=FLOW_METRICS.update)


@dataclass
class Runtime:
    """What the handlers share while the operator runs: `memo.runtime`, made by the startup handler.

    kopf gives the startup, login and cleanup handlers the operator's memo itself, and every resource
    and admission handler a shallow copy of it, taken when kopf first sees the object. This one
    mutable object is in all those copies, so they see what the login handler changes later.
    """

    kube: Kube | None = None  # the client of the latest login
    username: str = ""  # who the operator is to the API server (its own status writes pass the webhook)
    ca_bundle: bytes | None = None  # installed into the webhook configurations at each login
    ca_installed: bool = False  # the first login put the CA into the webhook configurations
    webhook_server: webhook.FlowkubeWebhookServer | None = None
    state_runner: web.AppRunner | None = None
    metrics_runner: web.AppRunner | None = None
    health_runner: web.AppRunner | None = None
    elector: LeaderElector | None = None  # with leader election: who holds the Lease
    leadership: asyncio.Task[None] | None = None  # acquires, then holds the Lease
    watches: list[asyncio.Task[None]] = field(default_factory=list)  # the informers feeding the caches

    def not_ready(self) -> str:
        """Why this replica must not get traffic yet ("" once it may): the API server calls its
        webhooks and runner pods its state API as soon as its pod is Ready, so Ready waits for the
        CA in the webhook configurations and the webhook server listening, not just for the process."""
        if self.kube is None or not self.ca_installed:
            return "not logged in to the API server yet (the CA is not in the webhook configurations)"
        if self.webhook_server is not None and not self.webhook_server.listening:
            return "the admission webhook server is not listening yet"
        if self.state_runner is None:
            return "the state API is not serving"
        return ""


# Set when the process stops because it lost the Lease: `main` then exits non-zero.
LOST_LEADERSHIP = False


def _runtime(memo: kopf.Memo) -> Runtime | None:
    runtime: Runtime | None = memo.get("runtime")
    return runtime


async def prepare_tls() -> tls.ServingTLS:
    """The CA (kept across restarts) and a fresh serving certificate. Runner pods are told the CA;
    the webhook configurations get it as caBundle. `main` runs this before kopf starts and hands
    the result over as `memo.tls`, so both servers find their files in place."""
    if SETTINGS.tls_secret:
        ks = kopf.OperatorSettings()
        info = (kopf.login_with_service_account(logger=log, settings=ks)
                or kopf.login_with_kubeconfig(logger=log, settings=ks))
        if info is None:
            raise RuntimeError("no credentials to read the CA Secret " + SETTINGS.tls_secret)
        kube = Kube(info)
        try:
            ca = await tls.ca_from_secret(kube, SETTINGS.tls_secret)
        finally:
            await kube.close()
    else:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            log.warning("FLOWKUBE_TLS_SECRET is not set: the CA lives in %s and a new pod makes a new one, "
                        "which running runner pods will not trust", SETTINGS.webhook_cert_dir)
        ca = tls.ca_from_dir(SETTINGS.webhook_cert_dir)
    hosts = [SETTINGS.webhook_host, urlsplit(SETTINGS.state_endpoint).hostname or ""]
    serving = tls.issue(ca, SETTINGS.webhook_cert_dir, hosts, SETTINGS.webhook_service)
    CONTROLLER.state_ca = serving.ca_pem.decode()
    return serving


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    # kopf watches nothing (informer.py does): it serves the admission webhooks and logs in. Only
    # the Events we post on purpose; operator logs stay logs.
    settings.posting.level = logging.CRITICAL + 1
    # Serving named namespaces, kopf need not look for namespaces and CRDs coming and going (it serves
    # only the webhooks): without this it lists namespaces, which a namespaced install may not.
    settings.scanning.disabled = bool(SETTINGS.watch_namespaces)
    settings.networking.request_timeout = 30
    serving: tls.ServingTLS = memo.get("tls") or await prepare_tls()
    memo.tls = serving
    runtime = memo.runtime = Runtime()
    state_api = StateApi(lambda: runtime.kube, CONTROLLER.active_run,
                         lambda t, report: CONTROLLER.late_report(t.namespace, t.flow, report), warm=CONTROLLER)
    CONTROLLER.on_flow_seen = state_api.flow_changed
    CONTROLLER.on_flow_deleted = state_api.forget_flow
    if SETTINGS.webhook_enabled:
        settings.admission.server = runtime.webhook_server = webhook.FlowkubeWebhookServer(
            addr=SETTINGS.bind_address, port=SETTINGS.webhook_port, host=SETTINGS.webhook_host,
            service=SETTINGS.webhook_service, cafile=serving.cafile, certfile=serving.certfile,
            pkeyfile=serving.keyfile)
        runtime.ca_bundle = serving.ca_pem
    else:
        runtime.ca_installed = True  # nothing to install
    runtime.state_runner = await state_api.serve(SETTINGS.bind_address, SETTINGS.state_port,
                                                 serving.certfile, serving.keyfile)
    if SETTINGS.metrics_port:
        auth = MetricsAuth(lambda: runtime.kube) if SETTINGS.metrics_auth else None
        runtime.metrics_runner = await _serve_metrics(auth)
    if SETTINGS.health_port:
        runtime.health_runner = await _serve_health(runtime)


async def _serve_health(runtime: Runtime) -> web.AppRunner:
    """/healthz (liveness: the event loop answers) and /readyz (readiness: `Runtime.not_ready`)."""
    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(_: web.Request) -> web.Response:
        why = runtime.not_ready()
        return web.Response(status=503 if why else 200, text=(why or "ok") + "\n")

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, SETTINGS.bind_address, SETTINGS.health_port).start()
    return runner


async def _serve_metrics(auth: MetricsAuth | None) -> web.AppRunner:
    async def metrics(request: web.Request) -> web.Response:
        if auth is not None:
            code = await auth.check(request.headers.get("Authorization", ""))
            if code != 200:
                return web.Response(status=code, text={401: "a bearer token is required\n", 403: (
                    "this user may not get /metrics (bind the metrics-reader ClusterRole)\n")}.get(code, "retry\n"))
        # The render runs on the event loop (95 ms at 10,000 Flows, bench_scale): with auth on, only
        # a user allowed /metrics can make the operator spend it; refusals are cached verdicts.
        # Per-flow series from the leader only: Prometheus scrapes every replica, and a flow seen by
        # two of them would be counted twice by any sum. Followers keep theirs current, unexported.
        flows = FLOW_METRICS.render() if CONTROLLER.leading else ""
        body = flows.encode() + generate_latest(selfmetrics.REGISTRY)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, SETTINGS.bind_address, SETTINGS.metrics_port)
    await site.start()
    log.info("serving /metrics on %s:%s", SETTINGS.bind_address, SETTINGS.metrics_port)
    return runner


@kopf.on.login()
async def login(memo: kopf.Memo, **kwargs: Any) -> kopf.ConnectionInfo | None:
    info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
    if info is None:
        return None
    runtime: Runtime = memo.runtime  # kopf logs in only after the startup handlers are done
    old = runtime.kube
    kube = Kube(info)
    runtime.kube = kube
    review = await kube.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
    runtime.username = review.get("status", {}).get("userInfo", {}).get("username", "")
    if runtime.ca_bundle is not None:
        await webhook.install_ca_bundle(kube, SETTINGS.webhook_configuration, runtime.ca_bundle)
        runtime.ca_installed = True
    CONTROLLER.attach(kube)
    if old is not None:
        await old.close()
        return info
    # The first login: the watches start (every replica keeps its caches warm), then reconciling.
    runtime.watches = [asyncio.create_task(informer.run())
                       for informer in CONTROLLER.informers(lambda: runtime.kube, SETTINGS.watch_namespaces)]
    if SETTINGS.leader_election:
        runtime.elector = LeaderElector(lambda: runtime.kube, _lease_config())
        CONTROLLER.fence = runtime.elector.still_leading
        runtime.leadership = asyncio.create_task(_lead(runtime.elector))
    else:
        CONTROLLER.start()
    return info


def _lease_namespace() -> str:
    if SETTINGS.leader_election_namespace:
        return SETTINGS.leader_election_namespace
    sa_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
    return sa_ns.read_text().strip() if sa_ns.exists() else "default"


def _lease_config() -> LeaseConfig:
    # The pod's name: a container restarted in the same pod takes its own Lease back at once.
    return LeaseConfig(namespace=_lease_namespace(), name=SETTINGS.leader_election_lease,
                       identity=socket.gethostname(),
                       lease_duration=SETTINGS.leader_election_lease_duration_seconds,
                       renew_deadline=SETTINGS.leader_election_renew_deadline_seconds,
                       retry_period=SETTINGS.leader_election_retry_period_seconds)


async def _lead(elector: LeaderElector) -> None:
    """Follow until the Lease is ours, reconcile while it stays ours; once it is lost, stop
    reconciling at once and end the process (SIGTERM: kopf shuts down cleanly, the kubelet starts
    the container again and it follows), as controller-runtime does."""
    global LOST_LEADERSHIP
    try:
        await elector.acquire()
        CONTROLLER.start()
        await elector.hold()
        log.error("leadership lost: stopping the operator")
    except Exception:
        log.exception("leader election failed: stopping the operator")
    await CONTROLLER.stop()
    LOST_LEADERSHIP = True
    os.kill(os.getpid(), signal.SIGTERM)


def _by_operator(userinfo: kopf.UserInfo, memo: kopf.Memo) -> bool:
    runtime = _runtime(memo)
    return runtime is not None and bool(runtime.username) and userinfo.get("username") == runtime.username


if SETTINGS.webhook_enabled:
    # The webhook configurations come from the chart, which sets the failure policies (documented
    # there): Flow writes fail closed, feedback fails open and the operator then refuses bad answers
    # asynchronously. The status handlers are async: pure checks on the answer's hot path, no thread hop.

    @kopf.on.validate(c.GROUP, c.VERSION, c.PLURAL, id="validate-flows", operations=["CREATE", "UPDATE"],
                      side_effects=False)
    def validate_flow(*, spec: kopf.Spec, **_: Any) -> None:
        problem = (limits.spec_problem(spec) or "; ".join(resources.pod_policy_problems(dict(spec), SETTINGS))
                   or webhook.definition_problem(spec, SETTINGS.validator_url))
        if problem:
            raise kopf.AdmissionError(problem, code=422)

    @kopf.on.validate(c.GROUP, c.VERSION, c.PLURAL, id="validate-flows-status", subresource="status",
                      operations=["UPDATE"], side_effects=False)
    async def validate_status(*, userinfo: kopf.UserInfo, memo: kopf.Memo, **kwargs: Any) -> None:
        problem = webhook.review_status_write(kwargs.get("old"), kwargs.get("new"),
                                              by_operator=_by_operator(userinfo, memo),
                                              username=str(userinfo.get("username", "")))
        if problem:
            raise kopf.AdmissionError(problem, code=422)

    @kopf.on.mutate(c.GROUP, c.VERSION, c.PLURAL, id="mutate-flows-status", subresource="status",
                    operations=["UPDATE"], side_effects=False)
    async def record_responder(*, userinfo: kopf.UserInfo, patch: kopf.Patch, memo: kopf.Memo,
                               **kwargs: Any) -> None:
        if _by_operator(userinfo, memo):
            return
        new, old = (kwargs.get("new") or {}).get("status"), (kwargs.get("old") or {}).get("status")
        user = userinfo.get("username", "")
        status: dict[str, Any] = {}
        resp = webhook.inbox_response(new)
        if resp is not None and resp != webhook.inbox_response(old):
            status["feedback"] = {"response": {**resp, "respondedBy": user}}
        message = webhook.inbox(new, webhook.MESSAGE_INBOX)
        if message is not None and message != webhook.inbox(old, webhook.MESSAGE_INBOX):
            status["conversation"] = {"inbox": {**message, "sentBy": user}}
        if status:
            patch["status"] = status


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    runtime = _runtime(memo)
    if runtime is not None and runtime.leadership is not None:
        runtime.leadership.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await runtime.leadership
    await CONTROLLER.stop()  # no status write after the Lease is given up
    if runtime is None:
        return
    for task in runtime.watches:
        task.cancel()
    await asyncio.gather(*runtime.watches, return_exceptions=True)
    if runtime.elector is not None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                await runtime.elector.release()  # the other replica takes over at its next try
    kube, runtime.kube = runtime.kube, None
    if kube is not None:
        await kube.close()
    for runner in (runtime.metrics_runner, runtime.state_runner, runtime.health_runner):
        if runner is not None:
            await runner.cleanup()
    runtime.metrics_runner = runtime.state_runner = runtime.health_runner = None
