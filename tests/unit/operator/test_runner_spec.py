"""What the operator writes of a Flow's spec into its runner pods (FLOWKUBE_SPEC), and the budget
rule it applies before a run: both are flowkube_api's, the runner's too."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

from flowkube_api import constants as c
from flowkube_api.limits import spec_problem
from flowkube_api.models import FlowSpec
from flowkube_api.report import TokenUsage, Usage
from flowkube_api.runspec import RunnerSpec, runner_spec_env
from flowkube_operator.flows.reconcile import budget_spent
from flowkube_operator.settings import Settings
from tests.unit.operator.pods import pod_of as runner_pod


def flow(**spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "f", "namespace": "ns", "uid": "u1"}, "spec": spec}


def pod_spec_env(body: dict[str, Any]) -> str:
    pod = runner_pod(body, index=0, trigger=c.Trigger.KICKOFF, settings=Settings())
    (value,) = [e["value"] for e in pod["spec"]["containers"][0]["env"] if e["name"] == c.ENV_SPEC]
    assert isinstance(value, str)
    return value


def test_the_pods_flowkube_spec_is_the_validated_spec_and_round_trips() -> None:
    spec = {"definition": {"name": "Research", "methods": {"go": {"start": True}}, "state": None},
            "inputs": {"topic": "AI", "draft": None}, "budget": {"maxTotalTokens": 500, "maxCost": "2.50"},
            "env": [{"name": "A", "value": "b"}], "retries": {"limit": 1}}
    text = pod_spec_env(flow(**spec))
    validated = FlowSpec.model_validate(spec)
    assert text == runner_spec_env(validated)  # the very text the webhook's bound measured
    assert spec_problem(spec) is None
    parsed = RunnerSpec.from_env(text)
    assert parsed == RunnerSpec.of(validated) and parsed.env() == text
    assert parsed.budget == validated.budget and parsed.budget is not None and parsed.budget.max_cost == Decimal("2.5")
    assert parsed.inputs == {"topic": "AI", "draft": None}
    assert parsed.definition_document() == spec["definition"]


def test_the_pods_flowkube_spec_of_a_flow_ref_keeps_the_wire_as_it_was() -> None:
    text = pod_spec_env(flow(flowRef="pkg.flows:Research", inputs={"topic": "AI"}, budget={"maxTotalTokens": 5}))
    assert text == '{"budget":{"maxTotalTokens":5},"flowRef":"pkg.flows:Research","inputs":{"topic":"AI"}}'


def spent(tokens: int, cost: str = "0") -> Usage:
    t = TokenUsage(total_tokens=tokens, prompt_tokens=tokens, cost=Decimal(cost))
    return Usage(**t.model_dump(), by_model={"m": t})


def test_no_run_starts_once_the_budget_is_reached_exactly() -> None:
    tokens = FlowSpec.model_validate({"flowRef": "a:B", "budget": {"maxTotalTokens": 100}})
    assert budget_spent(tokens, spent(99)) is None
    assert budget_spent(tokens, spent(100)) == "100 tokens used of budget.maxTotalTokens=100"
    assert budget_spent(tokens, spent(101)) == "101 tokens used of budget.maxTotalTokens=100"
    money = FlowSpec.model_validate({"flowRef": "a:B", "budget": {"maxCost": "0.01"}})
    assert budget_spent(money, spent(10**6, "0.0099")) is None
    assert budget_spent(money, spent(1, "0.01")) == "USD 0.01 spent of budget.maxCost=0.01"
    assert budget_spent(FlowSpec.model_validate({"flowRef": "a:B"}), spent(10**9, "1000")) is None


def test_tracing_on_gives_each_pod_its_runs_span_in_the_flows_trace_and_a_flow_cannot_redirect_it() -> None:
    from flowkube_api import traces

    body = flow(definition={"schema": "crewai.flow/v1", "name": "X", "methods": {}},
                env=[{"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": "http://tenant"}])

    def env(settings: Settings, index: int) -> dict[str, str]:
        pod = runner_pod(body, index=index, trigger=c.Trigger.RETRY, settings=settings)
        return {e["name"]: e.get("value", "") for e in pod["spec"]["containers"][0]["env"]}

    off = env(Settings(), 0)
    assert (off[c.ENV_TRACEPARENT], off[c.ENV_TRACES_ENDPOINT]) == ("", ""), "blanked: a Flow cannot set them"
    on = env(Settings(otel_exporter_otlp_endpoint="http://collector:4318"), 2)
    assert on[c.ENV_TRACEPARENT] == traces.traceparent(traces.trace_id("u1"), traces.run_span_id("u1", 2))
    assert on[c.ENV_TRACES_ENDPOINT] == "http://collector:4318/v1/traces"
    runner = env(Settings(otel_exporter_otlp_endpoint="http://collector:4318",
                          tracing_runner_endpoint="http://otel.tenant-gw:4318/v1/traces"), 0)
    assert runner[c.ENV_TRACES_ENDPOINT] == "http://otel.tenant-gw:4318/v1/traces"
