"""Benchmark: a one-call inline Flow, cold, from `kubectl apply` to `Succeeded`, beside a pod that only
imports crewAI and exits. Prints figures and the ratio.

    .venv/bin/python -m tests.benchmarks.bench_cold [--runs 5]

The operator from its chart, runner pods from the runner image on the local stack's real node
(kubelet, containerd), the stub model. Each round, one after the other, never at once:

- the floor: a pod shaped like a runner pod (same image, security context, environment, resources)
  whose container runs ``python -c "import crewai.flow.flow"``, writes the time and exits: from its
  POST returning to the import done (the container's clock is this host's), and to a watch seeing
  it terminated (the kubelet's report of the end comes up to a second later). Nothing a runner
  does can take less than the import (it imports crewAI first);
- the Flow: an inline definition whose one method is an Agent's answer (one model call): from its
  POST returning to a watch seeing it ``Succeeded``, split into runner pod created, first model call
  received, model call answered.

A first, untimed floor pod warms the node's page cache with the image. Ratios (Flow / floor, p50 of
each) are what to read: the machine is shared.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.benchmarks.bench_conversation import Watch, container_state, floor_pod, http_client, named
from tests.benchmarks.bench_feedback_warm import RESOURCES
from tests.benchmarks.realstack import real_stack
from tests.integration.test_e2e_runner import WRITER

NS = "bench-cold"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
PODS = f"/api/v1/namespaces/{NS}/pods"
TIMEOUT = 300.0
ONE_CALL = {"schema": "crewai.flow/v1", "name": "OneCall", "methods": {
    "answer": {"start": True, "do": {"call": "agent", "with": {**WRITER, "input": "ONE CALL please"}}}}}
RULES = {"default": "A plain reply.", "rules": [{"contains": "ONE CALL", "reply": "Done in one call."}]}


FLOOR = "import crewai.flow.flow, json, time; open('/dev/termination-log', 'w').write(json.dumps(time.time()))"


def floor(cluster: LocalCluster, http: httpx.Client, pods: Watch, name: str) -> tuple[float, float]:
    """(POST returned -> import done in the container, -> the pod seen terminated), seconds."""
    body = floor_pod(cluster, name)
    container = body["spec"]["containers"][0]
    container["command"] = ["python", "-c", FLOOR]
    container["resources"] = RESOURCES
    mark = pods.mark()
    http.post(PODS, json=body).raise_for_status()
    sent = time.time()
    ended, pod = pods.wait(lambda o: named(name)(o) and "terminated" in container_state(o), TIMEOUT,
                           f"{name} to finish", since=mark)
    terminated = container_state(pod)["terminated"]
    if terminated.get("exitCode") != 0:
        raise RuntimeError(f"{name} failed: {terminated}")
    return float(json.loads(terminated["message"])) - sent, ended - sent


def flow(http: httpx.Client, flows: Watch, pods: Watch, stub: StubModel, name: str) -> tuple[float, ...]:
    """(-> pod created, -> first call received, -> call answered, -> Succeeded), seconds from the POST."""
    fmark, pmark, lmark = flows.mark(), pods.mark(), len(stub.ledger())
    http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                           "spec": {"definition": ONE_CALL, "resources": RESOURCES}}).raise_for_status()
    sent = time.time()
    done, obj = flows.wait(lambda o: named(name)(o) and (o.get("status") or {}).get("phase") in ("Succeeded", "Failed"),
                           TIMEOUT, f"{name} to end", since=fmark)
    if obj["status"]["phase"] != "Succeeded":
        raise RuntimeError(f"{name} failed: {obj['status'].get('message')}")
    created, _ = pods.wait(lambda o: o["metadata"]["name"].startswith(f"{name}-"), 5, f"{name}'s pod", since=pmark)
    calls = stub.ledger()[lmark:]
    if len(calls) != 1:
        raise RuntimeError(f"{name} made {len(calls)} model calls, not one")
    return created - sent, calls[0]["received"] - sent, calls[0]["time"] - sent, done - sent


def run(cluster: LocalCluster, stub: StubModel, n: int) -> tuple[list[tuple[float, float]], list[tuple[float, ...]]]:
    http = http_client(cluster)
    flows, pods = Watch(cluster, FLOWS), Watch(cluster, PODS)
    try:
        floor(cluster, http, pods, "floor-warmup")
        floors, runs = [], []
        for i in range(n):
            floors.append(floor(cluster, http, pods, f"floor-{i}"))
            runs.append(flow(http, flows, pods, stub, f"cold-{i}"))
            print(f"  round {i}: floor import done {floors[-1][0]:.2f} s, terminated {floors[-1][1]:.2f} s; "
                  f"Flow pod created {runs[-1][0]:.2f} s, first call {runs[-1][1]:.2f} s, answered "
                  f"{runs[-1][2]:.2f} s, Succeeded {runs[-1][3]:.2f} s", flush=True)
        return floors, runs
    finally:
        flows.stop()
        pods.stop()
        http.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    with real_stack("cold", Rules.from_json(RULES), NS) as (cluster, stub, _):
        floors, runs = run(cluster, stub, args.runs)
    p50 = statistics.median
    imported, floor50 = p50(f[0] for f in floors), p50(f[1] for f in floors)
    steps = [p50(r[k] for r in runs) for k in range(4)]
    print(f"\ncold one-call inline Flow on the real node, {args.runs} rounds (p50):")
    print(f"  floor pod (`import crewai.flow.flow`, exit): POST -> import done in the container {imported:.2f} s, "
          f"-> seen terminated {floor50:.2f} s (min {min(f[1] for f in floors):.2f}, "
          f"max {max(f[1] for f in floors):.2f})")
    print(f"  Flow POST -> runner pod created {steps[0] * 1000:.0f} ms, -> first model call {steps[1]:.2f} s "
          f"({steps[1] / imported:.2f}x the import), -> call answered {steps[2]:.2f} s, -> Succeeded "
          f"{steps[3]:.2f} s (min {min(r[3] for r in runs):.2f}, max {max(r[3] for r in runs):.2f})")
    print(f"  apply -> Succeeded / floor pod seen terminated: {steps[3] / floor50:.2f}x; "
          f"/ floor's import done: {steps[3] / imported:.2f}x")


if __name__ == "__main__":
    main()
