"""Every example under examples/flows/ reaches the end state its header documents.

Applied as a user would (``kubectl apply -f``), run by the real runner against the stub model
(the operator points runner pods at it; the examples' ``openai-api`` Secret holds a stub key).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster
from tests.integration.conftest import Flows
from tests.integration.realrunner import RealRunnerStack, real_runner_stack

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "flows"
RULES = {
    "default": "A plain reply.",
    "rules": [{"contains": "approved", "anywhere": True, "reply": "approved"}],
}
RUN_TIMEOUT = 180


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[RealRunnerStack]:
    with real_runner_stack(cluster, RULES, "examples") as s:
        yield s


def example(name: str) -> tuple[Path, dict[str, Any], str]:
    path = EXAMPLES / name
    text = path.read_text()
    found = re.search(r"^# Documented end state: (.+)$", text, re.MULTILINE)
    assert found, f"{name} documents no end state"
    return path, yaml.safe_load(text), found.group(1)


def apply(stack: RealRunnerStack, flows: Flows, path: Path) -> None:
    # The examples read the model key from this Secret; the stub takes any key.
    stack.cluster.kubectl("create", "secret", "generic", "openai-api", "-n", flows.ns,
                          "--from-literal=OPENAI_API_KEY=stub")
    stack.cluster.kubectl("apply", "-n", flows.ns, "-f", str(path))


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_every_example_is_covered() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.yaml")) == [
        "budget-retries.yaml", "class-flow.yaml", "inline-feedback.yaml"]


def test_inline_feedback(stack: RealRunnerStack, flows: Flows) -> None:
    path, obj, documented = example("inline-feedback.yaml")
    assert documented.startswith("AwaitingFeedback; once answered, Succeeded")
    name, mark = obj["metadata"]["name"], len(stack.stub.ledger())
    apply(stack, flows, path)

    st = flows.wait_phase(name, "AwaitingFeedback", timeout=RUN_TIMEOUT)
    assert st["feedback"]["request"]["output"] == "A plain reply."  # the draft, shown to the reviewer
    assert "version 1.4.0" in stack.stub.ledger()[mark]["lastUser"]  # spec.inputs reached the state
    stack.cluster.kubectl("patch", "flow", name, "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
    st = flows.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert st["feedback"]["history"][0]["response"] == "approved"
    # "approved" routed to publish (not shelve, whose output would start with "shelved: ").
    assert any("Polish for publication: A plain reply." in e["lastUser"] for e in stack.stub.ledger()[mark:])
    assert st["result"]["output"] == "A plain reply."
    assert Usage.model_validate(st["usage"]) == stack.usage_since(mark)


def test_class_flow(stack: RealRunnerStack, flows: Flows) -> None:
    path, obj, documented = example("class-flow.yaml")
    assert documented.startswith("Succeeded")
    name, mark = obj["metadata"]["name"], len(stack.stub.ledger())
    apply(stack, flows, path)
    st = flows.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert st["result"]["output"] == "A plain reply."
    usage = Usage.model_validate(st["usage"])
    assert usage == stack.usage_since(mark) and usage.successful_requests == 2


def test_budget_retries(stack: RealRunnerStack, flows: Flows) -> None:
    path, obj, documented = example("budget-retries.yaml")
    assert documented.startswith("Failed, reason BudgetExceeded, after exactly one run")
    name, mark = obj["metadata"]["name"], len(stack.stub.ledger())
    apply(stack, flows, path)
    st = flows.wait_phase(name, "Failed", timeout=RUN_TIMEOUT)
    assert cond(st, "Succeeded")["reason"] == "BudgetExceeded"
    assert len(st["runs"]) == 1 and obj["spec"]["retries"]["limit"] > 0
    usage = Usage.model_validate(st["usage"])
    assert usage == stack.usage_since(mark)
    assert usage.total_tokens > obj["spec"]["budget"]["maxTotalTokens"]


def test_a_template_and_a_flow_of_it(stack: RealRunnerStack, flows: Flows) -> None:
    templates = EXAMPLES.parent / "templates"
    assert sorted(p.name for p in templates.glob("*.yaml")) == ["nightly-report.yaml", "report-flow.yaml"]
    path = templates / "report-flow.yaml"
    text = path.read_text()
    assert re.search(r"^# Documented end state: Succeeded", text, re.MULTILINE)
    name, mark = yaml.safe_load(text)["metadata"]["name"], len(stack.stub.ledger())
    apply(stack, flows, templates / "nightly-report.yaml")
    stack.cluster.kubectl("apply", "-n", flows.ns, "-f", str(path))
    st = flows.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert (st["template"]["name"], st["template"]["generation"]) == ("nightly-report", 1)
    assert "Write a 150-word report about Kubernetes operators." in stack.stub.ledger()[mark]["lastUser"]
    usage = Usage.model_validate(st["usage"])
    assert usage == stack.usage_since(mark) and usage.successful_requests == 1


def test_a_cronflow_of_the_template_triggered_now(stack: RealRunnerStack, flows: Flows) -> None:
    """examples/cronflows/ runs at 02:00 Berlin time: `kubectl flow trigger` starts its Flow now, and
    the CronFlow counts it (status.active, then status.usage)."""
    import json
    import os
    import subprocess
    import sys

    cronflows = EXAMPLES.parent / "cronflows"
    assert sorted(p.name for p in cronflows.glob("*.yaml")) == ["nightly-report.yaml"]
    assert re.search(r"^# Documented end state: once a night", (cronflows / "nightly-report.yaml").read_text(),
                     re.MULTILINE)
    apply(stack, flows, EXAMPLES.parent / "templates" / "nightly-report.yaml")
    stack.cluster.kubectl("apply", "-n", flows.ns, "-f", str(cronflows / "nightly-report.yaml"))
    env = {**os.environ, "KUBECONFIG": str(stack.cluster.kubeconfig), "KUBECTL": str(stack.cluster.bins["kubectl"])}
    mark = len(stack.stub.ledger())
    out = subprocess.run([sys.executable, "-m", "flowkube_kubectl", "-n", flows.ns, "trigger", "nightly-operators"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    name = out.stdout.strip()
    assert name.startswith("nightly-operators-manual-"), name
    st = flows.wait_phase(name, "Succeeded", timeout=RUN_TIMEOUT)
    assert st["template"]["name"] == "nightly-report"
    assert "report about Kubernetes operators." in stack.stub.ledger()[mark]["lastUser"]
    usage = Usage.model_validate(st["usage"])
    assert usage == stack.usage_since(mark)

    def cronflow_counted() -> dict[str, Any] | None:
        got = json.loads(stack.cluster.kubectl("get", "cronflow", "nightly-operators", "-n", flows.ns,
                                               "-o", "json").stdout).get("status") or {}
        return got if (got.get("usage") or {}).get("totalTokens") == usage.total_tokens else None

    from flowkube_devstack.cluster import wait_for

    wait_for(lambda: cronflow_counted() is not None, 60, "the CronFlow's usage counting the triggered Flow")
    status = cronflow_counted()
    assert status is not None and not status.get("active") and status["lastSuccessfulTime"]
    assert "lastScheduleTime" not in status, "a triggered run is not a scheduled time"
