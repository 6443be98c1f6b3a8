"""Who may see the console, and what every answer carries: the two middlewares (`security`: the
loopback address in local mode, forms posted from this site only, the API server's failures as
statuses, the hardening headers; `signed_in`: a credential, the CSRF token of a form, who you are)
and the sign-in pages (a token, `kubectl flow console`'s launch link, signing out)."""

from __future__ import annotations

import logging
import secrets
import time
from typing import Any
from urllib.parse import unquote, urlencode, urlsplit

import aiohttp
from aiohttp import web

from flowkube_console.auth import is_tls, same_origin
from flowkube_console.kube import ApiError
from flowkube_console.pages import AUTH, CRED, KUBE, SETTINGS, USER, Handler, cached, render

log = logging.getLogger("flowkube.console")

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin",
           "X-Frame-Options": "DENY", "Cache-Control": "no-store"}
LOGIN_COOKIE = "flowkube_login"  # the sign-in page's nonce, until the browser signs in
PUBLIC = frozenset({"/login", "/healthz", "/auth/local", "/favicon.ico"})


@web.middleware
async def security(request: web.Request, handler: Handler) -> web.StreamResponse:
    settings = request.app[SETTINGS]
    if settings.mode == "local" and request.host.rsplit(":", 1)[0] not in ("127.0.0.1", "localhost", "[::1]"):
        return web.Response(status=421, text="this console answers only on its loopback address")
    if request.method == "POST" and not same_origin(request):
        return web.Response(status=403, text="refused: the form was posted from another site")
    started = time.perf_counter()
    try:
        response = await handler(request)
    except web.HTTPException as e:
        _harden(request, e)
        raise
    except (OSError, TimeoutError, aiohttp.ClientError) as e:
        log.warning("%s %s: the API server did not answer: %s", request.method, request.path, e)
        response = web.Response(status=502, text=f"the API server did not answer: {e}")
    except ApiError as e:
        status = e.status if e.status in (401, 403, 404, 409, 422, 429, 503) else 502
        response = web.Response(status=status, text=f"the API server said: {e.message}")
    _harden(request, response)
    if not response.prepared:  # a stream (server-sent events) has sent its headers already
        response.headers["Server-Timing"] = f"app;dur={(time.perf_counter() - started) * 1000:.1f}"
    return response


def _harden(request: web.Request, response: web.StreamResponse) -> None:
    for k, v in HEADERS.items():
        response.headers.setdefault(k, v)
    if is_tls(request):
        response.headers.setdefault("Strict-Transport-Security", "max-age=31536000")


@web.middleware
async def signed_in(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.path in PUBLIC or request.path.startswith("/static/"):
        return await handler(request)
    auth = request.app[AUTH]
    cred = auth.credential(request)
    if cred is None:
        if request.method == "GET" and not request.path.startswith("/events/"):
            # Not a redirect: a page that goes on to sign-in by itself. A link from another site (a
            # notification in a chat) is a navigation the browser holds the SameSite=Strict session cookie
            # back from, and a redirect would stay "from another site"; the sign-in page asked for by
            # this page is this site's own request, carries the cookie, and sends a signed-in person
            # straight back here. (A browser without the cookie stays on the sign-in page: no loop.)
            response = render(request, "bounce.html", url="/login?" + urlencode({"next": request.path_qs}))
            response.headers["Cache-Control"] = "no-store"
            return response
        raise web.HTTPUnauthorized(text="sign in first")
    request[CRED] = cred
    if request.method == "POST":
        form = await request.post()
        if not auth.csrf_ok(cred.key, str(form.get("csrf") or "")):
            raise web.HTTPForbidden(text="refused: the form's CSRF token does not match your session; reload the page")
    try:
        request[USER] = await cached(request, ("whoami", cred.key), 60, lambda: request.app[KUBE].whoami(cred.token))
    except ApiError as e:
        if e.status == 401:
            response = web.HTTPSeeOther("/login?" + urlencode({"expired": "1"}))
            auth.sign_out(response)
            raise response from None
        request[USER] = "?"
    return await handler(request)


async def login_page(request: web.Request) -> web.Response:
    settings = request.app[SETTINGS]
    if request.app[AUTH].credential(request) is not None and not request.query.get("expired"):
        raise web.HTTPSeeOther(_next(request))  # signed in already (back from a link of another site)
    # One nonce per browser until it signs in: another tab (or a favicon request sent here) keeps it.
    nonce = request.cookies.get(LOGIN_COOKIE) or secrets.token_urlsafe(16)
    response = render(request, "login.html", mode=settings.mode, error="", next=_next(request),
                      expired=bool(request.query.get("expired")), login_csrf=request.app[AUTH].csrf(nonce))
    response.set_cookie(LOGIN_COOKIE, nonce, httponly=True, samesite="Strict", secure=is_tls(request),
                        path="/login")
    return response


def local_path(target: str) -> bool:
    """A path of this console, nothing a browser could read as another site: as written, and as decoded once."""
    def local(path: str) -> bool:
        parts = urlsplit(path)
        plain = path.isprintable() and not any(c in path for c in "\\ \t")
        return plain and path.startswith("/") and not path.startswith("//") and not parts.scheme and not parts.netloc

    return local(target) and local(unquote(target))


def _next(request: web.Request, form: Any = None) -> str:
    """Where to go after signing in."""
    target = str((form or {}).get("next") or request.query.get("next") or "/")
    return target if local_path(target) else "/"


async def login(request: web.Request) -> web.Response:
    auth, form = request.app[AUTH], await request.post()
    nonce = request.cookies.get(LOGIN_COOKIE, "")
    if not nonce or not auth.csrf_ok(nonce, str(form.get("csrf") or "")):
        raise web.HTTPForbidden(text="refused: reload the sign-in page and try again")
    token = "".join(str(form.get("token") or "").split())
    error = ""
    if not token:
        error = "Paste a token."
    elif not auth.fits(token):
        error = ("This token is too long to keep in a browser cookie (about 2,900 characters at most). "
                 "Sign in through your auth proxy instead, which passes the token with each request.")
    else:
        try:
            await request.app[KUBE].whoami(token)
        except ApiError as e:
            error = f"The API server did not accept this token: {e.message}"
    if error:
        return render(request, "login.html", status=401, mode=request.app[SETTINGS].mode, error=error,
                      next=_next(request, form), expired=False, login_csrf=auth.csrf(nonce))
    response = web.HTTPSeeOther(_next(request, form))
    auth.sign_in(response, request, token)
    response.del_cookie(LOGIN_COOKIE, path="/login")
    raise response


async def launch(request: web.Request) -> web.Response:
    """Local mode: the URL `kubectl flow console` opens carries the launch key once."""
    auth = request.app[AUTH]
    if request.app[SETTINGS].mode != "local" or not auth.launch(request.query.get("key", "")):
        raise web.HTTPForbidden(text="this link is not (or no longer) valid: it signs in one browser once; "
                                     "run `kubectl flow console` again")
    response = web.HTTPSeeOther("/")
    auth.sign_in(response, request, None)
    raise response


async def logout(request: web.Request) -> web.Response:
    response = web.HTTPSeeOther("/login")
    request.app[AUTH].sign_out(response)
    raise response
