"""The kubelet endpoint subset the API server proxies to: container logs and health, over mutual TLS."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from flowkube_devstack.node.agent import Agent

# kubelet asks the API server (SubjectAccessReview on nodes/proxy); this cluster binds no role to the
# kubelet-client identity, so the agent authorizes that identity and cluster admins by certificate.
ALLOWED_USERS = {"kube-apiserver-kubelet-client"}
ALLOWED_GROUPS = {"system:masters", "kubeadm:cluster-admins"}
FOLLOW_POLL = 0.1


def _subject(request: web.Request) -> tuple[str, set[str]]:
    cert: Any = request.transport.get_extra_info("peercert") if request.transport else None
    cn, orgs = "", set()
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                cn = value
            elif key == "organizationName":
                orgs.add(value)
    return cn, orgs


@web.middleware
async def authorize(request: web.Request, handler: Any) -> web.StreamResponse:
    if request.path != "/healthz":
        cn, orgs = _subject(request)
        if cn not in ALLOWED_USERS and not orgs & ALLOWED_GROUPS:
            raise web.HTTPForbidden(text=f"Forbidden (user={cn}, verb=get, resource=nodes, "
                                         "subresource=proxy)\n")
    response: web.StreamResponse = await handler(request)
    return response


async def start(agent: Agent, cert: Path, key: Path, client_ca: Path) -> web.AppRunner:
    tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
    tls.load_cert_chain(str(cert), str(key))
    tls.verify_mode = ssl.CERT_REQUIRED
    app = web.Application(middlewares=[authorize])
    app["agent"] = agent
    app.router.add_get("/healthz", lambda _: _text("ok"))
    app.router.add_get("/containerLogs/{namespace}/{pod}/{container}", container_logs)
    for verb in ("exec", "attach", "portForward", "run"):
        app.router.add_route("*", f"/{verb}/{{tail:.*}}", unsupported)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=tls)
    await site.start()
    agent.port = int(runner.addresses[0][1])
    return runner


async def _text(body: str) -> web.Response:
    return web.Response(text=body)


async def unsupported(request: web.Request) -> web.Response:
    raise web.HTTPNotImplemented(text=(
        f"{request.path.split('/')[1]} is not supported by the flowkube node agent: containers are host "
        "processes without a runtime to attach to; use kubectl logs or look at the process directly\n"))


async def container_logs(request: web.Request) -> web.StreamResponse:
    agent: Agent = request.app["agent"]
    ns, pod, name = (request.match_info[k] for k in ("namespace", "pod", "container"))
    worker = agent.find(ns, pod)
    rec = worker.record(name) if worker else None
    if worker is None or rec is None:
        raise web.HTTPNotFound(text=f'container "{name}" in pod "{pod}" not found\n')
    q = request.query
    restart = rec.restart_count
    if q.get("previous") in ("true", "1"):
        restart -= 1
        if restart < 0 or not worker.log_path(name, restart).exists():
            raise web.HTTPBadRequest(
                text=f'previous terminated container "{name}" in pod "{pod}" not found\n')
    path = worker.log_path(name, restart)
    if not path.exists():
        reason = rec.state.get("waiting", {}).get("reason", "ContainerCreating")
        raise web.HTTPBadRequest(text=f'container "{name}" in pod "{pod}" is waiting to start: {reason}\n')
    data = path.read_bytes()
    if "tailLines" in q:
        lines = data.splitlines(keepends=True)
        data = b"".join(lines[-int(q["tailLines"]):]) if int(q["tailLines"]) > 0 else b""
    limit = int(q["limitBytes"]) if "limitBytes" in q else None
    if limit is not None:
        data = data[:limit]
    resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
    await resp.prepare(request)
    await resp.write(data)
    if q.get("follow") in ("true", "1") and (limit is None or len(data) < limit):
        await _follow(resp, path, path.stat().st_size, lambda: rec.restart_count == restart
                      and "terminated" not in rec.state and not worker.gone)
    await resp.write_eof()
    return resp


async def _follow(resp: web.StreamResponse, path: Path, offset: int, alive: Any) -> None:
    # The process writes its log file directly; poll its size while the container lives.
    while True:
        running = alive()
        with path.open("rb") as f:
            f.seek(offset)
            chunk = f.read()
        if chunk:
            offset += len(chunk)
            await resp.write(chunk)
        elif not running:
            return
        else:
            await asyncio.sleep(FOLLOW_POLL)
