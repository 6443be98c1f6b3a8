"""The FlowTemplates and ClusterFlowTemplates the operator knows, from their watches.

Every replica runs the watches: the admission webhook (any replica) checks a Flow's parameters
against its template, and the leader's reconcile copies the template into the Flow's status at its
first reconcile. A Flow whose template is not there yet waits: it is noted here, and queued again
when a template of that name appears or changes (no scan of every Flow per template event).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api.templates import template_key
from flowkube_operator import projections
from flowkube_operator.informer import Informer
from flowkube_operator.kube import Kube

Body = dict[str, Any]
TemplateKey = tuple[str, str, str]  # (kind, namespace or "", name)
FlowKey = tuple[str, str]


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

    def __init__(self, wake: Callable[[FlowKey], None]) -> None:
        self.wake = wake
        self.templates: dict[TemplateKey, Body] = {}
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
        self.templates[key] = projections.template(body)
        for flow in self.waiting.pop(key, set()):
            self.wake(flow)

    def get(self, key: TemplateKey) -> Body | None:
        return self.templates.get(key)

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


async def fetch(kube: Kube, key: TemplateKey) -> Body | None:
    """The template read from the API server (a cache miss: it may have been created a moment ago)."""
    kind, namespace, name = key
    found = await kube.get(template_path(kind, namespace, name))
    if found is not None:
        found.setdefault("kind", kind)
    return found
