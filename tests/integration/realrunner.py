"""The operator with the REAL runner on the local stack: stub model, definition validator, webhook.

Shared by the end-to-end and the examples tests. Each module builds one ``RealRunnerStack`` (the
operator starts once per module); tests slice the stub's ledger to the calls their flow made.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage

MODEL = "gpt-4o-mini"


@dataclass
class RealRunnerStack:
    cluster: LocalCluster
    stub: StubModel
    operator: ChartOperator

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
                      values: Sequence[str] = ()) -> Iterator[RealRunnerStack]:
    """The stub model (so tests can hold its calls and read its ledger) and the chart's operator
    running ``flowkube-runner`` from the runner image (``values``: more chart values)."""
    with StubModel(Rules.from_json(rules), host=cluster.host_ip) as stub, \
            chart_operator_on(cluster, stub, name, values) as operator:
        yield RealRunnerStack(cluster, stub, operator)
