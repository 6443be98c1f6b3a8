"""Benchmark: apply -> runner pod created, against the local control plane. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_apply [--flows 300] [--rate 10]

1. Paced: N Flows applied at `rate`/s; latency from each POST to the pod's ADDED watch event.
2. Burst: N Flows applied as fast as C concurrent clients can; sustained Flows/s until all
   runner pods exist, next to a plain client creating N pods with the same concurrency. Run with
   one client (a kubectl loop, a CI job) and with 16 (enough to saturate the API server here).
3. CPU: milliseconds each process spent per Flow and per raw pod in the bursts, from /proc: where a
   burst's time goes.
0. Before the operator starts: the API server's CPU per write of each kind a Flow needs (its
   create, one status update, its pod), one client, nobody watching. A Flow needs all three where a
   raw pod is one, which bounds the ratio on a host where the API server is the bottleneck.
No node runs, so pods stay Pending: this measures the operator and the API server only.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from flowkube_api import constants as c
from flowkube_api import crd
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import OperatorProcess


class Client:
    def __init__(self, cluster: LocalCluster) -> None:
        cfg = yaml.safe_load(cluster.kubeconfig.read_text())
        user = cfg["users"][0]["user"]
        ctx = ssl.create_default_context(cafile=cfg["clusters"][0]["cluster"]["certificate-authority"])
        ctx.load_cert_chain(user["client-certificate"], user["client-key"])
        self.server = cluster.server
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=32))

    async def post(self, path: str, body: dict[str, Any]) -> None:
        async with self.session.post(self.server + path, json=body) as r:
            if r.status >= 300:
                raise RuntimeError(f"{path}: {r.status} {await r.text()}")

    async def watch_pods(self, ns: str, seen: dict[str, float], ready: asyncio.Event) -> None:
        url = f"{self.server}/api/v1/namespaces/{ns}/pods?watch=1&allowWatchBookmarks=false"
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=None)) as r:
            ready.set()
            async for line in r.content:
                ev = json.loads(line)
                if ev["type"] == "ADDED":
                    seen.setdefault(ev["object"]["metadata"]["name"], time.perf_counter())


def flow(name: str) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
            "spec": {"flowRef": "bench.flows:Noop"}}


def pod(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            # Like a runner pod, without the namespace's API token (runner pods carry only their own).
            "spec": {"restartPolicy": "Never", "automountServiceAccountToken": False,
                     "containers": [{"name": "c", "image": "x", "command": ["true"]}]}}


async def namespace(client: Client, ns: str) -> None:
    """Create ns and wait for its default ServiceAccount (pod admission needs it)."""
    await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    deadline = time.perf_counter() + 30
    while True:
        async with client.session.get(f"{client.server}/api/v1/namespaces/{ns}/serviceaccounts/default") as r:
            if r.status == 200:
                return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"no default ServiceAccount in {ns}")
        await asyncio.sleep(0.05)


async def until(pred: Any, limit: float) -> None:
    deadline = time.perf_counter() + limit
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError("benchmark did not finish in time")
        await asyncio.sleep(0.01)


PENDING_STATUS = {"status": {"phase": "Pending", "observedGeneration": 1, "definition": "Noop", "runs": [
    {"pod": "x-0", "trigger": "kickoff"}], "conditions": [
    {"type": t, "status": "Unknown", "reason": "RunPending", "message": "waiting for the runner pod",
     "lastTransitionTime": "2026-01-01T00:00:00Z"} for t in ("Accepted", "Running", "Succeeded")]}}


async def write_costs(cluster: LocalCluster, n: int, pids: dict[str, int]) -> dict[str, float]:
    """API server CPU ms per write, one kind at a time (no operator yet: nobody acts on the Flows)."""
    client = Client(cluster)
    ns = "bench-costs"
    try:
        await namespace(client, ns)

        async def status(name: str) -> None:
            async with client.session.patch(
                    f"{client.server}/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows/{name}/status",
                    json=PENDING_STATUS, headers={"Content-Type": "application/merge-patch+json"}) as r:
                if r.status >= 300:
                    raise RuntimeError(f"status of {name}: {r.status} {await r.text()}")

        kinds: dict[str, Any] = {
            "Flow create": lambda i: client.post(f"/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows", flow(f"c{i}")),
            "Flow status update": lambda i: status(f"c{i}"),
            "pod create": lambda i: client.post(f"/api/v1/namespaces/{ns}/pods", pod(f"c{i}")),
        }
        costs = {}
        for kind, write in kinds.items():
            before = cpu_seconds(pids)["kube-apiserver"]
            for i in range(n):
                await write(i)
            await asyncio.sleep(0.5)  # the scheduler's answer to the pods
            costs[kind] = (cpu_seconds(pids)["kube-apiserver"] - before) * 1000 / n
        # Gone before the operator starts: it must not spend the next phases acting on them.
        for path in (f"/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows", f"/api/v1/namespaces/{ns}/pods"):
            async with client.session.delete(client.server + path, params={"gracePeriodSeconds": "0"}) as r:
                r.raise_for_status()

            async def left(path: str = path) -> int:
                async with client.session.get(client.server + path) as r:
                    return len((await r.json())["items"])

            deadline = time.perf_counter() + 60
            while await left():
                if time.perf_counter() > deadline:
                    raise TimeoutError(f"{path} not emptied")
                await asyncio.sleep(0.1)
        return costs
    finally:
        await client.session.close()


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each process, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


async def run(cluster: LocalCluster, n: int, rate: float, pids: dict[str, int],
              concurrencies: tuple[int, ...]) -> dict[str, Any]:
    client = Client(cluster)
    try:
        namespaces = ["bench-paced"] + [f"bench-{k}-{c}" for c in concurrencies for k in ("burst", "raw")]
        for ns in namespaces:
            await namespace(client, ns)

        # 1. paced
        seen: dict[str, float] = {}
        ready = asyncio.Event()
        watcher = asyncio.create_task(client.watch_pods("bench-paced", seen, ready))
        await ready.wait()
        sent: dict[str, float] = {}
        start = time.perf_counter()
        for i in range(n):
            await asyncio.sleep(max(0.0, start + i / rate - time.perf_counter()))
            sent[f"p{i}-0"] = time.perf_counter()
            await client.post("/apis/flowkube.io/v1alpha1/namespaces/bench-paced/flows", flow(f"p{i}"))
        await until(lambda: len(seen) >= n, 120)
        watcher.cancel()
        lat = sorted((seen[k] - sent[k]) * 1000 for k in sent)

        # 2. bursts through the operator, then raw pods, with each process's CPU time
        async def burst(ns: str, make: Any, path: str, concurrency: int) -> tuple[float, dict[str, float]]:
            seen_b: dict[str, float] = {}
            ready_b = asyncio.Event()
            w = asyncio.create_task(client.watch_pods(ns, seen_b, ready_b))
            await ready_b.wait()
            cpu0 = cpu_seconds(pids)
            t0 = time.perf_counter()
            queue = list(range(n))

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    await client.post(path, make(f"b{i}"))

            await asyncio.gather(*(worker() for _ in range(concurrency)))
            await until(lambda: len(seen_b) >= n, 300)
            rate_b = n / (max(seen_b.values()) - t0)
            await asyncio.sleep(0.5)  # the scheduler's last status writes
            cpu1 = cpu_seconds(pids)
            w.cancel()
            return rate_b, {k: (cpu1[k] - cpu0[k]) * 1000 / n for k in pids}

        result: dict[str, Any] = {"flows": n, "rate": rate, "p50_ms": statistics.median(lat),
                                  "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "max_ms": lat[-1],
                                  "bursts": []}
        for conc in concurrencies:
            flows_per_s, flow_cpu = await burst(f"bench-burst-{conc}", flow,
                                                f"/apis/flowkube.io/v1alpha1/namespaces/bench-burst-{conc}/flows", conc)
            pods_per_s, pod_cpu = await burst(f"bench-raw-{conc}", pod, f"/api/v1/namespaces/bench-raw-{conc}/pods",
                                              conc)
            result["bursts"].append({"concurrency": conc, "flows_per_s": flows_per_s, "pods_per_s": pods_per_s,
                                     "flow_cpu_ms": flow_cpu, "pod_cpu_ms": pod_cpu})
        return result
    finally:
        await client.session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flows", type=int, default=300)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING"})
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(crd.CRD_FILE))
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{c.PLURAL}.{c.GROUP}", "--timeout=60s")
            pids = {name: p.pid for name, p in cluster.procs.items()}
            costs = asyncio.run(write_costs(cluster, args.flows, pids))
            op.start()
            assert op.proc is not None
            pids["operator"] = op.proc.pid
            r = asyncio.run(run(cluster, args.flows, args.rate, pids, tuple(args.concurrency)))
        finally:
            op.stop()
            cluster.stop()
    print("API server CPU per write, one client, no operator: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in costs.items()))
    print(f"    a Flow needs all three where a raw pod is one: ratio at most "
          f"{costs['pod create'] / sum(costs.values()):.0%} where the API server is the bottleneck")
    print(f"apply -> runner pod created, {r['flows']} Flows at {r['rate']:.0f}/s: "
          f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms")
    for b in r["bursts"]:
        print(f"burst of {r['flows']}, {b['concurrency']} client(s): operator {b['flows_per_s']:.1f} Flows/s -> pods; "
              f"plain client {b['pods_per_s']:.1f} pods/s; ratio {b['flows_per_s'] / b['pods_per_s']:.0%}")
        for what, cpu in (("per Flow", b["flow_cpu_ms"]), ("per raw pod", b["pod_cpu_ms"])):
            parts = ", ".join(f"{k} {v:.2f}" for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]))
            print(f"    CPU ms {what}: {parts}")


if __name__ == "__main__":
    main()
