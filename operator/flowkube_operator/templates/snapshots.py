"""Template snapshots: the ControllerRevisions that store a template once per generation.

A Flow of a template takes it at its first reconcile (`flows.reconcile.state.FlowState.take_template`);
what it took is stored once per (namespace, template uid, generation) as an immutable
`apps/v1 ControllerRevision` named by a hash of its content (`flowkube_api.templates.snapshot_name`),
and `status.template` names it. This module is the operator's side of them:

- **the read**: `SpecCache`, a bounded LRU of template specs keyed by (namespace, snapshot name),
  bounded by count and by bytes, each entry checked against the hash its Flow recorded. Content-
  addressed and immutable, so the 5,000 Flows of one template share one entry; a miss is one GET.
- **the references**: `Index`, fed by every Flow cache event (a listener) and by a label-selected
  watch of the ControllerRevisions (only name, namespace and uid kept): how many cached Flows name
  each snapshot, updated per event, never a scan of all Flows.
- **garbage collection**: `Index.sweep`, run by the leader on a timer, returns the snapshots to
  delete (`collectable`: unreferenced by any cached Flow, no take of this process in flight, and seen
  unreferenced at `grace` consecutive sweeps); the controller deletes each with a uid precondition.

The pure parts (LRU, index, `collectable`) are tested without a cluster; the I/O is in
`Snapshots`, on the controller's client.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from flowkube_api import constants as c
from flowkube_api import templates
from flowkube_operator.kube.client import ApiError, Kube, delete_if_same, ns_path
from flowkube_operator.kube.informer import Informer

Body = dict[str, Any]
SnapKey = tuple[str, str]  # (namespace, snapshot name)
FlowKey = tuple[str, str]
log = logging.getLogger("flowkube.snapshots")

SELECTOR = f"{c.LABEL_MANAGED_BY}={c.MANAGED_BY},{c.LABEL_TEMPLATE}"


def snapshot_path(namespace: str, name: str = "") -> str:
    if not namespace:
        return f"/apis/apps/v1/{templates.SNAPSHOT_PLURAL}"
    return ns_path(namespace, templates.SNAPSHOT_PLURAL, name or None, group="apps", version="v1")


def reference(flow: Body | None) -> SnapKey | None:
    """The snapshot a (cached) Flow names in status.template, or None."""
    if not flow:
        return None
    taken = (flow.get("status") or {}).get("template")
    name = taken.get("snapshot") if isinstance(taken, Mapping) else None
    ns = (flow.get("metadata") or {}).get("namespace")
    return (str(ns), str(name)) if name and ns else None


PER_VALUE = 100  # bytes of memory a parsed JSON value may take beyond its text (an empty dict: 64, and its slot)


def footprint(text: bytes) -> int:
    """An upper estimate of the memory a JSON document takes once parsed: its text, and PER_VALUE for
    each value in it (every value but the first follows a `{`, `[`, `,` or `:`). A spec's JSON bytes
    say little: 255 kB of empty objects, within every bound of a template, is 5.8 MB of Python objects
    (this estimate: 16 MB); 250 kB of one string is 250 kB."""
    return len(text) + PER_VALUE * (text.count(b"{") + text.count(b"[") + text.count(b",") + text.count(b":") + 1)


class SpecCache:
    """Template specs by a key (here (namespace, snapshot name); the template cache's by template and
    generation), least recently used first out; at most ``entries`` of them and ``max_bytes`` of their
    estimated memory together (`footprint`: their JSON's size says little of what they take parsed).
    A spec larger than the whole bound is not kept: it is read again at each use."""

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries, self.max_bytes = max(entries, 1), max_bytes
        self._items: OrderedDict[tuple[str, ...], tuple[Body, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: tuple[str, ...]) -> Body | None:
        hit = self._items.get(key)
        if hit is None:
            return None
        self._items.move_to_end(key)
        return hit[0]

    def put(self, key: tuple[str, ...], spec: Body) -> None:
        size = footprint(templates.canonical(spec))
        old = self._items.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
        if size > self.max_bytes:
            return  # never kept: read again at each use (bounded memory wins over one GET)
        self._items[key] = (spec, size)
        self.bytes += size
        while len(self._items) > self.entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._items.popitem(last=False)
            self.bytes -= dropped


def collectable(existing: Mapping[SnapKey, str], refs: Mapping[SnapKey, int], in_flight: set[SnapKey],
                unreferenced: Mapping[SnapKey, int], grace: int) -> tuple[dict[SnapKey, int], list[SnapKey]]:
    """One sweep's decision: (how many sweeps in a row each existing snapshot has now been seen
    unreferenced, the ones to delete). A snapshot is deleted once no cached Flow names it, no take of
    this process is about to name it, and that has held at ``grace`` sweeps in a row (a Flow whose
    status write that names it is on its way through the watch is not raced)."""
    seen: dict[SnapKey, int] = {}
    delete = []
    for key in existing:
        if refs.get(key, 0) > 0 or key in in_flight:
            continue
        seen[key] = unreferenced.get(key, 0) + 1
        if seen[key] >= grace:
            delete.append(key)
    return seen, delete


class Index:
    """Which snapshots exist (their uids, from the watch) and how many cached Flows name each."""

    def __init__(self, grace: int = 2) -> None:
        self.grace = grace
        self.existing: dict[SnapKey, str] = {}  # -> uid
        self.refs: dict[SnapKey, int] = {}
        self.of_flow: dict[FlowKey, SnapKey] = {}
        self.in_flight: set[SnapKey] = set()
        self.unreferenced: dict[SnapKey, int] = {}

    def flow_changed(self, key: FlowKey, body: Body | None) -> None:
        """A Flow cache listener: the reference counts follow each Flow event (O(1))."""
        new, old = reference(body), self.of_flow.get(key)
        if new == old:
            return
        if old is not None:
            left = self.refs.get(old, 0) - 1
            if left > 0:
                self.refs[old] = left
            else:
                self.refs.pop(old, None)
            del self.of_flow[key]
        if new is not None:
            self.of_flow[key] = new
            self.refs[new] = self.refs.get(new, 0) + 1
            self.in_flight.discard(new)  # the take is done: the cache shows its reference
            self.unreferenced.pop(new, None)

    def event(self, event_type: str, body: Body) -> None:
        """The ControllerRevisions' watch: only name, namespace and uid are kept."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if event_type == "DELETED":
            self.existing.pop(key, None)
            self.unreferenced.pop(key, None)
        else:
            self.existing[key] = str(meta.get("uid") or "")

    def sweep(self) -> list[tuple[SnapKey, str]]:
        """The snapshots to delete now, with the uid each must still have."""
        self.unreferenced, delete = collectable(self.existing, self.refs, self.in_flight, self.unreferenced,
                                                self.grace)
        return [(key, self.existing[key]) for key in delete]


class SnapshotMismatchError(Exception):
    """A ControllerRevision of a snapshot's name exists and holds something else (its name squatted)."""


class Snapshots:
    """The operator's snapshots: their reads (through the LRU), creates, watch and sweeps."""

    def __init__(self, kube: Callable[[], Kube | None], entries: int, max_bytes: int, grace: int = 2) -> None:
        self.kube = kube
        self.specs = SpecCache(entries, max_bytes)
        self.index = Index(grace)
        self._informers: list[Informer] = []
        # Snapshots whose DELETE is on its way: a take of one waits for it, then creates it anew (a take
        # that found it just before the DELETE landed would name a snapshot about to be gone).
        self._deleting: dict[SnapKey, asyncio.Event] = {}
        # What each snapshot this process made or found holds (its data without the spec, and the
        # uid it had): the next Flow of the same template generation takes it without a request.
        # Without this, 5,000 Flows of one 250 KiB template sent 2.5 GB (a POST answered
        # AlreadyExists and a GET per Flow) and held the event loop long enough to miss a Lease renewal.
        self._stored: dict[SnapKey, tuple[str, Body, str]] = {}  # -> (uid, data without spec, data's hash)

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        self._informers = [Informer(kube, snapshot_path(ns), templates.SNAPSHOT_API_VERSION, templates.SNAPSHOT_KIND,
                                    self.index.event, label_selector=SELECTOR) for ns in namespaces or [""]]
        return self._informers

    def synced(self) -> bool:
        return bool(self._informers) and all(i.synced.is_set() for i in self._informers)

    async def load(self, namespace: str, taken: Mapping[str, Any]) -> tuple[Body | None, str | None]:
        """(the template spec `taken` (a status.template with a snapshot) names, None) or (None, why it
        cannot be used: gone, or not what the Flow took). An API error other than 404 raises (the
        reconcile is tried again; a Flow is never failed for a moment's outage)."""
        name = str(taken.get("snapshot") or "")
        key = (namespace, name)
        spec = self.specs.get(key)
        if spec is not None:
            return spec, None
        kube = self.kube()
        if kube is None:
            raise ApiError(503, "not logged in yet", "GET", snapshot_path(namespace, name))
        obj = await kube.get(snapshot_path(namespace, name))
        problem = templates.snapshot_problem(taken, obj)
        if problem is not None:
            return None, problem
        assert obj is not None
        spec = dict(obj["data"].get("spec") or {})
        self.specs.put(key, spec)
        return spec, None

    async def ensure(self, obj: Body, fence: Callable[[], None]) -> tuple[Body, str]:
        """Create the snapshot `obj` before the status write that names it; returns the `data` it holds
        and that data's hash (`templates.data_hash`, taken once per snapshot, not once per take).
        AlreadyExists is success when it holds the same template generation (another Flow took it):
        its data is returned (its resourceVersion may be an earlier one of the same generation, when
        only the template's metadata changed between the takes), and the Flow names that. Another
        content under its name raises SnapshotMismatchError."""
        meta, data = obj["metadata"], obj["data"]
        key = (meta["namespace"], meta["name"])
        self.index.in_flight.add(key)  # before the create: a sweep now must not take it
        known = self._known(key)
        if known is not None:
            return known
        kube = self.kube()
        assert kube is not None
        for _ in range(3):  # a snapshot deleted between the AlreadyExists and the read is made again
            while key in self._deleting:
                await self._deleting[key].wait()
            fence()
            created = await kube.create(snapshot_path(meta["namespace"]), obj)
            if created is not None:
                uid = str((created.get("metadata") or {}).get("uid") or "")
                break
            existing = await kube.get(snapshot_path(*key))
            if existing is None:
                continue
            stored = existing.get("data")
            if not isinstance(stored, Mapping) or templates.snapshot_name(stored) != meta["name"]:
                self.index.in_flight.discard(key)
                raise SnapshotMismatchError(
                    f"ControllerRevision {key[0]}/{key[1]} exists and does not hold this template's snapshot "
                    "(something else has its name); the Flow does not run it")
            data, uid = dict(stored), str((existing.get("metadata") or {}).get("uid") or "")
            break
        else:
            self.index.in_flight.discard(key)
            raise ApiError(409, "the snapshot vanished after each AlreadyExists", "POST", snapshot_path(*key))
        self.specs.put(key, dict(data.get("spec") or {}))
        digest = templates.data_hash(data)
        if uid:
            self._stored[key] = (uid, {k: v for k, v in data.items() if k != "spec"}, digest)
        return dict(data), digest

    def _known(self, key: SnapKey) -> tuple[Body, str] | None:
        """The data (and its hash) of a snapshot this process made or found, while the watch shows that
        same object and its spec is in the LRU; None: ask the API server."""
        stored = self._stored.get(key)
        if stored is None or key in self._deleting or self.index.existing.get(key) != stored[0]:
            return None
        spec = self.specs.get(key)
        return None if spec is None else ({**stored[1], "spec": spec}, stored[2])

    def not_taken(self, obj: Body | None) -> None:
        """A take whose status write failed: no longer in flight (the retry adds it again)."""
        if obj is not None:
            self.index.in_flight.discard((obj["metadata"]["namespace"], obj["metadata"]["name"]))

    async def sweep(self, fence: Callable[[], None]) -> int:
        """Delete the snapshots no Flow names any more (see `collectable`); returns how many."""
        kube = self.kube()
        if kube is None or not self.synced():
            return 0
        for gone in self._stored.keys() - self.index.existing.keys():
            del self._stored[gone]
        deleted = 0
        for key, uid in self.index.sweep():
            if key in self.index.in_flight or self.index.refs.get(key):
                continue  # taken again while an earlier DELETE of this sweep was on its way
            fence()
            log.info("deleting template snapshot %s/%s: no Flow names it", *key)
            done = self._deleting[key] = asyncio.Event()  # marked before the first await: a take waits
            try:
                await kube.delete(snapshot_path(*key), delete_if_same(uid))
            finally:
                del self._deleting[key]
                done.set()
            deleted += 1
        return deleted
