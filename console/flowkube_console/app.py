"""The console's HTTP side: pages rendered on the server, live parts over server-sent events.

Every page is rendered by Jinja2 with autoescaping on: whatever a flow produced is text on the page,
never markup. The Content-Security-Policy allows scripts, styles and connections from the console
itself only (one small script, no inline code), so even a template mistake could not run a flow's
script (`signin.HEADERS`). Who may see it, and signing in, are `signin`'s; what every handler uses
(the app's keys, `render`), `pages`'. See docs/console.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from collections.abc import Callable
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import quote, urlencode

import orjson
from aiohttp import web

from flowkube_api.inbox import feedback_patch, message_patch
from flowkube_console import forking, quotas, views
from flowkube_console.auth import Auth
from flowkube_console.kube import ApiError, Kube, flows_path
from flowkube_console.live import Feeds
from flowkube_console.pages import (
    AUTH,
    CACHE,
    FEEDS,
    KUBE,
    SETTINGS,
    STREAMS,
    TEMPLATES,
    USER,
    cached,
    cred_of,
    render,
    templates,
)
from flowkube_console.settings import Settings
from flowkube_console.signin import HEADERS, launch, login, login_page, logout, security, signed_in

log = logging.getLogger("flowkube.console")

KEEPALIVE_SECONDS = 15.0
STREAM_LIMIT = 16  # live pages (event streams) one person may hold open
DEBOUNCE_SECONDS = 0.1  # a live list re-renders at most this often, however many Flows change
LINE_BREAK = re.compile(r"\r\n|\r|\n")
FORM_LIMIT = 1 << 20  # bytes of a posted form (a 64 Ki-character message, URL-encoded, fits)
SENT = {"answer": "your answer", "message": "your message", "fork": "the fork: it starts from the checkpoint"}
def digest(html: str) -> str:
    """Names a rendered fragment: the event stream skips one the page already shows."""
    return hashlib.sha256(html.encode()).hexdigest()[:20]


async def may_answer(request: web.Request, namespace: str) -> bool:
    cred = cred_of(request)
    return bool(await cached(request, ("patch", cred.key, namespace), 30,
                             lambda: request.app[KUBE].can(cred.token, "patch", namespace, "status")))


async def healthz(_: web.Request) -> web.Response:
    return web.Response(text="ok")


async def favicon(_: web.Request) -> web.Response:
    return web.Response(status=204)


# -------------------------------------------------------------------------------------- inbox, list


def _filters(request: web.Request) -> views.Filters:
    return views.Filters(namespace=request.query.get("namespace", ""), definition=request.query.get("definition", ""))


# The two live lists: their fragment template and which Flows they show, in which order.
COLLECTIONS: dict[str, tuple[str, Callable[[list[views.Summary], views.Filters], list[views.Summary]]]] = {
    "inbox": ("_inbox.html", views.inbox), "flows": ("_flows.html", views.listing)}


def _collection(request: web.Request, feed_summaries: list[views.Summary], what: str) -> str:
    template, pick = COLLECTIONS[what]
    return request.app[TEMPLATES].get_template(template).render(
        items=pick(feed_summaries, _filters(request)), now=datetime.now(UTC))


def wanted(request: web.Request) -> set[str]:
    """Namespaces to follow when the user may not list Flows cluster-wide: the one the page filters
    on, and a ServiceAccount's own."""
    user = request.get(USER, "")
    own = user.split(":")[2] if user.startswith("system:serviceaccount:") and user.count(":") == 3 else ""
    return {ns for ns in (request.query.get("namespace", ""), own) if ns}


async def collection_page(request: web.Request, what: str) -> web.Response:
    feeds = request.app[FEEDS]
    async with feeds.use(cred_of(request), wanted(request)) as feed:
        summaries = feed.summaries()
        namespaces, definitions = views.choices(summaries)
        body = _collection(request, summaries, what)
        return render(request, f"{what}.html", body=body, filters=_filters(request), namespaces=namespaces,
                      definitions=definitions, problems=dict(feed.problems), scope=feed.scope,
                      live=f"/events/{what}?" + urlencode({**request.query, "have": digest(body)}))


async def inbox_page(request: web.Request) -> web.Response:
    return await collection_page(request, "inbox")


async def flows_page(request: web.Request) -> web.Response:
    return await collection_page(request, "flows")


def sse_event(html: str) -> bytes:
    """One ``update`` event. Every line break a browser's event-stream parser knows (CR, LF, CRLF)
    starts a new ``data:`` line: a flow's text with a bare CR cannot end the event or start another."""
    data = "".join(f"data: {ln}\n" for ln in LINE_BREAK.split(html))
    return f"event: update\n{data}\n".encode()


async def sse(request: web.Request, updates: Callable[[], Any]) -> web.StreamResponse:
    """Server-sent events: ``update`` with a fragment of HTML each time ``updates`` yields a new one
    (None: nothing new). A comment every KEEPALIVE_SECONDS keeps proxies from cutting the stream and
    finds a closed tab, whose watch then ends. At most STREAM_LIMIT streams per person."""
    cred = cred_of(request)
    streams = request.app[STREAMS]
    if streams.get(cred.key, 0) >= STREAM_LIMIT:
        raise web.HTTPTooManyRequests(text=f"at most {STREAM_LIMIT} live pages per person; close some tabs")
    streams[cred.key] = streams.get(cred.key, 0) + 1
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store",
                                           "X-Accel-Buffering": "no", **HEADERS})
    source = updates().__aiter__()
    pending: asyncio.Future[Any] | None = None
    try:
        await response.prepare(request)
        last = request.query.get("have")  # what the page already shows: not sent again (nor swapped in)
        while True:
            pending = pending or asyncio.ensure_future(source.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS)
            if not done:
                await response.write(b": keepalive\n\n")
                continue
            html, pending = pending.result(), None
            name = digest(html) if html is not None else last
            if name != last:
                last = name
                await response.write(sse_event(html))
    except (ConnectionResetError, asyncio.CancelledError, StopAsyncIteration):
        pass
    except ApiError as e:  # the person may no longer read this: the stream ends, the page says so on reload
        log.info("live page %s ended: %s", request.path, e.message)
    finally:
        streams[cred.key] -= 1
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await pending
        with contextlib.suppress(Exception):
            await source.aclose()
    return response


async def collection_events(request: web.Request) -> web.StreamResponse:
    what = request.match_info["what"]

    async def updates() -> Any:
        async with request.app[FEEDS].use(cred_of(request), wanted(request)) as feed:
            seen = -1
            while True:
                if seen >= 0:
                    await feed.changed(seen, KEEPALIVE_SECONDS)
                    await asyncio.sleep(DEBOUNCE_SECONDS)  # a burst of changes is one render
                version = feed.version
                yield _collection(request, feed.summaries(), what) if version != seen else None
                seen = version

    return await sse(request, updates)


# ------------------------------------------------------------------------------------------ one Flow


SNAPSHOT_KEPT = 64 * 1024  # bytes of a template spec the console keeps a minute (larger: read at each view)


async def _template_spec(request: web.Request, flow: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The template spec a Flow of a template runs, from its snapshot, read with the signed-in
    person's token (kept a minute per credential); (None, why) when it cannot be read."""
    name = views.taken_snapshot(flow)
    if name is None:
        return None, ""
    cred, ns = cred_of(request), str((flow.get("metadata") or {}).get("namespace") or "")
    key, cache = ("snapshot", cred.key, ns, name), request.app[CACHE]
    hit = cache.get(key)
    if hit is not None and hit[0] > time.monotonic():
        return hit[1], ""
    try:
        obj: dict[str, Any] | None = await request.app[KUBE].get_snapshot(cred.token, ns, name)
    except ApiError as e:
        if e.status != 404:
            return None, f"the template's inputs are not shown: its snapshot {name!r} could not be read ({e.message})"
        obj = None
    spec, note = views.snapshot_spec(flow, obj)
    if spec is not None and len(orjson.dumps(spec)) <= SNAPSHOT_KEPT:
        if len(cache) > 10_000:
            cache.clear()
        cache[key] = (time.monotonic() + 60, spec)
    return spec, note


async def _flow_context(request: web.Request, flow: dict[str, Any]) -> dict[str, Any]:
    d = views.detail(flow, *await _template_spec(request, flow))
    ns, name = d.summary.namespace, d.summary.name
    events: list[dict[str, Any]] = []
    with contextlib.suppress(ApiError):
        events = views.event_rows(await request.app[KUBE].events(cred_of(request).token, ns, d.summary.uid))
    grafana = request.app[SETTINGS].grafana_url
    return {"d": d, "events": events, "may_answer": await may_answer(request, ns),
            "grafana": grafana.format(namespace=quote(ns), name=quote(name)) if grafana else "",
            "trace": views.trace_link(request.app[SETTINGS].trace_url, flow)}


async def flow_page(request: web.Request, *, error: str = "", status: int = 200, sent: str = "",
                    draft: str = "") -> web.Response:
    flow = await request.app[KUBE].get_flow(cred_of(request).token, request.match_info["namespace"],
                                            request.match_info["name"])  # a refusal: the middleware says it
    context = await _flow_context(request, flow)
    live = await render_live(request, context, draft=draft)
    events = f"/events/flows/{quote(request.match_info['namespace'])}/{quote(request.match_info['name'])}"
    return render(request, "flow.html", status=status, live=live, error=error,
                  sent=sent or SENT.get(request.query.get("sent", ""), ""),
                  live_url=events + ("" if draft else f"?have={digest(live)}"),
                  csrf=request.app[AUTH].csrf(cred_of(request).key), **await forking.context(request, flow),
                  **context)


async def render_live(request: web.Request, context: dict[str, Any], *, draft: str = "") -> str:
    cred = cred_of(request)
    return request.app[TEMPLATES].get_template("_flow_live.html").render(
        now=datetime.now(UTC), csrf=request.app[AUTH].csrf(cred.key), draft=draft, **context)


async def flow_events(request: web.Request) -> web.StreamResponse:
    kube, token = request.app[KUBE], cred_of(request).token
    ns, name = request.match_info["namespace"], request.match_info["name"]

    async def updates() -> Any:
        selector = {"fieldSelector": f"metadata.name={name}"}
        while True:
            rv = ""
            async for item in kube.list_all(flows_path(ns), token, **selector):
                if "_list" in item:
                    rv = str(item["_list"].get("resourceVersion") or "")
                else:
                    yield await render_live(request, await _flow_context(request, item))
            try:
                async for event in kube.watch(flows_path(ns), token, rv, **selector):
                    if event.get("type") in ("ADDED", "MODIFIED"):
                        yield await render_live(request, await _flow_context(request, event["object"]))
            except ApiError as e:
                if e.status != 410:
                    return
            yield None

    return await sse(request, updates)


async def _answer(request: web.Request, patch: dict[str, Any], what: str, draft: str) -> web.Response:
    ns, name = request.match_info["namespace"], request.match_info["name"]
    try:
        await request.app[KUBE].patch_status(cred_of(request).token, ns, name, patch)
    except ApiError as e:
        return await flow_page(request, error=f"The API server refused {SENT[what]}: {e.message}",
                               status=e.status if 400 <= e.status < 500 else 502, draft=draft)
    raise web.HTTPSeeOther(f"/flows/{quote(ns)}/{quote(name)}?" + urlencode({"sent": what}))


async def answer_feedback(request: web.Request) -> web.Response:
    form = await request.post()
    text, outcome = str(form.get("text") or "").strip(), str(form.get("outcome") or "").strip()
    if outcome:
        text = f"{outcome}. {text}" if text else outcome
    if not text:
        return await flow_page(request, error="Write an answer or choose an outcome.", status=422)
    return await _answer(request, feedback_patch(text, str(form.get("request_id") or "")), "answer",
                         str(form.get("text") or ""))


async def fork_flow(request: web.Request) -> web.Response:
    """"Fork from here": a new Flow from a checkpoint, with the person's token; its page next."""
    try:
        created = await forking.fork(request)
    except ValueError as e:
        return await flow_page(request, error=f"No fork made: {e}.", status=422)
    except ApiError as e:
        return await flow_page(request, error=f"The API server refused the fork: {e.message}",
                               status=e.status if 400 <= e.status < 500 else 502)
    meta = created.get("metadata") or {}
    raise web.HTTPSeeOther(f"/flows/{quote(str(meta.get('namespace')))}/{quote(str(meta.get('name')))}?"
                           + urlencode({"sent": "fork"}))


async def send_message(request: web.Request) -> web.Response:
    form = await request.post()
    text = "exit" if form.get("end") else str(form.get("text") or "").strip()  # exit: crewAI's end command
    if not text:
        return await flow_page(request, error="Write a message.", status=422)
    return await _answer(request, message_patch(text), "message", text)


# ---------------------------------------------------------------------------------------------- app


def make_app(settings: Settings) -> web.Application:
    app = web.Application(middlewares=[security, signed_in], client_max_size=FORM_LIMIT)
    kube = Kube(settings.api_server, settings.ca_file, socket=settings.api_socket)
    app[SETTINGS], app[KUBE], app[AUTH] = settings, kube, Auth(settings)
    app[FEEDS] = Feeds(kube, settings.namespaces)
    app[TEMPLATES], app[CACHE], app[STREAMS] = templates(), {}, {}
    static = resources.files("flowkube_console") / "static"
    app.add_routes([
        web.get("/healthz", healthz), web.get("/favicon.ico", favicon),
        web.get("/login", login_page), web.post("/login", login), web.get("/auth/local", launch),
        web.post("/logout", logout),
        web.get("/", inbox_page), web.get("/flows", flows_page), web.get("/quotas", quotas.quotas_page),
        web.get("/events/{what:inbox|flows}", collection_events),
        web.get("/flows/{namespace}/{name}", flow_page), web.get("/events/flows/{namespace}/{name}", flow_events),
        web.post("/flows/{namespace}/{name}/feedback", answer_feedback),
        web.post("/flows/{namespace}/{name}/message", send_message),
        web.post("/flows/{namespace}/{name}/fork", fork_flow),
    ])
    app.router.add_static("/static/", str(static))

    async def cleanup(_: web.Application) -> None:
        await app[FEEDS].close()
        await kube.close()

    app.on_cleanup.append(cleanup)
    return app
