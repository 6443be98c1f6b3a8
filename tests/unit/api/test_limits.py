"""The bounds of a Flow spec's free-form fields: the message names the field, and the checks
themselves are bounded (no recursion, no whole copy) whatever they are given."""

from __future__ import annotations

import json
from typing import Any

from flowkube_api import constants as c
from flowkube_api.limits import (
    DEPTH_LIMIT,
    METADATA_KEYS_LIMIT,
    POD_FIELD_LIMIT,
    SPEC_ENV_LIMIT,
    depth_over,
    spec_problem,
)
from flowkube_api.models import FlowSpec
from flowkube_api.runspec import runner_spec_env


def nested(levels: int) -> Any:
    value: Any = []
    for _ in range(levels - 1):
        value = [value]
    return value


def test_depth_counts_objects_and_lists_and_stops_without_recursion() -> None:
    assert not depth_over(nested(DEPTH_LIMIT)) and depth_over(nested(DEPTH_LIMIT + 1))
    assert not depth_over({"a": [{"b": "text"}]}, limit=3) and depth_over({"a": [{"b": []}]}, limit=3)
    assert depth_over(nested(200_000))  # far past Python's recursion limit


def test_a_reasonable_spec_passes() -> None:
    spec = {"flowRef": "a:B", "inputs": {"topic": "AI", "items": list(range(100))},
            "env": [{"name": "A", "value": "b"}], "podTemplate": {"tolerations": [{"key": "gpu"}]}}
    assert spec_problem(spec) is None


def test_each_problem_names_its_field() -> None:
    deep = spec_problem({"flowRef": "a:B", "inputs": {"x": nested(40)}})
    assert deep is not None and deep.startswith("spec.inputs nests") and str(DEPTH_LIMIT) in deep
    wide = spec_problem({"flowRef": "a:B", "podTemplate": {"affinity": {"k": "v" * POD_FIELD_LIMIT}}})
    assert wide is not None and wide.startswith("spec.podTemplate.affinity is ")
    big = spec_problem({"definition": {"name": "d"}, "inputs": {"blob": "x" * SPEC_ENV_LIMIT}})
    assert big is not None and big.startswith("spec.inputs and spec.definition are ")
    assert "spec.inputs " in big and f"limit is {SPEC_ENV_LIMIT}" in big


def test_pod_labels_and_annotations_are_bounded_in_count_and_label_values_in_length() -> None:
    """Kubernetes bounds neither count: a Flow's pods get at most 64 of each, and a label value the
    API server would refuse at pod create is refused at apply, naming the key."""
    def meta(**parts: Any) -> dict[str, Any]:
        return {"flowRef": "a:B", "podTemplate": {"metadata": parts}}

    many = {f"k{i}": "v" for i in range(METADATA_KEYS_LIMIT)}
    assert spec_problem(meta(labels=many, annotations=many)) is None
    over = spec_problem(meta(annotations={**many, "one-more": "v"}))
    assert over == f"spec.podTemplate.metadata.annotations has 65 keys; the limit is {METADATA_KEYS_LIMIT}"
    long = spec_problem(meta(labels={"team": "a", "tier": "x" * 64}))
    assert long == 'spec.podTemplate.metadata.labels["tier"] is 64 characters; a label value\'s limit is 63'
    assert spec_problem(meta(annotations={"note": "x" * 1000})) is None


def env(spec: dict[str, Any]) -> str:
    """FLOWKUBE_SPEC as the operator writes it into the pod."""
    return runner_spec_env(FlowSpec.model_validate(spec))


def test_the_bound_is_what_one_environment_string_may_hold() -> None:
    # Linux: "NAME=value" with its NUL at most 128 KiB (MAX_ARG_STRLEN); one byte more and no runner starts.
    inputs = {"t": ""}
    spec: dict[str, Any] = {"flowRef": "a:B", "inputs": inputs, "budget": {"maxCost": "2.50"}}
    inputs["t"] = "x" * (SPEC_ENV_LIMIT - len(env(spec)))
    assert len(env(spec)) == SPEC_ENV_LIMIT and spec_problem(spec) is None
    assert len(f"{c.ENV_SPEC}={env(spec)}".encode()) + 1 <= 128 * 1024
    inputs["t"] += "x"
    assert spec_problem(spec) is not None
    assert json.loads(env(spec))["inputs"] == inputs


def test_the_bound_measures_multibyte_text_as_the_pod_gets_it() -> None:
    # Non-ASCII text goes into the pod escaped (\uXXXX, 6 bytes a character): the bound counts those bytes.
    spec: dict[str, Any] = {"flowRef": "a:B", "inputs": {"t": "é" * (SPEC_ENV_LIMIT // 6)}}
    assert len(env(spec)) > SPEC_ENV_LIMIT
    problem = spec_problem(spec)
    assert problem is not None and f"are {len(env(spec))} bytes as JSON" in problem


def test_a_spec_the_model_refuses_is_refused_naming_the_field() -> None:
    # The API server checks the schema before the webhook does; a Flow that got in while it was
    # different (or the reconcile's check of a stored one) still names what is wrong.
    assert spec_problem({"flowRef": "a:B", "budget": {"maxTotalTokens": 0}}) == (
        "spec.budget.maxTotalTokens: Input should be greater than or equal to 1")
    assert spec_problem({"flowRef": "a:B", "definition": {"name": "d"}}) == (
        "spec: exactly one of spec.definition or spec.flowRef must be set")


def test_an_image_that_is_not_a_reference_is_refused_naming_the_field() -> None:
    """`spec.image: ../../etc` (or a NUL byte, or upper-case path components) was admitted, and its pod
    waited forever as InvalidImageName; references a registry takes still pass."""
    for bad in ("../../etc", "runner\x00:1", "Team/Runner:1", "runner:", "/abs/path"):
        problem = spec_problem({"flowRef": "a:B", "image": bad})
        assert problem is not None and problem.startswith("spec.image: String should match pattern"), (bad, problem)
    for good in ("python", "localhost/flowkube-devstack:bfba7bf81b3f", "registry.example.com:5000/team/runner:1",
                 "ghcr.io/flowkube/flowkube-runner:0.1.0@sha256:" + "a" * 64):
        assert spec_problem({"flowRef": "a:B", "image": good}) is None, good
