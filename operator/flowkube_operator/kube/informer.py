"""List-then-watch of one kind of object, as client-go's reflector does it, feeding the controller.

The operator watches its Flows, runner pods, templates, CronFlows, labelled Secrets and (the leader,
for notifications) nodes and ServiceCIDRs. It needs no more than the events, in
order, and the guarantee that after any break (a dropped connection, an API server restart, a
watch too old to resume) what it is told adds up to what exists. That is all this does:

- the first list, and every relist, is read in pages and delivered as ADDED; an object known before
  that the list no longer has is delivered as DELETED (an object deleted while the watch was down is
  not left in the caches for ever);
- the watch resumes from the last resourceVersion seen (BOOKMARKs keep it current when nothing of
  ours changes); a 410 Gone, or an ERROR event, means relist;
- a dropped connection is retried with a capped backoff, resuming where it was.

Memory: a list is read a page at a time, each page bounded by bytes as well as by count. The first
page asks for FIRST_PAGE objects, few enough that a page of objects of the API server's largest size
(MAX_OBJECT_BYTES, etcd's 1.5 MiB) stays under PAGE_BYTES; each next page asks for as many as fit in
half of PAGE_BYTES at the bytes per object of the page before (at most PAGE). Objects of one
collection vary, so this is an estimate; the bound itself is enforced on the answer: a page over
PAGE_BYTES is cut off as it comes (http1.TooLargeError, nothing more read) and asked again, with the
same continue token, for FIRST_PAGE objects or fewer, and that list's pages never grow back to half
as many as the page that was cut off. So a list never holds more than PAGE_BYTES of
answer (and its decoded objects) at once, whatever the tenants' objects weigh; the consumer keeps
only its projection of each. Of every object delivered, the informer itself keeps its key, its uid
and the one label a DELETED after a relist must carry (`keep_label`, the runner pod's Flow): not
its labels, which a tenant writes.

Each event costs one JSON decode (orjson) and one call. This replaced kopf's watching, whose
per-event machinery (a logger, cause detection and bookkeeping per event) was about a quarter of the
operator's CPU in a burst, and which watched every pod of the cluster and filtered runner pods in
Python (here the API server filters, by label). kopf still serves the admission webhooks and logs in;
/healthz and /readyz are the operator's own (app.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from flowkube_api import constants as c
from flowkube_operator import selfmetrics
from flowkube_operator.kube.client import ApiError, Kube
from flowkube_operator.kube.http1 import TooLargeError

Body = dict[str, Any]
Key = tuple[str, str]
log = logging.getLogger("flowkube.informer")

PAGE = 500  # objects per list page at most, as client-go's reflector pages its lists
PAGE_BYTES = 32 * 1024 * 1024  # bytes of one list page's answer at most (see the module's docstring)
MAX_OBJECT_BYTES = 1536 * 1024  # the largest object the API server stores (etcd's request limit)
FIRST_PAGE = 16  # 16 objects of MAX_OBJECT_BYTES: 24 MiB, JSON's overhead on top still under PAGE_BYTES
WATCH_SECONDS = 300  # the API server ends each watch after this; it is then resumed where it was
BACKOFF_CAP = 10.0  # seconds between tries while the API server does not answer


class Relist(Exception):
    """The watch cannot resume from where it was (410 Gone, an ERROR event): list again."""


@dataclass
class Informer:
    """One kind of object, in one namespace or all of them, delivered to ``on_event(type, object)``."""

    kube: Callable[[], Kube | None]  # the client of the latest login
    path: str  # the collection, e.g. /api/v1/pods or /apis/flowkube.io/v1alpha1/namespaces/ns/flows
    api_version: str
    kind: str
    on_event: Callable[[str, Body], None]
    label_selector: str = ""
    synced: asyncio.Event = field(default_factory=asyncio.Event)  # set once the first list is delivered
    keep_label: str = c.LABEL_FLOW  # the one label a DELETED after a relist carries (cache.pod_event reads it)
    # What each known object was last seen as (uid, keep_label's value), to say DELETED for one a
    # relist no longer has.
    _known: dict[Key, tuple[str, str]] = field(default_factory=dict)
    _rv: str = ""

    async def run(self) -> None:
        failures = 0
        while True:
            try:
                if not self._rv:
                    await self._list()
                await self._watch()
                failures = 0
            except Relist as e:
                log.info("%s: %s; listing again", self.path, e)
                self._rv = ""
            except asyncio.CancelledError:
                raise
            except Exception as e:  # a refusal, a dropped connection, a line that is not JSON: never stop
                failures += 1
                log.warning("%s: watch broke (%s: %s); resuming", self.path, type(e).__name__, e)
                if isinstance(e, ApiError) and e.status == 410:
                    self._rv = ""
                await asyncio.sleep(min(BACKOFF_CAP, 0.2 * 2 ** failures))

    def _client(self) -> Kube:
        kube = self.kube()
        if kube is None:
            raise ConnectionError("not logged in yet")
        return kube

    async def _list(self) -> None:
        """Each page is delivered as it comes (10,000 Flows are never all decoded at once); what was
        known and is not listed any more is DELETED once the last page is in."""
        limit, ceiling, cont = FIRST_PAGE, PAGE, ""
        listed: set[Key] = set()
        while True:
            params = self._params(limit=str(limit), **({"continue": cont} if cont else {}))
            try:
                page, size = await self._client().list_page(self.path, params, max_bytes=PAGE_BYTES)
            except TooLargeError:
                if limit == 1:
                    raise
                # Small objects then big ones: never again as many as failed (no seesaw of cut-offs).
                ceiling = max(1, limit // 2)
                limit = min(FIRST_PAGE, ceiling)
                log.info("%s: a list page was over %d bytes; asking for %d objects a page", self.path,
                         PAGE_BYTES, limit)
                continue
            items = page.get("items") or []
            for obj in items:
                obj["apiVersion"], obj["kind"] = self.api_version, self.kind  # lists leave them out
                key = _key(obj)
                known = self._known.get(key)
                if known is not None and known[0] != obj["metadata"].get("uid"):
                    self._deliver_deleted(key, known)  # deleted and made again while nobody watched
                listed.add(key)
                self._deliver("ADDED", obj)
            cont = (page.get("metadata") or {}).get("continue") or ""
            if not cont:
                break
            limit = min(ceiling, next_limit(size, len(items)))
            del page, items
        for key in self._known.keys() - listed:
            self._deliver_deleted(key, self._known[key])
        self._rv = str(page.get("metadata", {}).get("resourceVersion", ""))
        self.synced.set()
        selfmetrics.CACHE_SYNCED.labels(self.path).set(1)

    def _params(self, **params: str) -> dict[str, str]:
        return {**params, "labelSelector": self.label_selector} if self.label_selector else params

    def _deliver_deleted(self, key: Key, known: tuple[str, str]) -> None:
        meta: Body = {"namespace": key[0], "name": key[1], "uid": known[0]}
        if known[1]:
            meta["labels"] = {self.keep_label: known[1]}
        self._deliver("DELETED", {"apiVersion": self.api_version, "kind": self.kind, "metadata": meta})

    async def _watch(self) -> None:
        params = self._params(watch="1", allowWatchBookmarks="true", resourceVersion=self._rv,
                              timeoutSeconds=str(WATCH_SECONDS))
        events: AsyncIterator[Body] = self._client().watch(self.path, params, read_timeout=WATCH_SECONDS + 30)
        async for event in events:
            etype, obj = event.get("type"), event.get("object") or {}
            if etype == "ERROR":  # 410 Gone (too old to resume) or another Status: list again
                raise Relist(f"watch error {obj.get('code')}: {obj.get('message')}")
            rv = (obj.get("metadata") or {}).get("resourceVersion")
            if rv:
                self._rv = str(rv)
            if etype in ("ADDED", "MODIFIED", "DELETED"):
                self._deliver(etype, obj)

    def _deliver(self, etype: str, obj: Body) -> None:
        key = _key(obj)
        if etype == "DELETED":
            self._known.pop(key, None)
        else:
            meta = obj.get("metadata") or {}
            self._known[key] = (str(meta.get("uid", "")), str((meta.get("labels") or {}).get(self.keep_label) or ""))
        try:
            self.on_event(etype, obj)
        except Exception:  # one object the controller cannot take must not stop the watch of all
            log.exception("%s: handling %s %s/%s failed", self.path, etype, *key)


def next_limit(size: int, count: int) -> int:
    """Objects to ask for in the next page, from the last page's size in bytes and its objects: as
    many as fit in half of PAGE_BYTES at that size each, at least 1, at most PAGE."""
    if count <= 0:
        return FIRST_PAGE
    per_object = max(1, size // count)
    return max(1, min(PAGE, PAGE_BYTES // 2 // per_object))


def _key(obj: Body) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")
