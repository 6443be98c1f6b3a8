"""Benchmark: /metrics scrape time and operator memory with 1,000 and 10,000 Flows. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_scale [--steps 1000,10000]

Each Flow carries usage for two models and three runs in its status, the way finished Flows look,
written by this script with the operator's own ServiceAccount token (the chart's status policy lets
no one else write those fields). No node runs; Flows are suspended so no pods are made.
"""

from __future__ import annotations

import argparse
import asyncio
import ssl
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import OperatorProcess
from tests.benchmarks.bench_apply import Client

NS = "scale"


def usage(n: int) -> dict[str, Any]:
    one = {"totalTokens": 150 + n, "promptTokens": 100 + n, "completionTokens": 50, "cachedPromptTokens": 10,
           "reasoningTokens": 0, "cacheCreationTokens": 0, "successfulRequests": 3}
    return {**{k: v * 2 for k, v in one.items()}, "byModel": {"gpt-4o-mini": one, "claude-sonnet": one}}


async def create(client: Client, operator: aiohttp.ClientSession, start: int, stop: int) -> None:
    async def one(i: int) -> None:
        name = f"f{i:05d}"
        base = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
        await client.post(base, {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                                 "spec": {"flowRef": "bench.flows:Research", "suspend": True}})
        status = {"status": {"phase": "Succeeded", "startedAt": "2026-11-22T00:00:00Z",
                             "finishedAt": "2026-11-22T00:01:00Z", "usage": usage(i),
                             "runs": [{"pod": f"{name}-{k}", "trigger": t, "result": r, "usage": usage(i)}
                                      for k, (t, r) in enumerate([("kickoff", "Failed"), ("retry", "Paused"),
                                                                  ("resume", "Succeeded")])]}}
        async with operator.patch(client.server + f"{base}/{name}/status", json=status,
                                  headers={"Content-Type": "application/merge-patch+json"}) as r:
            if r.status >= 300:
                raise RuntimeError(await r.text())

    queue = list(range(start, stop))

    async def worker() -> None:
        while queue:
            await one(queue.pop())

    await asyncio.gather(*(worker() for _ in range(16)))


def scrape(target: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=60) as r:
        body = r.read()
    return (time.perf_counter() - t0) * 1000, len(body)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", default="1000,10000")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory(prefix="flowkube-scale-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING"})
        try:
            op.start()
            assert op.proc is not None
            cluster.kubectl("create", "namespace", NS)
            print(f"operator idle: RSS {rss_mb(op.proc.pid):.0f} MB")
            kubeconfig = yaml.safe_load((cluster.root / "operator.kubeconfig").read_text())
            token = kubeconfig["users"][0]["user"]["token"]
            done = 0
            for n in steps:
                t0 = time.perf_counter()

                async def fill(lo: int, hi: int) -> None:
                    c = Client.of(cluster)
                    # Only the token: with the admin's client certificate the API server would see the admin.
                    ctx = ssl.create_default_context(cafile=str(cluster.pki_dir / "ca.crt"))
                    operator = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                                     connector=aiohttp.TCPConnector(ssl=ctx, limit=32))
                    try:
                        await create(c, operator, lo, hi)
                    finally:
                        await c.session.close()
                        await operator.close()

                asyncio.run(fill(done, n))
                done = n
                marker = f'flowkube_flows{{namespace="{NS}",phase="Succeeded"}} {n}'
                def seen(m: str = marker) -> bool:
                    return m in op.metrics()

                wait_for(seen, 1800, f"the operator to see {n} flows", interval=1)
                took = time.perf_counter() - t0
                times = [scrape(op.metrics_target) for _ in range(10)]
                ms = sorted(t for t, _ in times)
                print(f"{n:>6} Flows (filled in {took:.0f}s): /metrics p50 {statistics.median(ms):.0f} ms, "
                      f"max {ms[-1]:.0f} ms, {times[0][1] / 1e6:.1f} MB, "
                      f"{sum(1 for _ in op.metrics().splitlines() if not _.startswith('#'))} samples; "
                      f"operator RSS {rss_mb(op.proc.pid):.0f} MB")
        finally:
            op.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
