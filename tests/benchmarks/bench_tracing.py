"""Benchmark: what tracing costs a Flow, and what a dead collector costs it. Prints figures.

    .venv/bin/python -m tests.benchmarks.bench_tracing [--cold 4] [--warm 6]

One local stack (real node, the chart's operator, runner pods from the runner image, the stub model),
three phases in one run, each against the same peer, the phase with tracing off:

- ``off``: no tracing endpoint;
- ``on``: the chart upgraded with ``tracing.endpoint`` at the stack's Jaeger (built from its Go
  module), every Flow one trace;
- ``collector down``: the same, with Jaeger stopped (its port refuses).

In each: ``--cold`` Flows applied one at a time, apply to ``Succeeded`` (a new runner pod, one model
call: crewAI's import is most of it); and ``--warm`` Flows paused warm for feedback, each answered
with the status patch, patch to ``Succeeded`` (the pod already up: the answer's model call and the
publish call). Medians, and each phase's ratio to ``off``.
"""

from __future__ import annotations

import argparse
import statistics
import time

from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.jaeger import Jaeger, read_spans
from flowkube_devstack.stubmodel import Rules
from tests.benchmarks.bench_conversation import Watch, http_client, named
from tests.benchmarks.realstack import real_stack
from tests.integration.test_e2e_runner import RULES, review_definition, spans_counted

NS = "bench-tracing"
FLOWS = f"/apis/flowkube.io/v1alpha1/namespaces/{NS}/flows"
TIMEOUT = 300.0
RESOURCES = {"requests": {"cpu": "10m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
ONE_CALL = {"schema": "crewai.flow/v1", "name": "OneCall", "methods": {"ask": {"start": True, "do": {
    "call": "agent", "with": {"role": "Writer", "goal": "Write", "backstory": "A writer.",
                              "settings": {"llm": "gpt-4o-mini"}, "input": "Write a short draft about cats."}}}}}


def phase(cluster: LocalCluster, tag: str, n_cold: int, n_warm: int) -> tuple[list[float], list[float], list[str]]:
    """(cold apply -> Succeeded, warm answer -> Succeeded) in seconds, and the Flows' trace ids."""
    http = http_client(cluster)
    flows = Watch(cluster, FLOWS)
    traces: list[str] = []

    def succeeded(name: str, since: int) -> float:
        t, obj = flows.wait(lambda o: named(name)(o) and (o.get("status") or {}).get("phase") == "Succeeded",
                            TIMEOUT, f"{name} to succeed", since=since)
        traces.append(((obj.get("status") or {}).get("trace") or {}).get("traceId", ""))
        return t

    try:
        cold: list[float] = []
        for i in range(n_cold):
            name, mark = f"{tag}-cold-{i}", flows.mark()
            sent = time.time()
            http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                                   "spec": {"definition": ONE_CALL, "resources": RESOURCES}}).raise_for_status()
            cold.append(succeeded(name, mark) - sent)
        names = [f"{tag}-warm-{i}" for i in range(n_warm)]
        for name in names:
            http.post(FLOWS, json={"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                                   "spec": {"definition": review_definition(), "resources": RESOURCES,
                                            "feedback": {"keepWarmSeconds": 600}}}).raise_for_status()
        for name in names:
            flows.wait(lambda o, name=name: named(name)(o)  # type: ignore[misc]
                       and (o.get("status") or {}).get("phase") == "AwaitingFeedback", TIMEOUT * 2, f"{name} to pause")
        warm: list[float] = []
        for name in names:
            mark = flows.mark()
            r = http.patch(f"{FLOWS}/{name}/status", json={"status": {"feedback": {"response": {"text": "approved"}}}},
                           headers={"Content-Type": "application/merge-patch+json"})
            r.raise_for_status()
            sent = time.time()
            warm.append(succeeded(name, mark) - sent)
        return cold, warm, traces
    finally:
        flows.stop()
        http.close()


def show(tag: str, cold: list[float], warm: list[float], *, peer: tuple[float, float] | None) -> tuple[float, float]:
    c, w = statistics.median(cold), statistics.median(warm)
    ratio = f"; vs off: cold {c / peer[0]:.2f}x, warm {w / peer[1]:.2f}x" if peer else ""
    print(f"  {tag:15s} cold apply -> Succeeded p50 {c:.2f} s (min {min(cold):.2f}, max {max(cold):.2f}); "
          f"warm answer -> Succeeded p50 {w * 1000:.0f} ms (min {min(warm) * 1000:.0f}, max {max(warm) * 1000:.0f})"
          f"{ratio}", flush=True)
    return c, w


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cold", type=int, default=4)
    parser.add_argument("--warm", type=int, default=6)
    args = parser.parse_args()
    with real_stack("tracing", Rules.from_json(RULES), NS) as (cluster, _stub, op):
        jaeger = Jaeger.beside(cluster)
        try:
            results: dict[str, tuple[list[float], list[float]]] = {}
            print("phase off (no tracing endpoint)", flush=True)
            cold, warm, _ = phase(cluster, "off", args.cold, args.warm)
            results["off"] = (cold, warm)
            op.upgrade(f"tracing.endpoint={jaeger.endpoint}", "log.level=WARNING")
            print("phase on (traces to Jaeger)", flush=True)
            cold, warm, ids = phase(cluster, "on", args.cold, args.warm)
            results["on"] = (cold, warm)
            spans = [len(read_spans(jaeger.query, t)) for t in ids if t]
            jaeger.stop()
            print("phase collector down (Jaeger stopped)", flush=True)
            before = spans_counted(op)
            cold, warm, _ = phase(cluster, "down", args.cold, args.warm)
            results["collector down"] = (cold, warm)
            after = spans_counted(op)
        finally:
            jaeger.stop()
    print(f"\ntracing: apply -> Succeeded (cold, {args.cold} Flows) and feedback answer -> Succeeded (warm, "
          f"{args.warm} Flows), real runner, one stack, phases in order:")
    peer = show("off", *results["off"], peer=None)
    show("on", *results["on"], peer=peer)
    show("collector down", *results["collector down"], peer=peer)
    print(f"  spans per traced Flow in Jaeger: min {min(spans)}, max {max(spans)}")
    rose = {key: after[key] - before.get(key, 0) for key in sorted(after)}
    print("  flowkube_operator_trace_spans_total during the collector-down phase: "
          + ", ".join(f"{source}/{result} +{n:.0f}" for (source, result), n in rose.items() if n))


if __name__ == "__main__":
    main()
