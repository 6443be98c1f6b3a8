"""Benchmark: operator memory, /metrics render time and series, and the Lease, at scale. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_scale [--steps 1000,10000] [--template-flows 5000]
        [--template-kib 250] [--secrets 100] [--secrets-per-namespace 50] [--restart | --no-restart]
        [--renew-deadline S]

Issue 37's goal: operator RSS <= 300 MB with 10,000 Flows of which 5,000 name one FlowTemplate near
the 256 KiB bound, and no growth from labelled Secrets beyond their bounded keys.

- Plain Flows carry usage for two models and three runs in their status, the way finished Flows look,
  written by this script with the operator's own ServiceAccount token (the chart's status policy lets
  no one else write those fields). Flows of the template (spec.templateRef only) get no status from
  this script: the operator takes the template (status.template names its snapshot) and the script
  waits, with a deadline, until every one of them has. All Flows are suspended: no node runs, no pod
  is made (a suspended Flow of a template takes it all the same: the take comes before the suspend).
- The template spreads its bytes over the fields that may hold them: env and tolerations (64 KiB each
  at most, `limits.POD_FIELD_LIMIT`), inputs and definition (together within a runner's environment
  variable, `limits.SPEC_ENV_LIMIT`).
- Each step fills the plain Flows, measures, fills the template Flows, measures: the RSS per Flow of
  each kind is the difference between the two. Then, with `--secrets N`, N Secrets labelled
  `flowkube.io/notifications` near 1 MiB (a `url` key and a big unused one), in namespaces of
  `--secrets-per-namespace`.
- Figures: the operator's RSS (VmRSS) and peak (VmHWM) from /proc, /metrics' time over 10 scrapes
  (p50/max) and its series, the longest gap between two renewals of the Lease by one holder during the
  phase (leader election is on, as the chart sets it; OperatorProcess leaves it off unless told), and,
  after each step, the same for a restarted operator (a fresh process lists everything: the peak that
  matters after an upgrade or a drain).
- The peer: the bytes of the Flow list the API server answers (the old design kept every Flow whole,
  and each template Flow a copy of its template), and the template's size times its Flows.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import datetime as dt
import itertools
import json
import ssl
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from flowkube_api import constants as c
from flowkube_api import limits
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import SYSTEM_NAMESPACE, OperatorProcess
from tests.benchmarks.bench_apply import Client, local_ssl

NS = "scale"
TEMPLATE = "big"
LEASE = "flowkube-operator"  # the chart's name for release "flowkube" (flowkube.leaseName)
BENCH_LABEL = "bench.flowkube.io/kind"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"


def usage(n: int) -> dict[str, Any]:
    one = {"totalTokens": 150 + n, "promptTokens": 100 + n, "completionTokens": 50, "cachedPromptTokens": 10,
           "reasoningTokens": 0, "cacheCreationTokens": 0, "successfulRequests": 3}
    return {**{k: v * 2 for k, v in one.items()}, "byModel": {"gpt-4o-mini": one, "claude-sonnet": one}}


def _filler(i: int, n: int) -> str:
    return (f"{i:06d}" * (n // 6 + 1))[:n]


def template_spec(kib: int) -> dict[str, Any]:
    """A FlowTemplate's spec of about `kib` KiB as JSON: a quarter in env, a quarter in tolerations,
    the rest in inputs and the definition, each under its bound."""
    total = kib * 1024
    pod_part = limits.POD_FIELD_LIMIT - 1024
    env = [{"name": f"BENCH_VAR_{i:03d}", "value": _filler(i, 960)} for i in range(pod_part // 1000)]
    tolerations = [{"key": f"bench.example.com/taint-{i:04d}-{_filler(i, 24)}", "operator": "Equal",
                    "value": _filler(i, 60), "effect": "NoSchedule"} for i in range(pod_part // 180)]
    rest = total - 2 * pod_part - 2048
    inputs = {f"input{i:03d}": _filler(i, 1000) for i in range(rest // 2 // 1020)}
    agent: dict[str, Any] = {"role": "Reporter", "goal": "Report briefly", "backstory": _filler(7, rest // 2 - 600),
                             "settings": {"llm": "gpt-4o-mini"}, "input": "Write about ${state.topic}."}
    definition = {"schema": "crewai.flow/v1", "name": "Big", "state": {"type": "dict", "default": {"topic": ""}},
                  "methods": {"write": {"start": True, "do": {"call": "agent", "with": agent}}}}
    spec: dict[str, Any] = {"template": {"definition": definition, "inputs": inputs, "env": env,
                                         "podTemplate": {"tolerations": tolerations}}}
    agent["backstory"] += _filler(8, total - json_size(spec))
    if (problem := limits.template_problem(spec) or limits.spec_problem(spec["template"])) is not None:
        raise ValueError(f"the bench's template is over a bound: {problem}")
    return spec


def json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode())


def proc_status(pid: int) -> tuple[float, float]:
    """VmRSS and VmHWM in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


class LeaseWatch:
    """Polls the Lease twice a second and keeps every renewal seen: (holder, renewTime)."""

    def __init__(self, cluster: LocalCluster) -> None:
        self.url = f"{cluster.server}/apis/coordination.k8s.io/v1/namespaces/{SYSTEM_NAMESPACE}/leases/{LEASE}"
        self.ctx = local_ssl(cluster)
        self.renewals: list[tuple[str, dt.datetime]] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stopping.wait(0.5):
            try:
                with urllib.request.urlopen(self.url, context=self.ctx, timeout=5) as r:
                    spec = json.loads(r.read())["spec"]
            except OSError:
                continue
            seen = (spec.get("holderIdentity", ""), dt.datetime.fromisoformat(spec["renewTime"]))
            if not self.renewals or self.renewals[-1] != seen:
                self.renewals.append(seen)

    def longest_gap(self, since: dt.datetime) -> float | None:
        """Longest time between two renewals by one holder after `since` (s); None before any."""
        seen = [r for r in self.renewals if r[1] >= since]
        gaps = [(b[1] - a[1]).total_seconds() for a, b in itertools.pairwise(seen) if a[0] == b[0]]
        return max(gaps) if gaps else None

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join()


class Bench:
    def __init__(self, cluster: LocalCluster, op: OperatorProcess, lease: LeaseWatch) -> None:
        self.cluster = cluster
        self.op = op
        self.lease = lease
        self.plain = 0
        self.templated = 0
        self.marks: dict[str, tuple[float, int, int]] = {}  # phase -> (rss, plain, templated)
        self.last = (0.0, 0.0)
        self.taken_last = 0  # the operator's (VmRSS, VmHWM) at the last check: what it had if it exits

    # -- the API server ------------------------------------------------------------------------

    def _api(self, path: str) -> bytes:
        with urllib.request.urlopen(self.cluster.server + path, context=local_ssl(self.cluster), timeout=300) as r:
            body: bytes = r.read()
            return body

    def taken(self) -> int:
        self.alive()
        body = json.loads(self._api(f"{FLOWS}?labelSelector={BENCH_LABEL}%3Dtemplate"))
        self.taken_last = sum(1 for f in body["items"]
                              if ((f.get("status") or {}).get("template") or {}).get("snapshot"))
        return sum(1 for f in body["items"] if ((f.get("status") or {}).get("template") or {}).get("snapshot"))

    async def _session(self) -> tuple[Client, aiohttp.ClientSession]:
        kubeconfig = yaml.safe_load((self.cluster.root / "operator.kubeconfig").read_text())
        token = kubeconfig["users"][0]["user"]["token"]
        # Only the token: with the admin's client certificate the API server would see the admin.
        ctx = ssl.create_default_context(cafile=str(self.cluster.pki_dir / "ca.crt"))
        operator = aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"},
                                         connector=aiohttp.TCPConnector(ssl=ctx, limit=32))
        return Client.of(self.cluster), operator

    async def _create(self, lo: int, hi: int, templated: bool) -> None:
        client, operator = await self._session()

        async def one(i: int) -> None:
            name = f"{'t' if templated else 'f'}{i:05d}"
            spec: dict[str, Any] = ({"templateRef": {"name": TEMPLATE}} if templated
                                    else {"flowRef": "bench.flows:Research"})
            await client.post(FLOWS, {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                      "metadata": {"name": name, "labels": {
                                          BENCH_LABEL: "template" if templated else "plain"}},
                                      "spec": {**spec, "suspend": True}})
            if templated:
                return
            status = {"status": {"phase": "Succeeded", "startedAt": "2026-11-22T00:00:00Z",
                                 "finishedAt": "2026-11-22T00:01:00Z", "usage": usage(i),
                                 "runs": [{"pod": f"{name}-{k}", "trigger": t, "result": r, "usage": usage(i)}
                                          for k, (t, r) in enumerate([("kickoff", "Failed"), ("retry", "Paused"),
                                                                      ("resume", "Succeeded")])]}}
            async with operator.patch(client.server + f"{FLOWS}/{name}/status", json=status,
                                      headers={"Content-Type": "application/merge-patch+json"}) as r:
                if r.status >= 300:
                    raise RuntimeError(await r.text())

        queue = list(range(lo, hi))

        async def worker() -> None:
            while queue:
                await one(queue.pop())

        try:
            await asyncio.gather(*(worker() for _ in range(16)))
        finally:
            await client.session.close()
            await operator.close()

    async def _secrets(self, lo: int, hi: int, per_namespace: int, blob: bytes) -> None:
        client = Client.of(self.cluster)
        try:
            for ns in sorted({f"secrets-{i // per_namespace}" for i in range(lo, hi)}):
                async with client.session.get(f"{client.server}/api/v1/namespaces/{ns}") as r:
                    exists = r.status == 200
                if not exists:
                    await client.post("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                             "metadata": {"name": ns}})
            queue = list(range(lo, hi))
            data = {"url": base64.b64encode(b"https://hooks.example.com/flowkube").decode(),
                    "unused": base64.b64encode(blob).decode()}

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    await client.post(f"/api/v1/namespaces/secrets-{i // per_namespace}/secrets", {
                        "apiVersion": "v1", "kind": "Secret", "type": "Opaque", "data": data,
                        "metadata": {"name": f"hook-{i:04d}", "labels": {c.LABEL_NOTIFICATIONS: "bench"}}})

            await asyncio.gather(*(worker() for _ in range(4)))
        finally:
            await client.session.close()

    # -- the operator --------------------------------------------------------------------------

    def alive(self) -> None:
        """Raise, with the tail of its log, when the operator has exited (it gives up leading, and
        exits, when it could not renew the Lease for the renew deadline)."""
        assert self.op.proc is not None
        if self.op.proc.poll() is not None:
            raise RuntimeError(f"the operator exited with {self.op.proc.returncode} (RSS {self.last[0]:.0f} MB, peak "
                               f"{self.last[1]:.0f} MB at the last check; Lease gap since the start "
                               f"{self.lease.longest_gap(dt.datetime.min.replace(tzinfo=dt.UTC))} s, "
                               f"{self.plain} plain Flows and {self.templated} of the template asked for, "
                               f"{self.taken_last} taken):\n{self.op.log.read_text()[-4000:]}")
        self.last = proc_status(self.op.proc.pid)

    def flows_seen(self) -> int:
        self.alive()
        total = 0
        for line in self.op.metrics().splitlines():
            if line.startswith(f'flowkube_flows{{namespace="{NS}"'):
                total += int(float(line.rsplit(" ", 1)[1]))
        return total

    def synced(self) -> bool:
        lines = [ln for ln in self.op.metrics().splitlines() if ln.startswith("flowkube_operator_cache_synced{")]
        return bool(lines) and all(ln.rsplit(" ", 1)[1] in ("1", "1.0") for ln in lines)

    def settle(self, timeout: float = 120) -> None:
        """Until RSS holds still (within 1 MB over 5 s): what a watch event still in flight would add."""
        assert self.op.proc is not None
        deadline = time.monotonic() + timeout
        last = proc_status(self.op.proc.pid)[0]
        while time.monotonic() < deadline:
            time.sleep(5)
            now = proc_status(self.op.proc.pid)[0]
            if abs(now - last) < 1:
                return
            last = now

    def report(self, what: str, since: dt.datetime) -> float:
        assert self.op.proc is not None
        times = []
        for _ in range(10):
            t0 = time.perf_counter()
            with urllib.request.urlopen(f"http://{self.op.metrics_target}/metrics", timeout=60) as r:
                body = r.read()
            times.append((time.perf_counter() - t0) * 1000)
        ms = sorted(times)
        series = sum(1 for ln in body.decode().splitlines() if ln and not ln.startswith("#"))
        rss, hwm = proc_status(self.op.proc.pid)
        gap = self.lease.longest_gap(since)
        print(f"  {what:<44} RSS {rss:5.0f} MB  peak {hwm:5.0f} MB  /metrics p50 {statistics.median(ms):4.0f} ms "
              f"max {ms[-1]:4.0f} ms, {series} series, {len(body) / 1e6:.2f} MB  Lease gap "
              f"{'-' if gap is None else f'{gap:.1f} s'}", flush=True)
        return rss

    def fill(self, plain: int, templated: int, deadline: float) -> None:
        since = dt.datetime.now(dt.UTC)
        t0 = time.perf_counter()
        asyncio.run(self._create(self.plain, plain, False))
        self.plain = max(self.plain, plain)
        wait_for(lambda: self.flows_seen() >= self.plain + self.templated, deadline, "the operator to see the Flows",
                 interval=2)
        self.settle()
        rss = self.report(f"{self.plain + self.templated} Flows, {self.templated} of the template "
                          f"(+{plain} plain in {time.perf_counter() - t0:.0f} s)", since)
        self.marks["plain"] = (rss, self.plain, self.templated)
        since = dt.datetime.now(dt.UTC)
        t0 = time.perf_counter()
        asyncio.run(self._create(self.templated, templated, True))
        self.templated = max(self.templated, templated)
        wait_for(lambda: self.taken() >= self.templated, deadline, f"{self.templated} Flows to take the template",
                 interval=5)
        self.settle()
        rss2 = self.report(f"{self.plain + self.templated} Flows, {self.templated} of the template "
                           f"(taken in {time.perf_counter() - t0:.0f} s)", since)
        self.marks["templated"] = (rss2, self.plain, self.templated)

    def restart(self, deadline: float) -> None:
        self.op.stop()
        since = dt.datetime.now(dt.UTC)
        t0 = time.perf_counter()
        self.op.start(timeout=deadline)
        wait_for(lambda: self.synced() and self.flows_seen() >= self.plain + self.templated, deadline,
                 "the restarted operator to list everything", interval=1)
        self.settle()
        self.report(f"restarted (listed in {time.perf_counter() - t0:.0f} s)", since)

    def peer(self, template_bytes: int) -> None:
        t0 = time.perf_counter()
        size = len(self._api(FLOWS))
        revisions = json.loads(self._api(f"/apis/apps/v1/namespaces/{NS}/controllerrevisions"))["items"]
        n = self.plain + self.templated
        print(f"  peer: the API server's Flow list is {size / 1e6:.1f} MB ({size / max(n, 1):.0f} B per Flow, "
              f"read in {time.perf_counter() - t0:.1f} s), {len(revisions)} template snapshot(s); the old design "
              f"kept a copy per template Flow: {self.templated} x {template_bytes / 1024:.0f} KiB = "
              f"{self.templated * template_bytes / 1e6:.0f} MB more", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", default="1000,10000")
    parser.add_argument("--template-flows", type=int, default=5000, help="Flows of the template at the last step "
                        "(earlier steps in proportion)")
    parser.add_argument("--template-kib", type=int, default=250)
    parser.add_argument("--secrets", type=int, default=100)
    parser.add_argument("--secrets-per-namespace", type=int, default=50)
    parser.add_argument("--secret-kib", type=int, default=1000)
    parser.add_argument("--restart", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--deadline", type=float, default=3600, help="seconds to wait for each phase")
    parser.add_argument("--renew-deadline", type=float, default=None,
                        help="the operator's Lease renew deadline (default the chart's 7 s; the lease duration is "
                        "3 s more): longer, the run goes on through a gap that would restart the operator, and the "
                        "gap is still reported")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    spec = template_spec(args.template_kib)
    template_bytes = json_size(spec)
    with tempfile.TemporaryDirectory(prefix="flowkube-scale-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        timing = {} if args.renew_deadline is None else {
            "FLOWKUBE_LEADER_ELECTION_RENEW_DEADLINE_SECONDS": str(args.renew_deadline),
            "FLOWKUBE_LEADER_ELECTION_LEASE_DURATION_SECONDS": str(args.renew_deadline + 3)}
        op = OperatorProcess(cluster, env={**timing, "FLOWKUBE_LOG_LEVEL": "WARNING",
                                           "FLOWKUBE_LEADER_ELECTION": "true",
                                           "FLOWKUBE_LEADER_ELECTION_NAMESPACE": SYSTEM_NAMESPACE,
                                           "FLOWKUBE_LEADER_ELECTION_LEASE": LEASE,
                                           # The template tolerates taints: an admin's runner policy allows them.
                                           "FLOWKUBE_RUNNER_TOLERATION_KEYS": "*"})
        lease: LeaseWatch | None = None
        try:
            op.start(timeout=min(args.deadline, 600))
            assert op.proc is not None
            lease = LeaseWatch(cluster)
            cluster.kubectl("create", "namespace", NS)
            cluster.kubectl("create", "-n", NS, "-f", "-", input=json.dumps({
                "apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate", "metadata": {"name": TEMPLATE},
                "spec": spec}))
            bench = Bench(cluster, op, lease)
            wait_for(lambda: lease is not None and bool(lease.renewals), 60, "the Lease held")
            bench.report(f"idle (template of {template_bytes} B as JSON)", dt.datetime.now(dt.UTC))
            for n in steps:
                templated = round(n * args.template_flows / max(steps))
                print(f"step {n}: {n - templated} plain Flows, {templated} of the template", flush=True)
                before = bench.marks.get("templated", (proc_status(op.proc.pid)[0], 0, 0))
                bench.fill(n - templated, templated, args.deadline)
                (r0, p0, t0), (r1, p1, _), (r2, _, t2) = before, bench.marks["plain"], bench.marks["templated"]
                if p1 > p0 and t2 > t0:
                    print(f"  per plain Flow {(r1 - r0) * 1e3 / (p1 - p0):.1f} kB, per template Flow "
                          f"{(r2 - r1) * 1e3 / (t2 - t0):.1f} kB (RSS differences over this step)", flush=True)
                bench.peer(template_bytes)
                if args.restart:
                    bench.restart(args.deadline)
            if args.secrets:
                since = dt.datetime.now(dt.UTC)
                t0f = time.perf_counter()
                asyncio.run(bench._secrets(0, args.secrets, args.secrets_per_namespace,
                                           b"x" * (args.secret_kib * 1024)))
                bench.settle()
                bench.report(f"+{args.secrets} labelled Secrets of {args.secret_kib} KiB "
                             f"(in {time.perf_counter() - t0f:.0f} s)", since)
                if args.restart:
                    bench.restart(args.deadline)
        finally:
            if lease is not None:
                lease.stop()
            op.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
