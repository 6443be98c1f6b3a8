"""What the operator's two controllers (Flows, CronFlows) share: the work queue, the merge patch
of their status writes, and the error that stops a replica that no longer leads from writing."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import time
from typing import Any

from flowkube_operator import selfmetrics

Key = tuple[str, str]
Body = dict[str, Any]


class NotLeadingError(Exception):
    """This replica may no longer write: its Lease ran out (the next leader reconciles the Flow)."""


def merge_patch(old: Any, new: Any) -> Any:
    """RFC 7386 merge patch turning old into new (lists are replaced whole)."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return new
    patch: Body = {}
    for k in old.keys() - new.keys():
        patch[k] = None
    for k, v in new.items():
        if k not in old:
            patch[k] = v
        elif old[k] != v:
            patch[k] = merge_patch(old[k], v)
    return patch


class WorkQueue:
    """De-duplicating queue with delayed adds; a key is handed to one worker at a time. ``gauges``:
    this is the Flows' queue, whose depth the operator's own metrics show."""

    def __init__(self, gauges: bool = True) -> None:
        self.gauges = gauges
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._dirty: set[Key] = set()
        self._delayed: list[tuple[float, Key]] = []
        self._wake = asyncio.Event()

    def add(self, key: Key) -> None:
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)
        if self.gauges:
            selfmetrics.QUEUE_DEPTH.set(len(self._queued))

    def add_after(self, key: Key, seconds: float) -> None:
        heapq.heappush(self._delayed, (time.monotonic() + seconds, key))
        if self.gauges:
            selfmetrics.DELAYED.set(len(self._delayed))
        self._wake.set()

    async def get(self) -> Key:
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        if self.gauges:
            selfmetrics.QUEUE_DEPTH.set(len(self._queued))
        return key

    def done(self, key: Key) -> None:
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            self.add(key)

    async def run_timers(self) -> None:
        while True:
            now = time.monotonic()
            while self._delayed and self._delayed[0][0] <= now:
                _, key = heapq.heappop(self._delayed)
                self.add(key)
            if self.gauges:
                selfmetrics.DELAYED.set(len(self._delayed))
            timeout = self._delayed[0][0] - now if self._delayed else None
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout)
