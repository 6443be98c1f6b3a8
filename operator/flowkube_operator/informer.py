"""List-then-watch of one kind of object, as client-go's reflector does it, feeding the controller.

The operator watches two things: its Flows and its runner pods. It needs no more than the events, in
order, and the guarantee that after any break (a dropped connection, an API server restart, a
watch too old to resume) what it is told adds up to what exists. That is all this does:

- the first list, and every relist, is read in pages and delivered as ADDED; an object known before
  that the list no longer has is delivered as DELETED (an object deleted while the watch was down is
  not left in the caches for ever);
- the watch resumes from the last resourceVersion seen (BOOKMARKs keep it current when nothing of
  ours changes); a 410 Gone, or an ERROR event, means relist;
- a dropped connection is retried with a capped backoff, resuming where it was.

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

from flowkube_operator import selfmetrics
from flowkube_operator.kube import ApiError, Kube

Body = dict[str, Any]
Key = tuple[str, str]
log = logging.getLogger("flowkube.informer")

PAGE = 500  # objects per list page, as client-go's reflector pages its lists
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
    # What each known object was last seen as, to say DELETED for one a relist no longer has.
    _known: dict[Key, Body] = field(default_factory=dict)
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
        params = self._params(limit=str(PAGE))
        listed: set[Key] = set()
        while True:
            page = await self._client().request("GET", self.path, params=params)
            for obj in page.get("items") or []:
                obj["apiVersion"], obj["kind"] = self.api_version, self.kind  # lists leave them out
                key = _key(obj)
                known = self._known.get(key)
                if known is not None and known["uid"] != obj["metadata"].get("uid"):
                    self._deliver_deleted(known)  # deleted and made again while nobody watched
                listed.add(key)
                self._deliver("ADDED", obj)
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                break
            params["continue"] = cont
        for key in self._known.keys() - listed:
            self._deliver_deleted(self._known[key])
        self._rv = str(page.get("metadata", {}).get("resourceVersion", ""))
        self.synced.set()
        selfmetrics.CACHE_SYNCED.labels(self.path).set(1)

    def _params(self, **params: str) -> dict[str, str]:
        return {**params, "labelSelector": self.label_selector} if self.label_selector else params

    def _deliver_deleted(self, meta: Body) -> None:
        self._deliver("DELETED", {"apiVersion": self.api_version, "kind": self.kind, "metadata": dict(meta)})

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
            self._known[key] = {"name": key[1], "namespace": key[0], "uid": meta.get("uid", ""),
                                "labels": meta.get("labels") or {}}
        try:
            self.on_event(etype, obj)
        except Exception:  # one object the controller cannot take must not stop the watch of all
            log.exception("%s: handling %s %s/%s failed", self.path, etype, *key)


def _key(obj: Body) -> Key:
    meta = obj.get("metadata") or {}
    return meta.get("namespace", ""), meta.get("name", "")
