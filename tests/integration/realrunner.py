"""The operator with the REAL runner on the local stack: stub model, definition validator, webhook.

Shared by the end-to-end and the examples tests. Each module builds one ``RealRunnerStack`` (the
operator starts once per module); tests slice the stub's ledger to the calls their flow made.
"""

from __future__ import annotations

from collections.abc import Iterator
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
    def validator_down(self) -> Iterator[None]:
        """The webhook cannot ask (failure-open): the runner has the last word. The chart is
        upgraded without its validator sidecar, and back."""
        self.operator.upgrade("validator.enabled=false")
        try:
            yield
        finally:
            self.operator.upgrade()


@contextmanager
def real_runner_stack(cluster: LocalCluster, rules: dict[str, Any], name: str) -> Iterator[RealRunnerStack]:
    """The stub model (a process of this host, so tests can hold its calls and read its ledger,
    behind a Service pods reach by name) and the operator installed by its chart, validator sidecar
    and admission webhooks included, running ``flowkube-runner`` from the runner image."""
    with StubModel(Rules.from_json(rules), host=cluster.host_ip) as stub:
        url = cluster.host_service(f"stub-model-{name}", "flowkube-dev", stub.port)
        operator = ChartOperator(cluster, runner_env={
            "OPENAI_BASE_URL": f"{url}/v1",
            "OPENAI_API_KEY": "stub",
            "CREWAI_TRACING_ENABLED": "false",
        })
        try:
            operator.start()
            yield RealRunnerStack(cluster, stub, operator)
        finally:
            operator.stop()
