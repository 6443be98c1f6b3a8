"""Benchmark: apply -> runner pod created, against the local control plane, beside Kubernetes' Job
controller. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_apply [--flows 300] [--rate 10] [--concurrency 1 16] [--kind NAME]

0. The API server's CPU per write of each kind a Flow needs, one client, nobody watching, each beside
   a stand-in that lacks one part: the Flow's create and its status writes (a pending one, a finished
   one) with the Flow's CRD, with the same CRD without CEL rules and without a schema (other API
   groups); a pod's create; a suspended Job's; then, with the operator running, a Flow's create with
   the validating webhook called and skipped. `--costs-only` stops there.
1. Paced: N Flows applied at `rate`/s; latency from each POST to the pod's ADDED watch event.
2. Bursts, with 1 and with 16 concurrent clients (a kubectl loop, a CI job; enough to saturate the API
   server here): N Flows, N Jobs (batch/v1, one pod each, the runner pod as template) and N plain pods;
   objects/s until all their pods exist. The Jobs run twice: with the controller-manager at Kubernetes'
   defaults, then restarted at its best (`jobpeer.CM_DEFAULTS`, `jobpeer.CM_BEST`), each beside a
   Flow burst of the same phase.
3. Per object, from a burst's first create until the cluster has settled: the API server's writes by
   verb and resource (its own `apiserver_request_total`, read before and after) and each process's
   CPU (/proc: the operator, kube-controller-manager, the API server...). Then a stand-in kubelet
   ends every pod (Succeeded, exit 0; a runner's report in its termination message) and the same
   until every Flow is Succeeded and every Job Complete.
No kubelet runs: a stand-in Node (its Lease renewed) lets the scheduler bind each pod once, pods stay
Pending until the stand-in kubelet ends them; this measures the controllers and the API server only.
Ratios (flowkube / Job controller) are what to read: the machine is shared.

It creates and deletes hundreds of objects, so it only ever runs against a control plane it starts
itself in a temporary directory and stops at the end (it takes no kubeconfig and reads no KUBECONFIG),
or, with `--kind NAME`, against a throwaway kind cluster made for it by
`KEEP_CLUSTER=1 CLUSTER=NAME hack/kind-e2e.sh` (see kindtarget.py; step 0 is skipped there: its
operator is already running).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import yaml

from flowkube_api import constants as c
from flowkube_api import crd
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import OperatorProcess
from tests.benchmarks import jobpeer
from tests.benchmarks.jobpeer import cpu_seconds
from tests.benchmarks.kindtarget import KindTarget


def local_ssl(cluster: LocalCluster) -> ssl.SSLContext:
    cfg = yaml.safe_load(cluster.kubeconfig.read_text())
    user = cfg["users"][0]["user"]
    ctx = ssl.create_default_context(cafile=cfg["clusters"][0]["cluster"]["certificate-authority"])
    ctx.load_cert_chain(user["client-certificate"], user["client-key"])
    return ctx


class Client:
    def __init__(self, server: str, ctx: ssl.SSLContext) -> None:
        self.server = server
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx, limit=32))

    @classmethod
    def of(cls, cluster: LocalCluster) -> Client:
        return cls(cluster.server, local_ssl(cluster))

    async def post(self, path: str, body: dict[str, Any]) -> None:
        async with self.session.post(self.server + path, json=body) as r:
            if r.status >= 300:
                raise RuntimeError(f"{path}: {r.status} {await r.text()}")

    async def patch(self, path: str, body: dict[str, Any]) -> None:
        async with self.session.patch(self.server + path, json=body,
                                      headers={"Content-Type": "application/merge-patch+json"}) as r:
            if r.status >= 300:
                raise RuntimeError(f"{path}: {r.status} {await r.text()}")

    async def watch_pods(self, ns: str, seen: dict[str, float], ready: asyncio.Event) -> None:
        """When each pod of `ns` was first seen (any event says it exists)."""
        await jobpeer.watch(self.session, f"{self.server}/api/v1/namespaces/{ns}/pods", lambda *_: True,
                            seen, ready)


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


async def until(pred: Any, limit: float, what: Any = lambda: "waiting") -> None:
    deadline = time.perf_counter() + limit
    while not pred():
        if time.perf_counter() > deadline:
            raise TimeoutError(f"benchmark did not finish in time: {what()} after {limit:.0f} s")
        await asyncio.sleep(0.01)


PENDING_STATUS = {"status": {"phase": "Pending", "observedGeneration": 1, "definition": "Noop", "runs": [
    {"pod": "x-0", "trigger": "kickoff"}], "conditions": [
    {"type": t, "status": "Unknown", "reason": "RunPending", "message": "waiting for the runner pod",
     "lastTransitionTime": "2026-01-01T00:00:00Z"} for t in ("Accepted", "Running", "Succeeded")]}}


# A finished Flow's status as the operator writes it (one run, one model), for the size of its update.
_USAGE = {"promptTokens": 1210, "completionTokens": 342, "totalTokens": 1552, "successfulRequests": 2,
          "cachedPromptTokens": 0, "cost": "0.000387", "currency": "USD", "unpricedTokens": 0}
FINAL_STATUS = {"status": {
    "phase": "Succeeded", "observedGeneration": 1, "definition": "Noop",
    "flowId": "3f0c1c9e-61a4-4f5e-9d0e-2c1b7e0a9d11",
    "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:00:06Z", "message": "finished",
    "result": {"output": "A short answer of a few words, as most flows end."},
    "usage": {**_USAGE, "byModel": {"gpt-4o-mini": _USAGE}},
    "runs": [{"pod": "x-0", "trigger": "kickoff", "startedAt": "2026-01-01T00:00:00Z",
              "finishedAt": "2026-01-01T00:00:06Z", "result": "Succeeded", "reason": "RunSucceeded",
              "message": "the flow finished", "exitCode": 0, "closedOnReport": True, "usage": _USAGE}],
    "conditions": [{"type": t, "status": s, "reason": r, "message": m, "observedGeneration": 1,
                    "lastTransitionTime": "2026-01-01T00:00:06Z"} for t, s, r, m in (
        ("Accepted", "True", "Accepted", "the flow was accepted"),
        ("Running", "False", "RunSucceeded", "the flow finished"),
        ("AwaitingFeedback", "False", "NoRequest", "no feedback request is pending"),
        ("Succeeded", "True", "RunSucceeded", "the flow finished"))]}}


def _strip_rules(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: _strip_rules(v) for k, v in node.items() if k != "x-kubernetes-validations"}
    if isinstance(node, list):
        return [_strip_rules(v) for v in node]
    return node


OPEN = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
IDLE_SECONDS = 10.0
# The Flow's CRD as served, and two stand-ins beside it in the same run (other API groups, same kind):
# without its CEL rules, and without a schema at all. What each costs the API server per write is
# what its rules and its schema cost.
CRD_VARIANTS: dict[str, Any] = {
    "": lambda schema: schema,
    "nocel": _strip_rules,
    "noschema": lambda schema: {"type": "object", "properties": {"spec": OPEN, "status": OPEN}},
}


def variant_group(name: str) -> str:
    return f"{name}.bench.flowkube.io" if name else c.GROUP


def crd_variant(name: str) -> dict[str, Any]:
    doc = crd.crd()
    if not name:
        return doc
    group = variant_group(name)
    doc["metadata"]["name"] = f"{c.PLURAL}.{group}"
    doc["spec"]["group"] = group
    doc["spec"]["names"].pop("shortNames", None)
    doc["spec"]["names"].pop("categories", None)
    for version in doc["spec"]["versions"]:
        version["schema"]["openAPIV3Schema"] = CRD_VARIANTS[name](version["schema"]["openAPIV3Schema"])
    return doc


def suspended_job(name: str) -> dict[str, Any]:
    """A Job with a pod like the bench's own: its controller writes its status, and makes no pod."""
    job = jobpeer.job(name, {"spec": pod(name)["spec"]})
    job["spec"]["suspend"] = True
    return job


async def write_costs(cluster: LocalCluster, n: int, pids: dict[str, int]) -> dict[str, float]:
    """API server CPU ms per write, one kind at a time (no operator yet: nobody acts on the Flows).
    Each of a Flow's parts beside its stand-in: the Flow's CRD, the same without CEL rules, without a
    schema; a pending and a finished status; a pod; a suspended Job (its controller adds a status
    write)."""
    for name in CRD_VARIANTS:
        if name:
            cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(crd_variant(name)))
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{c.PLURAL}.{variant_group(name)}",
                            "--timeout=60s")
    client = Client.of(cluster)
    ns = "bench-costs"
    try:
        await namespace(client, ns)
        kinds: dict[str, Any] = {}
        for name in CRD_VARIANTS:
            group = variant_group(name)
            base = f"/apis/{group}/v1alpha1/namespaces/{ns}/flows"
            label = f"Flow ({name})" if name else "Flow"

            def make(i: int, base: str = base, group: str = group) -> Any:
                return client.post(base, {**flow(f"c{i}"), "apiVersion": f"{group}/v1alpha1"})

            def status(i: int, body: Any, base: str = base) -> Any:
                return client.patch(f"{base}/c{i}/status", body)

            kinds[f"{label} create"] = make
            kinds[f"{label} status, pending"] = lambda i, status=status: status(i, PENDING_STATUS)
            kinds[f"{label} status, finished"] = lambda i, status=status: status(i, FINAL_STATUS)
        kinds["pod create"] = lambda i: client.post(f"/api/v1/namespaces/{ns}/pods", pod(f"c{i}"))
        kinds["Job create (suspended)"] = lambda i: client.post(f"/apis/batch/v1/namespaces/{ns}/jobs",
                                                                suspended_job(f"c{i}"))
        costs = await _costs(client, kinds, n, pids)
        # The same pods again, with a watch on them that asks for JSON, as the operator's does
        # (kube-controller-manager, the scheduler and the kubelet ask for protobuf).
        seen: dict[str, float] = {}
        ready = asyncio.Event()
        watch = asyncio.create_task(jobpeer.watch(client.session, f"{client.server}/api/v1/namespaces/{ns}/pods",
                                                  lambda *_: True, seen, ready))
        await ready.wait()
        costs |= await _costs(client, {"pod create, watched in JSON": lambda i: client.post(
            f"/api/v1/namespaces/{ns}/pods", pod(f"j{i}"))}, n, pids)
        await stop(watch)
        # Gone before the operator starts: it must not spend the next phases acting on them.
        for path in (f"/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows", f"/api/v1/namespaces/{ns}/pods",
                     f"/apis/batch/v1/namespaces/{ns}/jobs"):
            await delete_all(client, path, limit=60)
        return costs
    finally:
        await client.session.close()


async def webhook_costs(cluster: LocalCluster, n: int, pids: dict[str, int]) -> dict[str, float]:
    """With the operator running: a suspended Flow's create with `spec.inputs` (the validating
    webhook is called) and without (its matchConditions skip it); the operator writes the same
    status for both."""
    client = Client.of(cluster)
    ns = "bench-webhook"
    path = f"/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows"
    try:
        await namespace(client, ns)
        plain = {"flowRef": "bench.flows:Noop", "suspend": True}
        kinds: dict[str, Any] = {
            "Flow create, webhook skipped": lambda i: client.post(path, {**flow(f"s{i}"), "spec": plain}),
            "Flow create, webhook called": lambda i: client.post(
                path, {**flow(f"w{i}"), "spec": {**plain, "inputs": {"topic": "x"}}}),
        }
        costs = await _costs(client, kinds, n, pids)
        await delete_all(client, path, limit=60)
        return costs
    finally:
        await client.session.close()


async def _costs(client: Client, kinds: dict[str, Any], n: int, pids: dict[str, int]) -> dict[str, float]:
    """Each kind's API server CPU per write, less what the API server spends idle over the same time
    (its own loops, leases, the controllers' resyncs, settle()'s /metrics reads), measured first."""
    await jobpeer.settle(client.session, client.server, pids)
    t, before = time.perf_counter(), cpu_seconds(pids)["kube-apiserver"]
    await asyncio.sleep(IDLE_SECONDS)  # the idle period measured
    await jobpeer.settle(client.session, client.server, pids)
    idle = (cpu_seconds(pids)["kube-apiserver"] - before) / (time.perf_counter() - t)
    costs = {}
    for kind, write in kinds.items():
        await jobpeer.settle(client.session, client.server, pids)
        t, before = time.perf_counter(), cpu_seconds(pids)["kube-apiserver"]
        for i in range(n):
            await write(i)
        await jobpeer.settle(client.session, client.server, pids)  # the scheduler's, the controllers' answers
        spent = cpu_seconds(pids)["kube-apiserver"] - before - idle * (time.perf_counter() - t)
        costs[kind] = spent * 1000 / n
    return costs


@dataclass
class Burst:
    """One burst of n objects of one kind: until their pods exist, then from pod end until done."""

    kind: str  # "Flow", "Job" or "pod" (a plain client's)
    cm: str  # the controller-manager's flags: "defaults" or "best"
    clients: int
    per_s: float
    writes: Counter[str]  # per object, by verb and resource, until the pods exist and all is written
    cpu_ms: dict[str, float]  # per object, by process
    end_per_s: float = 0.0
    end_writes: Counter[str] = field(default_factory=Counter)  # pod end -> done; not the stand-in's own
    end_cpu_ms: dict[str, float] = field(default_factory=dict)
    reconciles: float = 0.0  # the operator's, per object (its own count), in each phase
    end_reconciles: float = 0.0
    connections: float = 0.0  # API connections the operator opened (TLS handshakes), per object
    end_connections: float = 0.0
    made_s: float = 0.0  # from the first create until the client's last create was answered
    pods_s: float = 0.0  # until the last pod existed
    lag_ms: tuple[float, float] = (0.0, 0.0)  # create answered -> its pod's event, p50 and p99
    # by "flow schema / priority level": (mean ms a request waited in API Priority and Fairness, requests per object)
    apf_ms: dict[str, tuple[float, float]] = field(default_factory=dict)


class Target(Protocol):
    """Where the bursts run: the control plane this benchmark starts, or a throwaway kind cluster."""

    @property
    def server(self) -> str: ...

    def restart_controller_manager(self, flags: Sequence[str]) -> int: ...  # its new pid

    def operator_metrics(self) -> str: ...


@dataclass
class LocalTarget:
    cluster: LocalCluster
    op: OperatorProcess

    @property
    def server(self) -> str:
        return self.cluster.server

    def restart_controller_manager(self, flags: Sequence[str]) -> int:
        self.cluster.restart_controller_manager(flags)
        return self.cluster.procs["kube-controller-manager"].pid

    def operator_metrics(self) -> str:
        return self.op.metrics()


@dataclass
class Bench:
    client: Client
    pids: dict[str, int]
    target: Target
    template: dict[str, Any]  # the Jobs' pod template
    n: int

    async def counts(self) -> tuple[float, float]:
        """(reconciles, API connections opened) by the operator since it started (its own /metrics)."""
        text = await asyncio.to_thread(self.target.operator_metrics)

        def total(name: str) -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))
        return (total("flowkube_operator_reconcile_duration_seconds_count"),
                total("flowkube_operator_api_connections_opened_total"))


def per_object(writes: Counter[str], n: int) -> Counter[str]:
    return Counter({k: v / n for k, v in writes.items()})


async def burst(b: Bench, ns: str, kind: str, cm: str, concurrency: int) -> Burst:
    """n objects of `kind` created by `concurrency` clients: objects/s until all their pods exist;
    the API server's writes and each process's CPU until the cluster settles. Then (Flows, Jobs) the
    pods end and the same until every object is done."""
    client, pids, n, template = b.client, b.pids, b.n, b.template
    make, path = {
        "Flow": (flow, f"/apis/flowkube.io/v1alpha1/namespaces/{ns}/flows"),
        "pod": (pod, f"/api/v1/namespaces/{ns}/pods"),
        "Job": (lambda name: jobpeer.job(name, template), f"/apis/batch/v1/namespaces/{ns}/jobs"),
    }[kind]
    session, server = client.session, client.server
    seen: dict[str, float] = {}
    ready = asyncio.Event()
    w = asyncio.create_task(client.watch_pods(ns, seen, ready))
    await ready.wait()
    writes0 = await jobpeer.settle(session, server, pids)
    cpu0, (rec0, conn0) = jobpeer.cpu_seconds(pids), await b.counts()
    apf0 = await jobpeer.apf_waits(session, server)
    t0 = time.perf_counter()
    queue = list(range(n))

    made: dict[str, float] = {}

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await client.post(path, make(f"b{i}"))
            made[f"b{i}"] = time.perf_counter()

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    try:
        await until(lambda: len(seen) >= n, 600, lambda: f"{kind} burst in {ns}: {len(seen)} of {n} pods seen")
    except TimeoutError as e:
        gauges = [line for line in (await asyncio.to_thread(b.target.operator_metrics)).splitlines()
                  if line.startswith(("flowkube_operator_workqueue", "flowkube_operator_reconciles_in_flight",
                                      "flowkube_operator_reconcile_errors_total"))]
        raise TimeoutError(f"{e}; {await census(client, ns, path, w)}; operator: {gauges}") from None
    per_s = n / (max(seen.values()) - t0)
    # Pods are named <object>-<suffix> (a Flow's -0, a Job's random one), a plain client's as the object.
    lags = sorted(t - made[obj] for pod_name, t in seen.items()
                  if (obj := pod_name if kind == "pod" else pod_name.rsplit("-", 1)[0]) in made)
    await stop(w)
    writes1 = await jobpeer.settle(session, server, pids)
    cpu1, (rec1, conn1) = jobpeer.cpu_seconds(pids), await b.counts()
    apf1 = await jobpeer.apf_waits(session, server)
    out = Burst(kind, cm, concurrency, per_s, per_object(jobpeer.diff(writes1, writes0), n),
                {k: (cpu1[k] - cpu0[k]) * 1000 / n for k in pids}, reconciles=(rec1 - rec0) / n,
                connections=(conn1 - conn0) / n, made_s=max(made.values()) - t0,
                pods_s=max(seen.values()) - t0, lag_ms=(statistics.median(lags) * 1000,
                                                         lags[int(len(lags) * 0.99)] * 1000),
                apf_ms={k: ((v[0] - apf0.get(k, (0, 0))[0]) * 1000 / n_req, n_req / n)
                        for k, v in apf1.items() if (n_req := v[1] - apf0.get(k, (0, 0))[1]) >= n / 10})
    if kind == "pod":
        # Pending pods are rescheduled every few minutes: gone before the next burst, not in it.
        await delete_all(client, path)
        return out

    done: dict[str, float] = {}
    ready = asyncio.Event()
    w = asyncio.create_task(jobpeer.watch(session, server + path, jobpeer.flow_succeeded if kind == "Flow"
                                          else jobpeer.job_complete, done, ready))
    await ready.wait()
    cpu2 = jobpeer.cpu_seconds(pids)
    t1 = time.perf_counter()
    ended = await jobpeer.end_pods(session, server, ns, list(seen), concurrency, runner=kind == "Flow")
    await until(lambda: len(done) >= n, 600, lambda: f"{kind} burst in {ns}: {len(done)} of {n} done")
    out.end_per_s = n / (max(done.values()) - t1)
    await stop(w)
    writes3 = await jobpeer.settle(session, server, pids)
    cpu3, (rec3, conn3) = jobpeer.cpu_seconds(pids), await b.counts()
    out.end_reconciles, out.end_connections = (rec3 - rec1) / n, (conn3 - conn1) / n
    end_writes = jobpeer.diff(writes3, writes1)
    end_writes["PATCH pods/status"] -= ended  # the stand-in kubelet's own
    out.end_writes = per_object(+end_writes, n)
    out.end_cpu_ms = {k: (cpu3[k] - cpu2[k]) * 1000 / n for k in pids}
    return out


async def census(client: Client, ns: str, path: str, watch: asyncio.Task[None]) -> str:
    """What the API server holds when a burst times out: whether the pods are missing, or only
    their watch events (and if the benchmark's own watch ended)."""
    async def items(p: str) -> list[dict[str, Any]]:
        async with client.session.get(client.server + p) as r:
            return list((await r.json())["items"])
    pods, objs = await items(f"/api/v1/namespaces/{ns}/pods"), await items(path)
    unstarted = [o["metadata"]["name"] for o in objs if not (o.get("status") or {}).get("runs")]
    return (f"the API server lists {len(pods)} pods and {len(objs)} objects, {len(unstarted)} with no run "
            f"recorded (first: {unstarted[:5]}); the benchmark's pod watch "
            f"{'ended' if watch.done() else 'is still open'}")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def delete_all(client: Client, path: str, limit: float = 120) -> None:
    """Delete every object at ``path`` and wait until none is left (at most ``limit`` seconds)."""
    async with client.session.delete(client.server + path, params={"gracePeriodSeconds": "0"}) as r:
        r.raise_for_status()
    deadline = time.perf_counter() + limit
    while True:
        async with client.session.get(client.server + path) as r:
            if not (await r.json())["items"]:
                return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{path} not emptied")
        await asyncio.sleep(0.1)


async def probe_job(client: Client, ns: str, name: str, template: dict[str, Any]) -> None:
    """A Job whose pod appears once the controller-manager's Job controller works; then ended."""
    seen: dict[str, float] = {}
    ready = asyncio.Event()
    w = asyncio.create_task(client.watch_pods(ns, seen, ready))
    await ready.wait()
    await client.post(f"/apis/batch/v1/namespaces/{ns}/jobs", jobpeer.job(name, template))
    await until(lambda: any(p.startswith(name + "-") for p in seen), 180)
    await stop(w)
    await jobpeer.end_pods(client.session, client.server, ns, [p for p in seen if p.startswith(name + "-")], 1,
                           runner=False)


async def paced(client: Client, n: int, rate: float) -> list[float]:
    """n Flows at `rate`/s: ms from each POST to its pod's ADDED event; then their pods end."""
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
    await stop(watcher)
    await jobpeer.end_pods(client.session, client.server, "bench-paced", list(seen), 4, runner=True)
    return sorted((seen[k] - sent[k]) * 1000 for k in sent)


async def run(target: Target, ctx: ssl.SSLContext, template: dict[str, Any], n: int, rate: float,
              pids: dict[str, int], concurrencies: tuple[int, ...]) -> dict[str, Any]:
    client = Client(target.server, ctx)
    try:
        namespaces = ["bench-paced", "bench-probe"] + [
            f"bench-{k}-{cm}-{c}" for c in concurrencies for cm in ("defaults", "best") for k in ("flow", "job")
        ] + [f"bench-raw-{c}" for c in concurrencies]
        for ns in namespaces:
            await namespace(client, ns)
        node = asyncio.create_task(jobpeer.node(client.session, client.server))
        bench = Bench(client, pids, target, template, n)
        await probe_job(client, "bench-probe", "defaults", template)

        lat = await paced(client, n, rate)
        result: dict[str, Any] = {"flows": n, "rate": rate, "p50_ms": statistics.median(lat),
                                  "p99_ms": lat[min(len(lat) - 1, int(len(lat) * 0.99))], "max_ms": lat[-1],
                                  "bursts": []}
        bursts: list[Burst] = result["bursts"]
        # The controller-manager as the stack starts it (Kubernetes' defaults for the Job controller's
        # limits), then restarted at its best; Flows again beside each, so every ratio is one phase's.
        for cm, kinds in (("defaults", ("flow", "raw", "job")), ("best", ("flow", "job"))):
            if cm == "best":
                pids["kube-controller-manager"] = await asyncio.to_thread(target.restart_controller_manager,
                                                                          jobpeer.CM_BEST)
                await probe_job(client, "bench-probe", "best", template)
            for conc in concurrencies:
                for k in kinds:
                    ns = f"bench-raw-{conc}" if k == "raw" else f"bench-{k}-{cm}-{conc}"
                    kind = {"flow": "Flow", "raw": "pod", "job": "Job"}[k]
                    bursts.append(await burst(bench, ns, kind, cm, conc))
        if node.done():
            node.result()  # its failure, if it failed
        await stop(node)
        return result
    finally:
        await client.session.close()


PLURAL = {"Flow": "Flows", "Job": "Jobs", "pod": "raw pods"}  # how the report names each kind of burst


def fmt_writes(w: Counter[str]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in sorted(w.items(), key=lambda kv: (-kv[1], kv[0])) if v >= 0.005)


def report(r: dict[str, Any]) -> None:
    bursts: list[Burst] = r["bursts"]
    n = r["flows"]
    procs = ("kube-apiserver", "operator", "kube-controller-manager", "kube-scheduler", "etcd")
    short = {"kube-apiserver": "apisrv", "operator": "oper", "kube-controller-manager": "kcm",
             "kube-scheduler": "sched", "etcd": "etcd"}
    print(f"\nBursts of {n} objects, one control plane, one run. Controller-manager 'defaults': "
          f"{' '.join(jobpeer.CM_DEFAULTS)} (Kubernetes' own); 'best': {' '.join(jobpeer.CM_BEST)}.")
    print("CPU in ms per object; writes = the API server's apiserver_request_total (POST/PUT/PATCH/DELETE) "
          "per object, the client's create included, the stand-in kubelet's pod-end write not.")
    head = (f"{'clients':>7} {'what':<9} {'kcm':<8} | {'obj/s':>6} {'writes':>6} "
            + " ".join(f"{short[p]:>6}" for p in procs)
            + f" | {'end/s':>6} {'writes':>6} " + " ".join(f"{short[p]:>6}" for p in procs[:3]))
    print(f"{'':27}| {'apply -> all pods exist, until settled':<48} | pod end -> Succeeded / Complete")
    print(head)
    for b in bursts:
        what = PLURAL[b.kind]
        line = (f"{b.clients:>7} {what:<9} {b.cm:<8} | {b.per_s:>6.1f} {sum(b.writes.values()):>6.2f} "
                + " ".join(f"{b.cpu_ms.get(p, 0):>6.2f}" for p in procs))
        if b.kind != "pod":
            line += (f" | {b.end_per_s:>6.1f} {sum(b.end_writes.values()):>6.2f} "
                     + " ".join(f"{b.end_cpu_ms.get(p, 0):>6.2f}" for p in procs[:3]))
        print(line)

    print("\nflowkube / Job controller, same clients, same controller-manager flags (> 1 for obj/s: flowkube faster; "
          "< 1 for writes and CPU: flowkube cheaper)")
    print(f"{'clients':>7} {'kcm':<8} | {'obj/s':>6} {'writes':>7} {'apisrv':>7} {'ctrl':>7} | "
          f"{'end/s':>6} {'writes':>7} {'apisrv':>7} {'ctrl':>7}   (ctrl: operator per Flow / kcm per Job)")
    for f in (b for b in bursts if b.kind == "Flow"):
        j = next(b for b in bursts if b.kind == "Job" and b.cm == f.cm and b.clients == f.clients)

        def ratio(a: float, b: float) -> str:
            return f"{a / b:>7.2f}" if b else f"{'-':>7}"

        print(f"{f.clients:>7} {f.cm:<8} | {f.per_s / j.per_s:>6.2f} "
              f"{ratio(sum(f.writes.values()), sum(j.writes.values()))} "
              f"{ratio(f.cpu_ms['kube-apiserver'], j.cpu_ms['kube-apiserver'])} "
              f"{ratio(f.cpu_ms['operator'], j.cpu_ms['kube-controller-manager'])} | "
              f"{f.end_per_s / j.end_per_s:>6.2f} {ratio(sum(f.end_writes.values()), sum(j.end_writes.values()))} "
              f"{ratio(f.end_cpu_ms['kube-apiserver'], j.end_cpu_ms['kube-apiserver'])} "
              f"{ratio(f.end_cpu_ms['operator'], j.end_cpu_ms['kube-controller-manager'])}")

    print("\nAPI writes per object, by verb and resource:")
    for b in bursts:
        print(f"  {b.kind:<4} {b.clients:>2} client(s), kcm {b.cm:<8} to pod: {fmt_writes(b.writes)}")
        if b.kind != "pod":
            print(f"  {'':<4} {'':>2}                             end:    {fmt_writes(b.end_writes)}")
    print("\nTimeline of each burst: the client's creates answered / every pod exists (s after the first "
          "create); create answered -> its pod seen, p50 / p99 (ms):")
    for b in bursts:
        what = PLURAL[b.kind]
        print(f"  {b.clients:>2} client(s) {what:<8} kcm {b.cm:<8}: {b.made_s:5.2f} / {b.pods_s:5.2f} s; "
              f"{b.lag_ms[0]:7.1f} / {b.lag_ms[1]:7.1f} ms")
    print("\nAPI Priority and Fairness, apply -> all pods exist: mean queue wait per request (ms) and "
          "requests per object, by flow schema / priority level (the benchmark's own client is exempt):")
    for b in bursts:
        what = PLURAL[b.kind]
        print(f"  {b.clients:>2} client(s) {what:<8} kcm {b.cm:<8}: " + "; ".join(
            f"{k} {ms:.2f} ms x {per:.1f}" for k, (ms, per) in sorted(b.apf_ms.items())))
    print("operator reconciles per Flow (its own count): " + "; ".join(
        f"{b.clients} client(s), kcm {b.cm}: to pod {b.reconciles:.2f}, end {b.end_reconciles:.2f}"
        for b in bursts if b.kind == "Flow"))
    print("operator API connections opened per Flow (TLS handshakes; its own count): " + "; ".join(
        f"{b.clients} client(s), kcm {b.cm}: to pod {b.connections:.3f}, end {b.end_connections:.3f}"
        for b in bursts if b.kind == "Flow"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flows", type=int, default=300)
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--costs-only", action="store_true", help="only the API server's cost of each write")
    parser.add_argument("--kind", metavar="NAME", help="run on the throwaway kind cluster NAME (kindtarget.py)")
    args = parser.parse_args()
    if os.environ.get("KUBECONFIG"):
        print("bench_apply: KUBECONFIG is ignored: this benchmark creates and deletes hundreds of objects, "
              "so it runs only against a throwaway control plane it starts itself or a kind cluster made "
              "for it (--kind)", file=sys.stderr)
    if args.kind:
        on_kind(args)
        return
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-") as tmp:
        # The stack's controller-manager flags, plus Kubernetes' defaults spelt out (the baseline).
        cluster = LocalCluster(Path(tmp), with_node=False, controller_manager_args=jobpeer.CM_DEFAULTS).start()
        op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING"})
        try:
            cluster.kubectl("apply", "--server-side", "-f", str(crd.CRD_FILE))
            cluster.kubectl("wait", "--for=condition=Established", f"crd/{c.PLURAL}.{c.GROUP}", "--timeout=60s")
            pids = dict(cluster.describe()["pids"])
            costs = asyncio.run(write_costs(cluster, args.flows, pids))
            op.start()
            assert op.proc is not None
            pids["operator"] = op.proc.pid
            costs |= asyncio.run(webhook_costs(cluster, args.flows, pids))
            if args.costs_only:
                print_costs(costs)
                return
            template = jobpeer.runner_template(cluster.host_ip, op.state_port, op.ca_file().read_text())
            r = asyncio.run(run(LocalTarget(cluster, op), local_ssl(cluster), template, args.flows, args.rate,
                                pids, tuple(args.concurrency)))
        except BaseException:
            if op.log.exists():  # the temporary directory goes with the cluster: show why now
                print(f"--- the operator's log, last 60 lines:\n{''.join(op.log.read_text().splitlines(True)[-60:])}",
                      file=sys.stderr)
            raise
        finally:
            op.stop()
            cluster.stop()
    print_costs(costs)
    summary(r)


def print_costs(costs: dict[str, float]) -> None:
    print("API server CPU per write, one client, each kind alone until the cluster settles (the webhook's "
          "with the operator running, the rest before it starts):")
    for k, v in costs.items():
        print(f"  {k:<34} {v:6.2f} ms")
    flow = costs["Flow create"] + costs["Flow status, pending"] + costs["Flow status, finished"]
    print(f"  a Flow's create and two status writes: {flow:.2f} ms; without CEL rules "
          f"{sum(v for k, v in costs.items() if k.startswith('Flow (nocel)')):.2f} ms; without a schema "
          f"{sum(v for k, v in costs.items() if k.startswith('Flow (noschema)')):.2f} ms; the webhook's call "
          f"{costs['Flow create, webhook called'] - costs['Flow create, webhook skipped']:+.2f} ms per create")


def on_kind(args: argparse.Namespace) -> None:
    """The same bursts on a kind cluster: the chart's operator (a pod) against kubeadm's controller-manager."""
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-kind-") as tmp:
        target = KindTarget.open(args.kind, Path(tmp))
        target.cordon()
        pids = target.pids()
        print(f"bench_apply on kind cluster {args.kind} ({target.engine}): processes {pids}", file=sys.stderr)
        r = asyncio.run(run(target, target.ctx, target.template(), args.flows, args.rate, pids,
                            tuple(args.concurrency)))
    print(f"On the kind cluster {args.kind}: the operator as the chart runs it (two replicas; 'oper' is the "
          "leader's CPU), kube-controller-manager as kubeadm runs it, restarted with the 'best' flags.")
    summary(r)
    follower = [f"{b.clients} client(s), kcm {b.cm}: {b.cpu_ms.get('operator follower', 0):.2f}"
                for b in r["bursts"] if b.kind == "Flow"]
    print("the follower replica's own CPU per Flow, apply -> pod (ms): " + "; ".join(follower))


def summary(r: dict[str, Any]) -> None:
    print(f"apply -> runner pod created, {r['flows']} Flows at {r['rate']:.0f}/s: "
          f"p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms, max {r['max_ms']:.1f} ms")
    for f in (b for b in r["bursts"] if b.kind == "Flow" and b.cm == "defaults"):
        raw = next(b for b in r["bursts"] if b.kind == "pod" and b.clients == f.clients)
        print(f"burst of {r['flows']}, {f.clients} client(s): operator {f.per_s:.1f} Flows/s -> pods; "
              f"plain client {raw.per_s:.1f} pods/s; ratio {f.per_s / raw.per_s:.0%}")
    report(r)


if __name__ == "__main__":
    main()
