"""The operator's one door to the API server: a small JSON client.

It reads, writes and watches (informer.py). Reads and writes go through http1.py (a lean keep-alive
HTTP/1.1 pool: the operator's CPU per request is most of its CPU per Flow); watches, long-lived
streams, through aiohttp. Credentials come from kopf's login (kubeconfig or the
in-cluster service account). JSON goes through orjson: every watch event and every answer is decoded
here, so the decoder's speed is the operator's.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import kopf
import orjson

from flowkube_api import constants as c
from flowkube_operator import selfmetrics
from flowkube_operator.kube import http1
from flowkube_operator.meta import orphaned_by_namesake

Body = dict[str, Any]


def _decode(raw: bytes) -> Any:
    """An answer: JSON, or the plain text a proxy or an old server sends with some errors."""
    return orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode(errors="replace")


class ApiError(Exception):
    def __init__(self, status: int, body: Body | str, method: str, path: str) -> None:
        self.status = status
        self.body = body
        msg = body.get("message") if isinstance(body, dict) else body
        super().__init__(f"{method} {path}: {status} {msg}")

    @property
    def reason(self) -> str:
        return str(self.body.get("reason", "")) if isinstance(self.body, dict) else ""


def _materialise(data: str | bytes | None, directory: Path, name: str) -> str | None:
    if data is None:
        return None
    raw = data.encode() if isinstance(data, str) else data
    if not raw.lstrip().startswith(b"-----"):
        raw = base64.b64decode(raw)
    path = directory / name
    path.write_bytes(raw)
    path.chmod(0o600)
    return str(path)


def ssl_context(info: kopf.ConnectionInfo) -> ssl.SSLContext:
    """The login's TLS settings: its CA (none checked with insecure-skip-tls-verify), its client certificate."""
    tmp = Path(tempfile.mkdtemp(prefix="flowkube-creds-"))
    if info.insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    else:
        ca = str(info.ca_path) if info.ca_path else _materialise(info.ca_data, tmp, "ca.crt")
        ctx = ssl.create_default_context(cafile=ca)
    cert = str(info.certificate_path) if info.certificate_path else _materialise(
        info.certificate_data, tmp, "client.crt")
    key = str(info.private_key_path) if info.private_key_path else _materialise(
        info.private_key_data, tmp, "client.key")
    if cert and key:
        ctx.load_cert_chain(cert, key)
    return ctx


def _resource_of(path: str) -> str:
    """`/api/v1/namespaces/ns/pods/x/status` -> `pods/status`, for metric labels."""
    parts = [p for p in path.split("?")[0].split("/") if p]
    if "namespaces" in parts:
        parts = parts[parts.index("namespaces") + 2:]
    elif parts[:1] == ["apis"]:
        parts = parts[3:]
    elif parts[:1] == ["api"]:
        parts = parts[2:]
    return parts[0] + ("/" + parts[2] if len(parts) > 2 else "") if parts else "?"


REQUEST_TIMEOUT = 30.0  # seconds for one request and its whole answer
USER_AGENT = "flowkube-operator"

# Who-is-asking requests tenants can cause (TokenReviews of runner tokens at the state API, /metrics'
# reviews) and the service-account issuer keys the state API checks tokens with: their own pool.
REVIEW_PREFIXES = ("/apis/authentication.k8s.io/v1/tokenreviews", "/apis/authorization.k8s.io/",
                   "/openid/", "/.well-known/")
REVIEW_CONNECTIONS = 24  # the state API's reviews (16 at once) and /metrics' (4) never wait for one
SA_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")


class Kube:
    """Its connections and pools belong to the event loop that first uses them: another loop (the
    Lease's thread) makes its own client with `sibling`."""

    def __init__(self, info: kopf.ConnectionInfo, *, limit: int = 64, ssl_ctx: ssl.SSLContext | None = None) -> None:
        self.info = info
        self.server = info.server.rstrip("/")
        self._scheme = info.scheme or "Bearer"
        self._token = info.token or ""
        self._ssl = ssl_ctx = ssl_ctx or ssl_context(info)
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        self._pool = http1.Pool(self.server, ssl_ctx, limit=limit, headers=headers,
                                on_open=selfmetrics.API_CONNECTIONS.inc)
        # Reviews have theirs too: a flood of tokens at the state API never takes the slots the
        # reconcile's reads and writes need, and the reconcile's burst never delays a runner's review.
        # The issuer's key set is served only as application/jwk-set+json (a bare application/json is
        # answered 406); reviews are JSON.
        self._review_pool = http1.Pool(self.server, ssl_ctx, limit=REVIEW_CONNECTIONS,
                                       headers={**headers, "Accept": "application/json, application/jwk-set+json"},
                                       on_open=selfmetrics.API_CONNECTIONS.inc)
        # Watches hold their connection for minutes, two per watched namespace: their own pool, so
        # they never take the connections writes need (and never wait for one).
        self._watch_session = aiohttp.ClientSession(
            headers={"User-Agent": USER_AGENT},
            connector=aiohttp.TCPConnector(ssl=ssl_ctx, limit=0),
        )

    async def close(self) -> None:
        await self._pool.close()
        await self._review_pool.close()
        await self._watch_session.close()

    def sibling(self, *, limit: int = 2) -> Kube:
        """A client of the same login (server, credentials, TLS context, the token as renewed since)
        with connections and pools of its own, for another event loop: made on that loop (the
        Lease's thread, whose requests then never wait for this loop or its connections)."""
        other = Kube(self.info, limit=limit, ssl_ctx=self._ssl)
        other._token = self._token
        return other

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Authorization": f"{self._scheme} {self._token}"} if self._token else {}
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def _token_renewed(self) -> bool:
        """After a 401: the kubelet renews a pod's projected token in place; take the new one."""
        if not self._token:
            return False
        try:
            token = SA_TOKEN.read_text().strip()
        except OSError:
            return False
        if not token or token == self._token:
            return False
        self._token = token
        return True

    async def request(self, method: str, path: str, body: Any = None, *,
                      content_type: str = "application/json", params: dict[str, str] | None = None) -> Any:
        return (await self._request(method, path, body, content_type=content_type, params=params))[0]

    async def list_page(self, path: str, params: dict[str, str], *, max_bytes: int) -> tuple[Body, int]:
        """One page of a list and its size in bytes (the informer sizes the next page from it);
        http1.TooLargeError, having read no more, when it is over ``max_bytes``."""
        payload, size = await self._request("GET", path, params=params, max_body=max_bytes)
        return payload, size

    async def _request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                       params: dict[str, str] | None = None, max_body: int | None = None) -> tuple[Any, int]:
        started = time.perf_counter()
        code = "error"
        try:
            data = orjson.dumps(body) if body is not None else None
            pool = self._review_pool if path.startswith(REVIEW_PREFIXES) else self._pool
            for attempt in (1, 2):
                async with asyncio.timeout(REQUEST_TIMEOUT):
                    status, raw = await pool.request(
                        method, path, data, params=params, max_body=max_body,
                        headers=self._headers(content_type if data is not None else None))
                code = str(status)
                if status != 401 or attempt == 2 or not self._token_renewed():
                    break
            payload = _decode(raw)
            if status >= 400:
                raise ApiError(status, payload, method, path)
            return payload, len(raw)
        finally:
            selfmetrics.API_LATENCY.labels(method, _resource_of(path), code).observe(
                time.perf_counter() - started)

    async def watch(self, path: str, params: dict[str, str], *, read_timeout: float) -> AsyncIterator[Body]:
        """The events of one watch request, decoded, until the API server ends it. Lines are split
        here, not by aiohttp's readline, which refuses lines over 128 KiB (a Flow's status can be larger)."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=read_timeout)
        async with self._watch_session.get(self.server + path, params=params, timeout=timeout,
                                           headers=self._headers()) as resp:
            if resp.status == 401:
                self._token_renewed()  # the informer tries again, with the new token if there is one
            if resp.status >= 400:
                raise ApiError(resp.status, _decode(await resp.read()), "WATCH", path)
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                if b"\n" not in chunk:
                    continue
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield orjson.loads(line)
            if buffer.strip():
                yield orjson.loads(buffer)

    async def get(self, path: str) -> Body | None:
        try:
            result: Body = await self.request("GET", path)
            return result
        except ApiError as e:
            if e.status == 404:
                return None
            raise

    async def create(self, path: str, body: Body) -> Body | None:
        """POST; None when the object already exists (deterministic names make that success)."""
        try:
            result: Body = await self.request("POST", path, body)
            return result
        except ApiError as e:
            if e.status == 409 and e.reason == "AlreadyExists":
                return None
            raise

    async def merge_patch(self, path: str, patch: Body) -> Body:
        result: Body = await self.request("PATCH", path, patch, content_type="application/merge-patch+json")
        return result

    async def delete(self, path: str, body: Body | None = None) -> None:
        """Gone already is done; so is a precondition (``delete_if_same``) that no longer holds (409):
        the object of that name is another one now."""
        try:
            await self.request("DELETE", path, body)
        except ApiError as e:
            if e.status != 404 and not (e.status == 409 and body and "preconditions" in body):
                raise


def delete_if_same(uid: str) -> Body:
    """DeleteOptions that delete an object only if it is still the one with this uid."""
    return {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"uid": uid},
            "propagationPolicy": "Background"}


async def delete_namesake_garbage(kube: Kube, path: str, obj: Body, flow: str, flow_uid: str) -> bool:
    """Delete obj (at path) if it is garbage of a deleted Flow named `flow`: controlled by a Flow of
    that name with another uid, while the live Flow of that name is the one with flow_uid (a cache
    can hold a namesake's late event, so the live Flow is read). The garbage collector can miss such
    objects for good. Returns whether it deleted obj."""
    meta = obj["metadata"]
    if not orphaned_by_namesake(meta, flow, flow_uid):
        return False
    live = await kube.get(flow_path(meta["namespace"], flow))
    if live is None or live["metadata"].get("uid") != flow_uid:
        return False
    await kube.delete(path, delete_if_same(meta["uid"]))
    return True


def flow_path(namespace: str, name: str | None = None, sub: str | None = None) -> str:
    return ns_path(namespace, c.PLURAL, name, group=c.GROUP, version=c.VERSION, sub=sub)


def ns_path(namespace: str, plural: str, name: str | None = None, *, group: str = "",
            version: str = "v1", sub: str | None = None) -> str:
    base = f"/apis/{group}/{version}" if group else f"/api/{version}"
    path = f"{base}/namespaces/{quote(namespace)}/{plural}"
    if name is not None:
        path += f"/{quote(name)}"
    if sub:
        path += f"/{sub}"
    return path


_KIND_PATHS = {
    "Pod": ("", "v1", "pods"),
    "ConfigMap": ("", "v1", "configmaps"),
}


def collection_path(obj: Body) -> str:
    group, version, plural = _KIND_PATHS[obj["kind"]]
    return ns_path(obj["metadata"]["namespace"], plural, group=group, version=version)
