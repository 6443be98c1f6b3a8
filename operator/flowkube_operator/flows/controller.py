"""The Flows' kind in the controller shell (shell.py): one reconcile of a Flow around
`reconcile.plan`, on the caches (`cache.FlowCache`) that two watches (informer.py) feed.

Like controller-runtime: watch events only put a Flow's key on the shell's de-duplicating queue;
workers take keys, read the latest cached Flow and its pods, plan, and apply. A key is never
processed by two workers at once, and a key that changes while being processed is processed again
afterwards.

Every replica keeps the caches warm (the state API and the per-flow metrics read them); only the
leader (see leader.py) queues and runs workers. Reconciling is level-based, so a replica that begins
to lead queues every cached Flow once and nothing a follower saw is lost.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Sequence
from typing import Any

from flowkube_api import constants as c
from flowkube_api import templates
from flowkube_api.models import TemplateStatus
from flowkube_api.report import RunReport
from flowkube_operator import selfmetrics
from flowkube_operator.cron.controller import Clock, CronFlows
from flowkube_operator.flows.apply import ForeignObjectError, PlanWriter, SpanSink
from flowkube_operator.flows.cache import FlowCache, FlowListener, Key
from flowkube_operator.flows.checkpoints import fork_source
from flowkube_operator.flows.reconcile import Plan, Taken, late_pods, plan
from flowkube_operator.flows.reconcile.forks import ForkSource
from flowkube_operator.flows.reports import active_report, load_report
from flowkube_operator.kube.client import Kube, ns_path
from flowkube_operator.kube.informer import Informer
from flowkube_operator.kube.shell import Shell, Writes
from flowkube_operator.kube.workqueue import NotLeadingError
from flowkube_operator.notify import notices
from flowkube_operator.notify.notifier import Notifier
from flowkube_operator.settings import Settings
from flowkube_operator.templates.cache import TemplateCache
from flowkube_operator.templates.snapshots import SnapshotMismatchError, Snapshots

__all__ = ["Controller", "ForeignObjectError", "NotLeadingError"]

Body = dict[str, Any]
log = logging.getLogger("flowkube.controller")


class Controller:
    """The Flows' reconcile of one operator process, on its caches (built by `app.App`).

    ``listeners`` hear every change of a cached Flow (the per-flow metrics); ``fence`` is asked
    before every write (the leader elector's `still_leading`; always yes without election);
    ``state_ca`` is the PEM runner pods trust for the state API; ``notifier`` sends the notifications
    the Flows it reconciles hold (none without one).
    """

    def __init__(self, settings: Settings, listeners: Sequence[FlowListener] = (), *,
                 fence: Callable[[], bool] = lambda: True, state_ca: str = "",
                 notifier: Notifier | None = None,
                 flow_labels: Callable[[str], frozenset[str]] = lambda namespace: frozenset(),
                 quota_exhausted: Callable[[str, str], str | None] = lambda namespace, flow: None,
                 spans: SpanSink | None = None) -> None:
        self.settings = settings
        self.kube: Kube | None = None
        self.notifier = notifier
        self.state_ca = state_ca
        self.quota_exhausted = quota_exhausted  # why a Flow may start no run now (an exhausted FlowQuota)
        # Both kinds write through one fence, one status writer and one Event poster.
        self.writes = Writes(lambda: self.kube, fence, socket.gethostname())
        self.shell = Shell(c.KIND, self.reconcile, settings.workers, measured=True)
        # CronFlows hear of their Flows from this cache.
        self.cron = CronFlows(self.writes, Clock(settings.cron_clock_rate, settings.cron_clock_epoch))
        # Template snapshots: the Flows' references counted as their events enter the cache.
        self.snapshots = Snapshots(lambda: self.kube, settings.template_snapshot_cache_entries,
                                   settings.template_snapshot_cache_mib * 1024 * 1024)
        self.cache = FlowCache([*listeners, self.cron.flow_changed, self.snapshots.index.flow_changed,
                                self._forget_hints], wake=self.shell.add, stale_warm=self._read_warm_report,
                                labels=flow_labels)
        self.templates = TemplateCache(wake=self.shell.add, kube=lambda: self.kube)
        self.writer = PlanWriter(self.writes, self.cache, settings, state_ca, spans)
        # Reports the state API took from pods of closed runs, not yet folded into the status. Lost
        # with the process, harmlessly: the pod's final report is read again when the pod ends.
        self._late: dict[Key, dict[str, RunReport]] = {}
        # Warm reports (a conversation's pod answered a turn and waits for the next message) the state
        # API took, not yet folded; None: a warm pod is waiting on a turn the status lacks, read its report.
        self._warm: dict[Key, RunReport | None] = {}
        self._informers: list[Informer] = []  # the watches CronFlows wait for (see _start_cron_when_listed)

    @property
    def leading(self) -> bool:
        """Workers run: this replica is the one status writer."""
        return self.shell.leading

    def _forget_hints(self, key: Key, body: Body | None) -> None:
        if body is None:  # the Flow is gone
            self._late.pop(key, None)
            self._warm.pop(key, None)

    def late_report(self, namespace: str, flow: str, report: RunReport) -> None:
        """The state API stored a report from a pod whose run is closed: fold it in soon. (A follower
        drops the hint: the leader reads the report when the pod ends, see `late_pods`.)"""
        key = (namespace, flow)
        if self.leading and key in self.cache.flows:
            self._late.setdefault(key, {})[report.pod] = report
            self.shell.add(key)

    def running_report(self, namespace: str, flow: str, report: RunReport) -> bool:
        """The state API stored a report of a Flow's running attempt that says something now: a warm
        one (a turn answered, a pause) or the final one (the run's end, before its pod has ended).
        Fold it in now. False on a follower: the runner sends it again so the leader has it (a
        follower's hint would be lost, and the report read only when the pod ends)."""
        key = (namespace, flow)
        if not self.leading:
            return False
        if key in self.cache.flows:
            self._warm[key] = report
            self.shell.add(key)
        return True

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        """The caches' watches, the templates', and the notifier's Secrets."""
        extra = self.notifier.informers(kube, namespaces) if self.notifier is not None else []
        self._informers = (self.cache.informers(kube, namespaces) + self.templates.informers(kube, namespaces)
                           + self.cron.informers(kube, namespaces) + self.snapshots.informers(kube, namespaces))
        return self._informers + extra

    async def _start_cron_when_listed(self) -> None:
        """CronFlows are planned from the Flows they started: only once every Flow, template and
        CronFlow is listed (a CronFlow that saw none of its Flows would start a Forbid one again, and
        forget what it was deleting). The templates' first list also wakes the Flows that waited."""
        await asyncio.gather(*(i.synced.wait() for i in self._informers))
        for key in list(self.templates.woken()):
            self.shell.add(key)
        self.cron.start()

    async def _offer_when_ready(self, notifier: Notifier) -> None:
        """Once the notification Secrets are listed and the cluster's ranges known, every Flow is looked
        at again: the ones reconciled before had nothing offered."""
        await notifier.wait_ready()
        for key in list(self.cache.flows):
            self.shell.add(key)

    def requeue_namespace(self, namespace: str) -> None:
        """A notification Secret of the namespace changed: its Flows may have sinks to serve now (a
        Secret created after the Flow that names it; new namespace defaults). Rare: a scan is fine."""
        if self.leading:  # a follower's view is queued all at once when it begins to lead
            for key in [k for k in self.cache.flows if k[0] == namespace]:
                self.shell.add(key)

    def notified(self, key: Key) -> None:
        """A delivery of the Flow's ended: reconcile it, which records the outcome in its status."""
        if self.leading and key in self.cache.flows:
            self.shell.add(key)
        elif self.notifier is not None:  # the Flow is gone: nowhere to record it
            self.notifier.recorded(key, self.notifier.take(key))

    def _read_warm_report(self, key: Key) -> None:
        """A warm pod waits on something the status does not show yet (the leader changed, or the
        hint was lost): read its report. Its polls repeat this until the status shows it."""
        if self.leading:
            self._warm.setdefault(key, None)
            self.shell.add(key)

    # -- leading -------------------------------------------------------------------------------------

    def attach(self, kube: Kube) -> None:
        """The API client of the latest login (kopf logs in again when credentials expire)."""
        self.kube = kube

    def start(self) -> None:
        """Begin to reconcile (at login, or when this replica begins to lead): every cached Flow is
        queued once, as a restarted operator's first list would queue it."""
        if self.leading:
            return
        assert self.kube is not None, "attach a client first"
        selfmetrics.LEADER.set(1)
        also = [self._recheck_pods_forever(), self._start_cron_when_listed(), self._sweep_snapshots_forever()]
        if self.notifier is not None:
            also += [self.notifier.learn_cluster(self.kube), self._offer_when_ready(self.notifier)]
        self.shell.start(self.cache.flows, *also)

    async def stop(self) -> None:
        """Stop reconciling at once (a reconcile cut short is repaired by the next leader's)."""
        selfmetrics.LEADER.set(0)
        await self.shell.stop()
        await self.cron.stop()
        if self.notifier is not None:
            await self.notifier.stop()

    async def _sweep_snapshots_forever(self) -> None:
        """Delete the template snapshots no Flow names any more, every sweep period, once every Flow
        and snapshot is listed (a replica that saw no Flow yet would see every snapshot unreferenced)."""
        await asyncio.gather(*(i.synced.wait() for i in self._informers))
        while True:
            await asyncio.sleep(self.settings.template_snapshot_sweep_seconds)  # a period, not a wait
            try:
                await self.snapshots.sweep(self.writes.may_write)
            except NotLeadingError:
                return
            except Exception:
                log.exception("sweeping template snapshots failed; trying again next period")

    async def _recheck_pods_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.pod_recheck_seconds / 2)  # a period, not a wait for a condition
            try:
                await self.recheck_pods()
            except Exception:
                log.exception("rechecking runner pods failed; trying again next period")

    async def recheck_pods(self, limit: int = 50) -> int:
        """Read again the running pods of active runs that the watch has been silent about for
        ``pod_recheck_seconds``. The informer's relist says DELETED for a pod deleted in a break of
        the watch; this is the guard against a watch that is connected but silent, which would
        leave the cache showing a pod running for ever. What the
        API server answers goes through ``pod_event`` (a pod gone as DELETED). Returns how many were read."""
        kube = self.writes.client()
        due = self.cache.silent_pods(self.settings.pod_recheck_seconds, limit)
        for key, view in due:
            live = await kube.get(ns_path(key[0], "pods", view.name))
            if live is None or (live.get("metadata") or {}).get("uid") != view.uid:
                log.warning("runner pod %s/%s is gone without the watch saying so; its run is looked at again",
                            key[0], view.name)
                self.cache.pod_event("DELETED", {"metadata": {"name": view.name, "namespace": key[0],
                                                              "labels": {c.LABEL_FLOW: key[1]}}})
            else:
                self.cache.pod_event("MODIFIED", live)
        return len(due)

    # -- one reconcile -------------------------------------------------------------------------------

    async def reconcile(self, key: Key) -> None:
        """Plan from the cached Flow and pods (and the reports the plan needs), then apply."""
        kube = self.writes.client()
        body = self.cache.flow(key)
        taken_outcomes = self.notifier.take(key) if self.notifier is not None else []
        if body is None or body.get("metadata", {}).get("deletionTimestamp"):
            if self.notifier is not None:
                self.notifier.recorded(key, taken_outcomes)  # nowhere to record them any more
            return
        # Only this Flow's: an earlier Flow of the same name, deleted while a delivery ran, is not this one.
        delivered = [o for o in taken_outcomes if notices.of_object(o.notice_id, body)]
        uid = body["metadata"]["uid"]
        # Pods of an earlier Flow with the same name are not this Flow's, however named.
        pods = {n: v for n, v in self.cache.pods.get(key, {}).items() if v.owner_uid == uid}
        status = body.get("status") or {}
        runs = status.get("runs") or []
        # The warm hint as this reconcile takes it, before any await: one that comes later stays.
        hinted, hint = key in self._warm, self._warm.get(key)
        active = runs[-1]["pod"] if runs and not runs[-1].get("finishedAt") else None
        report, checked = None, False
        if active is not None:
            report, checked = await active_report(kube, key, uid, pods, runs[-1], hinted, hint)
        if not self.settings.webhook_enabled:
            # Only the mutating webhook can vouch for who answered; without it the name is unknown.
            ((status.get("feedback") or {}).get("response") or {}).pop("respondedBy", None)
        taken = dict(self._late.get(key, {}))  # the state API's hints this reconcile folds in
        late: dict[str, RunReport | None] = dict(taken)
        for pod_name in late_pods(status, pods):  # pods that ended after their run was closed
            late[pod_name] = await load_report(kube, *key, uid, pod_name, pods[pod_name])
        cap = self.settings.retry_backoff_cap_seconds
        read = await self._read_sources(key, body)
        if read is None:
            return  # not "not found" before the templates are listed: queued again once they are
        template_or_taken, fork = read
        p = plan(body, pods, report, backoff_cap=cap, report_checked=checked, late=late, template=template_or_taken,
                 fork=fork, quota=(quota := self.quota_exhausted(*key)))
        if p.need_report and active is not None:
            report = await load_report(kube, *key, uid, active, pods.get(active))
            p = plan(body, pods, report, backoff_cap=cap, report_checked=True, late=late, template=template_or_taken,
                     fork=fork, quota=quota)
        if delivered:
            current = [n.id for n in notices.notices({"metadata": body["metadata"], "status": p.status.dump()})]
            p.events += notices.record(p.status, delivered, current)
        body = await self._take_and_apply(key, body, p)
        self._forget_late(key, taken)
        if self.notifier is not None:
            self.notifier.recorded(key, taken_outcomes)
            # Offered even when the TTL deletes the Flow now: its end is still told (not retried after).
            # A Flow of a template is told with the spec it runs (its template's notifications).
            self.notifier.offer(key, p.runs_as(body))
        if hinted and key in self._warm and self._warm[key] is hint:
            del self._warm[key]  # a newer one that came meanwhile stays for the next reconcile

    async def _take_and_apply(self, key: Key, body: Body, p: Plan) -> Body:
        """Apply the plan; a take's snapshot is made first, before anything (the status write, the
        pod) names it."""
        try:
            if p.snapshot is not None and p.status.template is not None:
                await self._ensure_snapshot(body, p.snapshot, p.status.template)
            written = await self.writer.apply(key, body, p)
            if p.delete_flow is None and p.requeue_after is not None:
                self.shell.queue.add_after(key, p.requeue_after)
            return written
        except BaseException:
            self.snapshots.not_taken(p.snapshot)  # its Flow does not name it: a sweep may take it
            raise

    async def _ensure_snapshot(self, body: Body, obj: Body, taken: TemplateStatus) -> None:
        try:
            stored, digest = await self.snapshots.ensure(obj, self.writes.may_write)
        except SnapshotMismatchError as e:  # said where users look; tried again now and then
            self.writes.event(body, "Warning", c.Reason.TEMPLATE_SNAPSHOT_UNUSABLE, str(e))
            raise ForeignObjectError(str(e), retry_after=60.0) from e
        # The Flow names what is stored: the same generation, maybe taken at an earlier resourceVersion.
        taken.hash = digest
        taken.resource_version = stored.get("resourceVersion")

    async def _read_sources(self, key: Key, body: Body) -> tuple[Body | Taken | None, ForkSource | None] | None:
        """What the plan needs read beyond the Flow and its pods: the template it names or took, and a
        fork's origin checkpoint. None: wait (the templates are not listed yet)."""
        template = await self._template_of(key, body)
        if template is None and not self.templates.synced() and self.templates.waits(key):
            return None
        return template or await self._taken(key, body), await fork_source(
            self.writes.client(), body,
            across_namespaces=self.settings.webhook_enabled and self.settings.webhook_flows_fail_closed)

    async def _taken(self, key: Key, body: Body) -> Taken | None:
        """For a Flow that took its template: the spec of the snapshot its status names (from the
        LRU, else one GET), or why it cannot be had. None for every other Flow."""
        taken = (body.get("status") or {}).get("template")
        if (not (body.get("spec") or {}).get("templateRef") or not isinstance(taken, dict)
                or "spec" in taken or not taken.get("snapshot")):
            return None
        spec, problem = await self.snapshots.load(key[0], taken)
        return Taken(spec=spec, problem=problem)

    async def _template_of(self, key: Key, body: Body) -> Body | None:
        """The template a Flow that has not taken one yet names, from the cache; None (and the Flow
        noted as waiting for it) when it is not there."""
        ref = (body.get("spec") or {}).get("templateRef")
        if not ref or (body.get("status") or {}).get("template"):
            return None
        tkey = templates.template_key(key[0], ref)
        found = await self.templates.resolve(tkey)
        if found is None:
            self.templates.wait(tkey, key)  # queued when it comes (or when the first list is in)
        return found

    def _forget_late(self, key: Key, folded: dict[str, RunReport]) -> None:
        """Drop the hints a reconcile folded in; one that arrived meanwhile (a newer report of the
        same pod, taken during the reconcile's awaits) stays queued for the next."""
        pending = self._late.get(key)
        if pending is None:
            return
        for pod_name, rep in folded.items():
            if pending.get(pod_name) is rep:
                del pending[pod_name]
        if not pending:
            del self._late[key]
