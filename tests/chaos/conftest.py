"""The chaos run's stack: the chart's operator with two replicas, the REAL runner in its runner pods,
and a stub model (a process of this host, so the test holds its calls and reads its ledger)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel
from tests.integration.realrunner import chart_operator_on

MODEL = "gpt-4o-mini"
DRAFT_REPLY = "A short draft."
RULES: dict[str, Any] = {
    "default": "A plain reply.",
    "rules": [
        {"contains": "DRAFT for ", "reply": DRAFT_REPLY},
        {"contains": "FINISH for ", "reply": "Finished."},
        {"contains": "PUBLISH for ", "reply": "Published."},
        # crewAI asks the step's model to map the human's words onto one of the outcomes.
        {"contains": "approved", "anywhere": True, "reply": "approved"},
    ],
}


class RoundStub(StubModel):
    """The stub model, whose held calls can be held again after a release: the chaos run holds some
    flows' calls in each of its rounds (the stub's own release is for good)."""

    def hold(self, contains: list[str]) -> None:
        """Hold the first call whose last user message contains each of ``contains``, from now on."""
        wait_for(lambda: self.held == 0, 30, "the calls held before to leave")
        with self._lock:
            self._release = threading.Event()
        holds = [{"contains": text, "hold": True, "times": 1, "reply": DRAFT_REPLY} for text in contains]
        self.set_rules(Rules.from_json({**RULES, "rules": [*holds, *RULES["rules"]]}))


@dataclass
class ChaosStack:
    cluster: LocalCluster
    stub: RoundStub
    operator: ChartOperator


@pytest.fixture(scope="module")
def chaos(cluster: LocalCluster) -> Iterator[ChaosStack]:
    stub = RoundStub(Rules.from_json(RULES), host=cluster.host_ip)
    with stub, chart_operator_on(cluster, stub, "chaos", values=["replicaCount=2"]) as operator:
        yield ChaosStack(cluster, stub, operator)
