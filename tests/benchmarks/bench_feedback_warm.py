"""Benchmark: a feedback answer to the resumed method running, warm and cold, real runner. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_feedback_warm [--warm 10] [--cold 3]

The operator from its chart, runner pods from the runner image on the local stack's real node, the
stub model. Flows with one feedback step (the integration tests' ReviewedArticle: draft, review,
publish) pause; ``--warm`` of them with ``feedback.keepWarmSeconds: 600`` (the paused pod waits for
the answer), ``--cold`` with none (the answer starts a new pod). Each is answered, one at a time,
with the documented status patch. Figures per answer, from the PATCH returning: the resumed step's
first model call received by the stub (crewAI maps the answer onto an outcome with the step's model:
the resumed method is running), and the Flow ``Succeeded`` as seen by a watch.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.benchmarks.bench_conversation import RUNNER_ENV, Watch, http_client, named, rank
from tests.integration.test_e2e_runner import RULES, review_definition

NS = "bench-feedback-warm"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
TIMEOUT = 300.0


def answer(http: httpx.Client, flows: Watch, stub: StubModel, name: str) -> tuple[float, float]:
    """(patch -> resumed step's first model call, patch -> Succeeded), seconds."""
    fmark, lmark = flows.mark(), len(stub.ledger())
    r = http.patch(f"{FLOWS}/{name}/status", json={"status": {"feedback": {"response": {"text": "approved"}}}},
                   headers={"Content-Type": "application/merge-patch+json"})
    if r.status_code >= 300:
        raise RuntimeError(f"answer refused: {r.status_code} {r.text}")
    sent = time.time()
    done, _ = flows.wait(lambda o: named(name)(o) and (o.get("status") or {}).get("phase") == "Succeeded",
                         TIMEOUT, f"{name} to succeed", since=fmark)
    wait_for(lambda: len(stub.ledger()) > lmark, 30, "the resumed step's model call", interval=0.01)
    first = stub.ledger()[lmark]["received"]
    return first - sent, done - sent


def run(cluster: LocalCluster, stub: StubModel, n_warm: int, n_cold: int) -> dict[str, list[tuple[float, float]]]:
    http = http_client(cluster)
    flows = Watch(cluster, FLOWS)
    try:
        names = {"warm": [f"warm-{i}" for i in range(n_warm)], "cold": [f"cold-{i}" for i in range(n_cold)]}
        for kind, group in names.items():
            keep = 600 if kind == "warm" else 0
            for name in group:
                http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
                                       "metadata": {"name": name},
                                       "spec": {"definition": review_definition(),
                                                "feedback": {"keepWarmSeconds": keep}}}).raise_for_status()
        every = [n for group in names.values() for n in group]
        for name in every:
            flows.wait(lambda o, name=name: named(name)(o)  # type: ignore[misc]
                       and (o.get("status") or {}).get("phase") == "AwaitingFeedback", TIMEOUT * 2,
                       f"{name} to pause")
        print(f"{len(every)} flows paused", flush=True)
        out: dict[str, list[tuple[float, float]]] = {"warm": [], "cold": []}
        for kind in ("cold", "warm"):
            for name in names[kind]:
                out[kind].append(answer(http, flows, stub, name))
                print(f"  {name}: resumed step running {out[kind][-1][0] * 1000:.0f} ms, "
                      f"Succeeded {out[kind][-1][1] * 1000:.0f} ms after the patch", flush=True)
        return out
    finally:
        flows.stop()
        http.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--warm", type=int, default=10)
    parser.add_argument("--cold", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-fbw-") as tmp:
        cluster = LocalCluster(Path(tmp)).start()
        try:
            with StubModel(Rules.from_json(RULES), host=cluster.host_ip) as stub:
                url = cluster.host_service("stub-model", "flowkube-dev", stub.port)
                op = ChartOperator(cluster, runner_env={"OPENAI_BASE_URL": f"{url}/v1", **RUNNER_ENV},
                                   values=["log.level=WARNING"])
                try:
                    op.start()
                    cluster.kubectl("create", "namespace", NS)
                    wait_for(lambda: cluster.kubectl("get", "sa", "default", "-n", NS, check=False).returncode == 0,
                             30, "the namespace's ServiceAccount")
                    res = run(cluster, stub, args.warm, args.cold)
                finally:
                    op.stop()
        finally:
            cluster.stop()
    print("\nfeedback patch returned -> (resumed step's first model call | Flow Succeeded), real runner:")
    for kind, rows in res.items():
        if not rows:
            continue
        running, done = [r[0] for r in rows], [r[1] for r in rows]
        print(f"  {kind} ({len(rows)}): resumed step running p50 {statistics.median(running) * 1000:.0f} ms, "
              f"p99 {rank(running, 99) * 1000:.0f} ms (nearest rank: the max); Succeeded p50 "
              f"{statistics.median(done) * 1000:.0f} ms, max {max(done) * 1000:.0f} ms")
    if res["warm"] and res["cold"]:
        ratio = statistics.median([r[0] for r in res["cold"]]) / statistics.median([r[0] for r in res["warm"]])
        print(f"  cold / warm (resumed step running, p50): {ratio:.0f}x")


if __name__ == "__main__":
    main()
