"""The FlowTemplates and ClusterFlowTemplates the operator knows, from their watches.

Every replica runs the watches: the admission webhook (any replica) checks a Flow's parameters
against its template, and the leader's reconcile takes the template into a snapshot at the Flow's
first reconcile. A Flow whose template is not there yet waits: it is noted here, and queued again
when a template of that name appears or changes (no scan of every Flow per template event).

What is kept of each template is its metadata (`projections.template_meta`): a tenant may make many
templates of up to 256 KiB each. Their specs go into a bounded LRU keyed by template and generation
(filled from the watch's events, `SPEC_ENTRIES` / `SPEC_BYTES`); `resolve` reads one from the API
server on a miss. A template is read when a Flow of it is applied and when it is taken, never again
for that Flow, so a small LRU serves bursts of Flows of a few templates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api.templates import template_key
from flowkube_operator import projections
from flowkube_operator.kube.client import Kube
from flowkube_operator.kube.informer import Informer
from flowkube_operator.templates.snapshots import SpecCache

Body = dict[str, Any]
TemplateKey = tuple[str, str, str]  # (kind, namespace or "", name)
FlowKey = tuple[str, str]
SPEC_ENTRIES = 32  # template specs kept in memory, least recently used dropped first
SPEC_BYTES = 32 * 1024 * 1024  # and at most these bytes of them (parsed, as snapshots.footprint estimates)


def template_path(kind: str, namespace: str, name: str = "") -> str:
    if kind == c.CLUSTER_TEMPLATE_KIND:
        base = f"/apis/{c.GROUP}/{c.VERSION}/{c.CLUSTER_TEMPLATE_PLURAL}"
    elif namespace:
        base = f"/apis/{c.GROUP}/{c.VERSION}/namespaces/{namespace}/{c.TEMPLATE_PLURAL}"
    else:
        base = f"/apis/{c.GROUP}/{c.VERSION}/{c.TEMPLATE_PLURAL}"
    return f"{base}/{name}" if name else base


class TemplateCache:
    """Templates by (kind, namespace, name); ``wake(flow key)`` when a template a Flow waits for comes."""

    def __init__(self, wake: Callable[[FlowKey], None], kube: Callable[[], Kube | None] = lambda: None) -> None:
        self.wake = wake
        self.kube = kube
        self.templates: dict[TemplateKey, Body] = {}  # without their specs (projections.template_meta)
        self.specs = SpecCache(SPEC_ENTRIES, SPEC_BYTES)
        self.waiting: dict[TemplateKey, set[FlowKey]] = {}
        self._informers: list[Informer] = []

    def informers(self, kube: Callable[[], Kube | None], namespaces: list[str]) -> list[Informer]:
        self._informers = [Informer(kube, template_path(c.TEMPLATE_KIND, ns), c.API_VERSION, c.TEMPLATE_KIND,
                                    self.event) for ns in namespaces or [""]]
        self._informers.append(Informer(kube, template_path(c.CLUSTER_TEMPLATE_KIND, ""), c.API_VERSION,
                                        c.CLUSTER_TEMPLATE_KIND, self.event))
        return self._informers

    def synced(self) -> bool:
        return all(i.synced.is_set() for i in self._informers)

    def event(self, event_type: str, body: Body) -> None:
        meta = body.get("metadata") or {}
        key = template_key(str(meta.get("namespace") or ""), {"kind": body.get("kind"), "name": meta.get("name")})
        if event_type == "DELETED":
            self.templates.pop(key, None)
            return
        kept = self.templates[key] = projections.template_meta(body)
        self.specs.put(_spec_key(key, kept), dict(body.get("spec") or {}))
        for flow in self.waiting.pop(key, set()):
            self.wake(flow)

    def get(self, key: TemplateKey) -> Body | None:
        """The template's metadata (no spec), if the watch has it."""
        return self.templates.get(key)

    async def resolve(self, key: TemplateKey) -> Body | None:
        """The template with its spec (a projection, `projections.template`) when the watch has it:
        the spec from the LRU, else read from the API server (the newest version then). None when the
        watch does not have it, or it is gone by the read."""
        meta = self.templates.get(key)
        if meta is None:
            return None
        spec = self.specs.get(_spec_key(key, meta))
        if spec is not None:
            return {**meta, "spec": spec}
        kube = self.kube()
        if kube is None:
            return None
        found = await fetch(kube, key)
        if found is None:
            return None
        kept = projections.template(found)
        self.specs.put(_spec_key(key, kept), kept["spec"])
        return kept

    def woken(self) -> set[FlowKey]:
        """Every Flow noted as waiting (taken: they are queued again once the first lists are in)."""
        flows = {f for waiting in self.waiting.values() for f in waiting}
        self.waiting.clear()
        return flows

    def waits(self, flow: FlowKey) -> bool:
        return any(flow in flows for flows in self.waiting.values())

    def wait(self, key: TemplateKey, flow: FlowKey) -> None:
        """``flow`` waits for the template ``key``: queue it when the template comes."""
        self.waiting.setdefault(key, set()).add(flow)


def _spec_key(key: TemplateKey, template: Body) -> tuple[str, ...]:
    meta = template.get("metadata") or {}
    return (*key, str(meta.get("uid") or ""), str(meta.get("generation") or ""))


async def fetch(kube: Kube, key: TemplateKey) -> Body | None:
    """The template read from the API server (a cache miss: it may have been created a moment ago)."""
    kind, namespace, name = key
    found = await kube.get(template_path(kind, namespace, name))
    if found is not None:
        found.setdefault("kind", kind)
    return found
