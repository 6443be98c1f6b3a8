"""FlowTemplates: how a Flow's spec comes out of its template, and which inputs a template refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from flowkube_api import templates
from flowkube_api.models import FlowSpec, FlowTemplate

TEMPLATE_SPEC: dict[str, Any] = {
    "parameters": [
        {"name": "topic", "required": True, "type": "string", "description": "what to write about"},
        {"name": "words", "type": "integer", "default": 300},
        {"name": "tags", "type": "array"},
        {"name": "anything"},
    ],
    "template": {
        "definition": {"name": "Article", "methods": {}},
        "image": "runner:1",
        "env": [{"name": "A", "value": "template"}, {"name": "B", "value": "template"}],
        "inputs": {"style": "plain"},
        "budget": {"maxTotalTokens": 1000},
        "feedback": {"timeoutSeconds": 60},
    },
}
REF = {"templateRef": {"name": "article"}}


def test_the_flows_own_fields_win_env_merges_by_name_and_inputs_key_by_key() -> None:
    spec = templates.effective_spec(TEMPLATE_SPEC, {
        **REF, "inputs": {"topic": "operators", "style": "bold"}, "budget": {"maxTotalTokens": 50},
        "env": [{"name": "B", "value": "flow"}, {"name": "C", "value": "flow"}],
    })
    assert spec["definition"] == TEMPLATE_SPEC["template"]["definition"] and spec["image"] == "runner:1"
    assert spec["budget"] == {"maxTotalTokens": 50}, "a field the Flow sets replaces the template's"
    assert spec["env"] == [{"name": "A", "value": "template"}, {"name": "B", "value": "flow"},
                           {"name": "C", "value": "flow"}]
    assert spec["inputs"] == {"style": "bold", "words": 300, "topic": "operators"}, "template, defaults, Flow"
    assert "templateRef" not in spec
    FlowSpec.model_validate(spec)  # a spec the runner pods can be built from


def test_the_template_object_is_never_changed_by_a_flow() -> None:
    before = repr(TEMPLATE_SPEC)
    spec = templates.effective_spec(TEMPLATE_SPEC, {**REF, "inputs": {"topic": "x"}, "env": [{"name": "A"}]})
    spec["env"][0]["value"] = "changed"
    spec["definition"]["name"] = "changed"
    assert repr(TEMPLATE_SPEC) == before


@pytest.mark.parametrize(("inputs", "problems"), [
    ({"topic": "ok"}, []),
    ({"topic": "ok", "words": 3.0, "tags": [], "anything": {"a": 1}}, []),
    ({}, ['spec.inputs.topic: required by FlowTemplate "article" in namespace "team" (what to write about)']),
    ({"topic": 7}, ['spec.inputs.topic: must be string (a parameter of FlowTemplate "article" in namespace "team"), '
                    "not integer"]),
    ({"topic": "ok", "words": True}, ["spec.inputs.words: must be integer (a parameter of FlowTemplate \"article\" "
                                      'in namespace "team"), not boolean']),
    ({"topic": "ok", "words": 2.5}, ["spec.inputs.words: must be integer (a parameter of FlowTemplate \"article\" "
                                     'in namespace "team"), not number']),
    ({"topic": "ok", "topik": "typo"}, ["spec.inputs.topik: FlowTemplate \"article\" in namespace \"team\" has no "
                                        "parameter 'topik' (its parameters: anything, tags, topic, words)"]),
])
def test_parameters_refuse_what_does_not_fit_naming_the_parameter(inputs: dict[str, Any], problems: list[str]) -> None:
    _, found = templates.problems({"spec": TEMPLATE_SPEC}, "team", {**REF, "inputs": inputs})
    assert found == problems


def test_a_template_without_parameters_takes_any_inputs_and_a_cluster_template_names_no_namespace() -> None:
    spec = {"template": {"flowRef": "pkg.mod:Flow"}}
    shared = {"name": "shared", "kind": "ClusterFlowTemplate"}
    ref: dict[str, Any] = {"templateRef": shared, "inputs": {"free": 1}}
    effective, found = templates.problems({"spec": spec}, "team", ref)
    assert found == [] and effective == {"flowRef": "pkg.mod:Flow", "inputs": {"free": 1}}
    assert templates.template_key("team", shared) == ("ClusterFlowTemplate", "", "shared")
    assert templates.template_key("team", {"name": "t"}) == ("FlowTemplate", "team", "t")
    assert templates.describe_ref("team", shared) == 'ClusterFlowTemplate "shared"'


def test_a_flow_runs_the_copy_in_its_status_not_the_template_as_it_is_now() -> None:
    template = {"kind": "FlowTemplate", "metadata": {"name": "article", "uid": "t1", "generation": 1,
                                                     "resourceVersion": "5"}, "spec": TEMPLATE_SPEC}
    taken = templates.snapshot(template)
    assert taken == {"kind": "FlowTemplate", "name": "article", "uid": "t1", "generation": 1,
                     "resourceVersion": "5", "spec": TEMPLATE_SPEC}
    TEMPLATE_SPEC_CHANGED = {**TEMPLATE_SPEC, "template": {"flowRef": "other:Flow"}}
    template["spec"] = TEMPLATE_SPEC_CHANGED
    flow = {"metadata": {"name": "f"}, "spec": {**REF, "inputs": {"topic": "x"}}, "status": {"template": taken}}
    assert templates.effective_flow(flow)["spec"]["definition"]["name"] == "Article"
    untaken = {"metadata": {"name": "f"}, "spec": {**REF}}
    assert templates.effective_flow(untaken) is untaken


def test_a_snapshot_is_named_by_its_content_and_its_hash_covers_all_its_data() -> None:
    template = {"kind": "FlowTemplate", "metadata": {"name": "article", "uid": "t1", "generation": 1,
                                                     "resourceVersion": "5"}, "spec": TEMPLATE_SPEC}
    data = templates.snapshot(template)
    name = templates.snapshot_name(data)
    assert name.startswith("article-") and len(name) == len("article-") + 16
    # The same generation is the same snapshot, whoever takes it and whatever the key order.
    reordered = {"spec": dict(reversed(list(TEMPLATE_SPEC.items()))), **{k: v for k, v in data.items() if k != "spec"}}
    assert templates.snapshot_name(reordered) == name and templates.data_hash(reordered) == templates.data_hash(data)
    # A label changed (resourceVersion, not generation): the same name; its data's hash tells them apart.
    relabelled = {**data, "resourceVersion": "6"}
    assert templates.snapshot_name(relabelled) == name and templates.data_hash(relabelled) != templates.data_hash(data)
    for changed in ({**data, "generation": 2}, {**data, "uid": "t2"}, {**data, "kind": "ClusterFlowTemplate"},
                    {**data, "spec": {**TEMPLATE_SPEC, "parameters": []}}):
        assert templates.snapshot_name(changed) != name
    obj = templates.snapshot_object("team", data)
    assert obj["apiVersion"] == "apps/v1" and obj["kind"] == "ControllerRevision" and obj["revision"] == 1
    assert obj["metadata"] == {"name": name, "namespace": "team", "labels": {
        "app.kubernetes.io/managed-by": "flowkube", "flowkube.io/template": "article"}}
    assert obj["data"] == data
    ref = templates.snapshot_ref(data)
    assert ref == {"kind": "FlowTemplate", "name": "article", "uid": "t1", "generation": 1, "resourceVersion": "5",
                   "snapshot": name, "hash": templates.data_hash(data)}
    assert templates.snapshot_problem(ref, obj) is None
    assert "is gone" in str(templates.snapshot_problem(ref, None))
    squatted = {**obj, "data": {**data, "spec": {"template": {"image": "evil"}}}}
    assert "does not hold what this Flow took" in str(templates.snapshot_problem(ref, squatted))
    # A long template name: the object name and the label value stay within Kubernetes' limits.
    long = templates.snapshot_object("team", {**data, "name": "a" * 250})
    assert len(long["metadata"]["name"]) <= 253 and len(long["metadata"]["labels"]["flowkube.io/template"]) <= 63


def test_a_flow_runs_its_snapshot_and_an_older_operators_status_copy_still_runs() -> None:
    template = {"kind": "FlowTemplate", "metadata": {"name": "article", "uid": "t1", "generation": 1},
                "spec": TEMPLATE_SPEC}
    ref = templates.snapshot_ref(templates.snapshot(template))
    flow = {"metadata": {"name": "f"}, "spec": {**REF, "inputs": {"topic": "x"}}, "status": {"template": ref}}
    assert templates.effective_flow(flow) is flow, "not resolved without the snapshot's spec"
    assert templates.effective_flow(flow, TEMPLATE_SPEC)["spec"]["definition"]["name"] == "Article"
    old = {**flow, "status": {"template": {"kind": "FlowTemplate", "name": "article", "spec": TEMPLATE_SPEC}}}
    assert templates.effective_flow(old)["spec"]["image"] == "runner:1"
    assert templates.effective_flow(old, {"template": {"image": "ignored"}})["spec"]["image"] == "runner:1"


def test_the_models_refuse_bad_parameter_names_and_types() -> None:
    with pytest.raises(ValidationError):
        FlowTemplate.model_validate({"spec": {"parameters": [{"name": "no spaces"}], "template": {"flowRef": "a:B"}}})
    with pytest.raises(ValidationError):
        FlowTemplate.model_validate({"spec": {"parameters": [{"name": "n", "type": "int"}],
                                              "template": {"flowRef": "a:B"}}})
    assert FlowSpec.model_validate({"templateRef": {"name": "t"}}).template_ref is not None


def test_a_refusal_stays_small_however_many_inputs_and_parameters() -> None:
    spec = {"parameters": [{"name": f"p{'x' * 120}{i}"} for i in range(64)], "template": {"flowRef": "a:B"}}
    inputs = {f"k{'y' * 120}{i}": i for i in range(5000)}
    _, found = templates.problems({"spec": spec}, "team", {**REF, "inputs": inputs})
    assert len(found) == 1 and len(found[0]) < 4000, len(found[0])
    assert "and 4990 more" in found[0]
