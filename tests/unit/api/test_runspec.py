"""FLOWKUBE_SPEC is one model on both sides (``flowkube_api.runspec``), and the budget one rule
(``Budget.exceeded_by``) for the operator and the runner."""

from __future__ import annotations

import json
from decimal import Decimal
from typing import Any

import pytest
from pydantic import ValidationError

from flowkube_api.models import Budget, FlowSpec
from flowkube_api.runspec import RunnerSpec, runner_spec_env, spec_error_text


def schema_of(model: type[FlowSpec] | type[RunnerSpec], field: str) -> Any:
    """The JSON schema of one property, descriptions aside (they are the CRD's documentation)."""
    schema = model.model_json_schema(by_alias=True)

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k not in ("description", "title")}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value

    return strip(schema["properties"][field]), strip(schema.get("$defs", {}))


def test_the_runner_spec_is_the_flow_specs_own_fields() -> None:
    runner_fields = {f.alias or name for name, f in RunnerSpec.model_fields.items()}
    assert runner_fields == {"definition", "flowRef", "inputs", "budget", "retries", "checkpoints", "forkFrom"}
    for name in runner_fields:
        ours, theirs = schema_of(RunnerSpec, name), schema_of(FlowSpec, name)
        assert ours[0] == theirs[0], name
        for ref in json.dumps(ours[0]).split('"$ref": "#/$defs/')[1:]:
            model = ref.split('"')[0]
            assert ours[1][model] == theirs[1][model], model
    assert RunnerSpec.model_fields["budget"].annotation == FlowSpec.model_fields["budget"].annotation


def test_the_pods_text_round_trips_through_the_model() -> None:
    spec = FlowSpec.model_validate({
        "definition": {"name": "d", "state": None, "methods": {"a": {"start": True, "x": None}}},
        "inputs": {"topic": "AI", "none": None, "nested": {"k": [1, 2.5, "é"]}},
        "budget": {"maxTotalTokens": 5, "maxCost": "2.50"},
        "image": "elsewhere:1", "retries": {"limit": 2},  # not the runner's (keepTasks is true): left out
    })
    text = runner_spec_env(spec)
    assert json.loads(text) == {
        # camelCase keys as before; the definition and the inputs as written, their nulls included
        "definition": {"name": "d", "state": None, "methods": {"a": {"start": True, "x": None}}},
        "inputs": {"topic": "AI", "none": None, "nested": {"k": [1, 2.5, "é"]}},
        "budget": {"maxTotalTokens": 5, "maxCost": "2.5"},
    }
    parsed = RunnerSpec.from_env(text)
    assert parsed == RunnerSpec.of(spec) and parsed.env() == text
    assert parsed.budget == spec.budget and parsed.inputs == spec.inputs
    assert parsed.definition_document() == {"name": "d", "state": None, "methods": {"a": {"start": True, "x": None}}}


def test_the_wire_is_the_compact_sorted_json_it_was() -> None:
    spec = FlowSpec.model_validate({"flowRef": "pkg.flows:Research", "inputs": {"b": 1, "a": "x"}})
    assert runner_spec_env(spec) == '{"flowRef":"pkg.flows:Research","inputs":{"a":"x","b":1}}'
    off = FlowSpec.model_validate({"flowRef": "pkg.flows:Research", "retries": {"keepTasks": False}})
    assert RunnerSpec.from_env(runner_spec_env(off)).retries == off.retries  # what the runner reads


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ({"flowRef": "m:C", "budget": {"maxTotalTokens": 0}},
         "spec.budget.maxTotalTokens: Input should be greater than or equal to 1"),
        ({"flowRef": "m:C", "budget": {"maxCost": "-1"}}, "spec.budget.maxCost: an amount of money is a decimal"),
        ({"flowRef": "not a ref"}, "spec.flowRef: String should match pattern"),
        ({"definition": {"name": ""}}, "spec.definition.name: String should have at least 1 character"),
        ({"flowRef": "m:C", "inputs": [1]}, "spec.inputs: Input should be an object"),
        ({"flowRef": "m:C", "definition": {"name": "d"}},
         "spec: exactly one of spec.definition or spec.flowRef must be set"),
        ({}, "spec: exactly one of spec.definition or spec.flowRef must be set"),
    ],
)
def test_what_the_api_refuses_the_runner_refuses_naming_the_field(raw: dict[str, Any], expected: str) -> None:
    with pytest.raises(ValidationError) as error:
        RunnerSpec.from_env(json.dumps(raw))
    assert spec_error_text(error.value).startswith(expected)


# ------------------------------------------------------------------------------------ the budget rule


def test_a_budget_reached_stops_what_would_start_and_only_one_crossed_ends_a_run() -> None:
    tokens = Budget(max_total_tokens=100)
    assert tokens.exceeded_by(99, Decimal(0)) is None
    assert tokens.exceeded_by(100, Decimal(0)) == "maxTotalTokens"  # reached: no run, no call starts
    assert tokens.exceeded_by(100, Decimal(0), starting=False) is None  # a call that lands on it: not crossed
    assert tokens.exceeded_by(101, Decimal(0), starting=False) == "maxTotalTokens"
    assert tokens.figure("maxTotalTokens", 100, Decimal(0)) == "100 tokens used of budget.maxTotalTokens=100"

    money = Budget(max_cost=Decimal("2.50"))
    assert money.exceeded_by(10**9, Decimal("2.4999")) is None
    assert money.exceeded_by(0, Decimal("2.5")) == "maxCost"
    assert money.exceeded_by(0, Decimal("2.5"), starting=False) is None
    assert money.exceeded_by(0, Decimal("2.5000001"), starting=False) == "maxCost"
    assert money.figure("maxCost", 0, Decimal("2.5031")) == "USD 2.5031 spent of budget.maxCost=2.5"

    both = Budget(max_total_tokens=100, max_cost=Decimal(1))
    assert both.exceeded_by(100, Decimal(1)) == "maxTotalTokens"  # both reached: tokens are named
    assert both.exceeded_by(5, Decimal(1)) == "maxCost"
    assert Budget().exceeded_by(10**9, Decimal(10**9)) is None
