"""Benchmark: the web console. Prints figures; docs/benchmarks.md keeps them.

    .venv/bin/python -m tests.benchmarks.bench_console [--flows 1000 --waiting 100 --scale 10000]
                                                       [--paused 20] [--skip-live]

Two parts, each on a local cluster of its own:

1. **Pages and memory** (control plane only): ``--flows`` Flows (``--waiting`` of them awaiting
   feedback) with realistic statuses, written directly (no operator). ``flowkube-console`` runs as a
   process of this host with a ServiceAccount token that may list Flows cluster-wide. The inbox and the
   Flows page are read 50 times each; their server time is the console's ``Server-Timing``. Peer: the
   same list read from the API server directly (the decode included), in the same run. Then the
   Flows grow to ``--scale`` and the console's resident memory is read from /proc.
2. **Live** (real node, the chart's operator and console, scripted runner pods): the inbox is open
   (its server-sent events read by this process), ``--paused`` Flows pause one by one; each one's
   latency runs from the watch event saying it is AwaitingFeedback to the event stream carrying it.
   Then each is answered: half through the console (the form post a click sends), half with the
   plain status patch (the peer); the latency runs from the request to the resume pod's first watch
   event. The node is cordoned first, so resume pods are created but not started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from flowkube_devstack.cluster import LocalCluster
from tests.benchmarks.bench_apply import Client, until
from tests.benchmarks.bench_scale import proc_status
from tests.benchmarks.realstack import scripted_stack

NS = "bench-console"
REPO = Path(__file__).resolve().parents[2]
REVIEW = {"id": "r1", "method": "review", "message": "Approve the draft?", "emit": ["approved", "rejected"]}
READER_RULES = [{"apiGroups": ["flowkube.io"], "resources": ["flows"], "verbs": ["get", "list", "watch"]},
                {"apiGroups": ["flowkube.io"], "resources": ["flows/status"], "verbs": ["get", "patch"]}]


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(len(s) * p))]


def figures(label: str, values: list[float]) -> str:
    return (f"{label}: p50 {statistics.median(values):.1f} ms, p99 {pct(values, 0.99):.1f} ms, "
            f"max {max(values):.1f} ms (n={len(values)})")


def reviewer_token(cluster: LocalCluster) -> str:
    """A ServiceAccount that may read Flows everywhere and answer them (a reviewer's token)."""
    objs = [{"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "reviewer", "namespace": "default"}},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "bench-reviewer"}, "rules": READER_RULES},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "bench-reviewer"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "bench-reviewer"},
             "subjects": [{"kind": "ServiceAccount", "name": "reviewer", "namespace": "default"}]}]
    cluster.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objs}))
    return cluster.kubectl("create", "token", "reviewer", "-n", "default", "--duration=2h").stdout.strip()


def status_of(i: int, waiting: bool) -> dict[str, Any]:
    """A status as the operator writes it: conditions, two runs with usage, and a request when waiting."""
    usage = {"totalTokens": 1200 + i, "promptTokens": 1000, "completionTokens": 200 + i, "successfulRequests": 3,
             "cost": "0.00042", "currency": "USD",
             "byModel": {"gpt-4o-mini": {"totalTokens": 1200 + i, "promptTokens": 1000, "completionTokens": 200 + i,
                                         "successfulRequests": 3, "cost": "0.00042"}}}
    run = {"pod": f"f{i}-0", "trigger": "kickoff", "startedAt": "2026-11-27T08:00:00Z",
           "finishedAt": "2026-11-27T08:00:09Z", "result": "Paused" if waiting else "Succeeded", "usage": usage}
    st: dict[str, Any] = {
        "phase": "AwaitingFeedback" if waiting else "Succeeded", "definition": "ReviewedArticle",
        "message": "awaiting feedback: Approve the draft?" if waiting else "finished", "runs": [run], "usage": usage,
        "conditions": [{"type": t, "status": "True", "reason": "Bench", "message": "",
                        "lastTransitionTime": "2026-11-27T08:00:00Z"} for t in ("Accepted", "Running")],
        "result": {"output": "A draft about operators. " * 40}}
    if waiting:
        st["feedback"] = {"request": {**REVIEW, "id": f"r{i}", "output": "A draft about operators. " * 40,
                                      "requestedAt": f"2026-11-27T08:{i % 60:02d}:00Z"}}
    return {"status": st}


async def write_flows(client: Client, start: int, stop: int, waiting: int, concurrency: int = 24) -> None:
    base = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
    queue = iter(range(start, stop))

    async def worker() -> None:
        for i in queue:
            await client.post(base, {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                     "metadata": {"name": f"f{i}"}, "spec": {"flowRef": "bench.flows:Review"}})
            await client.patch(f"{base}/f{i}/status", status_of(i, i < waiting))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def page_times(session: aiohttp.ClientSession, url: str, token: str, n: int) -> tuple[list[float], int]:
    times, size = [], 0
    for _ in range(n):
        async with session.get(url, headers={"Authorization": f"Bearer {token}"}) as r:
            body = await r.read()
            if r.status != 200:
                raise RuntimeError(f"{url}: {r.status} {body[:300]!r}")
            times.append(float(r.headers["Server-Timing"].split("dur=")[1]))
            size = len(body)
    return times, size


async def api_list_times(client: Client, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        async with client.session.get(f"{client.server}/apis/flowkube.io/v1alpha1/flows") as r:
            json.loads(await r.read())
        times.append((time.perf_counter() - t0) * 1000)
    return times


async def count_rows(session: aiohttp.ClientSession, url: str, token: str) -> int:
    async with session.get(f"{url}/flows", headers={"Authorization": f"Bearer {token}"}) as r:
        return (await r.text()).count('<tr data-flow="')


def console_process(cluster: LocalCluster, port: int) -> subprocess.Popen[bytes]:
    """flowkube-console as a process of this host, against the cluster's API server."""
    return subprocess.Popen([str(REPO / ".venv/bin/flowkube-console"), "--host", "127.0.0.1", "--port", str(port),
                             "--api-server", cluster.server, "--ca-file", str(cluster.pki_dir / "ca.crt")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def pages_part(cluster: LocalCluster, proc: subprocess.Popen[bytes], url: str, token: str,
                     flows: int, waiting: int, scale: int) -> None:
    client = Client.of(cluster)
    try:
        async with aiohttp.ClientSession() as session:
            async def up() -> bool:
                try:
                    async with session.get(url + "/healthz") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            deadline = time.monotonic() + 30
            while not await up():
                if time.monotonic() > deadline:
                    raise TimeoutError("the console did not start")
                await asyncio.sleep(0.1)
            print(f"console started: {proc_status(proc.pid)[0]:.1f} MB resident", flush=True)
            t0 = time.monotonic()
            await write_flows(client, 0, flows, waiting)
            print(f"{flows} Flows written in {time.monotonic() - t0:.0f} s", flush=True)
            await page_times(session, url + "/", token, 1)  # the first page lists (then the watch keeps up)
            await until_rows(session, url, token, flows)
            inbox, inbox_bytes = await page_times(session, url + "/", token, 50)
            listing, listing_bytes = await page_times(session, url + "/flows", token, 20)
            peer = await api_list_times(client, 20)
            print(figures(f"inbox page, {flows} Flows ({waiting} waiting), server time", inbox)
                  + f", {inbox_bytes // 1024} KiB")
            print(figures(f"Flows page, {flows} rows, server time", listing) + f", {listing_bytes // 1024} KiB")
            print(figures(f"peer: the same {flows} Flows listed from the API server and decoded", peer))
            print(f"inbox p50 / peer p50: {statistics.median(inbox) / statistics.median(peer):.2f}")
            print(f"console resident memory with {flows} Flows in view: {proc_status(proc.pid)[0]:.1f} MB", flush=True)
            if scale > flows:
                t0 = time.monotonic()
                await write_flows(client, flows, scale, waiting)
                print(f"{scale - flows} more Flows written in {time.monotonic() - t0:.0f} s", flush=True)
                await until_rows(session, url, token, scale)
                inbox, _ = await page_times(session, url + "/", token, 20)
                print(figures(f"inbox page, {scale} Flows ({waiting} waiting), server time", inbox))
                print(f"console resident memory with {scale} Flows in view: {proc_status(proc.pid)[0]:.1f} MB")
                # A console started with all of them there lists them (100 a page) before it watches.
                fresh = console_process(cluster, 18932)
                try:
                    t0 = time.monotonic()
                    await until_rows(session, "http://127.0.0.1:18932", token, scale)
                    print(f"a console started with {scale} Flows there shows them all after "
                          f"{time.monotonic() - t0:.1f} s; resident memory {proc_status(fresh.pid)[0]:.1f} MB")
                finally:
                    fresh.terminate()
    finally:
        await client.session.close()


async def until_rows(session: aiohttp.ClientSession, url: str, token: str, n: int) -> None:
    deadline, rows = time.monotonic() + 300, 0
    while True:
        try:
            rows = await count_rows(session, url, token)
        except aiohttp.ClientError:
            rows = 0  # not listening yet
        if rows >= n:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"the console shows {rows} of {n} Flows")
        await asyncio.sleep(0.2)


# --------------------------------------------------------------------------------------------- live


async def sse_seen(session: aiohttp.ClientSession, url: str, token: str, seen: dict[str, float],
                   ready: asyncio.Event) -> None:
    """When each Flow first appears in the open inbox's event stream."""
    async with session.get(f"{url}/events/inbox", headers={"Authorization": f"Bearer {token}"},
                           timeout=aiohttp.ClientTimeout(total=None)) as r:
        ready.set()
        async for line in r.content:
            for name in re.findall(rb'data-flow="[^/"]+/([^"]+)"', line):
                seen.setdefault(name.decode(), time.perf_counter())


async def paused_seen(client: Client, seen: dict[str, float], ready: asyncio.Event) -> None:
    from tests.benchmarks import jobpeer

    await jobpeer.watch(client.session, f"{client.server}/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows",
                        lambda _t, o: (o.get("status") or {}).get("phase") == "AwaitingFeedback", seen, ready)


async def live_part(cluster: LocalCluster, console: str, n: int) -> None:
    token = reviewer_token(cluster)
    client = Client.of(cluster)
    base = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
    auth = {"Authorization": f"Bearer {token}"}
    try:
        async with aiohttp.ClientSession() as session:
            in_inbox: dict[str, float] = {}
            paused: dict[str, float] = {}
            ready_sse, ready_watch = asyncio.Event(), asyncio.Event()
            tasks = [asyncio.create_task(sse_seen(session, console, token, in_inbox, ready_sse)),
                     asyncio.create_task(paused_seen(client, paused, ready_watch))]
            await ready_sse.wait()
            await ready_watch.wait()
            for i in range(n):
                await client.post(base, {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                         "metadata": {"name": f"p{i}"},
                                         "spec": {"flowRef": "bench:Review", "inputs": {
                                             "plan": [{"result": "Paused", "feedback": {**REVIEW, "id": f"r{i}"}},
                                                      {}]}}})
                name = f"p{i}"
                await until(lambda name=name: name in in_inbox, 300, lambda name=name: f"{name} in the inbox")
            appear = [(in_inbox[k] - paused[k]) * 1000 for k in paused]
            print(figures(f"Flow AwaitingFeedback (watch) -> in the open inbox (event stream), {n} Flows", appear))

            cluster.kubectl("cordon", "flowkube-local-node")
            pods: dict[str, float] = {}
            ready = asyncio.Event()
            tasks.append(asyncio.create_task(client.watch_pods(NS, pods, ready)))
            await ready.wait()
            sent: dict[str, tuple[str, float]] = {}
            for i in range(n):
                name = f"p{i}"
                if i % 2 == 0:  # the console: the form a click posts (its page read first, as a person would)
                    async with session.get(f"{console}/flows/{NS}/{name}", headers=auth) as r:
                        page = await r.text()
                    csrf = re.search(r'name="csrf" value="([^"]+)"', page)
                    assert csrf, page[:500]
                    t0 = time.perf_counter()
                    async with session.post(f"{console}/flows/{NS}/{name}/feedback", headers=auth,
                                            allow_redirects=False,
                                            data={"csrf": csrf.group(1), "request_id": f"r{i}",
                                                  "outcome": "approved"}) as r:
                        if r.status != 303:
                            raise RuntimeError(f"console answer: {r.status} {(await r.text())[:300]}")
                    sent[f"{name}-1"] = ("console", t0)
                else:
                    t0 = time.perf_counter()
                    await client.patch(f"{base}/{name}/status",
                                       {"status": {"feedback": {"response": {"text": "approved",
                                                                             "requestId": f"r{i}"}}}})
                    sent[f"{name}-1"] = ("patch", t0)
                await until(lambda pod=f"{name}-1": pod in pods, 120, lambda pod=f"{name}-1": f"{pod}")
            for t in tasks:
                t.cancel()
            by = {how: [(pods[p] - t0) * 1000 for p, (h, t0) in sent.items() if h == how]
                  for how in ("console", "patch")}
            print(figures("answer through the console (form post) -> resume pod created", by["console"]))
            print(figures("peer: the status patch itself -> resume pod created", by["patch"]))
            print(f"beyond the patch: p50 {statistics.median(by['console']) - statistics.median(by['patch']):+.1f} ms, "
                  f"p99 {pct(by['console'], 0.99) - pct(by['patch'], 0.99):+.1f} ms")
    finally:
        await client.session.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flows", type=int, default=1000)
    parser.add_argument("--waiting", type=int, default=100)
    parser.add_argument("--scale", type=int, default=10000)
    parser.add_argument("--paused", type=int, default=20)
    parser.add_argument("--skip-live", action="store_true")
    parser.add_argument("--skip-pages", action="store_true")
    args = parser.parse_args()
    if not args.skip_pages:
        with tempfile.TemporaryDirectory(prefix="flowkube-bench-console-") as tmp:
            cluster = LocalCluster(Path(tmp), with_node=False).start()
            try:
                cluster.kubectl("apply", "--server-side", "-f", str(REPO / "crds" / "flowkube.io_flows.yaml"))
                cluster.kubectl("wait", "--for=condition=Established", "crd/flows.flowkube.io", "--timeout=60s")
                token = reviewer_token(cluster)
                cluster.kubectl("create", "namespace", NS)
                proc = console_process(cluster, 18931)
                try:
                    asyncio.run(pages_part(cluster, proc, "http://127.0.0.1:18931", token, args.flows, args.waiting,
                                           args.scale))
                finally:
                    proc.terminate()
                    proc.wait(timeout=10)
            finally:
                cluster.stop()
    if not args.skip_live:
        with scripted_stack("console-live", NS) as (cluster, op):
            asyncio.run(live_part(cluster, op.console_url(), args.paused))


if __name__ == "__main__":
    main()
