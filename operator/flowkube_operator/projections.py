"""What the operator's caches keep of each watched kind: the projection its logic reads.

Every replica keeps every Flow, template and CronFlow of the namespaces it serves, and tenants write
those objects: whatever a cache keeps beyond what the operator reads is memory a tenant sets. Each
watch event goes through one function here where it enters its cache, so what is kept is said once:

- **metadata** (every kind): name, namespace, uid, resourceVersion, generation, creationTimestamp,
  deletionTimestamp (identity, write preconditions, `observedGeneration`, the CronFlow's clock and
  deletes). `managedFields`, `finalizers` and kubectl's `last-applied-configuration` (a second
  copy of the whole spec) are never kept; nor is any label or annotation the operator does not read.
- **Flow**: `ownerReferences` (a CronFlow's Flows: `meta.owner_uid`), the label
  `flowkube.io/cronflow` (the CronFlow index and the per-CronFlow metrics), the labels whose keys
  FlowQuota selectors name (at most `QUOTA_LABEL_KEYS_LIMIT` keys in all), the annotation
  `flowkube.io/scheduled-at` (the time a CronFlow started it for); `spec` (what it runs, bounded by the
  webhook and checked again by the reconcile) and `status` (the reconcile's input).
- **FlowTemplate / ClusterFlowTemplate**: the metadata above only (`template_meta`: is it there,
  which generation); its spec (up to 256 KiB, and a tenant may make many) goes into the template
  cache's bounded LRU and is read from the API server on a miss (`templatecache.TemplateCache.resolve`).
  No label or annotation of a template is read.
- **CronFlow**: `spec` (its schedule and `flowTemplate`, whose own metadata is the Flows' and is
  kept with it) and `status`; none of its own labels or annotations.

Pure: no I/O; the caches call these on every event (a few dict lookups each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flowkube_api import constants as c

Body = dict[str, Any]

META_KEPT = ("name", "namespace", "uid", "resourceVersion", "generation", "creationTimestamp", "deletionTimestamp")
FLOW_LABELS = (c.LABEL_CRONFLOW,)
FLOW_ANNOTATIONS = (c.ANNOTATION_SCHEDULED,)


def _pick(source: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    if not isinstance(source, Mapping):
        return {}
    return {k: source[k] for k in keys if k in source}


def _meta(body: Mapping[str, Any], labels: tuple[str, ...] = (), annotations: tuple[str, ...] = (),
          owners: bool = False) -> Body:
    meta = body.get("metadata") or {}
    out = _pick(meta, META_KEPT)
    kept_labels, kept_annotations = _pick(meta.get("labels"), labels), _pick(meta.get("annotations"), annotations)
    if kept_labels:
        out["labels"] = kept_labels
    if kept_annotations:
        out["annotations"] = kept_annotations
    if owners and meta.get("ownerReferences"):
        out["ownerReferences"] = meta["ownerReferences"]
    return out


def _kind(body: Mapping[str, Any], meta: Body) -> Body:
    out: Body = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "metadata": meta}
    return {k: v for k, v in out.items() if v is not None}


def flow(body: Mapping[str, Any], labels: frozenset[str] = frozenset()) -> Body:
    """A Flow as the Flow cache keeps it (and its listeners hear it); ``labels``: the keys FlowQuota
    selectors name (at most ``QUOTA_LABEL_KEYS_LIMIT``), kept too."""
    out = _kind(body, _meta(body, (*FLOW_LABELS, *sorted(labels)), FLOW_ANNOTATIONS, owners=True))
    for part in ("spec", "status"):
        if part in body:
            out[part] = body[part]
    return out


def template(body: Mapping[str, Any]) -> Body:
    """A FlowTemplate or ClusterFlowTemplate as the template cache keeps it."""
    out = _kind(body, _meta(body))
    out["spec"] = body.get("spec") or {}
    return out


def template_meta(body: Mapping[str, Any]) -> Body:
    """A template without its spec: what the template cache keeps of every template."""
    return _kind(body, _meta(body))


def cronflow(body: Mapping[str, Any]) -> Body:
    """A CronFlow as the CronFlow cache keeps it."""
    out = _kind(body, _meta(body))
    for part in ("spec", "status"):
        if part in body:
            out[part] = body[part]
    return out


__all__ = ["cronflow", "flow", "template", "template_meta"]
