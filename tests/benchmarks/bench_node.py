"""Benchmark: the local stack on its real node. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_node [--flows 20]

- start of a local cluster (control plane and node, caches warm) and `helm install --wait` of the chart;
- Flow applied -> its runner's first LLM call received by the model, for a single-method inline Flow
  with the real runner (crewAI) on the real node (apply -> pod is tens of milliseconds: `bench_apply`),
  next to the crewAI import floor measured in the same run, in the same runner image, on the same
  node: a bare pod, created -> `import crewai.flow.flow` done;
- the memory of the whole stack (every process of the cluster, its containers included) while
  ``--flows`` Flows run at once, from /proc and the node's cgroups.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import time
from pathlib import Path

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.kubenode import CGROUP_FS
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.integration.conftest import terminated_states, watched_pods

NS = "bench-node"
RUNNER_CPU = "20m"
MODEL = "gpt-4o-mini"
AGENT = {"role": "Writer", "goal": "Write", "backstory": "A writer.", "settings": {"llm": MODEL}}


def flow(name: str) -> str:
    """A one-method inline Flow whose first LLM call names the Flow."""
    definition = {"schema": "crewai.flow/v1", "name": "Once", "methods": {
        "write": {"start": True, "do": {"call": "agent", "with": {**AGENT, "input": f"flow {name} writes"}}}}}
    return json.dumps({"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                       "spec": {"definition": definition}})


def stack_rss_mb(cluster: LocalCluster) -> float:
    """Resident memory of the cluster's processes (control plane, node) and of its containers."""
    rss = 0
    for proc in cluster.procs.values():
        try:
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
        except OSError:
            continue
    assert cluster.node is not None
    pods = CGROUP_FS / "memory" / cluster.node.cgroup_name / "kubepods"
    # The pods' cgroup counts their processes' memory and page cache; rss alone is what they hold.
    for line in (pods / "memory.stat").read_text().splitlines():
        key, value = line.split()
        if key == "total_rss":
            rss += int(value)
    return rss / 1e6


def import_floor(cluster: LocalCluster) -> float:
    """Seconds from a bare pod's creation to `import crewai.flow.flow` done, in the runner image."""
    assert cluster.images is not None
    script = ("import time, crewai.flow.flow; open('/dev/termination-log', 'w').write(repr(time.time()))")
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "floor", "labels": {"bench": "floor"}},
           "spec": {"restartPolicy": "Never", "containers": [{
               "name": "c", "image": cluster.images.runner, "imagePullPolicy": "Never",
               "command": ["python", "-c", script], "env": [{"name": "HOME", "value": "/tmp"}]}]}}
    with watched_pods(cluster, NS, "-l", "bench=floor") as watch:
        cluster.kubectl("apply", "-n", NS, "-f", "-", input=json.dumps(pod))
        created = time.time()
        watch.wait(lambda pods: bool(terminated_states(pods)), 300, "the import floor pod to finish")
        done = float(terminated_states(watch.seen)[-1]["message"])
    return done - created


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--flows", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-node-") as tmp:
        t0 = time.monotonic()
        cluster = LocalCluster(Path(tmp)).start()
        started = time.monotonic() - t0
        try:
            # The burst's calls are held until every Flow is in one, so all N runners are alive at once.
            rules = Rules.from_json({"default": "ok", "rules": [{"contains": "burst", "hold": True}]})
            with StubModel(rules, host=cluster.host_ip) as stub:
                url = cluster.host_service("stub-model", "flowkube-dev", stub.port)
                # The chart requests 100m CPU per runner: twenty do not fit on this 2-core node beside the
                # operator (the scheduler leaves the last Pending). A runner waiting on its model needs little.
                op = ChartOperator(cluster, runner_env={"OPENAI_BASE_URL": f"{url}/v1", "OPENAI_API_KEY": "stub"},
                                   values=[f"runner.resources.requests.cpu={RUNNER_CPU}"])
                t0 = time.monotonic()
                op.start()
                installed = time.monotonic() - t0
                cluster.kubectl("create", "namespace", NS)
                wait_for(lambda: cluster.kubectl("get", "sa", "default", "-n", NS, check=False).returncode == 0, 30,
                         "the namespace's ServiceAccount")
                floor = import_floor(cluster)
                idle = stack_rss_mb(cluster)
                applied = {"solo": time.time()}
                cluster.kubectl("apply", "-n", NS, "-f", "-", input=flow("solo"))
                wait_for(lambda: len(stub.ledger()) == 1, 300, "the solo Flow's first call")
                for i in range(args.flows):
                    applied[f"burst{i}"] = time.time()
                    cluster.kubectl("apply", "-n", NS, "-f", "-", input=flow(f"burst{i}"))
                wait_for(lambda: stub.held >= args.flows, 600, f"{args.flows} runners in their first call",
                         interval=0.5)
                peak = stack_rss_mb(cluster)
                stub.release_held()
                wait_for(lambda: len(stub.ledger()) > args.flows, 120, "every call answered")
                first: dict[str, float] = {}
                for e in stub.ledger():
                    if found := re.search(r"flow (\S+) writes", e["lastUser"]):
                        first.setdefault(found.group(1), e["received"])
                solo = first["solo"] - applied["solo"]
                starts = sorted(first[n] - applied[n] for n in applied if n != "solo")
        finally:
            cluster.stop()
    print(f"local cluster start (control plane and real node, caches warm): {started:.1f} s; "
          f"helm install --wait of the chart: {installed:.1f} s")
    print(f"bare pod created -> `import crewai.flow.flow` done (the floor): {floor:.2f} s")
    print(f"Flow applied -> its runner's first LLM call received: alone {solo:.2f} s ({solo / floor:.2f}x the "
          f"floor); {args.flows} Flows at once: p50 {statistics.median(starts):.2f} s, max {starts[-1]:.2f} s")
    print(f"(runner pods request {RUNNER_CPU} CPU here, so {args.flows} fit on the node's 2 cores)")
    print(f"memory of the stack: idle {idle:.0f} MB, with {args.flows} runners in a call {peak:.0f} MB "
          f"({(peak - idle) / args.flows:.0f} MB per runner)")



if __name__ == "__main__":
    main()
