"""A small asyncio client for the few API calls the node agent makes (aiohttp; no client library)."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncGenerator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yaml

Obj = dict[str, Any]
MERGE_PATCH = "application/merge-patch+json"


class ApiError(Exception):
    def __init__(self, status: int, method: str, path: str, body: Any) -> None:
        self.status = status
        self.body = body
        message = body.get("message", "") if isinstance(body, dict) else str(body)[:300]
        super().__init__(f"{method} {path}: {status} {message}")


def ssl_context_from_kubeconfig(path: Path) -> tuple[str, ssl.SSLContext]:
    """Server URL and a TLS context with the client certificate of the kubeconfig's current context."""
    cfg = yaml.safe_load(path.read_text())
    ctx_name = cfg["current-context"]
    context = next(c["context"] for c in cfg["contexts"] if c["name"] == ctx_name)
    cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == context["cluster"])
    user = next(u["user"] for u in cfg["users"] if u["name"] == context["user"])
    tls = ssl.create_default_context(cafile=cluster["certificate-authority"])
    tls.load_cert_chain(user["client-certificate"], user["client-key"])
    return str(cluster["server"]), tls


class Api:
    def __init__(self, server: str, tls: ssl.SSLContext) -> None:
        self.server = server.rstrip("/")
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls, limit=64),
            headers={"User-Agent": "flowkube-node/0.1", "Accept": "application/json"},
        )

    async def close(self) -> None:
        await self._session.close()

    async def request(self, method: str, path: str, body: Any = None, *,
                      params: Mapping[str, str] | None = None, content_type: str = "application/json",
                      time_limit: float = 10.0) -> Obj:
        data = None if body is None else json.dumps(body)
        headers = {"Content-Type": content_type} if data is not None else {}
        async with self._session.request(method, self.server + path, data=data, params=params,
                                         headers=headers,
                                         timeout=aiohttp.ClientTimeout(total=time_limit)) as resp:
            raw = await resp.read()
            try:
                payload = json.loads(raw) if raw else {}
            except ValueError:
                payload = raw.decode(errors="replace")
            if resp.status >= 400:
                raise ApiError(resp.status, method, path, payload)
            return payload if isinstance(payload, dict) else {}

    async def watch(self, path: str, params: Mapping[str, str]) -> AsyncGenerator[Obj, None]:
        """Events of one watch request, until the server ends it; raises ApiError or aiohttp errors."""
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=5, sock_read=None)
        async with self._session.get(self.server + path, params={**params, "watch": "1"},
                                     timeout=timeout) as resp:
            if resp.status >= 400:
                raise ApiError(resp.status, "WATCH", path, await resp.text())
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    if line.strip():
                        yield json.loads(line)
