"""The console's quota page (``/quotas``): each FlowQuota the person may list, its limits as bars of
what is used and what calls in flight hold, the window and when it resets, and why a quota is held or
not used. Read with the person's own token: cluster-wide when they may list FlowQuotas everywhere,
else in the namespaces the page names (``?namespace=``) and their ServiceAccount's own."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from aiohttp import web

from flowkube_api.constants import CLUSTER_QUOTA_PLURAL, GROUP, QUOTA_PLURAL, VERSION
from flowkube_console.kube import ApiError, Kube
from flowkube_console.pages import KUBE, USER, cred_of, render

Body = dict[str, Any]
NAMESPACES_LIMIT = 16  # namespaces one page lists quotas of, one by one
SHOWN_LIMIT = 512  # FlowQuotas one page shows (the operator uses 16 a namespace; a tenant may make more)


def _path(namespace: str | None) -> str:
    base = f"/apis/{GROUP}/{VERSION}"
    return f"{base}/namespaces/{namespace}/{QUOTA_PLURAL}" if namespace else f"{base}/{QUOTA_PLURAL}"


def _number(v: Any) -> Decimal:
    try:
        return Decimal(str(v or 0))
    except InvalidOperation:
        return Decimal(0)


def _share(part: Decimal, whole: Decimal) -> float:
    return float(min(Decimal(100), Decimal(100) * part / whole)) if whole > 0 else 0.0


def view(quota: Body) -> Body:
    """What the page shows of one FlowQuota: one row per cap (tokens or USD) of each limit."""
    meta, spec, st = quota.get("metadata") or {}, quota.get("spec") or {}, quota.get("status") or {}
    shown = {x.get("name"): x for x in st.get("limits") or [] if isinstance(x, dict)}
    conditions = {x.get("type"): x for x in st.get("conditions") or [] if isinstance(x, dict)}
    rows = []
    for lim in spec.get("limits") or []:
        got = shown.get(lim.get("name")) or {}
        window = lim.get("window") or {}
        for key, cap_key, unit in (("totalTokens", "maxTotalTokens", "tokens"), ("cost", "maxCost", "USD")):
            if lim.get(cap_key) is None:
                continue
            cap = _number(lim[cap_key])
            used, reserved = _number((got.get("used") or {}).get(key)), _number((got.get("reserved") or {}).get(key))
            rows.append({"limit": lim.get("name", ""), "unit": unit, "model": lim.get("model"), "cap": cap,
                         "used": used, "reserved": reserved, "used_pct": _share(used, cap),
                         "reserved_pct": min(_share(reserved, cap), 100 - _share(used, cap)),
                         "window": window, "resets": got.get("resetsAt"), "written": bool(got)})
    return {"namespace": meta.get("namespace", ""), "name": meta.get("name", ""), "action": spec.get("action")
            or "Refuse", "rows": rows, "ready": conditions.get("Ready"), "exhausted": conditions.get("Exhausted"),
            "warning": conditions.get("Warning")}


async def _some(kube: Kube, namespace: str | None, token: str | None, room: int, path: str = "") -> list[Body]:
    out: list[Body] = []
    async for q in kube.list_all(path or _path(namespace), token):
        if "_list" not in q:
            out.append(q)
        if len(out) >= room:
            break
    return out


async def _list(request: web.Request) -> tuple[list[Body], list[str]]:
    """The FlowQuotas the person may list (at most SHOWN_LIMIT), and the namespaces they may not."""
    kube, token = request.app[KUBE], cred_of(request).token
    try:
        return await _some(kube, None, token, SHOWN_LIMIT), []
    except ApiError as e:
        if e.status != 403:
            raise
    user = request.get(USER, "")
    own = user.split(":")[2] if user.startswith("system:serviceaccount:") and user.count(":") == 3 else ""
    wanted = sorted({ns for ns in (*request.query.getall("namespace", []), own) if ns})[:NAMESPACES_LIMIT]
    found: list[Body] = []
    refused: list[str] = []
    for ns in wanted:
        try:
            found += await _some(kube, ns, token, SHOWN_LIMIT - len(found))
        except ApiError as e:
            if e.status != 403:
                raise
            refused.append(ns)
    return found, refused


async def _cluster(request: web.Request) -> list[Body]:
    """The ClusterFlowQuotas, when the person may list them (a platform team's: often not)."""
    try:
        return await _some(request.app[KUBE], None, cred_of(request).token, SHOWN_LIMIT,
                           f"/apis/{GROUP}/{VERSION}/{CLUSTER_QUOTA_PLURAL}")
    except ApiError as e:
        if e.status in (403, 404):
            return []
        raise


async def quotas_page(request: web.Request) -> web.Response:
    found, refused = await _list(request)
    found += await _cluster(request)
    quotas = sorted((view(q) for q in found), key=lambda v: (v["namespace"], v["name"]))
    return render(request, "quotas.html", quotas=quotas, refused=refused,
                  namespace=request.query.get("namespace", ""))
