"""The controller shell every kind the operator reconciles runs in (Flows, CronFlows, and the next).

A kind supplies only its reconcile of one key: read its cache, plan, apply through `Writes`. The
shell owns the rest, once: a de-duplicating work queue (workqueue.py) and its workers, the policy
for a reconcile that failed, and, in `Writes`, the write fence, the guarded status write, the
uid-guarded delete and the Events, which every kind of one process shares.

Like prometheus-operator's `ResourceReconciler`, which runs a `Syncer` per kind: the loop is written
once, and a kind is a plan and its writes.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any

from flowkube_api import constants as c
from flowkube_operator import selfmetrics
from flowkube_operator.kube.client import ApiError, Kube, delete_if_same, ns_path
from flowkube_operator.kube.workqueue import Key, NotLeadingError, WorkQueue, merge_patch
from flowkube_operator.meta import Doomed

Body = dict[str, Any]
log = logging.getLogger("flowkube.shell")


class RetryLater(Exception):
    """A reconcile that cannot go on yet, and says when to look again (not a failure: no backoff)."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Writes:
    """The writes of one operator process, whatever the kind: each asks the fence first (the
    leader elector's `still_leading`), so a replica that no longer leads writes nothing."""

    def __init__(self, kube: Callable[[], Kube | None], fence: Callable[[], bool], instance: str) -> None:
        self._kube, self.fence, self.instance = kube, fence, instance
        self._background: set[asyncio.Task[None]] = set()

    def client(self) -> Kube:
        kube = self._kube()
        assert kube is not None, "attach a client first"
        return kube

    def may_write(self) -> None:
        if not self.fence():
            raise NotLeadingError

    async def status(self, path: str, body: Body, old_status: Body, new_status: Body) -> Body:
        """The one status write of a reconcile, as a merge patch, guarded by the resourceVersion the
        plan was made from: the object as written."""
        self.may_write()
        patch = {"metadata": {"resourceVersion": body["metadata"]["resourceVersion"]},
                 "status": merge_patch(old_status, new_status)}
        return await self.client().merge_patch(path, patch)

    async def delete(self, path: str, doomed: Doomed) -> None:
        """Delete what a plan decided on, never without its uid as the precondition: a name alone
        could delete an object made again under it since the plan looked."""
        if not doomed.uid:
            log.warning("not deleting %s: the plan saw no uid for it", path)
            return
        self.may_write()
        await self.client().delete(path, delete_if_same(doomed.uid))

    def event(self, obj: Body, etype: str, reason: str, message: str, kind: str = c.KIND) -> None:
        """Events are history for `kubectl describe`; posting one never holds up a reconcile."""
        task = asyncio.create_task(self.post_event(obj, etype, reason, message, kind))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def post_event(self, obj: Body, etype: str, reason: str, message: str, kind: str = c.KIND) -> None:
        """An Event posted now (a failure is logged): before the status write that records its
        decision, a crash between the two loses no Event (the next leader posts it again)."""
        meta = obj["metadata"]
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        event = {
            "apiVersion": "events.k8s.io/v1", "kind": "Event",
            # Named as client-go names Events: the object's name and a hex timestamp.
            "metadata": {"name": f"{meta['name']}.{time.time_ns():x}", "namespace": meta["namespace"]},
            "regarding": {"apiVersion": c.API_VERSION, "kind": kind, "name": meta["name"],
                          "namespace": meta["namespace"], "uid": meta["uid"],
                          "resourceVersion": meta.get("resourceVersion", "")},
            "reason": reason, "note": message[:1024], "type": etype, "action": "Reconcile",
            "eventTime": now, "reportingController": "flowkube.io/operator",
            "reportingInstance": self.instance,
        }
        try:
            await self.client().create(ns_path(meta["namespace"], "events", group="events.k8s.io", version="v1"),
                                       event)
        except Exception as e:  # an Event lost is a line of history lost, never a reason to fail
            log.warning("could not post event %s: %s", reason, e)

    async def settled(self) -> None:
        """Wait for the Events being posted."""
        await asyncio.gather(*list(self._background), return_exceptions=True)


class Shell:
    """The queue and the workers of one kind. Only the leader runs them (`start`); every replica
    keeps the kind's cache warm, so `start` queues what the cache holds and nothing is lost.

    ``measured``: this is the Flows' shell, whose queue, reconciles and errors the operator's own
    metrics show (selfmetrics)."""

    def __init__(self, kind: str, reconcile: Callable[[Key], Awaitable[Any]], workers: int, *,
                 measured: bool = False) -> None:
        self.kind, self._reconcile, self.workers, self.measured = kind, reconcile, workers, measured
        self.queue = WorkQueue(gauges=measured)
        self.leading = False
        self._tasks: list[asyncio.Task[None]] = []
        self._failures: dict[Key, int] = {}  # consecutive failed reconciles, for backoff

    def add(self, key: Key) -> None:
        """Something the key's plan reads changed: queued while leading (a follower's view is queued
        all at once when it begins to lead)."""
        if self.leading:
            self.queue.add(key)

    def start(self, keys: Iterable[Key], *also: Coroutine[Any, Any, None]) -> None:
        """Begin to reconcile: every key once, then as they change. ``also`` run beside the workers
        and stop with them."""
        if self.leading:
            return
        self.leading = True
        for key in list(keys):
            self.queue.add(key)
        self._tasks.append(asyncio.create_task(self.queue.run_timers()))
        self._tasks += [asyncio.create_task(self._worker()) for _ in range(self.workers)]
        self._tasks += [asyncio.create_task(task) for task in also]

    async def stop(self) -> None:
        """Stop at once: the workers are cancelled (a reconcile cut short is repaired by the next
        leader's, as after a crash)."""
        self.leading = False
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    async def _worker(self) -> None:
        while True:
            key = await self.queue.get()
            if self.measured:
                selfmetrics.IN_FLIGHT.inc()
            started = time.perf_counter()
            error = None
            try:
                await self._reconcile(key)
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                error = self._failed(key, e)
            finally:
                if self.measured:
                    selfmetrics.IN_FLIGHT.dec()
                    selfmetrics.RECONCILE_SECONDS.labels("ok" if error is None else "error").observe(
                        time.perf_counter() - started)
                self.queue.done(key)
            if error is not None and self.measured:
                selfmetrics.RECONCILE_ERRORS.labels(error).inc()

    def _failed(self, key: Key, e: Exception) -> str:
        """Queue the key again as its failure says; the failure's name for the metrics."""
        what = f"{self.kind} {key[0]}/{key[1]}"
        if isinstance(e, NotLeadingError):
            log.warning("reconcile of %s stopped: no longer the leader", what)
            return "NotLeading"
        if isinstance(e, RetryLater):
            log.info("reconcile of %s waits: %s", what, e)
            self.queue.add_after(key, e.retry_after)
            return "ForeignObject"
        if isinstance(e, ApiError) and e.status == 409:
            self.queue.add_after(key, 0.05)  # our view was stale; the watch brings the new one
            return "Conflict"
        if isinstance(e, ApiError):
            failures = self._failures[key] = self._failures.get(key, 0) + 1
            log.warning("reconcile of %s failed (%d in a row): %s", what, failures, e)
            self.queue.add_after(key, min(60.0, 0.5 * 2 ** failures))
            return f"Api{e.status}"
        log.exception("reconcile of %s failed", what, exc_info=e)
        self.queue.add_after(key, 2.0)
        return type(e).__name__
