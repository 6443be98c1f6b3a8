"""Benchmark: the runner state API (the runner's only way to its state). Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_state [--requests 500] [--size 20000]

A Flow's runner pod is created (no node runs, so it stays Pending but is the Flow's running
attempt); a token bound to it for the state audience is requested, as the kubelet would. Then, as
a runner does: one first request (TokenReview included), N PUTs of a state-sized blob (a runner
writes its state and an interim report after every LLM call) and N GETs, one at a time.
"""

from __future__ import annotations

import argparse
import os
import ssl
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from flowkube_api import constants as c
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import OperatorProcess


def percentiles(ms: list[float]) -> str:
    ms = sorted(ms)
    return f"p50 {statistics.median(ms):.1f} ms, p99 {ms[min(len(ms) - 1, int(len(ms) * 0.99))]:.1f} ms"


def runner_pod_token(cluster: LocalCluster, before: str = "") -> str:
    """Namespace ``bench`` (``before`` applied in it first: a quota), Flow ``b`` and its runner pod
    ``b-0`` (Pending: no node), and a state token bound to that pod, as the kubelet would mount."""
    cluster.kubectl("create", "namespace", "bench")
    wait_for(lambda: cluster.kubectl("get", "serviceaccount", "default", "-n", "bench",
                                     check=False).returncode == 0, 30, "the default ServiceAccount")
    if before:
        cluster.kubectl("apply", "-n", "bench", "-f", "-", input=before)
    cluster.kubectl("apply", "-n", "bench", "-f", "-", input='{"apiVersion": "flowkube.io/v1alpha1", '
                    '"kind": "Flow", "metadata": {"name": "b"}, "spec": {"flowRef": "bench.flows:Noop"}}')
    wait_for(lambda: cluster.kubectl("get", "pod", "b-0", "-n", "bench", check=False).returncode == 0,
             30, "the runner pod")
    uid = cluster.kubectl("get", "pod", "b-0", "-n", "bench", "-o", "jsonpath={.metadata.uid}").stdout
    return cluster.kubectl("create", "token", "default", "-n", "bench", f"--audience={c.STATE_AUDIENCE}",
                           "--bound-object-kind=Pod", "--bound-object-name=b-0",
                           f"--bound-object-uid={uid}").stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--size", type=int, default=20_000, help="bytes per PUT (gzip state is typically KBs)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), with_node=False).start()
        op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING"})
        try:
            op.start()
            token = runner_pod_token(cluster)
            client = httpx.Client(base_url=op.state_url, timeout=10,
                                  verify=ssl.create_default_context(cafile=str(op.ca_file())),
                                  headers={"Authorization": f"Bearer {token}"})
            blob = os.urandom(args.size)  # incompressible: the ConfigMap holds it as is
            t0 = time.perf_counter()
            first = client.get(c.STATE_API_PREFIX + c.STATE_KEY)
            first_ms = (time.perf_counter() - t0) * 1000
            assert first.status_code == 404, first.text
            timings: dict[str, list[float]] = {"PUT": [], "GET": []}
            for method in ("PUT", "GET"):
                for _ in range(args.requests):
                    t0 = time.perf_counter()
                    r = client.request(method, c.STATE_API_PREFIX + c.STATE_KEY,
                                       content=blob if method == "PUT" else None)
                    timings[method].append((time.perf_counter() - t0) * 1000)
                    assert r.status_code in (200, 204), r.text
            assert r.content == blob
        finally:
            op.stop()
            cluster.stop()
    print(f"state API, first request (TokenReview, pod and Flow checks): {first_ms:.1f} ms")
    for method, ms in timings.items():
        print(f"state API {method} of {args.size} bytes, {args.requests} in a row: {percentiles(ms)}, "
              f"{len(ms) / (sum(ms) / 1000):.0f}/s")


if __name__ == "__main__":
    main()
