"""The operator with the REAL runner on the local stack: stub model, definition validator, webhook.

Shared by the end-to-end and the examples tests. Each module builds one ``RealRunnerStack`` (the
operator starts once per module); tests slice the stub's ledger to the calls their flow made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.jaeger import Jaeger, Span
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage

MODEL = "gpt-4o-mini"


@dataclass
class RealRunnerStack:
    cluster: LocalCluster
    stub: StubModel
    operator: ChartOperator
    jaeger: Jaeger | None = None

    def trace(self, status: dict[str, Any], done: Callable[[list[Span]], bool], what: str,
              timeout: float = 60) -> list[Span]:
        """The Flow's trace as Jaeger has it (its id from status.trace), once ``done`` says it is all
        there (spans arrive in batches: the pods' within half a second, the operator's within one)."""
        assert self.jaeger is not None, "this stack sends no traces"
        trace_id = status["trace"]["traceId"]
        seen: list[Span] = []

        def arrived() -> bool:
            seen[:] = self.jaeger.spans(trace_id) if self.jaeger is not None else []
            return done(seen)

        wait_for(arrived, timeout, f"trace {trace_id}: {what}", interval=0.3)
        return seen

    def one_trace(self, st: dict[str, Any]) -> dict[str, list[Span]]:
        """The Flow's one trace, checked whole, by span name: one span per ended run (the operator's),
        the root once the Flow ended, every other span under a span of the trace (each pod's under its
        run), the model calls' tokens summing to the Flow's status.usage."""
        ended = [r for r in st["runs"] if r.get("finishedAt")]
        usage = Usage.model_validate(st.get("usage") or {})
        definition, done = st.get("definition") or "", st.get("phase") in ("Succeeded", "Failed")

        def whole(spans: list[Span]) -> bool:
            names = [s.name for s in spans]
            return ((not done or f"invoke_workflow {definition}" in names)
                    and sum(n.startswith("run ") for n in names) == len(ended)
                    and sum("flowkube.usage.total_tokens" in s.tags for s in spans if s.name.startswith("chat "))
                    >= usage.successful_requests)

        spans = self.trace(st, whole, f"{len(ended)} run(s), {usage.successful_requests} model call(s)"
                           f"{' and the root' if done else ''}")
        by_name: dict[str, list[Span]] = {}
        for sp in spans:
            by_name.setdefault(sp.name, []).append(sp)
        ids = {sp.span_id for sp in spans}
        roots = [sp for sp in spans if not sp.parent_id]
        if done:
            (root,) = roots
            assert (root.name, root.service) == (f"invoke_workflow {definition}", "flowkube-operator")
        runs = [sp for sp in spans if sp.name.startswith("run ")]
        assert len({sp.parent_id for sp in runs}) == 1 and all(sp.service == "flowkube-operator" for sp in runs)
        orphans = [(sp.name, sp.service) for sp in spans if sp.parent_id not in ids | {runs[0].parent_id, ""}]
        assert not orphans, f"spans whose parent is not in the trace: {orphans}"
        # A call refused before it was sent (a stopping pod, a budget, a quota) has a span too, without
        # usage; the calls the model answered carry the figures status counts.
        chats = [sp for sp in spans if sp.name.startswith("chat ") and "flowkube.usage.total_tokens" in sp.tags]
        assert len(chats) == usage.successful_requests
        assert sum(int(sp.tags["gen_ai.usage.input_tokens"]) for sp in chats) == usage.prompt_tokens
        assert sum(int(sp.tags["gen_ai.usage.output_tokens"]) for sp in chats) == usage.completion_tokens
        assert not {k for sp in spans for k in sp.tags if k.endswith(".messages")}, "no message content"
        return by_name

    def usage_since(self, mark: int) -> Usage:
        return ledger_usage(self.stub.ledger()[mark:])


@contextmanager
def chart_operator_on(cluster: LocalCluster, stub: StubModel, name: str,
                      values: Sequence[str] = ()) -> Iterator[ChartOperator]:
    """The operator installed by its chart (``values`` on top), validator sidecar and admission
    webhooks included, its runner pods pointed at ``stub`` (a process of this host) through a Service
    pods reach by name."""
    url = cluster.host_service(f"stub-model-{name}", "flowkube-dev", stub.port)
    operator = ChartOperator(cluster, values=values, runner_env={
        "OPENAI_BASE_URL": f"{url}/v1",
        "OPENAI_API_KEY": "stub",
        "CREWAI_TRACING_ENABLED": "false",
    })
    try:
        operator.start()
        yield operator
    finally:
        operator.stop()


@contextmanager
def real_runner_stack(cluster: LocalCluster, rules: dict[str, Any], name: str,
                      values: Sequence[str] = (), jaeger: Jaeger | None = None) -> Iterator[RealRunnerStack]:
    """The stub model (so tests can hold its calls and read its ledger) and the chart's operator
    running ``flowkube-runner`` from the runner image (``values``: more chart values; with ``jaeger``,
    its traces go there)."""
    values = [*values, *([f"tracing.endpoint={jaeger.endpoint}"] if jaeger is not None else [])]
    with StubModel(Rules.from_json(rules), host=cluster.host_ip) as stub, \
            chart_operator_on(cluster, stub, name, values) as operator:
        yield RealRunnerStack(cluster, stub, operator, jaeger)
