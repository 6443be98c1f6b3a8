"""Benchmark: a feedback answer to the resumed method running, warm and cold, real runner. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_feedback_warm [--warm 10] [--cold 3]

The operator from its chart, runner pods from the runner image on the local stack's real node, the
stub model. Flows with one feedback step (the integration tests' ReviewedArticle: draft, review,
publish) pause; ``--warm`` of them with ``feedback.keepWarmSeconds: 600`` (the paused pod waits for
the answer), ``--cold`` with none (the answer starts a new pod). Each is answered, one at a time,
with the documented status patch. Figures per answer, from the PATCH returning: the resumed step's
first model call received by the stub (crewAI maps the answer onto an outcome with the step's model:
the resumed method is running), the last model call answered, and the Flow ``Succeeded`` as seen by
a watch.

``--resumed one-call`` (the default): what follows the answer is that one model call (``publish``
is an expression). ``--resumed agent``: ``publish`` is a crewAI Agent's call, two calls in all.
Every Flow asks for 10m of CPU: with the chart's default request (100m) the local node's two cores
hold 19 runner pods beside the operator, and a 20th stays Pending (Unschedulable, which the Flow's
status says).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.benchmarks.bench_conversation import Watch, http_client, named, rank
from tests.benchmarks.realstack import real_stack
from tests.integration.test_e2e_runner import RULES, review_definition

NS = "bench-feedback-warm"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
TIMEOUT = 300.0


RESOURCES = {"requests": {"cpu": "10m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}


def definition(resumed: str) -> dict[str, Any]:
    d = review_definition()
    if resumed == "one-call":
        d["methods"]["publish"]["do"] = {"call": "expression", "expr": "'published'"}
    return d


Answer = tuple[float, float, float]


def answer(http: httpx.Client, flows: Watch, stub: StubModel, name: str) -> Answer:
    """(patch -> resumed step's first model call, -> its last call answered, -> Succeeded), seconds."""
    fmark, lmark = flows.mark(), len(stub.ledger())
    r = http.patch(f"{FLOWS}/{name}/status", json={"status": {"feedback": {"response": {"text": "approved"}}}},
                   headers={"Content-Type": "application/merge-patch+json"})
    if r.status_code >= 300:
        raise RuntimeError(f"answer refused: {r.status_code} {r.text}")
    sent = time.time()
    done, _ = flows.wait(lambda o: named(name)(o) and (o.get("status") or {}).get("phase") == "Succeeded",
                         TIMEOUT, f"{name} to succeed", since=fmark)
    wait_for(lambda: len(stub.ledger()) > lmark, 30, "the resumed step's model call", interval=0.01)
    calls = stub.ledger()[lmark:]
    return calls[0]["received"] - sent, calls[-1]["time"] - sent, done - sent


def run(cluster: LocalCluster, stub: StubModel, n_warm: int, n_cold: int, resumed: str,
        logs: Path | None = None) -> dict[str, list[Answer]]:
    http = http_client(cluster)
    flows = Watch(cluster, FLOWS)
    try:
        names = {"warm": [f"warm-{i}" for i in range(n_warm)], "cold": [f"cold-{i}" for i in range(n_cold)]}
        for kind, group in names.items():
            keep = 600 if kind == "warm" else 0
            for name in group:
                http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                       "metadata": {"name": name},
                                       "spec": {"definition": definition(resumed), "resources": RESOURCES,
                                                "feedback": {"keepWarmSeconds": keep}}}).raise_for_status()
        every = [n for group in names.values() for n in group]
        for name in every:
            flows.wait(lambda o, name=name: named(name)(o)  # type: ignore[misc]
                       and (o.get("status") or {}).get("phase") == "AwaitingFeedback", TIMEOUT * 2,
                       f"{name} to pause")
        print(f"{len(every)} flows paused", flush=True)
        out: dict[str, list[Answer]] = {"warm": [], "cold": []}
        for kind in ("cold", "warm"):
            for name in names[kind]:
                out[kind].append(answer(http, flows, stub, name))
                running, last, done = out[kind][-1]
                print(f"  {name}: resumed step running {running * 1000:.0f} ms, its last call answered "
                      f"{last * 1000:.0f} ms, Succeeded {done * 1000:.0f} ms after the patch", flush=True)
        if logs is not None:  # what each warm runner logged (httpx stamps every request): its timeline
            logs.mkdir(parents=True, exist_ok=True)
            for name in names["warm"]:
                out_log = cluster.kubectl("logs", "-n", NS, f"{name}-0", check=False)
                (logs / f"{name}.log").write_text(out_log.stdout + out_log.stderr)
        return out
    finally:
        flows.stop()
        http.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--cold", type=int, default=3)
    parser.add_argument("--resumed", choices=("one-call", "agent"), default="one-call")
    parser.add_argument("--logs", type=Path, help="save each warm runner pod's log in this directory")
    args = parser.parse_args()
    with real_stack("fbw", Rules.from_json(RULES), NS) as (cluster, stub, _):
        res = run(cluster, stub, args.warm, args.cold, args.resumed, args.logs)
    print(f"\nfeedback patch returned -> (resumed step's first model call | last call answered | Flow "
          f"Succeeded), real runner, resumed part: {args.resumed}:")
    for kind, rows in res.items():
        if not rows:
            continue
        running, last, done = ([r[k] for r in rows] for k in range(3))
        tail = [d - la for la, d in zip(last, done, strict=True)]
        print(f"  {kind} ({len(rows)}): resumed step running p50 {statistics.median(running) * 1000:.0f} ms; "
              f"last call answered p50 {statistics.median(last) * 1000:.0f} ms; Succeeded p50 "
              f"{statistics.median(done) * 1000:.0f} ms, p99 {rank(done, 99) * 1000:.0f} ms (nearest rank), "
              f"max {max(done) * 1000:.0f} ms; last call answered -> Succeeded p50 "
              f"{statistics.median(tail) * 1000:.0f} ms")
    if res["warm"] and res["cold"]:
        ratio = statistics.median([r[0] for r in res["cold"]]) / statistics.median([r[0] for r in res["warm"]])
        print(f"  cold / warm (resumed step running, p50): {ratio:.0f}x")


if __name__ == "__main__":
    main()
