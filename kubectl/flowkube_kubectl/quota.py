"""`kubectl flow quota [NAME] [-A]`: each FlowQuota's limits, what is used and reserved of them, and when
they reset, as the operator last wrote them in the quotas' status."""

from __future__ import annotations

import sys
from typing import Any

from flowkube_api.constants import CLUSTER_QUOTA_PLURAL, QUOTA_PLURAL
from flowkube_kubectl.args import Args
from flowkube_kubectl.kube import KubectlError, kubectl_json


def _spent(s: dict[str, Any] | None, cost: bool) -> str:
    s = s or {}
    return f"USD {s.get('cost') or '0'}" if cost else str(s.get("totalTokens") or 0)


def _window(w: dict[str, Any]) -> str:
    kind = str(w.get("kind") or "")
    if kind == "Rolling":
        return f"rolling {w.get('hours')}h"
    if kind == "Lifetime":
        return "lifetime"
    return f"{kind.lower()} ({w.get('timeZone') or 'UTC'})"


def quota_rows(quotas: list[dict[str, Any]], all_namespaces: bool) -> list[list[str]]:
    rows = [["NAMESPACE"] * all_namespaces + ["QUOTA", "LIMIT", "USED", "OF", "RESERVED", "WINDOW", "RESETS"]]
    for q in quotas:
        meta, spec, st = q["metadata"], q.get("spec") or {}, q.get("status") or {}
        shown = {x.get("name"): x for x in st.get("limits") or [] if isinstance(x, dict)}
        ready = next((x for x in st.get("conditions") or [] if x.get("type") == "Ready"), None)
        for lim in spec.get("limits") or []:
            got = shown.get(lim.get("name"))
            for cost, cap in ((False, lim.get("maxTotalTokens")), (True, lim.get("maxCost"))):
                if cap is None:
                    continue
                if got is not None:
                    used, reserved = _spent(got.get("used"), cost), _spent(got.get("reserved"), cost)
                else:  # not written yet, or not used (its Ready condition says why)
                    used = reserved = "-" if ready is None or ready.get("status") == "True" else "not used"
                name = meta["name"] if meta.get("namespace") else f"cluster/{meta['name']}"
                rows.append([meta.get("namespace", "")] * all_namespaces + [
                    name, lim.get("name", ""), used, f"USD {cap}" if cost else str(cap), reserved,
                    _window(lim.get("window") or {}), (got or {}).get("resetsAt") or "-"])
    return rows


def _cluster_quotas(a: Args) -> list[dict[str, Any]]:
    """The ClusterFlowQuotas, when this user may list them (none otherwise: they are a platform team's)."""
    try:
        return list(kubectl_json(["get", CLUSTER_QUOTA_PLURAL], a.kube).get("items") or [])
    except KubectlError as e:
        if "(Forbidden)" in str(e) or "the server doesn't have a resource type" in str(e):
            return []
        raise


def quota(a: Args) -> int:
    if a.pos:
        items = [kubectl_json(["get", QUOTA_PLURAL, a.pos[0]], a.kube)]
    else:
        items = kubectl_json(["get", QUOTA_PLURAL, *["--all-namespaces"] * a.all_namespaces], a.kube).get("items") or []
        items += _cluster_quotas(a)
    if not items:
        print("No flowquotas found.", file=sys.stderr)
        return 0
    rows = quota_rows(items, a.all_namespaces)
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    print("\n".join("   ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in rows))
    return 0
