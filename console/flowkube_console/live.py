"""Live views of Flows, one per signed-in credential: a list, then a watch, with the user's token.

A ``Feed`` keeps a ``Summary`` of every Flow the user may list (cluster-wide when RBAC allows it,
otherwise in the console's configured namespaces) and wakes the pages that show them (server-sent
events) when anything changes. Feeds are shared by the pages of one credential and closed a while
after the last page leaves; their number is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from flowkube_console.auth import Credential
from flowkube_console.kube import ApiError, Kube, cancel, flows_path
from flowkube_console.views import Summary, summarise

log = logging.getLogger("flowkube.console.live")
Key = tuple[str, str]
RETRY_SECONDS = (0.5, 1, 2, 5, 10)
NAMESPACE_LIMIT = 64  # namespaces one feed follows one by one


class Feed:
    def __init__(self, kube: Kube, token: str | None, namespaces: tuple[str, ...]) -> None:
        self.kube = kube
        self.token = token
        self.namespaces = namespaces  # followed when the user may not list Flows cluster-wide
        self.flows: dict[Key, Summary] = {}
        self.version = 0
        self.cluster_refused = False
        self.problems: dict[str, str] = {}  # namespace ("" for all) -> why it is not in view
        self.users = 0
        self.idle_since = time.monotonic()
        self._changed = asyncio.Condition()
        self._tasks: dict[str | None, asyncio.Task[None]] = {}
        self._ready: dict[str | None, asyncio.Event] = {}
        self._wanted: set[str] = set()

    @property
    def scope(self) -> tuple[str, ...]:
        """The namespaces followed one by one (none: all of them, with one cluster-wide watch)."""
        return tuple(sorted(ns for ns in self._tasks if ns is not None))

    def start(self) -> Feed:
        self._follow_scope(None)
        return self

    def _follow_scope(self, namespace: str | None) -> None:
        if namespace not in self._tasks and len(self._tasks) <= NAMESPACE_LIMIT:
            self._ready[namespace] = asyncio.Event()
            self._tasks[namespace] = asyncio.create_task(self._follow(namespace))

    def want(self, namespaces: set[str]) -> list[asyncio.Event]:
        """Also follow ``namespaces`` (the one a page filters on, a ServiceAccount's own) when the
        cluster-wide list is refused; the events are set once each is listed."""
        self._wanted |= {ns for ns in namespaces if ns}
        if self.cluster_refused:
            for ns in sorted(self._wanted):
                self._follow_scope(ns)
        return [e for e in self._ready.values() if not e.is_set()]

    async def ready(self, within: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                for ns in list(self._ready):
                    await self._ready[ns].wait()

    async def close(self) -> None:
        for t in self._tasks.values():
            await cancel(t)

    async def _bump(self) -> None:
        async with self._changed:
            self.version += 1
            self._changed.notify_all()

    async def changed(self, seen: int, within: float) -> int:
        """The version after ``seen`` (or ``seen`` again after ``within`` seconds)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait_for(lambda: self.version != seen), within)
            return self.version

    def summaries(self) -> list[Summary]:
        return list(self.flows.values())

    async def _follow(self, namespace: str | None) -> None:
        """List then watch one scope, for as long as the feed lives; a refusal of the cluster-wide
        list turns the feed to the configured and wanted namespaces."""
        attempt = 0
        while True:
            try:
                rv = await self._relist(namespace)
                attempt = 0
                while True:
                    rv = await self._watch(namespace, rv)
            except ApiError as e:
                if e.status in (401, 403):
                    self.problems[namespace or ""] = e.message
                    if namespace is None:
                        self.cluster_refused = True
                        for ns in sorted({*self.namespaces, *self._wanted}):
                            self._follow_scope(ns)
                    self._ready[namespace].set()
                    await self._bump()
                    return
                if e.status != 410:
                    await self._retry(namespace, e.message, attempt)
                    attempt += 1
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a feed never dies quietly: it says why and lists again
                await self._retry(namespace, str(e) or type(e).__name__, attempt)
                attempt += 1

    async def _retry(self, namespace: str | None, problem: str, attempt: int) -> None:
        """Shown on the pages (which stop waiting for this scope) until a list succeeds; then again."""
        log.warning("flows in %s: %s", namespace or "all namespaces", problem)
        self.problems[namespace or ""] = f"not followed, retrying: {problem}"
        self._ready[namespace].set()
        await self._bump()
        await asyncio.sleep(RETRY_SECONDS[min(attempt, len(RETRY_SECONDS) - 1)])

    def _in(self, namespace: str | None, key: Key) -> bool:
        return namespace is None or key[0] == namespace

    async def _relist(self, namespace: str | None) -> str:
        fresh: dict[Key, Summary] = {}
        rv = ""
        async for item in self.kube.list_all(flows_path(namespace), self.token):
            if "_list" in item:
                rv = str(item["_list"].get("resourceVersion") or "")
            else:
                s = summarise(item)
                fresh[s.key] = s
        for key in [k for k in self.flows if self._in(namespace, k) and k not in fresh]:
            del self.flows[key]
        self.flows.update(fresh)
        self.problems.pop(namespace or "", None)
        self._ready[namespace].set()
        await self._bump()
        return rv

    async def _watch(self, namespace: str | None, rv: str) -> str:
        async for event in self.kube.watch(flows_path(namespace), self.token, rv):
            obj: dict[str, Any] = event.get("object") or {}
            rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
            kind = event.get("type")
            if kind == "BOOKMARK":
                continue
            s = summarise(obj)
            if kind == "DELETED":
                self.flows.pop(s.key, None)
            else:
                self.flows[s.key] = s
            await self._bump()
        return rv


class Feeds:
    """The live feeds by credential; at most ``limit``, each kept ``linger`` seconds after its last page."""

    def __init__(self, kube: Kube, namespaces: tuple[str, ...], limit: int = 256, linger: float = 120.0) -> None:
        self.kube = kube
        self.namespaces = namespaces
        self.limit = limit
        self.linger = linger
        self._feeds: dict[str, Feed] = {}

    def __len__(self) -> int:
        return len(self._feeds)

    async def _evict(self) -> None:
        now = time.monotonic()
        for key, feed in list(self._feeds.items()):
            if feed.users == 0 and (now - feed.idle_since > self.linger or len(self._feeds) >= self.limit):
                del self._feeds[key]
                await feed.close()

    @contextlib.asynccontextmanager
    async def use(self, cred: Credential, wanted: set[str] | None = None,
                  ready_within: float = 10.0) -> AsyncIterator[Feed]:
        await self._evict()
        key = cred.key
        feed = self._feeds.get(key)
        if feed is None:
            if len(self._feeds) >= self.limit:
                raise ApiError(503, "the console follows as many users as it may; try again shortly")
            feed = self._feeds[key] = Feed(self.kube, cred.token, self.namespaces).start()
        feed.users += 1
        try:
            await feed.ready(ready_within)
            if wanted and feed.want(wanted):
                await feed.ready(ready_within)
            yield feed
        finally:
            feed.users -= 1
            feed.idle_since = time.monotonic()

    async def close(self) -> None:
        for feed in self._feeds.values():
            await feed.close()
        self._feeds.clear()
