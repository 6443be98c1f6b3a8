"""Benchmark: the CPU the operator's process spends per API request, its own client (http1.py, through
`Kube`) beside aiohttp's ClientSession (what `Kube` used before), on the same API server. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_http [--requests 3000] [--concurrency 1 16]

Each client makes the requests a reconcile makes, in turns: GET a ConfigMap, PATCH it (a merge
patch), POST an Event-sized object (a ConfigMap, then deleted with the namespace). CPU is this
process's own (time.process_time) over the requests, on uvloop as in the operator; the API server's
share is not in it. Both clients decode every answer with orjson, so the difference is the client.
The ratio is what to read: the machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import kopf
import orjson
import uvloop
import yaml

from flowkube_devstack.cluster import LocalCluster
from flowkube_operator.kube.client import Kube

NS = "bench-http"
CM = f"/api/v1/namespaces/{NS}/configmaps"


def _creds(cluster: LocalCluster) -> tuple[str, str, str]:
    cfg = yaml.safe_load(cluster.kubeconfig.read_text())
    user = cfg["users"][0]["user"]
    return cfg["clusters"][0]["cluster"]["certificate-authority"], user["client-certificate"], user["client-key"]


class AiohttpClient:
    """The same three calls through aiohttp's ClientSession, configured as `Kube` had it."""

    def __init__(self, server: str, ca: str, cert: str, key: str) -> None:
        ctx = ssl.create_default_context(cafile=ca)
        ctx.load_cert_chain(cert, key)
        self.server = server
        self.session = aiohttp.ClientSession(headers={"User-Agent": "flowkube-operator"},
                                             connector=aiohttp.TCPConnector(ssl=ctx, limit=64),
                                             timeout=aiohttp.ClientTimeout(total=30))

    async def request(self, method: str, path: str, body: Any = None,
                      content_type: str = "application/json") -> Any:
        data = orjson.dumps(body) if body is not None else None
        async with self.session.request(method, self.server + path, data=data,
                                        headers={"Content-Type": content_type}) as r:
            raw = await r.read()
            if r.status >= 400:
                raise RuntimeError(f"{method} {path}: {r.status} {raw[:200]!r}")
        return orjson.loads(raw)

    async def close(self) -> None:
        await self.session.close()


async def measure(name: str, call: Callable[[int], Awaitable[Any]], n: int, concurrency: int) -> float:
    queue = list(range(n))

    async def worker() -> None:
        while queue:
            await call(queue.pop())

    for first in (0, n):  # the first pass warms connections and caches; the second is measured
        queue[:] = list(range(first, first + n))
        cpu, wall = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    per = cpu * 1e6 / n
    print(f"  {name:28s} {per:7.1f} us CPU per request ({n / wall:6.0f} requests/s)", flush=True)
    return per


async def main(cluster: LocalCluster, n: int, concurrencies: list[int]) -> None:
    ca, cert, key = _creds(cluster)
    kube = Kube(kopf.ConnectionInfo(server=cluster.server, ca_path=ca, certificate_path=cert, private_key_path=key))
    other = AiohttpClient(cluster.server, ca, cert, key)
    try:
        await kube.request("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                           "metadata": {"name": NS}})
        await kube.request("POST", CM, {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "s"}})
        for concurrency in concurrencies:
            print(f"{n} requests, {concurrency} at once (GET, PATCH, POST in turns):")
            results = {}
            for name, client in (("aiohttp ClientSession", other), ("flowkube http1 (Kube)", kube)):
                async def call(i: int, client: Any = client, tag: str = f"{name[:3].lower()}-{concurrency}") -> Any:
                    kind = i % 3
                    if kind == 0:
                        return await client.request("GET", f"{CM}/s")
                    if kind == 1:
                        return await client.request("PATCH", f"{CM}/s", {"data": {"k": str(i)}},
                                                    content_type="application/merge-patch+json")
                    return await client.request("POST", CM, {"apiVersion": "v1", "kind": "ConfigMap",
                                                             "metadata": {"name": f"{tag}-{i}"},
                                                             "data": {"reason": "Created", "message": "x" * 80}})
                results[name] = await measure(name, call, n, concurrency)
                for cm in (await kube.request("GET", CM))["items"]:
                    if cm["metadata"]["name"] != "s":
                        await kube.request("DELETE", f"{CM}/{cm['metadata']['name']}")
            a, b = results["aiohttp ClientSession"], results["flowkube http1 (Kube)"]
            print(f"  http1 / aiohttp CPU per request: {b / a:.2f}")
    finally:
        await kube.close()
        await other.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-http-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        try:
            uvloop.run(main(cluster, args.requests, args.concurrency))
        finally:
            cluster.stop()


if __name__ == "__main__":
    cli()
