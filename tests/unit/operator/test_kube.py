"""The API client keeps working when the kubelet renews the pod's token: a 401 makes it read the
projected token again and try once more with it (a scripted HTTP server plays the API server's check)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import kopf
import pytest
from aiohttp import web

from flowkube_operator.kube import client as kube_mod
from flowkube_operator.kube.client import ApiError, Kube


@contextlib.asynccontextmanager
async def api_server(app: web.Application, token: str = "t", limit: int = 64) -> AsyncIterator[Kube]:
    """``app`` served on a free port of this host, and the operator's client of it holding ``token``."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    client = Kube(kopf.ConnectionInfo(server=f"http://127.0.0.1:{runner.addresses[0][1]}", token=token), limit=limit)
    try:
        yield client
    finally:
        await client.close()
        await runner.cleanup()


async def _served(valid: str) -> tuple[list[str | None], object]:
    """One GET by a client holding the token "old", against a server that takes only ``valid``."""
    seen: list[str | None] = []

    async def namespace(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        if request.headers.get("Authorization") != f"Bearer {valid}":
            return web.json_response({"kind": "Status", "code": 401, "message": "Unauthorized"}, status=401)
        return web.json_response({"kind": "Namespace"})

    app = web.Application()
    app.router.add_get("/api/v1/namespaces/x", namespace)
    async with api_server(app, token="old") as client:
        try:
            result: object = await client.get("/api/v1/namespaces/x")
        except ApiError as e:
            result = e
    return seen, result


def test_a_401_after_the_kubelet_renewed_the_token_is_tried_again_with_the_new_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    monkeypatch.setattr(kube_mod, "SA_TOKEN", token)
    token.write_text("new\n")  # the kubelet renewed it in place
    seen, result = asyncio.run(_served("new"))
    assert result == {"kind": "Namespace"}
    assert seen == ["Bearer old", "Bearer new"]


def test_a_401_with_no_newer_token_is_the_callers_error_after_one_try(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    token = tmp_path / "token"
    monkeypatch.setattr(kube_mod, "SA_TOKEN", token)
    token.write_text("old\n")
    seen, result = asyncio.run(_served("something-else"))
    assert isinstance(result, ApiError) and result.status == 401
    assert seen == ["Bearer old"]


def test_a_sibling_has_the_login_and_connections_of_its_own() -> None:
    """The Lease's client (`Kube.sibling`, made on the election's thread) holds the login's token
    and never waits behind its requests: with every slot of the operator's client held by slow
    requests (a flood of state API reads or TokenReviews), a renewal still goes out at once."""
    release = asyncio.Event()
    seen: list[str | None] = []

    async def slow(_: web.Request) -> web.Response:
        await release.wait()
        return web.json_response({"kind": "ConfigMap"})

    async def lease(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"kind": "Lease"})

    async def scenario() -> None:
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/x/configmaps/c", slow)
        app.router.add_put("/apis/coordination.k8s.io/v1/namespaces/x/leases/l", lease)
        async with api_server(app, token="secret", limit=4) as client:
            sibling = client.sibling()
            held = [asyncio.create_task(client.get("/api/v1/namespaces/x/configmaps/c")) for _ in range(8)]
            try:
                async with asyncio.timeout(5):  # would wait for `release` if it shared the slots
                    renewed = await sibling.request("PUT", "/apis/coordination.k8s.io/v1/namespaces/x/leases/l", {})
                assert renewed == {"kind": "Lease"} and seen == ["Bearer secret"]
            finally:
                release.set()
                await asyncio.gather(*held)
                await sibling.close()

    asyncio.run(scenario())


def test_token_reviews_and_the_reconciles_requests_never_wait_for_each_other() -> None:
    """A flood of TokenReviews (made-up tokens at the state API) holds every review slot; the
    reconcile's reads still go out at once, and with the reconcile's slots all held a review does."""
    review_path = "/apis/authentication.k8s.io/v1/tokenreviews"
    release: list[asyncio.Event] = []

    async def slow(_: web.Request) -> web.Response:
        await release[-1].wait()
        return web.json_response({"kind": "Slow"})

    async def fast(_: web.Request) -> web.Response:
        return web.json_response({"kind": "Fast"})

    async def scenario(slow_path: str, fast_path: str, method: str) -> None:
        release.append(asyncio.Event())
        app = web.Application()
        app.router.add_route("*", slow_path, slow)
        app.router.add_route("*", fast_path, fast)
        async with api_server(app, limit=4) as client:
            held = [asyncio.create_task(client.request("POST", slow_path, {}))
                    for _ in range(kube_mod.REVIEW_CONNECTIONS + 8)]
            try:
                async with asyncio.timeout(5):  # would wait for `release` if they shared the slots
                    assert await client.request(method, fast_path, {} if method == "POST" else None) == {"kind": "Fast"}
            finally:
                release[-1].set()
                await asyncio.gather(*held)

    asyncio.run(scenario(review_path, "/api/v1/namespaces/x/configmaps/c", "GET"))
    asyncio.run(scenario("/api/v1/namespaces/x/configmaps", review_path, "POST"))


def test_the_issuers_key_set_is_asked_for_as_the_api_server_serves_it() -> None:
    """kube-apiserver serves /openid/v1/jwks only as application/jwk-set+json: a client that accepts
    only application/json gets 406, and the state API fell back to a TokenReview per token (seen on
    the local stack). The server here negotiates as the API server does."""
    async def main() -> object:
        async def jwks(request: web.Request) -> web.Response:
            if "application/jwk-set+json" not in request.headers.get("Accept", ""):
                return web.Response(status=406, text="Available representations: application/jwk-set+json")
            return web.json_response({"keys": []}, content_type="application/jwk-set+json")

        app = web.Application()
        app.router.add_get("/openid/v1/jwks", jwks)
        async with api_server(app) as client:
            return await client.request("GET", "/openid/v1/jwks")

    assert asyncio.run(main()) == {"keys": []}
