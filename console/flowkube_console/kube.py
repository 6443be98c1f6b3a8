"""The console's door to the API server, always with the signed-in user's own credential.

The console holds no account of its own: every read, watch and status patch carries the user's
bearer token (or, run by `kubectl flow console`, goes through `kubectl proxy`, which adds the
kubeconfig's credentials), so the API server's authentication, RBAC and admission decide.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import orjson

from flowkube_api import constants as c

Body = dict[str, Any]
FLOWS = f"/apis/{c.GROUP}/{c.VERSION}"
PAGE = 100  # Flows per list page: a large namespace is decoded a page at a time, never at once
ANSWER_LIMIT = 4 << 20  # bytes of one answer about one object (etcd keeps an object below 1.5 MiB)
LIST_LIMIT = 64 << 20  # bytes of one page of a list
WATCH_LINE_LIMIT = 4 << 20  # bytes of one watch event: a Flow's status is bounded well below


class ApiError(Exception):
    """The API server's refusal, with its own message (shown to the user as it is)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def flows_path(namespace: str | None, name: str | None = None) -> str:
    base = f"{FLOWS}/namespaces/{quote(namespace, safe='')}/{c.PLURAL}" if namespace else f"{FLOWS}/{c.PLURAL}"
    return f"{base}/{quote(name, safe='')}" if name else base


class Kube:
    """One HTTP session to the API server, shared by every user; each call names its credential."""

    def __init__(self, server: str, ca_file: str | None = None, timeout: float = 15.0,
                 socket: str | None = None) -> None:
        self.server = "http://localhost" if socket else server.rstrip("/")
        self._socket = socket  # `kubectl proxy --unix-socket`: only this user's processes reach it
        self._ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=ca_file) if ca_file else True
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._sessions: dict[str, aiohttp.ClientSession] = {}

    def _connector(self, limit: int) -> aiohttp.BaseConnector:
        if self._socket:
            return aiohttp.UnixConnector(path=self._socket, limit=limit)
        return aiohttp.TCPConnector(ssl=self._ssl, limit=limit)

    def session(self, kind: str = "requests") -> aiohttp.ClientSession:
        """Requests share a pool; watches (long-lived, one per feed scope and live page) have their
        own without a limit, so open pages never starve a sign-in or an answer."""
        if kind not in self._sessions:
            self._sessions[kind] = aiohttp.ClientSession(connector=self._connector(100 if kind == "requests" else 0))
        return self._sessions[kind]

    async def close(self) -> None:
        for session in self._sessions.values():
            await session.close()

    @staticmethod
    def _headers(token: str | None, content_type: str | None = None) -> dict[str, str]:
        h = {"Accept": "application/json"}
        if token:
            h["Authorization"] = f"Bearer {token}"
        if content_type:
            h["Content-Type"] = content_type
        return h

    async def request(self, method: str, path: str, token: str | None, body: Any = None,
                      content_type: str = "application/json", limit: int = ANSWER_LIMIT) -> Body:
        data = orjson.dumps(body) if body is not None else None
        async with self.session().request(
                method, self.server + path, data=data, timeout=self._timeout,
                headers=self._headers(token, content_type if data is not None else None)) as r:
            raw = await read_bounded(r.content, limit)
            if len(raw) > limit:
                raise ApiError(502, f"the API server's answer to {method} {path} is larger than {limit} bytes")
            doc = _decode(raw)
            if r.status >= 400:
                if isinstance(doc, dict):
                    raise ApiError(r.status, str(doc.get("message") or r.reason))
                raise ApiError(r.status, str(doc or r.reason)[:1000])
            if not isinstance(doc, dict):
                raise ApiError(502, f"the API server answered {method} {path} with something other than JSON")
            return doc

    async def list_all(self, path: str, token: str | None, **params: str) -> AsyncIterator[Body]:
        """Every item of a list, a page at a time; the last page's list metadata is yielded last as
        ``{"_list": metadata}`` (its resourceVersion starts a watch)."""
        cont = ""
        while True:
            query = {"limit": str(PAGE), **params, **({"continue": cont} if cont else {})}
            page = await self.request("GET", f"{path}?{urlencode(query)}", token, limit=LIST_LIMIT)
            for item in page.get("items") or ():
                yield item
            meta = page.get("metadata") or {}
            cont = str(meta.get("continue") or "")
            if not cont:
                yield {"_list": meta}
                return

    async def watch(self, path: str, token: str | None, resource_version: str,
                    **params: str) -> AsyncIterator[Body]:
        """Watch events from ``resource_version`` until the server ends the stream. An ERROR event
        (410 Gone: too old) raises ApiError with its code."""
        query = {"watch": "1", "resourceVersion": resource_version, "allowWatchBookmarks": "true",
                 "timeoutSeconds": "300", **params}
        timeout = aiohttp.ClientTimeout(total=None, sock_read=330)
        async with self.session("watches").get(f"{self.server}{path}?{urlencode(query)}",
                                               headers=self._headers(token), timeout=timeout) as r:
            if r.status >= 400:
                doc = _decode(await read_bounded(r.content, ANSWER_LIMIT))
                msg = doc.get("message") if isinstance(doc, dict) else doc
                raise ApiError(r.status, str(msg or r.reason))
            buf = b""
            async for chunk in r.content.iter_any():
                buf += chunk
                if len(buf) > WATCH_LINE_LIMIT:
                    raise ApiError(502, "a watch event is larger than the console accepts")
                *lines, buf = buf.split(b"\n")
                for line in lines:
                    if not line.strip():
                        continue
                    event = orjson.loads(line)
                    if event.get("type") == "ERROR":
                        obj = event.get("object") or {}
                        raise ApiError(int(obj.get("code") or 500), str(obj.get("message") or "watch error"))
                    yield event

    # -- what the console asks -----------------------------------------------------------------

    async def whoami(self, token: str | None) -> str:
        doc = await self.request("POST", "/apis/authentication.k8s.io/v1/selfsubjectreviews", token,
                                 {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        return str(((doc.get("status") or {}).get("userInfo") or {}).get("username") or "")

    async def can(self, token: str | None, verb: str, namespace: str | None, subresource: str = "") -> bool:
        attrs = {"verb": verb, "group": c.GROUP, "resource": c.PLURAL, "subresource": subresource}
        if namespace:
            attrs["namespace"] = namespace
        doc = await self.request("POST", "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", token,
                                 {"apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
                                  "spec": {"resourceAttributes": attrs}})
        return bool((doc.get("status") or {}).get("allowed"))

    async def get_flow(self, token: str | None, namespace: str, name: str) -> Body:
        return await self.request("GET", flows_path(namespace, name), token)

    async def create_flow(self, token: str | None, namespace: str, body: Body) -> Body:
        return await self.request("POST", flows_path(namespace), token, body)

    async def patch_status(self, token: str | None, namespace: str, name: str, patch: Body) -> Body:
        return await self.request("PATCH", flows_path(namespace, name) + "/status", token, patch,
                                  content_type="application/merge-patch+json")

    async def get_snapshot(self, token: str | None, namespace: str, name: str) -> Body:
        """A template snapshot (ControllerRevision): the Kubernetes `view` role may read it."""
        return await self.request(
            "GET", f"/apis/apps/v1/namespaces/{quote(namespace, safe='')}/controllerrevisions/{quote(name, safe='')}",
            token)

    async def events(self, token: str | None, namespace: str, uid: str) -> list[Body]:
        query = urlencode({"fieldSelector": f"involvedObject.uid={uid}", "limit": "100"})
        doc = await self.request("GET", f"/api/v1/namespaces/{quote(namespace, safe='')}/events?{query}", token)
        return list(doc.get("items") or [])


async def read_bounded(stream: aiohttp.StreamReader, limit: int) -> bytes:
    """The body, or its first ``limit + 1`` bytes when it is longer (the caller refuses it)."""
    chunks, size = [], 0
    while size <= limit:
        chunk = await stream.read(limit + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _decode(raw: bytes) -> Any:
    try:
        return orjson.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode(errors="replace")
    except orjson.JSONDecodeError:
        return raw.decode(errors="replace")


async def cancel(task: asyncio.Task[Any] | None) -> None:
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
