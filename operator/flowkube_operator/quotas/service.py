"""The operator's FlowQuotas (issue 41): their watch, the Flows' side (heard from the Flow cache), the
desk runner pods reserve at through the state API, and the status each quota shows.

Every replica keeps the book warm (the same watches feed it); only the leader answers reservations
(a follower says 503, and the pod asks again, reaching the leader) and writes status. What a quota
shows is written at most once per ``quota_status_seconds``, and only when it changed.

A new leader (a restart, a failover) knows every ended run from the Flows' status, but not what a
running pod has spent since its run started, nor the calls it has in flight. So it recovers before it
lets any call through: it reads each covered running pod's interim report (rewritten after every
model call, with its charges) from the Flow's state ConfigMap, and every pod tells it, with each
reserve and settle, its charges so far and the reservations it holds (taken again as they were).
Until each covered running pod has been heard from, or ``recovery_seconds`` passed (a pod idle all
that time has no call in flight), reservations are answered 503 and the pods ask again.

What is kept of a FlowQuota is its parsed spec in the tracker (at most ``QUOTAS_PER_NAMESPACE_LIMIT``
per namespace; the rest are named and wait) and, per quota, its uid, generation, the status last
written, and the conditions and notification records its watch last showed.

A FlowQuota tells its namespace's default notification sinks when its Exhausted or Warning condition
turns True (QuotaExhausted, QuotaWarning): the leader offers its events to the notifier (`Notices`,
wired by the app) after each status write and whenever the quota is seen, and folds the deliveries
that ended into ``status.notifications`` with its next write. An event is named after the time its
condition turned True, so that time is kept across restarts: a new operator keeps each condition's
lastTransitionTime from the status it observes until it has written its own.

The Flow cache keeps only the labels quota selectors name. When a quota names a key no selector named
before, the Flows carrying that key are listed once (``labelSelector=<key>``, in pages) so that the
ones already there are covered; later changes come with their watch events.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from decimal import Decimal
from typing import Any, Protocol

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.base import money_text
from flowkube_api.models.quota import QuotaCondition
from flowkube_api.report import RunReport
from flowkube_operator.kube.client import ApiError, Kube, flow_path, ns_path
from flowkube_operator.kube.informer import Informer
from flowkube_operator.labels import escape_value
from flowkube_operator.meta import owner_uid
from flowkube_operator.quotas.book import Charges, Refusal, Spend
from flowkube_operator.quotas.tracker import QuotaTracker, quota_name

log = logging.getLogger("flowkube.operator")

Body = dict[str, Any]
Key = tuple[str, str]
BACKFILL_PAGE = 200


class Caller(Protocol):
    """The runner pod asking (the state API's authenticated target)."""

    @property
    def namespace(self) -> str: ...

    @property
    def flow(self) -> str: ...

    @property
    def pod(self) -> str: ...


class Notices(Protocol):
    """The notifier, as the FlowQuotas' notifications use it (app.py wires it: quotas never import
    notify). Outcomes are the notifier's own; here they are only carried from `take` to `fold` and
    `recorded`."""

    def ready(self) -> bool:
        """Offers are taken: the notification Secrets are listed and the cluster's ranges known."""
        ...

    def announce(self, key: Key, quota: Body) -> None:
        """Deliver what the quota's status holds and does not record as handled (not twice at once)."""
        ...

    def take(self, key: Key) -> list[Any]:
        """The quota's deliveries that ended and are not in its status yet."""
        ...

    def fold(self, quota: Body, ended: list[Any]) -> list[tuple[str, str, str]]:
        """Fold ``ended`` into ``quota["status"]["notifications"]``; the Events to post for them."""
        ...

    def recorded(self, key: Key, ended: list[Any]) -> None:
        """These are in the quota's status now (or the quota is gone)."""
        ...


def quota_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    """A FlowQuota's path (namespace "" and no name: every namespace's), or, for namespace "" and a
    name, that ClusterFlowQuota's."""
    if not namespace:
        if name is None:
            return f"/apis/{c.GROUP}/{c.VERSION}/{c.QUOTA_PLURAL}"
        return f"/apis/{c.GROUP}/{c.VERSION}/{c.CLUSTER_QUOTA_PLURAL}/{name}" + (f"/{sub}" if sub else "")
    return ns_path(namespace, c.QUOTA_PLURAL, name, group=c.GROUP, version=c.VERSION, sub=sub)


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


class Quotas:
    """``notices``: the notifier (None: notifications are off); ``event`` posts an Event on a quota
    (type, reason, message), as the Flows' Events are posted."""

    def __init__(self, kube: Callable[[], Kube | None], leading: Callable[[], bool], *,
                 status_seconds: float = 5.0, recovery_seconds: float = 30.0,
                 clock: Callable[[], dt.datetime] = _now, notices: Notices | None = None,
                 event: Callable[[Body, str, str, str], None] = lambda _obj, _type, _reason, _message: None) -> None:
        self.tracker = QuotaTracker()
        self._kube, self._leading, self._clock = kube, leading, clock
        self._notices, self._event = notices, event
        self._status_seconds, self._recovery_seconds = status_seconds, recovery_seconds
        self._leading_since: float | None = None  # monotonic time this replica began to answer the desk
        self._reports_read = False  # the covered running pods' interim reports, read once per leadership
        self._heard: set[str] = set()  # "<namespace>/<pod>" that told this leader what they hold
        self.listed: Callable[[], bool] = lambda: True  # every watch has listed once (the app sets it)
        self._known: dict[Key, tuple[str, int]] = {}  # quota -> (uid, generation)
        self._why: dict[Key, str] = {}  # quota -> why it is not used
        self._written: dict[Key, Body] = {}  # quota -> the status last written (while this replica leads)
        # quota -> its conditions and notification records as its watch last showed them: where a new
        # leader keeps transition times and handled events from, before it writes its own
        self._observed: dict[Key, Body] = {}
        self._announced = False  # every quota's events offered since the notifier was ready, this term
        self._announce: set[str] = set()  # namespaces whose default sinks changed: offer their quotas again
        self._backfill: set[str] = set()  # label keys whose Flows are to be listed
        self._backfill_namespaces: set[str] = set()  # label keys whose namespaces are to be listed
        self._fetch: set[Key] = set()  # waiting quotas to read again (a place came free)
        self._namespaces: list[str] = []
        self._wake = asyncio.Event()

    # -- the watches ---------------------------------------------------------------------------------

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        """FlowQuotas (per watched namespace, or all), ClusterFlowQuotas, and namespaces (their labels:
        a ClusterFlowQuota's namespaceSelector)."""
        self._namespaces = list(namespaces)
        return [*(Informer(kube, quota_path(ns), c.API_VERSION, c.QUOTA_KIND, self.quota_event)
                  for ns in namespaces or [""]),
                Informer(kube, f"/apis/{c.GROUP}/{c.VERSION}/{c.CLUSTER_QUOTA_PLURAL}", c.API_VERSION,
                         c.CLUSTER_QUOTA_KIND, self.quota_event),
                Informer(kube, "/api/v1/namespaces", "v1", "Namespace", self.namespace_event, keep_label="")]

    def namespace_event(self, event_type: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        name = str(meta.get("name") or "")
        if self._watched(name):
            labels = {str(k): str(v) for k, v in (meta.get("labels") or {}).items()}
            self.tracker.namespace_event(name, None if event_type == "DELETED" else labels)

    def _watched(self, namespace: str) -> bool:
        return not self._namespaces or namespace in self._namespaces

    def quota_event(self, event_type: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))  # ("", name): a ClusterFlowQuota
        before, spaces_before = self.tracker.label_keys(), self.tracker.namespace_keys()
        if event_type == "DELETED":
            self.tracker.quota_event(None, *key)
            self._known.pop(key, None)
            self._why.pop(key, None)
            self._written.pop(key, None)
            self._observed.pop(key, None)
            if self._notices is not None:
                self._notices.recorded(key, self._notices.take(key))  # nowhere to record them any more
            waiting = self.tracker.next_waiting(key[0])
            if waiting is not None:
                self._fetch.add((key[0], waiting))
        else:
            why = self.tracker.quota_event(body, *key)
            self._known[key] = (str(meta.get("uid") or ""), int(meta.get("generation") or 0))
            if why is None:
                self._why.pop(key, None)
            else:
                self._why[key] = why
            status = body.get("status") or {}
            self._observed[key] = {"conditions": status.get("conditions") or [],
                                   "notifications": status.get("notifications")}
            if self._notices is not None and key[0] and self._leading():
                self._offer(key)
        self._backfill |= self.tracker.label_keys() - before
        self._backfill_namespaces |= self.tracker.namespace_keys() - spaces_before
        if self._backfill or self._fetch or self._backfill_namespaces:
            self._wake.set()

    # -- notifications ------------------------------------------------------------------------------

    def noticed(self, key: Key) -> Body | None:
        """The FlowQuota as its notifications read it (None: not known): its status as this leader
        last wrote it, else as last observed (an echo of an older write must not make a recorded event
        look new), and its limits' caps."""
        known, status = self._known.get(key), self._written.get(key) or self._observed.get(key)
        if known is None or status is None:
            return None
        limits = [{"name": lim.name, "maxTotalTokens": lim.max_tokens,
                   "maxCost": money_text(lim.max_cost) if lim.max_cost is not None else None}
                  for lim in self.tracker.book.limits(quota_name(*key))]
        return {"metadata": {"namespace": key[0], "name": key[1], "uid": known[0]},
                "spec": {"limits": limits}, "status": status}

    def _offer(self, key: Key) -> None:
        quota = self.noticed(key)
        if quota is not None and self._notices is not None:
            self._notices.announce(key, quota)

    def notified(self, key: Key) -> None:
        """A delivery of the quota's ended: write its status soon, which records it."""
        if key not in self._known and self._notices is not None:  # the quota is gone: nowhere to record it
            self._notices.recorded(key, self._notices.take(key))
            return
        self._wake.set()

    def defaults_changed(self, namespace: str) -> None:
        """A notification Secret of the namespace changed: its quotas may have sinks to serve now."""
        if self._notices is not None and self._leading():
            self._announce.add(namespace)
            self._wake.set()

    def _announce_due(self) -> None:
        """Offer the events of every quota once the notifier is ready in this term (a new leader sends
        what no record says is handled), and of the quotas of namespaces whose defaults changed."""
        if self._notices is None or not self._notices.ready():
            return
        everything, self._announced = not self._announced, True
        namespaces, self._announce = self._announce, set()
        keys = [k for k in self._known if k[0] and (everything or k[0] in namespaces)]
        for key in keys:
            self._offer(key)
        if everything:
            log.info("quotas: the notifications of %d FlowQuota(s) offered (this leader's first look)", len(keys))

    def flow_changed(self, key: Key, body: Body | None) -> None:
        """The Flow cache's listener: a Flow seen, or gone (None)."""
        self.tracker.flow_event(key[0], key[1], body)

    # -- the desk (the state API's, on the leader) ---------------------------------------------------

    def reserve(self, t: Caller, model: str, worst: Spend, priced: bool, charges: Charges | None = None,
                held: list[tuple[int, str, Spend]] | None = None) -> int | Refusal | str | None:
        """The reservation's id (0: no quota covers the Flow), a refusal, why to ask again (the book
        is recovering), or None (not the leader)."""
        if not self._lead():
            return None
        if not self.listed():
            return "the operator is still listing FlowQuotas and Flows: ask again"
        self._adopt(t, charges, held or [])
        if not self.tracker.covering(t.namespace, t.flow):
            return 0  # no quota covers the Flow: nothing to reserve, nothing to wait for
        waiting = self._recovering()
        if waiting is not None:
            return waiting
        outcome = self.tracker.reserve(t.namespace, t.flow, t.pod, model, worst, self._clock(), priced=priced)
        if outcome is None:
            return 0
        return outcome if isinstance(outcome, Refusal) else outcome.id

    def settle(self, t: Caller, reservation: int, charges: Charges,
               held: list[tuple[int, str, Spend]] | None = None) -> bool | None:
        if not self._lead() or not self.listed():
            return None  # asked again (503): a settle taken before the Flows are listed would be lost
        self._adopt(t, None, held or [])
        return self.tracker.settle(t.namespace, t.flow, t.pod, reservation, charges)

    def hold(self, t: Caller, charges: Charges | None, held: list[tuple[int, str, Spend]]) -> bool | None:
        """A pod's reminder, while its calls are in flight, of the reservations it holds: taken again
        by a new leader (answered while it recovers: this is what its recovery waits for)."""
        if not self._lead() or not self.listed():
            return None
        self._adopt(t, charges, held)
        return True

    def _adopt(self, t: Caller, charges: Charges | None, held: list[tuple[int, str, Spend]]) -> None:
        restored = self.tracker.adopt(t.namespace, t.flow, t.pod, charges, held)
        if restored:
            log.info("quotas: %d reservation(s) of %s/%s made with an earlier leader taken again", restored,
                     t.namespace, t.pod)
        self._heard.add(f"{t.namespace}/{t.pod}")

    def _lead(self) -> bool:
        """Whether this replica answers the desk; its recovery starts when it begins to."""
        if not self._leading():
            if self._leading_since is not None:
                self._leading_since, self._reports_read, self._announced = None, False, False
                self._heard.clear()
                self._written.clear()  # another leader may write next: what it writes is observed
            return False
        if self._leading_since is None:
            self._leading_since = time.monotonic()
            self._wake.set()  # read the interim reports now
        return True

    def _recovering(self) -> str | None:
        """Why no reservation is answered yet, while the book recovers (None: it has)."""
        if self._leading_since is None or not self._reports_read:
            return "the operator is reading the running pods' spend (a new leader): ask again"
        if time.monotonic() - self._leading_since >= self._recovery_seconds:
            return None
        silent = [f"{ns}/{pod}" for ns, _flow, pod in self.tracker.active() if f"{ns}/{pod}" not in self._heard]
        if silent:
            return (f"the operator is waiting for {len(silent)} running pod(s) to say what they hold (a new "
                    "leader): ask again")
        return None

    async def _read_reports(self, kube: Kube) -> None:
        """Each covered running pod's interim report: its charges so far, into the book."""
        for namespace, flow, pod in self.tracker.active():
            try:
                cm = await kube.get(ns_path(namespace, "configmaps", c.state_configmap_name(flow)))
            except ApiError as e:
                log.warning("quotas: could not read %s/%s's state: %s", namespace, flow, e)
                continue
            raw = ((cm or {}).get("binaryData") or {}).get(c.report_key(pod))
            if cm is None or not raw or owner_uid(cm["metadata"]) != self.tracker.flow_uid(namespace, flow):
                continue
            try:
                report = RunReport.decode(base64.b64decode(raw))
            except (ValidationError, OSError, ValueError, binascii.Error) as e:
                log.warning("quotas: unreadable report of %s/%s: %s", namespace, pod, e)
                continue
            if report.charges:
                charges = [(ch.at, ch.model, Spend(ch.total_tokens, ch.cost)) for ch in report.charges]
                self.tracker.adopt(namespace, flow, pod, charges, [])
        self._reports_read = True

    def exhausted(self, namespace: str, flow: str) -> str | None:
        """Why the Flow may start no run now (a covering quota's limit is used up), for its reconcile."""
        return self.tracker.exhausted(namespace, flow, self._clock())

    def refuses(self, namespace: str, labels: dict[str, str]) -> str | None:
        """Why a new Flow is refused at apply (a Refuse quota that would cover it is used up)."""
        return self.tracker.refuses(namespace, labels, self._clock())

    # -- the loop: backfills, waiting quotas, status -------------------------------------------------

    async def run(self) -> None:
        """Until cancelled: list what a new selector key needs, read quotas that may now be used, and
        (on the leader) write each quota's status when it changed."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._status_seconds)
            self._wake.clear()
            try:
                await self.one_pass()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("quotas: a pass failed; trying again in %.1f s", self._status_seconds)

    async def one_pass(self) -> None:
        await self._catch_up()
        if self._lead():
            kube = self._kube()
            if not self._reports_read and kube is not None and self.listed():
                await self._read_reports(kube)
            await self.write_statuses()
            self._announce_due()

    async def _catch_up(self) -> None:
        kube = self._kube()
        if kube is None:
            return
        while self._fetch:
            namespace, name = self._fetch.pop()
            found = await kube.get(quota_path(namespace, name))
            if found is not None:
                self.quota_event("MODIFIED", found)
        while self._backfill_namespaces:
            key = self._backfill_namespaces.pop()
            await _list_with(kube, "/api/v1/namespaces", key, lambda ns: self.namespace_event("MODIFIED", ns))
        while self._backfill:
            key = self._backfill.pop()
            for ns in self._namespaces or [""]:
                path = flow_path(ns) if ns else f"/apis/{c.GROUP}/{c.VERSION}/{c.PLURAL}"
                await _list_with(kube, path, key, self._flow_listed)

    def _flow_listed(self, flow: Body) -> None:
        meta = flow.get("metadata") or {}
        kept = {**meta, "labels": {k: v for k, v in (meta.get("labels") or {}).items()
                                   if k in self.tracker.label_keys()}}
        self.tracker.flow_event(str(meta.get("namespace") or ""), str(meta.get("name") or ""),
                                {"metadata": kept, "status": flow.get("status") or {}})

    def metrics_text(self) -> str:
        """``flowkube_quota_used``, ``_limit`` and ``_reserved`` per quota, limit and unit (``tokens``,
        ``usd``), in Prometheus text: at most 16 quotas a namespace, 16 limits a quota, 2 units."""
        now = self._clock()
        samples: dict[str, list[str]] = {name: [] for name, _ in QUOTA_FAMILIES}
        for namespace, name in sorted(self.tracker.quotas()):
            for limit in self.tracker.book.limits(quota_name(namespace, name)):
                used, reserved = self.tracker.book.used(limit.key, now), self.tracker.book.reserved(limit.key)
                for unit, cap, u, r in (("tokens", limit.max_tokens, used.tokens, reserved.tokens),
                                        ("usd", limit.max_cost, used.cost, reserved.cost)):
                    if cap is None:
                        continue
                    labels = (f'namespace="{escape_value(namespace)}",quota="{escape_value(name)}",'
                              f'limit="{escape_value(limit.name)}",unit="{unit}"')
                    for family, value in (("flowkube_quota_used", u), ("flowkube_quota_limit", cap),
                                          ("flowkube_quota_reserved", r)):
                        text = f"{value:f}" if isinstance(value, Decimal) else str(value)  # never 1E+2
                        samples[family].append(f"{family}{{{labels}}} {text}")
        out = []
        for family, help_text in QUOTA_FAMILIES:
            out += [f"# HELP {family} {help_text}", f"# TYPE {family} gauge", *samples[family]]
        return "\n".join(out) + "\n"

    def status_of(self, key: Key, now: dt.datetime) -> Body:
        """The status a quota shows now (as JSON)."""
        uid_gen = self._known.get(key, ("", 0))
        why = self._why.get(key)
        if why is not None:
            ready = QuotaCondition(type="Ready", status="False", reason="NotUsed", message=why[:1024],
                                   last_transition_time=now)
            return {"observedGeneration": uid_gen[1], "conditions": [_dump(ready)]}
        limits, conditions = self.tracker.status(*key, now)
        ready = QuotaCondition(type="Ready", status="True", reason="Enforced", last_transition_time=now)
        resets = [lim.resets_at for lim in limits if lim.resets_at is not None]
        out: Body = {"observedGeneration": uid_gen[1], "summary": self.tracker.summary(*key, now),
                     "limits": [lim.model_dump(mode="json", by_alias=True, exclude_none=True) for lim in limits],
                     "conditions": [_dump(x) for x in (ready, *conditions)]}
        out["nextReset"] = min(resets).isoformat().replace("+00:00", "Z") if resets else None
        out["retired"] = self.tracker.retired(quota_name(*key)) or None
        return out

    async def write_statuses(self) -> int:
        """Write each quota's status that changed since it was last written, or that has deliveries to
        record; how many were written. Each written quota's events are offered after its write."""
        kube, now, written = self._kube(), self._clock(), 0
        if kube is None:
            return 0
        for key in list(self._known):
            status = self.status_of(key, now)
            last = self._written.get(key)
            notices = self._notices if key[0] else None  # a ClusterFlowQuota has no default sinks
            ended = notices.take(key) if notices is not None else []
            before = last if last is not None else self._observed.get(key)
            if notices is not None:
                status["notifications"] = (before or {}).get("notifications")
            if last is not None and _same(last, status) and not ended:
                continue
            _keep_transitions(status, before)
            if notices is not None and ended:
                # Folded after the transitions are kept: the events still current are named by them.
                quota = {"metadata": {"namespace": key[0], "name": key[1], "uid": self._known[key][0]},
                         "status": status}
                for etype, reason, message in notices.fold(quota, ended):
                    self._event(quota, etype, reason, message)  # before the write, as a Flow's
            try:
                await kube.merge_patch(quota_path(key[0], key[1], "status"), {"status": status})
            except ApiError as e:
                if e.status != 404:
                    log.warning("quotas: could not write the status of FlowQuota %s/%s: %s", *key, e)
                elif notices is not None:
                    notices.recorded(key, ended)  # the quota is gone: nowhere to record them
                continue
            self._written[key] = status
            written += 1
            if notices is not None:
                notices.recorded(key, ended)
                self._offer(key)
        return written


QUOTA_FAMILIES = (
    ("flowkube_quota_used", "Spent in the limit's current window by the Flows its FlowQuota covers."),
    ("flowkube_quota_limit", "The limit (maxTotalTokens in tokens, maxCost in USD)."),
    ("flowkube_quota_reserved", "The worst case of the covered Flows' model calls in flight."),
)


async def _list_with(kube: Kube, path: str, key: str, deliver: Callable[[Body], None]) -> None:
    """Every object of ``path`` that carries label ``key``, a page at a time, to ``deliver``."""
    cont = ""
    while True:
        params = {"labelSelector": key, "limit": str(BACKFILL_PAGE), **({"continue": cont} if cont else {})}
        page, _ = await kube.list_page(path, params, max_bytes=64 * 1024 * 1024)
        for item in page.get("items") or []:
            deliver(item)
        cont = (page.get("metadata") or {}).get("continue") or ""
        if not cont:
            return


def _dump(condition: QuotaCondition) -> Body:
    return condition.model_dump(mode="json", by_alias=True, exclude_none=True)


def _same(a: Body, b: Body) -> bool:
    """The same status but for when its conditions last changed."""
    def bare(s: Body) -> Body:
        return {**s, "conditions": [{k: v for k, v in x.items() if k != "lastTransitionTime"}
                                    for x in s.get("conditions") or []]}
    return bare(a) == bare(b)


def _keep_transitions(status: Body, last: Body | None) -> None:
    """A condition whose status did not change keeps the time it last changed."""
    before = {x["type"]: x for x in (last or {}).get("conditions") or []}
    for x in status.get("conditions") or []:
        old = before.get(x["type"])
        if old is not None and old.get("status") == x.get("status"):
            x["lastTransitionTime"] = old["lastTransitionTime"]
