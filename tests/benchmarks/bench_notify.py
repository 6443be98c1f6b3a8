"""Benchmark: notifications. Prints figures; docs/benchmarks.md keeps them.

    .venv/bin/python -m tests.benchmarks.bench_notify [--flows 100] [--hang 30]

On a local cluster of its own (real node, the chart's operator, scripted runner pods), two receivers
run on this host behind Services (their IPs in the chart's ``notifications.allowedCIDRs``): a quick
one, and one that holds every request ``--hang`` seconds before it answers.

1. ``--flows`` Flows are created at once, each pausing for feedback, each with the quick receiver as
   its one sink. A Flow's latency runs from the watch event saying it is AwaitingFeedback (the
   operator's status write) to the quick receiver reading its notification. Peer, in the same run: the
   operator's `FeedbackRequested` Event for the same Flow, as a watcher of Events (what a
   Kubernetes-native router like argo-events would hear) receives it.
2. The same again with a second sink per Flow, the hanging receiver: the quick receiver's figures
   are compared with the first round's.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import ChartOperator
from tests.benchmarks.bench_apply import Client, until
from tests.benchmarks.bench_console import figures, pct
from tests.benchmarks.realstack import scripted_stack

NS = "bench-notify"
REVIEW = {"method": "review", "message": "Approve the draft?", "emit": ["approved", "rejected"]}


class Server(ThreadingHTTPServer):
    request_queue_size = 1024  # the standard library's 5 drops SYNs of a burst: a 1 s retransmit, not ours
    daemon_threads = True


class Receiver:
    def __init__(self, host: str, hang: float = 0.0) -> None:
        self.arrived: dict[str, float] = {}
        self.hang = hang
        self.count = 0
        self._lock = threading.Lock()
        self.server = Server((host, 0), self._handler())
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                now = time.perf_counter()
                name = json.loads(body)["data"]["flow"]["name"]
                with receiver._lock:
                    receiver.arrived.setdefault(name, now)
                    receiver.count += 1
                if receiver.hang:
                    time.sleep(receiver.hang)  # the receiver hangs: that is what is measured
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])


def secret(name: str, url: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name, "namespace": NS,
                                                               "labels": {"flowkube.io/notifications": "true"}},
            "data": {"url": base64.b64encode(url.encode()).decode()}}


async def round_of(client: Client, prefix: str, n: int, sinks: list[str], quick: Receiver) -> list[float]:
    from tests.benchmarks import jobpeer

    base = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
    paused: dict[str, float] = {}
    told: dict[str, float] = {}  # the peer: the FeedbackRequested Event, by Flow
    ready_flows, ready_events = asyncio.Event(), asyncio.Event()

    def event(_t: str, o: dict[str, Any]) -> bool:
        if o.get("reason") == "FeedbackRequested":
            told.setdefault((o.get("regarding") or {}).get("name", ""), time.perf_counter())
        return False

    tasks = [asyncio.create_task(jobpeer.watch(
        client.session, f"{client.server}{base}",
        lambda _t, o: (o.get("status") or {}).get("phase") == "AwaitingFeedback", paused, ready_flows)),
        asyncio.create_task(jobpeer.watch(
            client.session, f"{client.server}/apis/events.k8s.io/v1/namespaces/{NS}/events", event, {},
            ready_events))]
    await ready_flows.wait()
    await ready_events.wait()
    names = [f"{prefix}{i}" for i in range(n)]
    await asyncio.gather(*(client.post(base, {
        "apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
        "spec": {"flowRef": "bench:Review",
                 "inputs": {"plan": [{"result": "Paused", "feedback": {**REVIEW, "id": f"r-{name}"}}, {}]},
                 "notifications": [{"name": s, "secretRef": {"name": s}} for s in sinks]}}) for name in names))
    await until(lambda: all(name in quick.arrived for name in names), 600,
                lambda: f"{sum(name in quick.arrived for name in names)}/{n} notified")
    await until(lambda: all(name in told for name in names), 60, lambda: "the Events")
    for t in tasks:
        t.cancel()
    notified = [(quick.arrived[k] - paused[k]) * 1000 for k in names]
    peer = [(told[k] - paused[k]) * 1000 for k in names]
    print(figures(f"  paused (watch) -> quick receiver has it, {n} Flows at once, sinks {sinks}", notified)
          + f", p90 {pct(notified, 0.9):.1f} ms")
    print(figures("  peer: paused (watch) -> the FeedbackRequested Event at an Event watcher", peer))
    print(f"  ratio to the peer: p50 {statistics.median(notified) / statistics.median(peer):.2f}x, "
          f"p99 {pct(notified, 0.99) / pct(peer, 0.99):.2f}x", flush=True)
    return notified


async def measure(cluster: LocalCluster, op: ChartOperator, n: int, hang: float, values: list[str]) -> None:
    quick, slow = Receiver(cluster.host_ip), Receiver(cluster.host_ip, hang)
    ips = []
    for name, r in (("quick", quick), ("slow", slow)):
        url = cluster.host_service(f"receiver-{name}", "flowkube-dev", r.port)
        ips.append(cluster.kubectl("get", "service", f"receiver-{name}", "-n", "flowkube-dev",
                                   "-o", "jsonpath={.spec.clusterIP}").stdout.strip())
        cluster.kubectl("apply", "-f", "-", input=json.dumps(secret(name, url)))
    op.upgrade(f"notifications.allowedCIDRs={{{ips[0]}/32,{ips[1]}/32}}", "log.level=WARNING", *values)
    client = Client.of(cluster)
    try:
        print("1. the quick receiver only", flush=True)
        alone = await round_of(client, "a", n, ["quick"], quick)
        print(f"2. with a second sink per Flow that hangs {hang:.0f} s", flush=True)
        beside = await round_of(client, "b", n, ["quick", "slow"], quick)
        print(f"the hanging receiver's effect on the quick one: p50 "
              f"{statistics.median(beside) - statistics.median(alone):+.1f} ms, "
              f"p99 {pct(beside, 0.99) - pct(alone, 0.99):+.1f} ms "
              f"(the hanging one had {slow.count} requests so far)")
    finally:
        await client.session.close()
        quick.server.shutdown()
        slow.server.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flows", type=int, default=100)
    parser.add_argument("--hang", type=float, default=30.0)
    parser.add_argument("--set", action="append", default=[], help="more chart values (key=value)")
    args = parser.parse_args()
    with scripted_stack("notify", NS) as (cluster, op):
        asyncio.run(measure(cluster, op, args.flows, args.hang, args.set))


if __name__ == "__main__":
    main()
