"""Template snapshots: stored once per generation, read through a bounded LRU, collected when unreferenced."""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any

import pytest

from flowkube_api import templates
from flowkube_operator.flows.controller import Controller, ForeignObjectError
from flowkube_operator.settings import Settings
from flowkube_operator.templates.snapshots import Index, SpecCache, collectable, footprint

TEMPLATE = {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate",
            "metadata": {"name": "article", "namespace": "ns", "uid": "t1", "generation": 3, "resourceVersion": "9"},
            "spec": {"template": {"flowRef": "pkg.mod:Article", "image": "runner:template"},
                     "parameters": [{"name": "topic", "type": "string"}]}}


def test_the_spec_cache_is_bounded_by_count_and_by_bytes() -> None:
    cache = SpecCache(entries=2, max_bytes=1000)
    cache.put(("ns", "a"), {"x": "1"})
    cache.put(("ns", "b"), {"x": "2"})
    assert cache.get(("ns", "a")) == {"x": "1"}  # a is now the most recently used
    cache.put(("ns", "c"), {"x": "3"})
    assert cache.get(("ns", "b")) is None and len(cache) == 2
    cache.put(("ns", "big"), {"x": "y" * 680})
    assert len(cache) == 1 and cache.bytes <= 1000 and cache.get(("ns", "big")) is not None
    cache.put(("ns", "huge"), {"x": "y" * 2000})  # above the whole bound: never kept, read at each use
    assert cache.get(("ns", "huge")) is None and cache.bytes <= 1000


def test_the_spec_cache_counts_what_a_spec_takes_parsed_not_its_json() -> None:
    """255 kB of empty objects (within every bound of a template) is 5.8 MB of Python objects: 64 of
    them in a cache bounded by their JSON's 64 MiB would have been 370 MB (bench_scale's finding)."""
    import tracemalloc

    spec: dict[str, Any] = {"template": {"inputs": {"x": [{} for _ in range(80_000)]}}}
    text = templates.canonical(spec)
    tracemalloc.start()
    parsed = json.loads(text)
    taken, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert parsed == spec and len(text) < 256 * 1024 < 20 * len(text) < taken
    assert footprint(text) >= taken
    cache = SpecCache(entries=64, max_bytes=64 << 20)
    for i in range(64):
        cache.put(("ns", f"s{i}"), spec)
    assert cache.bytes <= 64 << 20 and len(cache) == (64 << 20) // footprint(text)


def test_garbage_collection_takes_only_snapshots_unreferenced_for_the_grace_and_not_in_flight() -> None:
    existing = {("ns", "a"): "ua", ("ns", "b"): "ub", ("ns", "c"): "uc"}
    seen, delete = collectable(existing, {("ns", "a"): 2}, {("ns", "c")}, {}, grace=2)
    assert seen == {("ns", "b"): 1} and delete == [], "first seen unreferenced: not yet"
    seen, delete = collectable(existing, {("ns", "a"): 2}, {("ns", "c")}, seen, grace=2)
    assert delete == [("ns", "b")]
    # Referenced again in between: it starts over.
    seen, delete = collectable(existing, {("ns", "b"): 1}, set(), {("ns", "b"): 1}, grace=2)
    assert ("ns", "b") not in seen and delete == []


def test_the_index_counts_references_per_flow_event_and_a_take_in_flight_is_kept() -> None:
    index = Index(grace=2)

    def flow(name: str, snapshot: str | None) -> dict[str, Any]:
        status = {"template": {"kind": "FlowTemplate", "name": "t", "snapshot": snapshot}} if snapshot else {}
        return {"metadata": {"name": name, "namespace": "ns"}, "status": status}

    index.event("ADDED", {"metadata": {"name": "t-1", "namespace": "ns", "uid": "u1", "labels": {}}})
    index.in_flight.add(("ns", "t-1"))
    assert index.sweep() == [] and index.sweep() == [], "a take in flight is never collected"
    for i in range(20):
        index.flow_changed(("ns", f"f{i}"), flow(f"f{i}", "t-1"))
    assert index.refs == {("ns", "t-1"): 20} and not index.in_flight, "the cache shows the reference"
    index.flow_changed(("ns", "f0"), flow("f0", "t-1"))  # a status write of a Flow: still one reference
    assert index.refs == {("ns", "t-1"): 20}
    for i in range(19):
        index.flow_changed(("ns", f"f{i}"), None)
    assert index.sweep() == [] and index.sweep() == []
    index.flow_changed(("ns", "f19"), None)
    assert index.sweep() == [] and index.sweep() == [(("ns", "t-1"), "u1")]
    index.event("DELETED", {"metadata": {"name": "t-1", "namespace": "ns"}})
    assert index.sweep() == [] and not index.existing


class Store:
    """Just enough of an API server: ControllerRevisions by path, Flow status writes, pods."""

    def __init__(self) -> None:
        self.objects: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    async def create(self, path: str, body: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(("POST", path))
        if path.endswith("/events"):
            return body
        full = f"{path}/{body['metadata']['name']}"
        if full in self.objects:
            return None
        self.objects[full] = created = {**copy.deepcopy(body), "metadata": {
            **body["metadata"], "uid": f"uid-{len(self.objects)}", "resourceVersion": "12",
            "creationTimestamp": "2026-11-24T01:02:03Z"}}
        return created

    async def get(self, path: str) -> dict[str, Any] | None:
        self.calls.append(("GET", path))
        return copy.deepcopy(self.objects.get(path))

    async def merge_patch(self, path: str, patch: dict[str, Any]) -> dict[str, Any]:
        self.calls.append(("PATCH", path))
        name = path.split("/")[-2]
        return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "13"},
                "spec": {"templateRef": {"name": "article"}, "inputs": {"topic": "x"}}, "status": patch["status"]}


def _new_flow(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "resourceVersion": "10"},
            "spec": {"templateRef": {"name": "article"}, "inputs": {"topic": "x"}}}


async def _reconcile(ctl: Controller, name: str) -> None:
    try:
        await ctl.reconcile(("ns", name))
    finally:
        await ctl.writes.settled()


def test_twenty_flows_of_one_template_make_one_snapshot_before_their_status_names_it() -> None:
    store = Store()
    ctl = Controller(Settings())
    ctl.shell.leading = True
    ctl.attach(store)  # type: ignore[arg-type]
    ctl.templates.event("ADDED", TEMPLATE)

    async def scenario() -> None:
        for i in range(20):
            ctl.cache.flow_event("ADDED", _new_flow(f"f{i}"))
            await _reconcile(ctl, f"f{i}")
            for path, obj in store.objects.items():  # what the ControllerRevisions' watch delivers
                if "/controllerrevisions/" in path:
                    ctl.snapshots.index.event("ADDED", obj)

    asyncio.run(scenario())
    revisions = [p for p in store.objects if "/controllerrevisions/" in p]
    assert len(revisions) == 1
    # The first Flow made it; the 19 others took what this process knows it holds, without a request
    # (each once sent the whole 250 KiB snapshot again, answered AlreadyExists, and read it back).
    assert [v for v, path in store.calls if "/controllerrevisions" in path] == ["POST"]
    name = revisions[0].rsplit("/", 1)[-1]
    order = [path for verb, path in store.calls if verb in ("POST", "PATCH") and not path.endswith("/events")]
    assert order[0].endswith("/controllerrevisions"), "the snapshot comes before anything names it"
    for i in range(20):
        cached = ctl.cache.flow(("ns", f"f{i}"))
        assert cached is not None and cached["status"]["template"]["snapshot"] == name
        assert "spec" not in cached["status"]["template"]
    assert ctl.snapshots.index.refs == {("ns", name): 20} and not ctl.snapshots.index.in_flight
    # The pods ran the template's spec; a later reconcile reads it from the LRU, not the API server.
    pods = [p for p in store.objects if "/pods/" in p]
    assert len(pods) == 20 and store.objects[pods[0]]["spec"]["containers"][0]["image"] == "runner:template"
    gets = sum(1 for verb, path in store.calls if verb == "GET" and "/controllerrevisions/" in path)
    asyncio.run(_reconcile(ctl, "f3"))
    assert sum(1 for verb, path in store.calls if verb == "GET" and "/controllerrevisions/" in path) == gets


def test_a_squatted_snapshot_name_is_an_event_and_the_flow_does_not_run_it() -> None:
    store = Store()
    data = templates.snapshot(TEMPLATE)
    squat = templates.snapshot_object("ns", {**data, "spec": {"template": {"image": "evil"}}})
    squat["metadata"]["name"] = templates.snapshot_name(data)
    store.objects[f"/apis/apps/v1/namespaces/ns/controllerrevisions/{squat['metadata']['name']}"] = squat
    ctl = Controller(Settings())
    ctl.shell.leading = True
    ctl.attach(store)  # type: ignore[arg-type]
    ctl.templates.event("ADDED", TEMPLATE)
    ctl.cache.flow_event("ADDED", _new_flow("f"))
    with pytest.raises(ForeignObjectError, match="does not hold this template's snapshot"):
        asyncio.run(_reconcile(ctl, "f"))
    assert not any(verb == "PATCH" or "/pods" in path for verb, path in store.calls), "no status write, no pod"
    assert any(path.endswith("/events") for _, path in store.calls)


def test_a_flow_whose_snapshot_was_deleted_fails_naming_it() -> None:
    store = Store()
    ctl = Controller(Settings())
    ctl.shell.leading = True
    ctl.attach(store)  # type: ignore[arg-type]
    ref = templates.snapshot_ref(templates.snapshot(TEMPLATE))
    flow = {**_new_flow("f"), "status": {"phase": "Pending", "template": ref}}
    ctl.cache.flow_event("ADDED", flow)
    asyncio.run(_reconcile(ctl, "f"))
    cached = ctl.cache.flow(("ns", "f"))
    assert cached is not None and cached["status"]["phase"] == "Failed"
    assert ref["snapshot"] in cached["status"]["message"] and not any("/pods" in p for _, p in store.calls)


def test_a_take_during_a_sweeps_delete_waits_for_it_and_makes_the_snapshot_anew() -> None:
    from flowkube_operator.templates.snapshots import Snapshots

    data = templates.snapshot(TEMPLATE)
    obj = templates.snapshot_object("ns", data)
    path = f"/apis/apps/v1/namespaces/ns/controllerrevisions/{obj['metadata']['name']}"

    class SlowDelete(Store):
        def __init__(self) -> None:
            super().__init__()
            self.landing = asyncio.Event()
            self.preconditions: list[Any] = []

        async def delete(self, path: str, body: dict[str, Any] | None = None) -> None:
            self.calls.append(("DELETE", path))
            self.preconditions.append((body or {}).get("preconditions"))
            await self.landing.wait()
            self.objects.pop(path, None)

    async def scenario() -> None:
        store = SlowDelete()
        snaps = Snapshots(lambda: store, entries=4, max_bytes=1 << 20, grace=1)  # type: ignore[arg-type, return-value]
        snaps._informers = []  # no watch here: synced() is asked of the informers
        snaps.synced = lambda: True  # type: ignore[method-assign]
        await store.create("/apis/apps/v1/namespaces/ns/controllerrevisions", obj)
        snaps.index.event("ADDED", store.objects[path])
        seen_uid = store.objects[path]["metadata"]["uid"]
        sweep = asyncio.create_task(snaps.sweep(lambda: None))
        await asyncio.sleep(0)  # the sweep decided and its DELETE is on its way
        take = asyncio.create_task(snaps.ensure(obj, lambda: None))
        await asyncio.sleep(0)
        assert not take.done(), "the take waits for the DELETE"
        store.landing.set()
        assert await sweep == 1
        assert store.preconditions == [{"uid": seen_uid}], "deleted only if it is still the one seen unreferenced"
        await take
        assert path in store.objects, "made anew after the DELETE: the Flow names a snapshot that exists"
        verbs = [v for v, _ in store.calls]
        assert verbs[-1] == "POST" and verbs.index("DELETE") < len(verbs) - 1, verbs

    asyncio.run(scenario())
