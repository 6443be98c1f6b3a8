"""A Flow's checkpoints on its page, with "Fork from here", and a fork's origin beside it.

A fork is made with the signed-in person's own token: the API server's RBAC (``create`` on Flows) and
the admission webhook (``get`` on the origin) decide, as for ``kubectl flow fork``, which makes the same
Flow (``flowkube_api.forks.fork_flow``).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from flowkube_api.forks import fork_flow
from flowkube_console import views
from flowkube_console.kube import ApiError
from flowkube_console.pages import KUBE, cred_of

Body = dict[str, Any]


async def context(request: web.Request, flow: Body) -> Body:
    """The page's checkpoint timeline, whether this person may fork, and for a fork its origin's result
    (read with their token; gone or unreadable says so)."""
    ns = str((flow.get("metadata") or {}).get("namespace") or "")
    kube, token = request.app[KUBE], cred_of(request).token
    rows = views.checkpoint_rows(flow)
    origin = views.fork_origin(flow)
    origin_result, origin_note = views.shown(""), ""
    if origin is not None:
        try:
            read = await kube.get_flow(token, origin.namespace, origin.name)
            origin_result = views.shown(((read.get("status") or {}).get("result") or {}).get("output"))
            if not origin_result.text:
                origin_note = f"{origin.name} has no result yet ({(read.get('status') or {}).get('phase')})"
        except ApiError as e:
            origin_note = ("the origin was deleted" if e.status == 404
                           else f"the origin cannot be read ({e.message})")
    may_fork = bool(rows) and await kube.can(token, "create", ns)
    return {"checkpoints": rows, "origin": origin, "origin_result": origin_result, "origin_note": origin_note,
            "may_fork": may_fork}


async def fork(request: web.Request) -> Body:
    """The fork a posted "Fork from here" form asks for, created with the person's token: the new Flow.
    Raises ValueError (the form) or ApiError (the API server's refusal, the webhook's included)."""
    ns, name = request.match_info["namespace"], request.match_info["name"]
    form = await request.post()
    kube, token = request.app[KUBE], cred_of(request).token
    origin = await kube.get_flow(token, ns, name)
    try:
        at = int(str(form.get("checkpoint") or ""))
    except ValueError:
        raise ValueError("choose a checkpoint to fork from") from None
    row = next((r for r in views.checkpoint_rows(origin) if r.id == at), None)
    if row is None:
        raise ValueError(f"{name} no longer keeps checkpoint {at}")
    inputs, outputs = views.fork_edits(str(form.get("inputs") or ""), str(form.get("output") or ""), row.method)
    if outputs and row.kind != "Completed":
        raise ValueError(f"checkpoint {at} paused in {row.method}: it has no output to edit yet")
    new = str(form.get("name") or "").strip() or None
    body = fork_flow(origin, at, inputs=inputs, outputs=outputs, name=new)
    created: Body = await kube.create_flow(token, ns, body)
    return created
