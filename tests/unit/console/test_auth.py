"""The console's doors, without a cluster: who is let in, which forms are refused, which headers
every page carries. (Signing in with a real token against a real API server is in
tests/integration/test_console.py.)"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp.test_utils import TestClient, TestServer

from flowkube_console.app import make_app
from flowkube_console.auth import COOKIE, Auth
from flowkube_console.settings import Settings

SETTINGS = Settings(api_server="http://127.0.0.1:9", session_key=b"k" * 32)


def run(settings: Settings, scenario: Callable[[TestClient[Any, Any]], Awaitable[None]]) -> None:
    async def main() -> None:
        async with TestClient(TestServer(make_app(settings))) as client:
            await scenario(client)

    asyncio.run(main())


def test_pages_need_a_sign_in_and_carry_a_strict_policy() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        r = await client.get("/", allow_redirects=False)
        assert r.status == 200 and 'content="0;url=/login?next=%2F"' in await r.text()
        r = await client.get("/login")
        assert r.status == 200
        csp = r.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "default-src 'none'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["X-Content-Type-Options"] == "nosniff"
        assert "HttpOnly" in r.headers["Set-Cookie"] and "SameSite=Strict" in r.headers["Set-Cookie"]
        r = await client.get("/events/inbox")
        assert r.status == 401

    run(SETTINGS, scenario)


def test_forms_without_their_csrf_token_or_from_another_site_are_refused() -> None:
    async def scenario(client: TestClient[Any, Any]) -> None:
        r = await client.post("/login", data={"token": "t"})
        assert r.status == 403
        r = await client.post("/login", data={"token": "t"}, headers={"Origin": "https://evil.example"})
        assert r.status == 403 and "another site" in await r.text()
        sealed = Auth(SETTINGS)
        cookie = sealed._fernet.encrypt(b'{"token": "t"}').decode()
        client.session.cookie_jar.update_cookies({COOKIE: cookie})
        r = await client.post("/flows/ns/f/feedback", data={"text": "approved", "csrf": "forged"})
        # Signed in (a sealed cookie), but the form's token is not this session's: refused before
        # anything reaches the API server (whoami fails against the closed port and is not needed).
        assert r.status == 403

    run(SETTINGS, scenario)


def test_an_event_carries_a_fragment_whatever_its_line_breaks() -> None:
    """A flow's text with bare CRs (which end a line in an event stream) cannot end the event early
    or inject another: every line of the fragment is a data line of one event."""
    from flowkube_console.app import sse_event

    hostile = "hi\r\rretry: 86400000\revent: update\rdata: SPOOF\r\n\nend"
    lines = sse_event(f"<pre>{hostile}</pre>").decode().split("\n")
    assert lines[0] == "event: update" and lines[-2:] == ["", ""]
    body = [ln for ln in lines[1:-2]]
    assert all(ln.startswith("data: ") for ln in body), body
    assert "\r" not in "".join(body)


def test_sign_in_goes_back_only_to_a_page_of_this_console() -> None:
    from aiohttp.test_utils import make_mocked_request

    from flowkube_console.signin import _next

    for bad in ("//evil.example", "/%09/evil.example", "/\t/evil.example", "https://evil.example/",
                "/\\evil.example", "javascript:alert(1)"):
        assert _next(make_mocked_request("GET", "/login"), {"next": bad}) == "/", bad
    assert _next(make_mocked_request("GET", "/login"), {"next": "/flows/a/b?x=1"}) == "/flows/a/b?x=1"


def test_a_token_too_long_for_a_cookie_is_told_apart() -> None:
    auth = Auth(SETTINGS)
    assert auth.fits("t" * 2000) and not auth.fits("t" * 3500)


def test_a_form_bigger_than_the_bound_is_refused_before_it_is_read() -> None:
    from flowkube_console.app import FORM_LIMIT

    async def scenario(client: TestClient[Any, Any]) -> None:
        page = await client.get("/login")
        csrf = (await page.text()).split('name="csrf" value="', 1)[1].split('"', 1)[0]
        r = await client.post("/login", data={"csrf": csrf, "token": "t" * (FORM_LIMIT + 1)})
        assert r.status == 413
        # a 64 Ki-character message of 3-byte characters, URL-encoded (9 bytes each), still fits
        assert len(("€" * 65536).encode()) * 3 < FORM_LIMIT

    run(SETTINGS, scenario)


def test_a_cookie_not_sealed_by_this_console_is_no_session() -> None:
    auth = Auth(SETTINGS)
    other = Auth(Settings(session_key=b"x" * 32))
    good = auth._fernet.encrypt(b'{"token": "abc"}').decode()
    assert auth._session(good) == {"token": "abc"}
    assert other._session(good) is None
    assert auth._session(good[:-4] + "AAAA") is None
    assert auth._session("not a cookie") is None


def test_local_mode_answers_on_loopback_only_and_signs_in_with_the_launch_key() -> None:
    local = Settings(api_server="http://127.0.0.1:9", session_key=b"k" * 32, mode="local", launch_key="secret")

    async def scenario(client: TestClient[Any, Any]) -> None:
        r = await client.get("/login", headers={"Host": "attacker.example:8080"})
        assert r.status == 421  # a DNS-rebound page cannot read the console
        r = await client.get("/auth/local?key=wrong", allow_redirects=False)
        assert r.status == 403
        r = await client.get("/auth/local?key=secret", allow_redirects=False)
        assert r.status == 303 and f"{COOKIE}_8080" in r.cookies  # cookies ignore ports: the name has it
        r = await client.get("/auth/local?key=secret", allow_redirects=False)
        assert r.status == 403, "the link signs in one browser, once"

    run(local, scenario)


def test_a_link_from_another_site_comes_back_from_this_one_before_sign_in_is_asked() -> None:
    """A notification's link (Slack, mail) is a navigation from another site: the browser holds the
    SameSite=Strict cookie back, and a redirect to sign-in would still count as from another site. So a
    page without a session is answered with a page that asks for sign-in itself (this site's own
    request, which carries the cookie), and sign-in sends a signed-in person straight back, only to a
    path of this console."""
    async def scenario(client: TestClient[Any, Any]) -> None:
        r = await client.get("/flows/team/review?x=1", allow_redirects=False)
        body = await r.text()
        assert r.status == 200 and r.headers["Cache-Control"] == "no-store"
        assert '<meta http-equiv="refresh" content="0;url=/login?next=%2Fflows%2Fteam%2Freview%3Fx%3D1">' in body
        r = await client.get('/flows/a/"><script>x</script>', allow_redirects=False)
        assert "<script>x" not in await r.text()
        r = await client.get("/login?next=%2Fflows%2Fteam%2Freview", allow_redirects=False)
        assert r.status == 200 and "Sign in" in await r.text()  # no session: the form, no loop
        sealed = Auth(SETTINGS)
        client.session.cookie_jar.update_cookies({COOKIE: sealed._fernet.encrypt(b'{"token": "t"}').decode()})
        r = await client.get("/login?next=%2Fflows%2Fteam%2Freview", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/flows/team/review"
        r = await client.get("/login?next=//evil.example/x", allow_redirects=False)
        assert r.status == 303 and r.headers["Location"] == "/"

    run(SETTINGS, scenario)
