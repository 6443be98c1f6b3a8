"""The operator with the REAL runner on the local stack: stub model, definition validator, webhook.

Shared by the end-to-end and the examples tests. Each module builds one ``RealRunnerStack`` (the
operator starts once per module); tests slice the stub's ledger to the calls their flow made.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import OperatorProcess
from flowkube_devstack.stack import Validator, runner_python
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage

MODEL = "gpt-4o-mini"


@dataclass
class RealRunnerStack:
    cluster: LocalCluster
    stub: StubModel
    validator: Validator
    operator: OperatorProcess

    def usage_since(self, mark: int) -> Usage:
        return ledger_usage(self.stub.ledger()[mark:])

    @contextmanager
    def validator_down(self) -> Iterator[None]:
        """The webhook cannot ask (failure-open): the runner has the last word."""
        self.validator.stop()
        try:
            yield
        finally:
            self.validator.start()


@contextmanager
def real_runner_stack(cluster: LocalCluster, rules: dict[str, Any], name: str) -> Iterator[RealRunnerStack]:
    """Stub model + validator + the operator (as the chart installs it, admission webhook included:
    see ``OperatorProcess``) running ``flowkube-runner`` in its runner pods."""
    with StubModel(Rules.from_json(rules)) as stub, runner_python() as python:
        validator = Validator(cluster.root / f"validator-{name}.log").start()
        operator = OperatorProcess(cluster, name=f"operator-{name}", env={
            "FLOWKUBE_RUNNER_COMMAND": f"{python} -m flowkube_runner",
            "FLOWKUBE_RUNNER_DEFAULT_ENV": json.dumps({
                "OPENAI_BASE_URL": stub.base_url,
                "OPENAI_API_KEY": "stub",
                "CREWAI_TRACING_ENABLED": "false",
            }),
            "FLOWKUBE_VALIDATOR_URL": validator.url,
        })
        try:
            operator.start()
            yield RealRunnerStack(cluster, stub, validator, operator)
        finally:
            operator.stop()
            validator.stop()
