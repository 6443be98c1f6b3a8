"""The informer's lists, paged by bytes as well as by count: a page of huge objects (300 labelled
Secrets of ~900 KiB OOM-killed the operator, listed 500 a page) never costs more than PAGE_BYTES,
and what the informer keeps of each object is its key, its uid and the one label a DELETED needs."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from flowkube_operator.kube import informer
from flowkube_operator.kube.http1 import TooLargeError
from flowkube_operator.kube.informer import FIRST_PAGE, PAGE, PAGE_BYTES, Informer


def obj(name: str, size: int, labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "team", "uid": f"u-{name}", "labels": labels or {}},
            "data": {"blob": "x" * size}}


class PagedApi:
    """Serves a list in pages as the API server does (`limit`, `continue`), each answer's size in
    bytes as Kube.list_page measures it, refusing one over ``max_bytes`` as http1 does."""

    def __init__(self, objects: list[dict[str, Any]]) -> None:
        self.objects = objects
        self.asked: list[int] = []  # the limit of each page asked for
        self.sizes: list[int] = []  # the bytes of each page answered

    async def list_page(self, path: str, params: dict[str, str], *, max_bytes: int) -> tuple[dict[str, Any], int]:
        limit, start = int(params["limit"]), int(params.get("continue") or 0)
        self.asked.append(limit)
        items = self.objects[start:start + limit]
        more = start + limit < len(self.objects)
        page = {"items": [orjson.loads(orjson.dumps(o)) for o in items],
                "metadata": {"resourceVersion": "7", **({"continue": str(start + limit)} if more else {})}}
        size = len(orjson.dumps(page))
        if size > max_bytes:
            raise TooLargeError(f"over {max_bytes}")
        self.sizes.append(size)
        return page, size


def listed(objects: list[dict[str, Any]]) -> tuple[PagedApi, Informer, list[tuple[str, str]]]:
    api = PagedApi(objects)
    seen: list[tuple[str, str]] = []
    inf = Informer(lambda: api, "/api/v1/secrets", "v1", "Secret",  # type: ignore[arg-type,return-value]
                   lambda etype, body: seen.append((etype, body["metadata"]["name"])))
    asyncio.run(inf._list())
    return api, inf, seen


def test_the_first_page_is_small_and_later_pages_grow_with_small_objects() -> None:
    api, _, seen = listed([obj(f"s{i:04}", 100) for i in range(3000)])
    assert api.asked[0] == FIRST_PAGE and FIRST_PAGE * informer.MAX_OBJECT_BYTES < PAGE_BYTES
    assert api.asked[1] == PAGE and len(seen) == 3000  # small objects: the count bound again


def test_pages_shrink_after_a_page_of_big_objects_and_never_exceed_the_byte_budget() -> None:
    small = [obj(f"a{i:04}", 100) for i in range(1200)]
    big = [obj(f"b{i:04}", 900 * 1024) for i in range(300)]
    api, _, seen = listed(small + big)
    assert len(seen) == 1500 and max(api.sizes) <= PAGE_BYTES
    # Pages cut off (and asked again): each halves the ceiling, so at most log2(PAGE / FIRST_PAGE) of them.
    assert 1 <= len(api.asked) - len(api.sizes) <= 5
    assert max(api.sizes[-5:]) <= PAGE_BYTES // 2 + 1024 * 1024  # then sized from the bytes per object seen
    assert informer.next_limit(16 * 900 * 1024, 16) == PAGE_BYTES // 2 // (900 * 1024)


def test_known_objects_keep_no_labels_but_the_flow_label_a_delete_needs() -> None:
    objects = [obj("p1", 10, {"flowkube.io/flow": "review", "tenant": "x" * 60}), obj("p2", 10)]
    api, inf, _ = listed(objects)
    assert inf._known[("team", "p1")] == ("u-p1", "review") and inf._known[("team", "p2")] == ("u-p2", "")
    deleted: list[dict[str, Any]] = []
    inf.on_event = lambda etype, body: deleted.append(body) if etype == "DELETED" else None
    api.objects = []
    asyncio.run(inf._list())  # both gone while nobody watched: DELETED, the pod with its Flow's label
    assert sorted(d["metadata"]["name"] for d in deleted) == ["p1", "p2"]
    deleted.sort(key=lambda d: str(d["metadata"]["name"]))
    assert deleted[0]["metadata"] == {"namespace": "team", "name": "p1", "uid": "u-p1",
                                      "labels": {"flowkube.io/flow": "review"}}
