"""What `bench_apply` needs to set flowkube beside Kubernetes' own Job controller (issue 13).

- The peer: a Job (batch/v1, one pod) whose pod template is a runner pod's, built by the operator's
  own `resources.runner_pod`, so both controllers create the same pod.
- The controller-manager's flags: Kubernetes' defaults, and the raised ones the peer runs "at its
  best" with (`CM_BEST`).
- The API server's own count of writes (`apiserver_request_total` from its `/metrics`, by verb and
  resource) and each process's CPU time (/proc), read before and after a phase.
- `settle`: waits until a phase's consequences are written (no write, the processes idle).
- A stand-in node and kubelet (no node runs): a Node object whose Lease is renewed (`node`), so the
  scheduler binds each pod once instead of retrying it as unschedulable (which costs the API server a
  varying number of Event writes); and `end_pods`, which marks pods Succeeded, exit code 0, with a
  runner's termination message for runner pods, so both controllers finish their objects.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import aiohttp

from flowkube_api import constants as c
from flowkube_api.models import FlowSpec
from flowkube_api.report import RunReport
from flowkube_operator.flows import resources
from flowkube_operator.settings import Settings

Body = dict[str, Any]

# Kubernetes' defaults for the flags that bound the Job controller, and the raised values the peer
# also runs with: client-side rate limits far above what two cores can serve, 10x the workers.
CM_DEFAULTS = ("--kube-api-qps=20", "--kube-api-burst=30", "--concurrent-job-syncs=5")
CM_BEST = ("--kube-api-qps=1000", "--kube-api-burst=2000", "--concurrent-job-syncs=50")

WRITE_VERBS = frozenset({"POST", "PUT", "PATCH", "DELETE", "DELETECOLLECTION", "APPLY"})
# The API server renews its own identity lease every 10 s and the stand-in node its Lease, whatever
# the benchmark does.
BACKGROUND = frozenset({"PUT leases.coordination.k8s.io", "PATCH leases.coordination.k8s.io"})
NODE = "bench-node"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """utime + stime of each process, from /proc (Linux)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for name, pid in pids.items():
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        out[name] = (int(fields[11]) + int(fields[12])) / tick
    return out


def write_key(labels: dict[str, str]) -> str:
    """`PATCH flows.flowkube.io/status`, kubectl's spelling; a refused write gets its code: `POST pods [409]`."""
    res = labels.get("resource", "?") + (f".{labels['group']}" if labels.get("group") else "")
    if labels.get("subresource"):
        res += "/" + labels["subresource"]
    code = labels.get("code", "")
    return f"{labels.get('verb')} {res}" + ("" if code.startswith("2") else f" [{code}]")


async def scrape(session: aiohttp.ClientSession, server: str) -> str:
    """The API server's /metrics text."""
    async with session.get(server + "/metrics") as r:
        r.raise_for_status()
        return await r.text()


def series(text: str, name: str) -> Iterator[tuple[dict[str, str], float]]:
    """(labels, value) of each sample of the metric `name` in a /metrics text."""
    prefix = name + "{"
    for line in text.splitlines():
        if line.startswith(prefix):
            labels_text, value = line[len(prefix):].rsplit("} ", 1)
            yield dict(_LABEL.findall(labels_text)), float(value)


async def api_writes(session: aiohttp.ClientSession, server: str) -> Counter[str]:
    """Writes the API server has served since it started, by verb and resource (its own count)."""
    out: Counter[str] = Counter()
    for labels, value in series(await scrape(session, server), "apiserver_request_total"):
        if labels.get("verb") in WRITE_VERBS:
            out[write_key(labels)] += int(value)
    return out


async def apf_waits(session: aiohttp.ClientSession, server: str) -> dict[str, tuple[float, float]]:
    """Seconds requests have waited in API Priority and Fairness queues, and how many requests, by
    "flow schema / priority level" (the API server's own count)."""
    text = await scrape(session, server)
    totals: list[defaultdict[str, float]] = [defaultdict(float), defaultdict(float)]
    for total, suffix in zip(totals, ("_sum", "_count"), strict=True):
        for labels, value in series(text, "apiserver_flowcontrol_request_wait_duration_seconds" + suffix):
            if labels.get("execute") == "true":
                total[f"{labels.get('flow_schema')} / {labels.get('priority_level')}"] += value
    waited, requests = totals
    return {k: (waited[k], requests[k]) for k in requests}


def diff(after: Counter[str], before: Counter[str]) -> Counter[str]:
    return Counter({k: v for k in after if k not in BACKGROUND and (v := after[k] - before[k]) > 0})


async def settle(session: aiohttp.ClientSession, server: str, pids: dict[str, int], *,
                 interval: float = 0.5, idle_cores: float = 0.2, limit: float = 180.0) -> Counter[str]:
    """Wait until nothing is being written (leases aside) and the processes in `pids` use less
    than `idle_cores` between two looks `interval` apart; return the write count then. Each look
    costs the API server a /metrics render (a few ms)."""
    deadline = time.monotonic() + limit
    writes, cpu = await api_writes(session, server), sum(cpu_seconds(pids).values())
    while True:
        await asyncio.sleep(interval)  # the polling period of the condition below
        writes2, cpu2 = await api_writes(session, server), sum(cpu_seconds(pids).values())
        if not diff(writes2, writes) and cpu2 - cpu < idle_cores * interval:
            return writes2
        if time.monotonic() > deadline:
            still = dict(diff(writes2, writes))
            raise TimeoutError(f"the cluster did not settle in {limit:.0f}s: still writing {still}")
        writes, cpu = writes2, cpu2


async def watch(session: aiohttp.ClientSession, url: str, done: Callable[[str, Body], bool],
                seen: dict[str, float], ready: asyncio.Event) -> None:
    """Record when each object at `url` first satisfies done(event type, object) (a listed object
    counts as ADDED). List, then watch from the list's resourceVersion; when the watch ends, watch
    again from the last one seen, and list again after a 410. The API server closes a watcher that
    falls behind ("Forcing ... watcher close due to unresponsiveness" in its log): on a saturated
    machine this benchmark's own watch is one, and must not lose the rest of a burst."""
    sep = "&" if "?" in url else "?"
    rv = ""
    while True:
        if not rv:
            async with session.get(url) as r:
                r.raise_for_status()
                listed = await r.json()
            for obj in listed["items"]:
                if done("ADDED", obj):
                    seen.setdefault(obj["metadata"]["name"], time.perf_counter())
            rv = listed["metadata"]["resourceVersion"]
        async with session.get(f"{url}{sep}watch=1&allowWatchBookmarks=true&resourceVersion={rv}",
                               timeout=aiohttp.ClientTimeout(total=None)) as r:
            if r.status == 410:
                rv = ""
                continue
            r.raise_for_status()
            ready.set()
            async for line in r.content:
                ev = json.loads(line)
                if ev["type"] == "ERROR":  # 410 Gone inside the stream: too old to resume
                    rv = ""
                    break
                rv = ev["object"]["metadata"]["resourceVersion"]
                if ev["type"] != "BOOKMARK" and done(ev["type"], ev["object"]):
                    seen.setdefault(ev["object"]["metadata"]["name"], time.perf_counter())


def flow_succeeded(_: str, obj: Body) -> bool:
    return bool((obj.get("status") or {}).get("phase") == "Succeeded")


def job_complete(_: str, obj: Body) -> bool:
    conds = (obj.get("status") or {}).get("conditions") or []
    return any(x.get("type") == "Complete" and x.get("status") == "True" for x in conds)


def runner_template(host_ip: str, state_port: int, state_ca: str) -> Body:
    """A Job's pod template: the runner pod the operator (as `OperatorProcess` sets it up) would make,
    minus what ties it to a Flow (owner, flowkube labels: the operator must not see these pods)."""
    settings = Settings(runner_image="flowkube-runner:local", runner_command=[sys.executable, "-m", "flowkube_runner"],
                        webhook_host=host_ip, state_port=state_port)
    flow = {"apiVersion": c.API_VERSION, "kind": c.KIND, "spec": {"flowRef": "bench.flows:Noop"},
            "metadata": {"name": "bench", "namespace": "bench", "uid": "-"}}
    pod = resources.runner_pod(flow, FlowSpec.model_validate(flow["spec"]), index=0, trigger=c.Trigger.KICKOFF,
                               settings=settings, state_ca=state_ca)
    return {"metadata": {"labels": {"app.kubernetes.io/name": "bench-job"}}, "spec": pod["spec"]}


def job(name: str, template: Body) -> Body:
    # A Flow is not retried unless spec.retries says so: backoffLimit 0 is the same promise.
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name},
            "spec": {"completions": 1, "parallelism": 1, "backoffLimit": 0, "template": template}}


def _now(micro: bool = False) -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ" if micro else "%Y-%m-%dT%H:%M:%SZ")


async def _send(session: aiohttp.ClientSession, method: str, url: str, body: Body,
                content_type: str = "application/json") -> None:
    async with session.request(method, url, json=body, headers={"Content-Type": content_type}) as r:
        if r.status >= 300:
            raise RuntimeError(f"{method} {url}: {r.status} {await r.text()}")


async def node(session: aiohttp.ClientSession, server: str) -> None:
    """Register the stand-in node, Ready and roomy, and renew its Lease every 10 s as a kubelet would
    (the node lifecycle controller would taint it otherwise) until cancelled."""
    room = {"cpu": "1000", "memory": "4Ti", "pods": "10000"}
    now = _now()
    await _send(session, "POST", f"{server}/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": NODE, "labels": {"kubernetes.io/hostname": NODE, "kubernetes.io/os": "linux"}}})
    await _send(session, "PATCH", f"{server}/api/v1/nodes/{NODE}/status", {"status": {
        "capacity": room, "allocatable": room,
        "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "stand-in",
                        "lastHeartbeatTime": now, "lastTransitionTime": now}]}}, "application/merge-patch+json")
    leases = f"{server}/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases"
    await _send(session, "POST", leases, {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                                          "metadata": {"name": NODE},
                                          "spec": {"holderIdentity": NODE, "leaseDurationSeconds": 40,
                                                   "renewTime": _now(micro=True)}})
    while True:
        await asyncio.sleep(10)  # the kubelet's renew interval
        await _send(session, "PATCH", f"{leases}/{NODE}", {"spec": {"renewTime": _now(micro=True)}},
                    "application/merge-patch+json")


def ended(pod: str, flow: str | None) -> Body:
    """The pod status a kubelet writes when the container exits 0; a runner's carries its report."""
    now = _now()
    term: Body = {"exitCode": 0, "reason": "Completed", "startedAt": now, "finishedAt": now}
    if flow is not None:
        term["message"] = RunReport(pod=pod, flow=flow, trigger=c.Trigger.KICKOFF, result=c.RunResult.SUCCEEDED,
                                    reason=c.Reason.RUN_SUCCEEDED, exit_code=0).termination_summary()
    return {"status": {"phase": "Succeeded", "containerStatuses": [{
        "name": "runner", "image": "flowkube-runner:local", "imageID": "", "ready": False, "restartCount": 0,
        "started": False, "state": {"terminated": term}}]}}


async def end_pods(session: aiohttp.ClientSession, server: str, ns: str, pods: Iterable[str],
                   concurrency: int, runner: bool) -> int:
    """Mark pods Succeeded as their kubelet would (one status write each); returns how many."""
    queue = list(pods)
    count = len(queue)

    async def worker() -> None:
        while queue:
            name = queue.pop()
            flow = name.rsplit("-", 1)[0] if runner else None
            async with session.patch(f"{server}/api/v1/namespaces/{ns}/pods/{name}/status", json=ended(name, flow),
                                     headers={"Content-Type": "application/merge-patch+json"}) as r:
                if r.status >= 300:
                    raise RuntimeError(f"status of pod {ns}/{name}: {r.status} {await r.text()}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return count
