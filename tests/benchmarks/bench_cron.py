"""Benchmark: many CronFlows scheduled in the same minute. Prints figures; docs/benchmarks.md keeps them.

    .venv/bin/python -m tests.benchmarks.bench_cron [--cronflows 1000]

A control plane of its own without a node (no pod runs), the operator as a host process with its
admission webhook. ``--cronflows`` CronFlows with the schedule ``* * * * *`` are created (their Flows
suspended: no runner pods), and at the next minute each must start its Flow. Figures: when each
Flow appeared after the minute (a watch of Flows), how many within the minute, and the operator's CPU
time and memory over that minute.

Peer, in the same run on the same control plane: as many CronJobs (``* * * * *``, suspended Jobs)
and kube-controller-manager's CronJob controller, measured the same way at a later minute (the
CronFlows deleted first).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import OperatorProcess
from tests.benchmarks import jobpeer
from tests.benchmarks.bench_apply import Client, namespace, until
from tests.benchmarks.bench_scale import proc_status

NS = "bench-cron"
GROUP_PATH = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}"


def cronflow(i: int) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "CronFlow", "metadata": {"name": f"c{i:04d}"},
            "spec": {"schedule": "* * * * *", "startingDeadlineSeconds": 50, "successfulFlowsHistoryLimit": 1,
                     "flowTemplate": {"spec": {"flowRef": "bench.flows:Report", "suspend": True}}}}


def cronjob(i: int) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "CronJob", "metadata": {"name": f"c{i:04d}"},
            "spec": {"schedule": "* * * * *", "startingDeadlineSeconds": 50, "successfulJobsHistoryLimit": 1,
                     "jobTemplate": {"spec": {"suspend": True, "template": {"spec": {
                         "restartPolicy": "Never", "containers": [{"name": "c", "image": "x"}]}}}}}}


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks (100 Hz)


async def create_all(client: Client, path: str, bodies: list[dict[str, Any]]) -> float:
    t0 = time.perf_counter()
    queue = list(bodies)

    async def worker() -> None:
        while queue:
            await client.post(path, queue.pop())

    await asyncio.gather(*(worker() for _ in range(16)))
    return time.perf_counter() - t0


async def one_minute(client: Client, n: int, url: str, pid: int) -> dict[str, float]:
    """Wait for the next minute (at least 10 s away), then until `n` objects at `url` appeared."""
    seen: dict[str, float] = {}
    ready = asyncio.Event()
    watch = asyncio.create_task(jobpeer.watch(client.session, url, lambda *_: True, seen, ready))
    await ready.wait()
    now = time.time()
    minute = (int(now) // 60 + 1) * 60
    if minute - now < 10:
        minute += 60
    await until(lambda: time.time() >= minute, 80, lambda: "the minute")
    offset = time.time() - time.perf_counter()
    cpu0 = cpu_seconds(pid)
    await until(lambda: len(seen) >= n, 300, lambda: f"{len(seen)} of {n} after the minute")
    cpu = cpu_seconds(pid) - cpu0
    watch.cancel()
    late = sorted(t + offset - minute for t in seen.values())
    return {"p50": statistics.median(late), "p99": late[int(0.99 * (len(late) - 1))], "max": late[-1],
            "within": sum(1 for x in late if x < 60), "cpu": cpu, "rss": proc_status(pid)[0],
            "minute": float(minute)}


def line(what: str, n: int, f: dict[str, float]) -> str:
    return (f"{what}: {int(f['within'])}/{n} within the minute; after it p50 {f['p50']:.1f} s, p99 {f['p99']:.1f} s, "
            f"max {f['max']:.1f} s; CPU {f['cpu']:.1f} s, RSS {f['rss']:.0f} MB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cronflows", type=int, default=1000)
    args = parser.parse_args()
    n = args.cronflows
    with tempfile.TemporaryDirectory(prefix="flowkube-cron-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING"})
        try:
            op.start()
            assert op.proc is not None
            pid, kcm = op.proc.pid, cluster.procs["kube-controller-manager"].pid

            async def run() -> None:
                client = Client.of(cluster)
                try:
                    await namespace(client, NS)
                    took = await create_all(client, f"{GROUP_PATH}/cronflows", [cronflow(i) for i in range(n)])
                    print(f"{n} CronFlows created in {took:.1f} s; operator RSS {proc_status(pid)[0]:.0f} MB")
                    ours = await one_minute(client, n, f"{client.server}{GROUP_PATH}/flows", pid)
                    print(line(f"CronFlows at {dt.datetime.fromtimestamp(ours['minute'], dt.UTC):%H:%M}", n, ours))
                    async with client.session.delete(f"{client.server}{GROUP_PATH}/cronflows") as r:
                        r.raise_for_status()
                    took = await create_all(client, f"/apis/batch/v1/namespaces/{NS}/cronjobs",
                                            [cronjob(i) for i in range(n)])
                    print(f"{n} CronJobs created in {took:.1f} s")
                    peer = await one_minute(client, n, f"{client.server}/apis/batch/v1/namespaces/{NS}/jobs", kcm)
                    print(line("CronJobs (kube-controller-manager)", n, peer))
                    ratio = {k: ours[k] / max(peer[k], 0.001) for k in ("p50", "max", "cpu")}
                    print(f"ratio CronFlows/CronJobs: p50 {ratio['p50']:.2f}, max {ratio['max']:.2f}, "
                          f"CPU {ratio['cpu']:.2f}")
                finally:
                    await client.session.close()

            asyncio.run(run())
        finally:
            op.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
