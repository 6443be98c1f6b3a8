"""The operator's list-then-watch against the real kube-apiserver: what it delivers adds up to what
exists, through pages, large objects, a watch too old to resume, and a deletion it never saw."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import urllib.request
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster
from flowkube_operator.kube import informer as informer_mod
from flowkube_operator.kube.client import Kube
from flowkube_operator.kube.informer import Informer
from tests.integration.conftest import operator_kube

Events = list[tuple[str, str, str]]  # (type, name, resourceVersion)


def _cm(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "labels": labels}}


@contextlib.asynccontextmanager
async def running(inf: Informer) -> AsyncIterator[None]:
    task = asyncio.create_task(inf.run())
    try:
        async with asyncio.timeout(30):
            await inf.synced.wait()
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class Recorder:
    """What the informer delivered, in order, and a wake-up for each delivery."""

    def __init__(self) -> None:
        self.events: Events = []
        self.arrived = asyncio.Event()

    def take(self, etype: str, obj: dict[str, Any]) -> None:
        self.events.append((etype, obj["metadata"]["name"], obj["metadata"].get("resourceVersion", "")))
        self.arrived.set()

    def seen(self) -> list[tuple[str, str]]:
        return [(t, n) for t, n, _ in self.events]

    async def until(self, pred: Callable[[], bool], what: str, limit: float = 30) -> None:
        try:
            async with asyncio.timeout(limit):
                while not pred():
                    self.arrived.clear()
                    await self.arrived.wait()
        except TimeoutError:
            raise AssertionError(f"{what}: not delivered in {limit} s; delivered {self.seen()}") from None


def compact(cluster: LocalCluster) -> None:
    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(cluster.etcd_url + path, data=json.dumps(body).encode(), method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:
            out: dict[str, Any] = json.loads(r.read())
            return out
    revision = call("/v3/kv/range", {"key": base64.b64encode(b"/").decode()})["header"]["revision"]
    call("/v3/kv/compaction", {"revision": revision, "physical": True})


def restart_apiserver(cluster: LocalCluster) -> None:
    with cluster.apiserver_stopped():
        pass


def _informer(kube: Kube, namespace: str, rec: Recorder, selector: str = "app=mine") -> Informer:
    return Informer(lambda: kube, f"/api/v1/namespaces/{namespace}/configmaps", "v1", "ConfigMap", rec.take,
                    label_selector=selector)


def test_lists_in_pages_then_follows_every_change_of_the_selected_objects(
        cluster: LocalCluster, namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(informer_mod, "PAGE", 2)
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    for i in range(5):
        cluster.api("POST", path, _cm(f"before-{i}", app="mine"))
    cluster.api("POST", path, _cm("other", app="theirs"))

    async def go() -> list[tuple[str, str]]:
        kube, rec = operator_kube(cluster), Recorder()
        try:
            async with running(_informer(kube, namespace, rec)):
                assert sorted(rec.seen()) == [("ADDED", f"before-{i}") for i in range(5)]
                await kube.request("POST", path, _cm("new", app="mine"))
                await kube.request("POST", path, _cm("new-other", app="theirs"))
                # Over aiohttp's 128 KiB line limit: a Flow's status can be this large.
                await kube.merge_patch(f"{path}/new", {"data": {"big": "x" * 300_000}})
                await kube.delete(f"{path}/before-0")
                await rec.until(lambda: ("DELETED", "before-0") in rec.seen(), "the delete")
            return rec.seen()
        finally:
            await kube.close()

    seen = asyncio.run(go())
    assert seen[5:] == [("ADDED", "new"), ("MODIFIED", "new"), ("DELETED", "before-0")]


def test_a_watch_too_old_to_resume_relists_and_says_deleted_for_what_went_meanwhile(
        cluster: LocalCluster, namespace: str) -> None:
    path = f"/api/v1/namespaces/{namespace}/configmaps"
    for name in ("stays", "goes"):
        cluster.api("POST", path, _cm(name, app="mine"))

    rec = Recorder()
    inf = Informer(lambda: None, path, "v1", "ConfigMap", rec.take, label_selector="app=mine")  # each phase
    # below gives it a client (and events) of its own event loop

    async def phase(changes: bool) -> None:
        kube = operator_kube(cluster)
        inf.kube, inf.synced, rec.arrived = (lambda: kube), asyncio.Event(), asyncio.Event()
        try:
            async with running(inf):
                pass  # synced: the (re)list is delivered whole
            if changes:  # while nobody watches: one object goes, one comes, one changes
                await kube.delete(f"{path}/goes")
                await kube.request("POST", path, _cm("comes", app="mine"))
                await kube.merge_patch(f"{path}/stays", {"data": {"k": "v"}})
        finally:
            await kube.close()

    asyncio.run(phase(changes=True))
    rec.events.clear()
    # etcd forgets the history before now, as the API server's periodic compaction does, and the API
    # server restarts (its watch cache, which still has the history, starts afresh): the informer's
    # resourceVersion is too old to resume from, and the API server says 410 Gone. (From this thread:
    # the API server dies with the thread that started it.)
    compact(cluster)
    restart_apiserver(cluster)
    asyncio.run(phase(changes=False))
    assert sorted(rec.seen()) == [("ADDED", "comes"), ("ADDED", "stays"), ("DELETED", "goes")]
