"""Notifications, the sending: the leader's delivery queue, the Secrets it reads, and the HTTP client
that will only call where the destination policy allows. What to send and how it is recorded is
`notify`'s (pure); the controller offers each Flow it reconciles and folds the outcomes into status,
and the quota service does the same for each FlowQuota (through `QuotaNotices`): one queue, one set
of bounds, one delivery loop for both kinds, each delivery keyed by its owner (kind, namespace, name).

A delivery never holds up a reconcile: each (owner, sink, event) is a task of its own, bounded by a
limit on deliveries in flight and a smaller one per receiver (host and port), so a receiver that hangs
holds only its own slots. Each attempt has a deadline; 5xx, 408, 429, timeouts and connection errors
are tried again after 1, 2, 4 ... 60 s until ``notifications_retry_seconds`` have passed.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import functools
import http
import logging
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple
from urllib.parse import urlsplit

import aiohttp
from aiohttp.abc import ResolveResult

from flowkube_api import constants as c
from flowkube_api import traces
from flowkube_api.base import now as now_utc
from flowkube_api.traces import SpanRecord
from flowkube_operator import selfmetrics
from flowkube_operator.kube.client import Kube, ns_path
from flowkube_operator.kube.informer import Informer
from flowkube_operator.notify import bodies, notices, policy
from flowkube_operator.notify.notices import Notice, Outcome, SecretView, Sink
from flowkube_operator.notify.policy import Policy
from flowkube_operator.settings import Settings

Body = dict[str, Any]
Key = tuple[str, str]
Owner = tuple[str, str, str]  # (kind, namespace, name): whose events, a Flow's or a FlowQuota's
Job = tuple[str, str]  # (sink, event id)
log = logging.getLogger("flowkube.notifier")

# The objects that say which addresses are the cluster's own: (collection, apiVersion, kind).
CLUSTER_KINDS = (("/apis/networking.k8s.io/v1/servicecidrs", "networking.k8s.io/v1", "ServiceCIDR"),
                 ("/api/v1/nodes", "v1", "Node"))


class RefusedError(Exception):
    """The destination policy refuses an address a receiver's URL leads to."""


class Attempt(NamedTuple):
    code: int | None
    reason: str
    message: str
    again: bool
    asked: float = 0.0  # seconds the receiver asked to wait (Retry-After)


class UndeliverableError(Exception):
    """The sink cannot be sent to as it is: ``again`` when that may change (a Secret not there yet)."""

    def __init__(self, reason: str, message: str, again: bool = False) -> None:
        super().__init__(message)
        self.reason, self.message, self.again = reason, message, again


class PolicyConnector(aiohttp.TCPConnector):
    """A connector that checks every address it is about to connect to, the one place the destination
    policy is applied: resolved names (cached or not, so a name that resolves differently later is
    checked again) and IP literals, which aiohttp hands back without resolving, after yarl has
    normalised forms such as full-width digits or ideographic dots that ``urlsplit`` does not see as an
    address."""

    def __init__(self, policy: Callable[[], Policy], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._policy = policy

    async def _resolve_host(self, host: str, port: int, traces: Any = None) -> list[ResolveResult]:
        found: list[ResolveResult] = await super()._resolve_host(host, port, traces)
        for r in found:
            why = self._policy().refusal(r["host"])
            if why:
                raise RefusedError(why if r["host"] == host else f"{host} resolves to {why}")
        return found


class Secrets:
    """The Secrets labelled flowkube.io/notifications, by namespace, as kept (`notices.project`: the
    bounded values a sink can use, made as each event comes in; the rest of the object is dropped at
    once). A reconcile looks at its own namespace's only. At most notices.SECRETS_PER_NAMESPACE are kept
    per namespace; the others are markers of their name (`notices.crowded`)."""

    def __init__(self, changed: Callable[[str], None] = lambda _ns: None) -> None:
        self.by_namespace: dict[str, dict[str, SecretView]] = {}
        self._kept: dict[str, int] = {}  # per namespace: how many are kept (not markers)
        self.changed = changed  # told the namespace of every change: its Flows may have sinks to serve now

    def get(self, namespace: str, name: str) -> SecretView | None:
        return self.by_namespace.get(namespace, {}).get(name)

    def event(self, etype: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        label = (meta.get("labels") or {}).get(c.LABEL_NOTIFICATIONS)
        here = self.by_namespace.setdefault(ns, {})
        was = here.pop(name, None)
        if was is not None and not was.refused:
            self._kept[ns] -= 1
        if etype == "DELETED" or label is None:
            if not here:
                self.by_namespace.pop(ns, None)
                self._kept.pop(ns, None)
            return
        if self._kept.get(ns, 0) >= notices.SECRETS_PER_NAMESPACE:
            view = notices.crowded(ns, name)
            log.warning("%s", view.refused)
        else:
            data = body.get("data")
            view = notices.project(name, str(label), data if isinstance(data, dict) else {})
            self._kept[ns] = self._kept.get(ns, 0) + 1
            if view.oversized:
                log.warning("notification Secret %s/%s: keys %s are over their bounds and not kept", ns, name,
                            ", ".join(sorted(view.oversized)))
            if label == c.NOTIFICATION_DEFAULTS and view.default is None:
                log.warning("notification defaults Secret %s/%s names an unknown format or event; ignored", ns, name)
        here[name] = view
        self.changed(ns)

    def defaults(self, namespace: str) -> list[Sink]:
        """The namespace's default sinks: the first NOTIFICATION_SINKS_LIMIT by name (each adds a record
        to every Flow's status, which must stay small)."""
        found = sorted((v.default for v in self.by_namespace.get(namespace, {}).values() if v.default is not None),
                       key=lambda s: s.name)
        return found[:c.NOTIFICATION_SINKS_LIMIT]


def _phrase(code: int) -> str:
    """The standard reason phrase of an HTTP status (the receiver's own words are not kept)."""
    try:
        return http.HTTPStatus(code).phrase
    except ValueError:
        return "(no standard reason)"


@dataclass(frozen=True)
class Kind:
    """What the notifier asks of a kind whose objects hold events (Flows, FlowQuotas)."""

    wake: Callable[[Key], None]  # a delivery of this object ended: fold it into its status
    current: Callable[[Key], Body | None]  # the object as known now, to drop a retry of an event that is over
    notices: Callable[[Body], list[Notice]]  # the events it holds


def _span(sink: Sink, notice: Notice, outcome: Outcome, began: dt.datetime) -> SpanRecord:
    """A Flow's delivery as a span of its trace: every attempt, from the first to the outcome."""
    uid = notice.id.split("/", 1)[0]
    attributes: dict[str, traces.Value] = {
        "k8s.namespace.name": notice.namespace, "flowkube.flow.name": notice.name,
        "flowkube.notification.sink": sink.name, "flowkube.notification.event": str(notice.type),
        "flowkube.notification.outcome": outcome.reason, "flowkube.notification.attempts": outcome.attempts}
    if outcome.code is not None:
        attributes["http.response.status_code"] = outcome.code
    return SpanRecord(f"deliver {notice.type} {sink.name}", traces.trace_id(uid),
                      traces.span_id(uid, "notify", sink.name, notice.id), traces.root_span_id(uid), began,
                      outcome.time, attributes, error=None if outcome.delivered else outcome.message or outcome.reason)


class Notifier:
    """The leader's deliveries. ``wake(key)`` asks for a reconcile of the Flow whose delivery ended,
    ``wake_quota(key)`` for a status write of the FlowQuota's (each folds the outcome into status, see
    `take` and `recorded`)."""

    def __init__(self, settings: Settings, wake: Callable[[Key], None], *,
                 wake_namespace: Callable[[str], None] = lambda _ns: None,
                 flow_of: Callable[[Key], Body | None] = lambda _key: None,
                 wake_quota: Callable[[Key], None] = lambda _key: None,
                 quota_of: Callable[[Key], Body | None] = lambda _key: None,
                 spans: Callable[[list[SpanRecord]], None] | None = None) -> None:
        self.settings = settings
        self.spans = spans  # tracing on: each Flow's delivery, a span of its trace
        self.kinds = {c.KIND: Kind(wake, flow_of, notices.notices),
                      c.QUOTA_KIND: Kind(wake_quota, quota_of, notices.quota_notices)}
        self.secrets = Secrets(changed=wake_namespace)
        self._informers: list[Informer] = []
        self.learned = asyncio.Event()  # the cluster's ranges are in the policy (or could not be read)
        self._configured = Policy.of(settings.notifications_allowed_cidrs, settings.notifications_denied_cidrs)
        self.policy = self._configured  # and the cluster's own ranges (learn_cluster)
        self._ranges: dict[tuple[str, str], tuple[str, ...]] = {}  # (kind, name) -> what it says to deny
        self._stale: list[str] = []  # the last term's, denied until this term's lists are in
        self._kube: Callable[[], Kube | None] | None = None  # the client of the latest login
        self._tasks: dict[tuple[Owner, Job], asyncio.Task[None]] = {}
        self._done: dict[Owner, dict[Job, Outcome]] = {}  # ended, not yet in status
        self._slots = asyncio.Semaphore(settings.notifications_max_in_flight)
        self._per_host: dict[str, asyncio.Semaphore] = {}
        self._per_namespace: dict[str, asyncio.Semaphore] = {}
        self._session: aiohttp.ClientSession | None = None

    async def learn_cluster(self, kube: Kube) -> None:
        """Deny the cluster's own addresses too, where the API tells them, kept current while this
        replica leads (a watch, not one read: nodes come and go): its ServiceCIDRs, its nodes' pod CIDRs
        and their InternalIP and ExternalIP addresses (NodePorts and kubelets listen there; the default
        denied ranges cover private ones, these may be public). A kind the operator may not read (the
        chart grants list and watch; a namespaced install may not) leaves the configured ranges."""
        latest = self._kube or (lambda: kube)
        # Leading again: what the last term learned stays denied until these lists are in (a node
        # gone meanwhile is then forgotten; one still there is denied throughout).
        self._stale, self._ranges = self._denied_now(), {}
        informers: list[Informer] = []
        tasks: list[asyncio.Task[None]] = []
        try:
            for path, version, kind in CLUSTER_KINDS:
                try:
                    await kube.request("GET", path, params={"limit": "1"})
                except Exception as e:  # forbidden, or an API server without ServiceCIDRs: not fatal
                    log.info("notifications: cannot read %s (%s); the configured ranges are denied", path, e)
                    continue
                informers.append(Informer(latest, path, version, kind, functools.partial(self._cluster_event, kind)))
            tasks = [asyncio.create_task(i.run()) for i in informers]
            for i in informers:
                await i.synced.wait()
            self._stale = []
            self.policy = self._configured.denying(self._denied_now())
            self.learned.set()
            log.info("notifications: %d of the cluster's ranges and addresses are denied too", len(self._denied_now()))
            await asyncio.gather(*tasks)
        finally:
            self.learned.set()
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _cluster_event(self, kind: str, etype: str, obj: Body) -> None:
        key = (kind, (obj.get("metadata") or {}).get("name", ""))
        ranges = () if etype == "DELETED" else tuple(sorted(set(policy.cluster_ranges(kind, obj))))
        if self._ranges.get(key, ()) == ranges:
            return  # a node's heartbeat, its images: nothing denied changed
        if ranges:
            self._ranges[key] = ranges
        else:
            self._ranges.pop(key, None)
        self.policy = self._configured.denying(self._denied_now() + self._stale)
        if self.learned.is_set():
            log.info("notifications: %s %s %s; %d of the cluster's ranges and addresses denied", kind, key[1],
                     etype.lower(), len(self._denied_now()))

    def _denied_now(self) -> list[str]:
        return sorted({r for rs in self._ranges.values() for r in rs})

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        self._kube = kube
        self._informers = [Informer(kube, ns_path(ns, "secrets") if ns else "/api/v1/secrets", "v1", "Secret",
                                    self.secrets.event, label_selector=c.LABEL_NOTIFICATIONS)
                           for ns in namespaces or [""]]
        return self._informers

    def ready(self) -> bool:
        """Nothing is offered before the Secrets are listed and the cluster's ranges known: a Flow looked
        at earlier would miss its namespace's defaults, or be sent where the policy would refuse."""
        return self.learned.is_set() and all(i.synced.is_set() for i in self._informers)

    async def wait_ready(self) -> None:
        await self.learned.wait()
        for i in self._informers:
            await i.synced.wait()

    # -- what the controller and the quota service call ---------------------------------------------

    def offer(self, key: Key, flow: Body) -> None:
        """Start a delivery for every (sink, event) of the Flow that is not handled in its status, not
        under way, and not ended and waiting to be recorded. Its sinks: its own and its namespace's
        defaults."""
        if not self.ready():
            return  # every Flow is offered again once it is (Controller._offer_when_ready)
        sinks = notices.sinks_of(flow.get("spec") or {}, self.secrets.defaults(key[0]))
        self._offer((c.KIND, *key), flow, sinks, notices.notices(flow, self.settings.console_url) if sinks else [])

    def offer_quota(self, key: Key, quota: Body) -> None:
        """`offer` for a FlowQuota: its events go to its namespace's default sinks only (a ClusterFlowQuota,
        of no namespace, has none)."""
        if not self.ready() or not key[0]:
            return  # every quota is offered again once it is (Quotas' loop)
        sinks = self.secrets.defaults(key[0])
        self._offer((c.QUOTA_KIND, *key), quota, sinks,
                    notices.quota_notices(quota, self.settings.console_url) if sinks else [])

    def _offer(self, owner: Owner, obj: Body, sinks: list[Sink], found: list[Notice]) -> None:
        done = self._done.get(owner, {})
        for sink, notice in notices.pending(obj, sinks, found):
            job = (sink.name, notice.id)
            if (owner, job) in self._tasks or job in done:
                continue
            task = asyncio.create_task(self._deliver(owner, sink, notice))
            self._tasks[(owner, job)] = task
            task.add_done_callback(functools.partial(self._ended, (owner, job)))

    def _ended(self, job: tuple[Owner, Job], _task: asyncio.Task[None]) -> None:
        self._tasks.pop(job, None)

    def take(self, key: Key, kind: str = c.KIND) -> list[Outcome]:
        """The deliveries of the object (a Flow, unless ``kind`` says) that ended and are not in its
        status yet."""
        return list(self._done.get((kind, *key), {}).values())

    def recorded(self, key: Key, outcomes: list[Outcome], kind: str = c.KIND) -> None:
        """These outcomes are in the object's status now (or the object is gone)."""
        owner = (kind, *key)
        done = self._done.get(owner)
        if done is None:
            return
        for o in outcomes:
            if done.get((o.sink, o.notice_id)) is o:
                del done[(o.sink, o.notice_id)]
        if not done:
            del self._done[owner]

    async def stop(self) -> None:
        """No longer the leader: every delivery under way stops (the next leader sends what its status
        does not record), and what ended unrecorded is forgotten for the same reason."""
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._done.clear()

    async def close(self) -> None:
        await self.stop()
        if self._session is not None:
            await self._session.close()
            self._session = None

    # -- one delivery -------------------------------------------------------------------------------

    async def _deliver(self, owner: Owner, sink: Sink, notice: Notice) -> None:
        started, attempts, began = time.monotonic(), 0, now_utc()
        payload, content_type = bodies.body(sink, notice)
        while True:
            attempts += 1
            code, reason, message, again, asked = await self._attempt(owner[1], sink, notice, payload, content_type)
            wait = max(notices.backoff(attempts), asked)
            if again and time.monotonic() - started + wait <= self.settings.notifications_retry_seconds:
                log.info("notification %s to %s %s/%s sink %s: %s (attempt %d); trying again in %.0fs",
                         notice.type, *owner, sink.name, message, attempts, wait)
                await asyncio.sleep(wait)  # the backoff itself, not a wait for a condition
                if not self._still_current(owner, notice):
                    log.info("notification %s to %s %s/%s sink %s dropped: the event is over (or its object gone)",
                             notice.type, *owner, sink.name)
                    return
                continue
            if again:
                reason = "GaveUp"
            break
        delivered = reason == "Delivered"
        outcome = Outcome(sink.name, notice.id, notice.type, delivered, reason, attempts, now_utc(), code, message)
        selfmetrics.NOTIFICATIONS.labels(reason).inc()
        if delivered and notice.time is not None:
            selfmetrics.NOTIFICATION_SECONDS.labels(str(notice.type)).observe(
                max(0.0, (outcome.time - notice.time).total_seconds()))
        elif not delivered:
            log.warning("notification %s to %s %s/%s sink %s failed: %s after %d attempt(s): %s",
                        notice.type, *owner, sink.name, reason, attempts, message)
        self._done.setdefault(owner, {})[(sink.name, notice.id)] = outcome
        if self.spans is not None and owner[0] == c.KIND:
            self.spans([_span(sink, notice, outcome, began)])
        self.kinds[owner[0]].wake((owner[1], owner[2]))

    def _still_current(self, owner: Owner, notice: Notice) -> bool:
        kind = self.kinds[owner[0]]
        obj = kind.current((owner[1], owner[2]))
        if obj is None or not notices.of_object(notice.id, obj):
            return False
        return any(n.id == notice.id for n in kind.notices(obj))

    async def _attempt(self, namespace: str, sink: Sink, notice: Notice, payload: bytes,
                       content_type: str) -> Attempt:
        """One POST: the HTTP status (None: no answer), the reason, a message, whether to try again, and
        how long the receiver asked to be left alone (Retry-After in seconds, at most the backoff cap)."""
        try:
            url, secret, tls, hostport = self._target(namespace, sink)
        except UndeliverableError as e:
            return Attempt(None, e.reason, e.message, e.again)
        headers = {"Content-Type": content_type, "User-Agent": "flowkube-operator",
                   bodies.EVENT_ID_HEADER: notice.id}
        key = secret.data.get(sink.signing_key_key)
        if key:
            headers[bodies.SIGNATURE_HEADER] = bodies.sign(key, payload, int(time.time()))
        per_host = self._per_host.setdefault(hostport, asyncio.Semaphore(self.settings.notifications_per_host))
        per_ns = self._per_namespace.setdefault(namespace, asyncio.Semaphore(self.settings.notifications_per_namespace))
        try:
            # Narrowest first: a delivery waiting for a slow receiver's slot holds nothing its namespace
            # or the others need.
            async with per_host, per_ns, self._slots:
                return await self._post(url, payload, headers, tls)
        finally:
            for table, name, sem in ((self._per_host, hostport, per_host), (self._per_namespace, namespace, per_ns)):
                if not sem.locked() and not getattr(sem, "_waiters", None) and table.get(name) is sem:
                    del table[name]  # nobody holds or waits for it: not kept for every host ever seen

    async def _post(self, url: str, payload: bytes, headers: dict[str, str], tls: ssl.SSLContext | bool) -> Attempt:
        """One POST. The answer's body is never read: what goes into status is the code and a fixed
        reason, so a receiver (an internal service a tenant points a sink at) cannot be read back."""
        try:
            async with self._client().post(url, data=payload, headers=headers, ssl=tls,
                                           allow_redirects=False) as resp:
                code, asked = resp.status, notices.retry_after(resp.headers.get("Retry-After"))
                resp.close()  # its body is not read
        except RefusedError as e:
            return Attempt(None, "Refused", str(e), False)
        except aiohttp.InvalidURL as e:
            # The client refuses the URL itself (e.g. a numeric host `_target` did not catch): the
            # Secret's mistake, which no retry mends.
            return Attempt(None, "Misconfigured", f"the HTTP client refuses the Secret's URL ({type(e).__name__})",
                           False)
        except (aiohttp.ClientResponseError, aiohttp.ClientPayloadError) as e:
            # Their text can quote the receiver's bytes (an answer that is not HTTP): the type only.
            return Attempt(None, "Unreachable", f"{type(e).__name__}: the answer is not HTTP as expected", True)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as e:
            # An error's text may quote the URL (a Secret's value): it is cut out.
            text = f"{type(e).__name__}: {e}".replace(url, "<the Secret's URL>")
            return Attempt(None, "Unreachable", text[:notices.MESSAGE_LIMIT], True)
        if 200 <= code < 300:
            return Attempt(code, "Delivered", f"{code}", False)
        if 300 <= code < 400:
            return Attempt(code, "Rejected", f"{code}: redirects are not followed", False)
        return Attempt(code, "Rejected", f"{code} {_phrase(code)}", notices.retryable(code), asked)

    def _target(self, namespace: str, sink: Sink) -> tuple[str, SecretView, ssl.SSLContext | bool, str]:
        """(URL, Secret, TLS, host:port) of the sink, or UndeliverableError. The URL itself is never
        repeated in a message: a Secret's value stays out of status and Events. (Where it may connect is
        the connector's check, PolicyConnector.)"""
        secret = self.secrets.get(namespace, sink.secret)
        if secret is None:
            raise UndeliverableError("Misconfigured", f"no Secret {sink.secret} labelled {c.LABEL_NOTIFICATIONS} "
                                     f"in namespace {namespace}", again=True)
        for key in (sink.url_key, sink.signing_key_key, sink.ca_key):
            why = secret.problem(sink.secret, key)
            if why:
                raise UndeliverableError("Misconfigured", why)
        raw_url = secret.data.get(sink.url_key)
        if not raw_url:
            raise UndeliverableError("Misconfigured", secret.missing(sink.secret, sink.url_key), again=True)
        if len(raw_url) > notices.VALUE_BYTES or len(secret.data.get(sink.signing_key_key, b"")) > notices.VALUE_BYTES:
            raise UndeliverableError("Misconfigured", f"key {sink.url_key} or {sink.signing_key_key} of Secret "
                                     f"{sink.secret} is over {notices.VALUE_BYTES} bytes")
        url = raw_url.decode(errors="replace").strip()
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            parts, port = urlsplit(""), 0
        if (parts.scheme not in ("http", "https") or not parts.hostname or any(ch.isspace() for ch in url)
                or not parts.hostname.isascii()):
            raise UndeliverableError("Misconfigured", f"key {sink.url_key} of Secret {sink.secret} is not an "
                                     "http(s) URL with an ASCII host name")
        numeric = policy.numeric_host_problem(parts.hostname)
        if numeric:
            raise UndeliverableError("Misconfigured", f"the host of key {sink.url_key} of Secret {sink.secret} "
                                     f"{numeric}")
        tls: ssl.SSLContext | bool = True
        ca = secret.data.get(sink.ca_key)
        if ca and parts.scheme == "https":
            try:
                tls = ssl.create_default_context(cadata=ca.decode(errors="replace"))
            except (ssl.SSLError, ValueError) as e:
                raise UndeliverableError("Misconfigured", f"key {sink.ca_key} of Secret {sink.secret} is no PEM "
                                         f"CA: {e}") from e
        return url, secret, tls, f"{parts.hostname}:{port}"

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            connector = PolicyConnector(lambda: self.policy, limit=0, ttl_dns_cache=10)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=self.settings.notifications_timeout_seconds),
                trust_env=False)
        return self._session


class QuotaNotices:
    """The notifier as the quota service uses it (its `quotas.service.Notices`; app.py wires the two,
    so that quotas never import notify): the same deliveries as the Flows', keyed by the FlowQuota."""

    def __init__(self, notifier: Notifier) -> None:
        self.notifier = notifier

    def ready(self) -> bool:
        return self.notifier.ready()

    def announce(self, key: Key, quota: Body) -> None:
        self.notifier.offer_quota(key, quota)

    def take(self, key: Key) -> list[Outcome]:
        return self.notifier.take(key, c.QUOTA_KIND)

    def fold(self, quota: Body, ended: list[Outcome]) -> list[tuple[str, str, str]]:
        return notices.record_quota(quota, ended)

    def recorded(self, key: Key, ended: list[Outcome]) -> None:
        self.notifier.recorded(key, ended, c.QUOTA_KIND)
