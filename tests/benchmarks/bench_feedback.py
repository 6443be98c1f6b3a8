"""Benchmark: feedback patch -> resume pod created, on the local stack. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_feedback [--flows 50]

N Flows pause for feedback (the Helm-installed operator, scripted fake runner pods on the real node,
admission webhook on); each is answered with the same merge patch of `status.feedback.response` a
person sends, one every 100 ms, and the latency runs from sending the patch to the ADDED watch
event of the resume pod. The node is cordoned before the answers, so resume pods are created but not
started: their Python start-up would otherwise compete for the same two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from flowkube_devstack.cluster import LocalCluster
from tests.benchmarks.bench_apply import Client, until
from tests.benchmarks.realstack import scripted_stack

NS = "bench-feedback"
REVIEW = {"id": "r1", "method": "review", "message": "ok?", "emit": ["approved", "rejected"]}


async def run(cluster: LocalCluster, n: int) -> list[float]:
    client = Client.of(cluster)
    try:
        base = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
        for i in range(n):
            await client.post(base, {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                     "metadata": {"name": f"fb{i}"},
                                     "spec": {"flowRef": "bench:Review",
                                              "inputs": {"plan": [{"result": "Paused", "feedback": REVIEW}, {}]}}})

        async def paused() -> int:
            async with client.session.get(client.server + base) as r:
                items: list[dict[str, Any]] = (await r.json())["items"]
            return sum(1 for f in items if (f.get("status") or {}).get("phase") == "AwaitingFeedback")

        deadline = time.perf_counter() + 600
        while await paused() < n:
            if time.perf_counter() > deadline:
                raise TimeoutError("flows did not all pause")
            await asyncio.sleep(0.5)

        # The resume pods need not run: cordon the node so their start-up does not load the 2 cores
        # this is measured on (only apply -> pod-created is measured).
        cluster.kubectl("cordon", "flowkube-local-node")
        seen: dict[str, float] = {}
        ready = asyncio.Event()
        watcher = asyncio.create_task(client.watch_pods(NS, seen, ready))
        await ready.wait()
        sent: dict[str, float] = {}
        for i in range(n):
            sent[f"fb{i}-1"] = time.perf_counter()
            async with client.session.patch(
                    client.server + f"{base}/fb{i}/status",
                    json={"status": {"feedback": {"response": {"text": "approved"}}}},
                    headers={"Content-Type": "application/merge-patch+json"}) as r:
                if r.status >= 300:
                    raise RuntimeError(await r.text())
            await asyncio.sleep(0.1)
        await until(lambda: all(k in seen for k in sent), 120)
        watcher.cancel()
        return sorted((seen[k] - sent[k]) * 1000 for k in sent)
    finally:
        await client.session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flows", type=int, default=50)
    args = parser.parse_args()
    with scripted_stack("fb", NS) as (cluster, _):
        lat = asyncio.run(run(cluster, args.flows))
    print(f"feedback patch -> resume pod created, {len(lat)} answers: p50 {statistics.median(lat):.1f} ms, "
          f"p99 {lat[min(len(lat) - 1, int(len(lat) * 0.99))]:.1f} ms, max {lat[-1]:.1f} ms")


if __name__ == "__main__":
    main()
