"""What the caches keep of a watched object: the projection the operator reads, not what a tenant wrote."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from flowkube_operator import projections
from flowkube_operator.cron.controller import CronFlows
from flowkube_operator.flows.controller import Controller
from flowkube_operator.kube.shell import Writes
from flowkube_operator.settings import Settings
from flowkube_operator.templates.cache import TemplateCache

BULK = "x" * 200_000  # what a tenant may put in metadata the operator never reads


def _meta(**extra: Any) -> dict[str, Any]:
    return {"name": "f", "namespace": "ns", "uid": "u", "resourceVersion": "10", "generation": 2,
            "creationTimestamp": "2026-11-27T00:00:00Z",
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": BULK}}],
            "finalizers": ["example.com/" + "y" * 200],
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": BULK,
                            "flowkube.io/scheduled-at": "2026-11-27T00:00:00Z", "tenant/notes": BULK},
            "labels": {"flowkube.io/cronflow": "nightly", "tenant/big": "z" * 63}, **extra}


def test_a_flow_with_large_managed_fields_and_last_applied_is_cached_without_them() -> None:
    heard: list[Any] = []
    ctl = Controller(Settings(), listeners=[lambda k, b: heard.append(b)])
    owners = [{"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow", "name": "nightly", "uid": "cf",
               "controller": True}]
    ctl.cache.flow_event("ADDED", {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                             "metadata": _meta(ownerReferences=owners),
                             "spec": {"flowRef": "a:B"}, "status": {"phase": "Pending"}})
    cached = ctl.cache.flows[("ns", "f")][2]
    assert len(cached) < 2_000, "the tenant's bulk is not kept"
    kept = orjson.loads(cached)
    assert kept["metadata"]["labels"] == {"flowkube.io/cronflow": "nightly"}
    assert kept["metadata"]["annotations"] == {"flowkube.io/scheduled-at": "2026-11-27T00:00:00Z"}
    assert kept["metadata"]["ownerReferences"] == owners and kept["metadata"]["generation"] == 2
    assert kept["spec"] == {"flowRef": "a:B"} and kept["status"] == {"phase": "Pending"}
    assert heard == [kept], "the listeners (metrics, CronFlows) hear the same projection"


def test_templates_and_cronflows_are_kept_without_metadata_the_operator_does_not_read() -> None:
    cache = TemplateCache(wake=lambda key: None)
    cache.event("ADDED", {"kind": "FlowTemplate", "metadata": _meta(), "spec": {"template": {"flowRef": "a:B"}}})
    kept = cache.get(("FlowTemplate", "ns", "f"))
    assert kept is not None and len(orjson.dumps(kept)) < 1_000 and "spec" not in kept
    resolved = asyncio.run(cache.resolve(("FlowTemplate", "ns", "f")))
    assert resolved is not None and resolved["spec"] == {"template": {"flowRef": "a:B"}}
    assert resolved["metadata"]["uid"] == "u" and len(orjson.dumps(resolved)) < 1_000

    cron = CronFlows(Writes(lambda: None, lambda: True, "test"))
    cron.event("ADDED", {"kind": "CronFlow", "metadata": _meta(), "spec": {"schedule": "@daily"}})
    assert len(orjson.dumps(cron.cronflows[("ns", "f")])) < 1_000


def test_a_flow_without_labels_or_annotations_keeps_none() -> None:
    kept = projections.flow({"metadata": {"name": "f", "namespace": "ns", "uid": "u"}, "spec": {}})
    assert kept == {"metadata": {"name": "f", "namespace": "ns", "uid": "u"}, "spec": {}}


def test_the_template_cache_keeps_metadata_and_a_bounded_lru_of_specs_read_again_on_a_miss() -> None:
    from flowkube_operator.templates import cache as templatecache

    reads: list[str] = []

    class Kube:
        async def get(self, path: str) -> dict[str, Any] | None:
            reads.append(path)
            name = path.rsplit("/", 1)[-1]
            return {"metadata": {"name": name, "namespace": "ns", "uid": f"u-{name}", "generation": 1},
                    "spec": {"template": {"flowRef": "a:B"}, "description": "y" * 100_000}}

    cache = TemplateCache(wake=lambda key: None, kube=lambda: Kube())  # type: ignore[arg-type, return-value]
    count = templatecache.SPEC_ENTRIES + 10
    for i in range(count):  # a tenant's many large templates
        cache.event("ADDED", {"kind": "FlowTemplate", "metadata": {"name": f"t{i}", "namespace": "ns", "uid": f"u-t{i}",
                                                                   "generation": 1},
                              "spec": {"template": {"flowRef": "a:B"}, "description": "y" * 100_000}})
    assert len(cache.templates) == count and len(cache.specs) <= templatecache.SPEC_ENTRIES
    assert sum(len(orjson.dumps(t)) for t in cache.templates.values()) < count * 300
    first = asyncio.run(cache.resolve(("FlowTemplate", "ns", "t0")))  # dropped from the LRU: read again
    assert first is not None and first["spec"]["template"] == {"flowRef": "a:B"} and len(reads) == 1
    assert asyncio.run(cache.resolve(("FlowTemplate", "ns", "t0"))) == first and len(reads) == 1
    assert asyncio.run(cache.resolve(("FlowTemplate", "ns", "nowhere"))) is None and len(reads) == 1


def test_the_flow_cache_keeps_each_flows_json_in_about_its_own_size() -> None:
    """orjson hands back its JSON in the buffer it grew while writing: kept as it was, 10,000 Flows
    cost 40 MB more than their JSON (bench_scale, 2026-11-27). The cache keeps an exact-size copy."""
    import tracemalloc

    ctl = Controller(Settings())
    bodies = [{"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
               "metadata": {"name": f"f{i}", "namespace": "ns", "uid": f"u{i}", "resourceVersion": str(i + 1)},
               "spec": {"flowRef": "a:B", "inputs": {"notes": "n" * 3000}}} for i in range(200)]
    tracemalloc.start()
    try:
        before, _ = tracemalloc.get_traced_memory()
        for body in bodies:
            ctl.cache.flow_event("ADDED", body)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    json_bytes = sum(len(v[2]) for v in ctl.cache.flows.values())
    assert len(ctl.cache.flows) == 200
    assert after - before < 2 * json_bytes, f"{(after - before) / 200:.0f} bytes per Flow for {json_bytes / 200:.0f}"
