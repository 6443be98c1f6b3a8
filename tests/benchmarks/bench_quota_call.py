"""Benchmark: what a FlowQuota adds to each model call, and the reservations the operator sustains
(issue 41). Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_quota_call [--calls 300] [--threads 4] [--pairs 500]

The operator runs as a host process with quotas on, against a control plane without a node; a Flow
under a FlowQuota of three limits (a calendar month of cost in Berlin, a rolling 24 h of tokens, a
lifetime of tokens) has a runner pod (Pending: no node) and a token bound to it, as a runner has.
crewAI's own ``LLM.call`` is made in this process against the stub model, one call at a time:
``--calls`` with the runner's quota gate (each request reserved at the operator's state API before
it is sent, settled once crewAI counted it) and, in the same rounds, as many without it (the peer).
Then ``--threads`` threads each reserve and settle ``--pairs`` times through the state API at once:
the reservations per second one operator answers (with the per-address rate limit lifted: at its
default, 50 requests a second from one address, one address gets 25 pairs a second).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from pathlib import Path

from flowkube_api import constants as c
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import OperatorProcess
from flowkube_devstack.stubmodel import Rules, StubModel
from flowkube_runner.store import StateApiStore
from tests.benchmarks.bench_state import runner_pod_token
from tests.definitions import crewai_in_process

QUOTA = """{"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowQuota", "metadata": {"name": "team"},
 "spec": {"limits": [
   {"name": "monthly", "maxCost": "1000000", "window": {"kind": "Month", "timeZone": "Europe/Berlin"}},
   {"name": "rolling", "maxTotalTokens": 1000000000000, "window": {"kind": "Rolling", "hours": 24}},
   {"name": "lifetime", "maxTotalTokens": 1000000000000, "window": {"kind": "Lifetime"}}]}}"""


def pct(ms: list[float], q: float) -> float:
    ms = sorted(ms)
    return ms[min(len(ms) - 1, int(len(ms) * q))]


@contextmanager
def operator_with_a_quota(tmp: Path) -> Iterator[tuple[OperatorProcess, str]]:
    """The operator (quotas on), the quota, the Flow and its pod's state token."""
    cluster = LocalCluster(tmp, with_node=False).start()
    # The per-address rate limit lifted: every request here comes from this one host (and one pod, whose
    # POD_IN_FLIGHT of 4 bounds --threads), and what is measured is the operator, not the limit.
    op = OperatorProcess(cluster, env={"FLOWKUBE_LOG_LEVEL": "WARNING", "FLOWKUBE_QUOTAS_ENABLED": "true",
                                       "FLOWKUBE_QUOTA_RECOVERY_SECONDS": "0", "FLOWKUBE_STATE_CLIENT_RATE": "10000",
                                       "FLOWKUBE_STATE_CLIENT_BURST": "100000"})
    try:
        op.start()
        token = runner_pod_token(cluster, before=QUOTA)
        yield op, token
    finally:
        op.stop()
        cluster.stop()


def store_for(op: OperatorProcess, token: str, tmp: Path) -> StateApiStore:
    token_file = tmp / "token"
    token_file.write_text(token)
    return StateApiStore.from_environment({c.ENV_STATE_URL: op.state_url, c.ENV_STATE_CA: op.ca_file().read_text(),
                                           c.ENV_STATE_TOKEN_FILE: str(token_file)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--threads", type=int, default=4, help="at most 4: one pod's requests in flight")
    parser.add_argument("--pairs", type=int, default=500)
    args = parser.parse_args()
    # The cluster first: crewAI's scratch HOME would hide the build cache (~/.cache/flowkube).
    with tempfile.TemporaryDirectory(prefix="flowkube-bench-") as name, \
            operator_with_a_quota(Path(name)) as (op, token), \
            StubModel(Rules.from_json({"default": "A short answer."})) as stub, crewai_in_process(stub.base_url):
        from crewai import LLM

        from flowkube_runner.engine.usage import UsageRecorder

        store = store_for(op, token, Path(name))
        llm = LLM(model="gpt-4o-mini", max_tokens=256)

        def covered() -> bool:  # the operator has seen the quota and the Flow
            reservation = store.reserve("gpt-4o-mini", 1, Decimal(0))
            store.settle(reservation, None)
            return reservation > 0

        wait_for(covered, 60, "the quota covering the Flow")
        timings: dict[str, list[float]] = {"quota": [], "none": []}
        recorders = {"quota": UsageRecorder(quota=store), "none": UsageRecorder()}
        for _ in range(args.calls // 10):  # ten of each in turn: the machine's drift falls on both alike
            for kind in ("none", "quota"):
                with recorders[kind].recording():
                    for _ in range(10):
                        t0 = time.perf_counter()
                        llm.call("Say something short about quotas.")
                        timings[kind].append((time.perf_counter() - t0) * 1000)
        used = recorders["quota"].usage().total_tokens

        done: list[float] = []
        lock = threading.Lock()

        def reserve_and_settle() -> None:
            own = store_for(op, token, Path(name))
            for _ in range(args.pairs):
                t0 = time.perf_counter()
                own.settle(own.reserve("gpt-4o-mini", 1000, Decimal("0.001")), None)
                with lock:
                    done.append((time.perf_counter() - t0) * 1000)

        threads = [threading.Thread(target=reserve_and_settle) for _ in range(args.threads)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0

    quota, none = timings["quota"], timings["none"]
    added = statistics.median(quota) - statistics.median(none)
    print(f"model call through crewAI to the stub, {len(none)} each, one at a time (tokens counted under the "
          f"quota: {used}):")
    print(f"  without a quota: p50 {statistics.median(none):.2f} ms, p99 {pct(none, 0.99):.2f} ms")
    print(f"  with the quota gate: p50 {statistics.median(quota):.2f} ms, p99 {pct(quota, 0.99):.2f} ms")
    print(f"  added per call: p50 {added:.2f} ms, p99 {pct(quota, 0.99) - pct(none, 0.99):.2f} ms "
          f"(ratio {statistics.median(quota) / statistics.median(none):.2f}x)")
    print(f"reserve + settle through the state API, {args.threads} threads x {args.pairs}: "
          f"{len(done) / wall:.0f} pairs/s ({2 * len(done) / wall:.0f} requests/s), p50 "
          f"{statistics.median(done):.2f} ms, p99 {pct(done, 0.99):.2f} ms per pair")


if __name__ == "__main__":
    main()
