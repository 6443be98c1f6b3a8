"""CronFlows: the watch, the index of the Flows each one started, and the leader's reconcile.

Every replica watches CronFlows and indexes the Flows they started (from the Flow cache's changes:
label `flowkube.io/cronflow`), so a new leader starts with warm caches. Only the leader reconciles,
in the controller shell (kube/shell.py) with the Flows' writes: `cron.plan.plan` decides, this
applies, in the order that survives a crash at any point (its docstring): create the scheduled Flow,
post the Events of the decisions (at least once: a crash before the status write has the next
leader post them again), write the status, delete what the plan deletes.

A CronFlow is queued when it changes, when one of its Flows starts, ends or goes, and at its next
scheduled time (a timer per CronFlow, not a scan).
"""

from __future__ import annotations

import datetime as dt
import time
from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api import cron
from flowkube_operator import projections
from flowkube_operator.cron.plan import Child, CronPlan, plan
from flowkube_operator.kube.client import ApiError, Kube, flow_path, ns_path
from flowkube_operator.kube.informer import Informer
from flowkube_operator.kube.shell import Shell, Writes
from flowkube_operator.meta import owner_uid

Body = dict[str, Any]
Key = tuple[str, str]
FAILED_CREATE_RETRY = 30.0  # seconds before a Flow the API server refused is tried again


def cronflow_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return ns_path(namespace, c.CRONFLOW_PLURAL, name, group=c.GROUP, version=c.VERSION, sub=sub)


class Clock:
    """CronFlows' time: the real clock, or (``rate`` > 1, for tests and demos) one that runs ``rate``
    times faster from ``epoch`` (Unix seconds), the same in every replica that has the same settings."""

    def __init__(self, rate: float = 1.0, epoch: float = 0.0,
                 real: Callable[[], float] = time.time) -> None:
        self.rate, self.epoch, self.real = rate, epoch, real

    def now(self) -> dt.datetime:
        t = self.real()
        return dt.datetime.fromtimestamp(self.epoch + (t - self.epoch) * self.rate, dt.UTC)

    def real_seconds(self, seconds: float) -> float:
        """How long ``seconds`` of this clock take on the real one."""
        return seconds / self.rate


class CronFlows:
    def __init__(self, writes: Writes, clock: Clock | None = None, workers: int = 2) -> None:
        self.writes = writes
        self.clock = clock or Clock()
        self.cronflows: dict[Key, Body] = {}
        self.children: dict[Key, dict[str, Child]] = {}  # (namespace, cronflow) -> its Flows by name
        self._cronflow_of: dict[Key, Key] = {}  # a Flow's key -> its CronFlow's, for the Flows in children
        self.shell = Shell(c.CRONFLOW_KIND, self.reconcile, workers)

    # -- what the watches tell -----------------------------------------------------------------------

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        return [Informer(kube, cronflow_path(ns) if ns else f"/apis/{c.GROUP}/{c.VERSION}/{c.CRONFLOW_PLURAL}",
                         c.API_VERSION, c.CRONFLOW_KIND, self.event) for ns in namespaces or [""]]

    def event(self, event_type: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        key = (meta.get("namespace", ""), meta.get("name", ""))
        if event_type == "DELETED":
            self.cronflows.pop(key, None)
            return
        self.cronflows[key] = projections.cronflow(body)
        self.shell.add(key)

    def flow_changed(self, key: Key, body: Body | None) -> None:
        """A listener of the Flow cache: keep the index of CronFlows' Flows, and queue a CronFlow
        when one of its Flows comes, ends or goes (not at every status write of a running one)."""
        owner = ((body.get("metadata") or {}).get("labels") or {}).get(c.LABEL_CRONFLOW) if body else None
        was = self._cronflow_of.get(key)
        if was is not None and (owner is None or was != (key[0], owner)):  # gone, or no longer its
            flows = self.children.get(was, {})
            flows.pop(key[1], None)
            if not flows:
                self.children.pop(was, None)
            del self._cronflow_of[key]
            self.shell.add(was)
        if owner is None or body is None:
            return
        cf = (key[0], owner)
        self._cronflow_of[key] = cf
        flows = self.children.setdefault(cf, {})
        new, old = Child.of(body), flows.get(key[1])
        flows[key[1]] = new
        if old is None or (old.ended, old.deleting, old.uid) != (new.ended, new.deleting, new.uid):
            self.shell.add(cf)

    # -- leading -------------------------------------------------------------------------------------

    def start(self) -> None:
        self.shell.start(self.cronflows)

    async def stop(self) -> None:
        await self.shell.stop()

    # -- one reconcile -------------------------------------------------------------------------------

    async def reconcile(self, key: Key) -> CronPlan | None:
        body = self.cronflows.get(key)
        kube = self.writes.client()
        if body is None or (body.get("metadata") or {}).get("deletionTimestamp"):
            return None
        uid = body["metadata"]["uid"]
        children = [ch for ch in self.children.get(key, {}).values() if ch.owner == uid]
        now = self.clock.now()
        p = plan(body, children, now)
        refused = await self._create(kube, body, p) if p.create is not None else None
        if refused is not None:  # not started: the time stays due, nothing is replaced for it
            p = plan(body, children, now, refused=refused)
            p.requeue_after = FAILED_CREATE_RETRY
        # The Events of the decisions this status write records go first: a crash in between loses none.
        for etype, reason, message in p.events:
            await self.writes.post_event(body, etype, reason, message, c.CRONFLOW_KIND)
        new_status, old_status = p.status.dump(), body.get("status") or {}
        if new_status != old_status:
            written = await self.writes.status(cronflow_path(*key, sub="status"), body, old_status, new_status)
            if self.cronflows.get(key) is body:
                self.cronflows[key] = projections.cronflow(written)
        for doomed in p.delete:  # by the uid the plan saw: a Flow made again under the name is another
            await self.writes.delete(flow_path(key[0], doomed.name), doomed)
        if p.requeue_after is not None:
            self.shell.queue.add_after(key, self.clock.real_seconds(p.requeue_after))
        return p

    async def _create(self, kube: Kube, cronflow: Body, p: CronPlan) -> str | None:
        """Create the scheduled Flow (one there already under the time's name is it, if the CronFlow
        owns it); why the API server refused it, else None."""
        assert p.create is not None
        name, scheduled = p.create
        ns, uid = cronflow["metadata"]["namespace"], cronflow["metadata"]["uid"]
        self.writes.may_write()
        try:
            created = await kube.create(flow_path(ns), cron.cronflow_flow(cronflow, scheduled, name=name))
        except ApiError as e:
            if e.status in (400, 401, 403, 404, 422):
                return str(e)
            raise
        if created is None:  # AlreadyExists: ours (a lost write), or someone else's Flow of that name
            existing = await kube.get(flow_path(ns, name))
            if existing is not None and owner_uid(existing.get("metadata") or {}) != uid:
                return "a Flow of that name exists and is not this CronFlow's"
        return None
