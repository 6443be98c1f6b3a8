"""What every handler of the console uses: the application's keys, the templates (Jinja2, autoescaped)
and `render`, and the answers of the API server kept per credential for a moment."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import jinja2
from aiohttp import web

from flowkube_console import views
from flowkube_console.auth import Auth, Credential
from flowkube_console.kube import Kube
from flowkube_console.live import Feeds
from flowkube_console.settings import Settings

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

SETTINGS: web.AppKey[Settings] = web.AppKey("settings", Settings)
KUBE: web.AppKey[Kube] = web.AppKey("kube", Kube)
FEEDS: web.AppKey[Feeds] = web.AppKey("feeds", Feeds)
AUTH: web.AppKey[Auth] = web.AppKey("auth", Auth)
TEMPLATES: web.AppKey[jinja2.Environment] = web.AppKey("templates", jinja2.Environment)
CACHE: web.AppKey[dict[tuple[str, ...], tuple[float, Any]]] = web.AppKey("cache", dict)
STREAMS: web.AppKey[dict[str, int]] = web.AppKey("streams", dict)
CRED: web.RequestKey[Credential] = web.RequestKey("credential", Credential)
USER: web.RequestKey[str] = web.RequestKey("user", str)


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("flowkube_console", "templates"),
                             autoescape=True, trim_blocks=True, lstrip_blocks=True)
    env.globals["age"] = views.age
    env.globals["cost_text"] = views.cost_text
    env.filters["q"] = lambda s: quote(str(s), safe="")
    return env


def render(request: web.Request, name: str, status: int = 200, **context: Any) -> web.Response:
    cred = request.get(CRED)
    context.setdefault("user", request.get(USER, ""))
    context.setdefault("csrf", request.app[AUTH].csrf(cred.key) if cred else "")
    context.setdefault("now", datetime.now(UTC))
    context.setdefault("signed_in_via", cred.via if cred else "")
    html = request.app[TEMPLATES].get_template(name).render(**context)
    return web.Response(text=html, content_type="text/html", status=status)


async def cached(request: web.Request, key: tuple[str, ...], seconds: float,
                 fetch: Callable[[], Awaitable[Any]]) -> Any:
    """An answer of the API server for this credential, kept ``seconds`` (who you are, what you may do)."""
    cache = request.app[CACHE]
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    value = await fetch()
    if len(cache) > 10_000:
        cache.clear()
    cache[key] = (now + seconds, value)
    return value


def cred_of(request: web.Request) -> Credential:
    return request[CRED]
