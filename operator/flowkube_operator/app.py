"""The composition root: every long-lived object of the operator, built here and passed in.

Read this file to see the whole operator at once:

- `Settings` (FLOWKUBE_* environment) and the serving TLS (`prepare_tls`, before anything serves);
- `FlowMetrics`, which listens to the `Controller`'s Flow cache;
- the `ElectionThread` (when leader election is on): the Lease's elector on a thread of its own,
  whose `still_leading` fences every write;
- the `Controller`: two watches (informer.py) feed its caches, a queue feeds its workers, each
  worker plans (reconcile) and applies;
- the `StateApi`, the runner pods' only way to their Flow's state, answering from the controller;
- `Quotas` (with quotas enforced): the FlowQuotas' watch and book, the desk the state API reserves
  model calls at, and their status;
- the admission webhook server, `/metrics` and `/healthz` + `/readyz`.

Nothing is wired by assigning callbacks after construction: each object gets what it uses in its
constructor. The API client is the one thing that changes while the process runs (a new login when
credentials expire), so objects that call the API server hold `lambda: app.kube`.

kopf is an adapter around this (handlers.py): it calls `start`, `login`, `stop` and the admission
checks; the operator's logic never imports kopf.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import kopf
from aiohttp import web
from prometheus_client import generate_latest

from flowkube_api import constants as c
from flowkube_operator import selfmetrics
from flowkube_operator.flows.controller import Controller
from flowkube_operator.flows.metrics import FlowMetrics, MetricsSnapshot
from flowkube_operator.kube import tls
from flowkube_operator.kube.client import ApiError, Kube
from flowkube_operator.kube.issuerkeys import IssuerKeys
from flowkube_operator.kube.leader import ElectionThread, LeaseConfig
from flowkube_operator.kube.reviews import MetricsAuth
from flowkube_operator.notify.notifier import Notifier, QuotaNotices
from flowkube_operator.quotas.service import Quotas
from flowkube_operator.serve import webhook
from flowkube_operator.serve.stateapi import StateApi
from flowkube_operator.serve.stateauth import ClientLimits
from flowkube_operator.settings import Settings
from flowkube_operator.templates import cache as templatecache
from flowkube_operator.templates.cache import TemplateKey

if TYPE_CHECKING:
    from flowkube_operator.tracing import Traces

log = logging.getLogger("flowkube.operator")


async def prepare_tls(settings: Settings) -> tls.ServingTLS:
    """The CA (kept across restarts, in FLOWKUBE_TLS_SECRET) and a fresh serving certificate. Runner
    pods are told the CA; the webhook configurations get it as caBundle. Runs before kopf starts, so
    both servers find their files in place."""
    if settings.tls_secret:
        ks = kopf.OperatorSettings()
        info = (kopf.login_with_service_account(logger=log, settings=ks)
                or kopf.login_with_kubeconfig(logger=log, settings=ks))
        if info is None:
            raise RuntimeError("no credentials to read the CA Secret " + settings.tls_secret)
        kube = Kube(info)
        try:
            ca = await tls.ca_from_secret(kube, settings.tls_secret)
        finally:
            await kube.close()
    else:
        if os.environ.get("KUBERNETES_SERVICE_HOST"):
            log.warning("FLOWKUBE_TLS_SECRET is not set: the CA lives in %s and a new pod makes a new one, "
                        "which running runner pods will not trust", settings.webhook_cert_dir)
        ca = tls.ca_from_dir(settings.webhook_cert_dir)
    hosts = [settings.webhook_host, urlsplit(settings.state_endpoint).hostname or ""]
    return tls.issue(ca, settings.webhook_cert_dir, hosts, settings.webhook_service)


def lease_config(settings: Settings) -> LeaseConfig:
    namespace = settings.leader_election_namespace
    if not namespace:
        sa_ns = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        namespace = sa_ns.read_text().strip() if sa_ns.exists() else "default"
    # The pod's name: a container restarted in the same pod takes its own Lease back at once.
    return LeaseConfig(namespace=namespace, name=settings.leader_election_lease,
                       identity=socket.gethostname(),
                       lease_duration=settings.leader_election_lease_duration_seconds,
                       renew_deadline=settings.leader_election_renew_deadline_seconds,
                       retry_period=settings.leader_election_retry_period_seconds)


class App:
    """One operator process. `start` (servers up), `login` (each time kopf logs in), `stop`."""

    def __init__(self, settings: Settings, serving: tls.ServingTLS | None = None) -> None:
        self.settings = settings
        self.serving = serving
        self.kube: Kube | None = None  # the client of the latest login
        self.username = ""  # who the operator is to the API server (its own status writes pass the webhook)
        self.metrics = FlowMetrics(per_flow=settings.metrics_per_flow, label_values=settings.metrics_label_values)
        selfmetrics.TURN_SECONDS.limit(settings.metrics_label_values)
        # Acquires, renews and releases the Lease on its own thread, with its own client of the
        # latest login: a busy event loop here delays no renewal.
        self.election = ElectionThread(lambda: self.kube, lease_config(settings)) if settings.leader_election else None
        # Traces (an OTLP endpoint configured): each Flow's spans, read off the leader's status writes,
        # and its notifications' deliveries.
        self.traces: Traces | None = None
        if settings.traces_url:
            from flowkube_operator.tracing import Traces as _Traces  # the SDK is loaded only when tracing

            self.traces = _Traces(settings.traces_url)
        # Outcomes of deliveries are folded into status by the controller's next reconcile of their Flow,
        # or by the quota service's next status write of their FlowQuota.
        self.notifier = Notifier(
            settings, wake=lambda key: self.controller.notified(key), wake_namespace=self._notification_secrets,
            flow_of=lambda key: self.controller.cache.flow(key),
            wake_quota=lambda key: self.quotas.notified(key) if self.quotas is not None else None,
            quota_of=lambda key: self.quotas.noticed(key) if self.quotas is not None else None,
            spans=self.traces.emit if self.traces is not None else None,
        ) if settings.notifications_enabled else None
        # FlowQuotas (when enforced): fed by their watch and the Flow cache; the leader answers the
        # runner pods' reservations through the state API, writes the quotas' status and tells their
        # namespaces' default sinks when one is exhausted or near (through the same notifier).
        # The desk answers and the status is written only within the lease's renew deadline (the
        # elector's fence, as every Flow write): a replica frozen past it may have a successor already.
        fence = self.election.elector.still_leading if self.election is not None else lambda: True
        self.quotas = Quotas(
            lambda: self.kube, lambda: self.controller.leading and fence(),
            status_seconds=settings.quota_status_seconds, recovery_seconds=settings.quota_recovery_seconds,
            notices=QuotaNotices(self.notifier) if self.notifier is not None else None,
            event=lambda obj, etype, reason, message: self.controller.writes.event(
                obj, etype, reason, message, kind=c.QUOTA_KIND)) if settings.quotas_enabled else None
        self.controller = Controller(
            settings, listeners=[self.metrics.update, *([self.quotas.flow_changed] if self.quotas else [])],
            notifier=self.notifier, fence=fence, spans=self.traces,
            state_ca=serving.ca_pem.decode() if serving is not None else "",
            flow_labels=self.quotas.tracker.label_keys_for if self.quotas else lambda namespace: frozenset(),
            quota_exhausted=self.quotas.exhausted if self.quotas else lambda namespace, flow: None)
        self.state_api = StateApi(
            lambda: self.kube, self.controller.cache, self.controller, issuer=IssuerKeys(lambda: self.kube),
            limits=ClientLimits(settings.state_client_rate, settings.state_client_burst,
                                settings.state_client_authenticating),
            token_reviews=settings.state_token_reviews, quotas=self.quotas)
        self.metrics_auth = MetricsAuth(lambda: self.kube) if settings.metrics_auth else None
        self.webhook_server: webhook.FlowkubeWebhookServer | None = None
        if settings.webhook_enabled and serving is not None:
            self.webhook_server = webhook.FlowkubeWebhookServer(
                addr=settings.bind_address, port=settings.webhook_port, host=settings.webhook_host,
                service=settings.webhook_service, cafile=serving.cafile, certfile=serving.certfile,
                pkeyfile=serving.keyfile, body_seconds=settings.webhook_body_seconds,
                body_budget=settings.webhook_body_budget_mib * 1024 * 1024)
        # Installed into the webhook configurations at each login; nothing to install without webhooks.
        self.ca_installed = self.webhook_server is None
        self.validator = webhook.Validator(settings.validator_url)
        self._servers: list[web.AppRunner] = []
        self.state_serving = False
        self._leadership: asyncio.Task[None] | None = None  # acquires, then holds the Lease
        self._watches: list[asyncio.Task[None]] = []  # the informers feeding the caches
        self.lost_leadership = False  # the process stops because it lost the Lease: exit non-zero

    def _notification_secrets(self, namespace: str) -> None:
        """A notification Secret of the namespace changed: its Flows and FlowQuotas may have sinks to
        serve now."""
        self.controller.requeue_namespace(namespace)
        if self.quotas is not None:
            self.quotas.defaults_changed(namespace)

    # -- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Serve the state API, /metrics and the health endpoints (the webhook server is kopf's)."""
        s = self.settings
        if self.serving is None:
            raise RuntimeError("prepare_tls first: the state API serves TLS")
        self._servers.append(await self.state_api.serve(s.bind_address, s.state_port,
                                                        self.serving.certfile, self.serving.keyfile))
        self.state_serving = True
        if s.metrics_port:
            self._servers.append(await _serve(self._metrics_app(), s.bind_address, s.metrics_port))
            log.info("serving /metrics on %s:%s", s.bind_address, s.metrics_port)
        if s.health_port:
            self._servers.append(await _serve(self._health_app(), s.bind_address, s.health_port))

    async def login(self, kube: Kube) -> None:
        """A new API client (the first login, or a new one when credentials expire)."""
        old, self.kube = self.kube, kube
        review = await kube.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews",
                                    {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        self.username = review.get("status", {}).get("userInfo", {}).get("username", "")
        if self.webhook_server is not None and self.serving is not None:
            await webhook.install_ca_bundle(kube, self.settings.webhook_configuration, self.serving.ca_pem)
            self.ca_installed = True
        self.controller.attach(kube)
        if old is not None:
            await old.close()
            return
        # The first login: the watches start (every replica keeps its caches warm), then reconciling.
        informers = self.controller.informers(lambda: self.kube, self.settings.watch_namespaces)
        if self.quotas is not None:
            informers += self.quotas.informers(lambda: self.kube, self.settings.watch_namespaces)
            # The desk answers no reservation before every watch has listed: a quota not seen yet
            # would let a call through unreserved.
            listed = list(informers)
            self.quotas.listed = lambda: all(i.synced.is_set() for i in listed)
        self._watches = [asyncio.create_task(informer.run()) for informer in informers]
        if self.quotas is not None:
            self._watches.append(asyncio.create_task(self.quotas.run()))
        if self.election is not None:
            self._leadership = asyncio.create_task(self._lead(self.election))
        else:
            self.controller.start()

    async def _lead(self, election: ElectionThread) -> None:
        """Follow until the Lease is ours, reconcile while it stays ours; once it is lost, stop
        reconciling at once and end the process (SIGTERM: kopf shuts down cleanly, the kubelet starts
        the container again and it follows), as controller-runtime does."""
        try:
            await election.acquire()
            self.controller.start()
            await election.hold()
            log.error("leadership lost: stopping the operator")
        except Exception:
            log.exception("leader election failed: stopping the operator")
        await self.controller.stop()
        self.lost_leadership = True
        os.kill(os.getpid(), signal.SIGTERM)

    async def stop(self) -> None:
        if self._leadership is not None:
            self._leadership.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._leadership
        await self.controller.stop()  # no status write after the Lease is given up
        for task in self._watches:
            task.cancel()
        await asyncio.gather(*self._watches, return_exceptions=True)
        if self.election is not None:
            if self.kube is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(3):
                        await self.election.release()  # the other replica takes over at its next try
            await self.election.close()
        kube, self.kube = self.kube, None
        if kube is not None:
            await kube.close()
        await self.validator.close()
        if self.notifier is not None:
            await self.notifier.close()
        if self.traces is not None:
            await asyncio.to_thread(self.traces.close)  # the last spans, within its deadline
        for runner in self._servers:
            await runner.cleanup()
        self._servers.clear()
        self.state_serving = False

    # -- what the servers answer ---------------------------------------------------------------------

    def not_ready(self) -> str:
        """Why this replica must not get traffic yet ("" once it may): the API server calls its
        webhooks and runner pods its state API as soon as its pod is Ready, so Ready waits for the
        CA in the webhook configurations and the webhook server listening, not just for the process."""
        if self.kube is None or not self.ca_installed:
            return "not logged in to the API server yet (the CA is not in the webhook configurations)"
        if self.webhook_server is not None and not self.webhook_server.listening:
            return "the admission webhook server is not listening yet"
        if not self.state_serving:
            return "the state API is not serving"
        return ""

    async def template(self, key: TemplateKey) -> dict[str, Any] | None:
        """A template for the admission webhook: from the cache, else from the API server (one
        created a moment before the Flow may not have reached the cache yet)."""
        found = await self.controller.templates.resolve(key)
        if found is None and self.kube is not None:
            found = await templatecache.fetch(self.kube, key)
        return found

    async def taken_template(self, namespace: str, taken: Mapping[str, Any]) -> dict[str, Any] | None:
        """The template spec a Flow took (the snapshot its status.template names), for the admission
        webhook: through the controller's LRU; None when it cannot be read (gone, not what was taken,
        or the API server does not answer)."""
        if self.kube is None:
            return None
        try:
            spec, _ = await self.controller.snapshots.load(namespace, taken)
        except ApiError:
            return None
        return spec

    def by_operator(self, username: str) -> bool:
        """Is this write the operator's own (its status writes pass the status webhook too)?"""
        return bool(self.username) and username == self.username

    def _health_app(self) -> web.Application:
        """/healthz (liveness: the event loop answers) and /readyz (readiness: `not_ready`)."""
        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text="ok\n")

        async def readyz(_: web.Request) -> web.Response:
            why = self.not_ready()
            return web.Response(status=503 if why else 200, text=(why or "ok") + "\n")

        app = web.Application()
        app.router.add_get("/healthz", healthz)
        app.router.add_get("/readyz", readyz)
        return app

    def _metrics_app(self) -> web.Application:
        auth = self.metrics_auth
        render_one = asyncio.Lock()

        async def metrics(request: web.Request) -> web.Response:
            if auth is not None:
                code = await auth.check(request.headers.get("Authorization", ""))
                if code != 200:
                    return web.Response(status=code, text={401: "a bearer token is required\n", 403: (
                        "this user may not get /metrics (bind the metrics-reader ClusterRole)\n")}.get(code, "retry\n"))
            # Per-flow series from the leader only: Prometheus scrapes every replica, and a flow seen by
            # two of them would be counted twice by any sum. Followers keep theirs current, unexported.
            # The snapshot is taken here, on the event loop that updates the metrics (under a ms at
            # 10,000 Flows); the render (about 60 ms there) runs in a thread, one scrape at a time, so
            # the loop that reconciles waits for neither (with auth on, only a user allowed
            # /metrics can make the operator spend it; refusals are cached verdicts).
            async with render_one:
                snapshot = self.metrics.snapshot() if self.controller.leading else None
                quotas = self.quotas.metrics_text() if self.quotas is not None and self.controller.leading else ""
                body = await asyncio.to_thread(_exposition, snapshot) + quotas.encode()
            return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app


def _exposition(flows: MetricsSnapshot | None) -> bytes:
    """The /metrics body, made in a thread: the flows' snapshot and the operator's own registry
    (prometheus_client's collectors lock for themselves)."""
    return (flows.render().encode() if flows is not None else b"") + generate_latest(selfmetrics.REGISTRY)


async def _serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
