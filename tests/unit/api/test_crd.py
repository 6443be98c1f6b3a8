"""The CRD the models generate is a structural schema the API server accepts as is."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from flowkube_api import crd
from flowkube_api.models import FlowSpec


def _walk(schema: dict[str, Any], path: str = "") -> list[str]:
    problems = []
    for banned in ("$ref", "anyOf", "oneOf", "allOf", "default"):
        if banned in schema and not (banned == "anyOf" and schema.get("x-kubernetes-int-or-string")):
            problems.append(f"{path}: {banned}")
    if "type" not in schema and not schema.get("x-kubernetes-int-or-string") \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        problems.append(f"{path}: no type")
    for name, sub in schema.get("properties", {}).items():
        problems += _walk(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            problems += _walk(schema[key], f"{path}[{key}]")
    return problems


def test_schema_is_structural() -> None:
    doc = yaml.safe_load(crd.render())
    schema = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _walk(schema) == []


def test_every_status_field_of_the_contract_is_declared() -> None:
    doc = yaml.safe_load(crd.render())
    status = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"]
    for field in ("phase", "conditions", "observedGeneration", "startedAt", "finishedAt", "message",
                  "flowId", "runs", "feedback", "usage", "result"):
        assert field in status, field
    fb = status["feedback"]["properties"]
    assert set(fb) >= {"request", "response", "history"}
    assert set(fb["response"]["properties"]) == {"text", "requestId", "respondedBy"}
    usage = status["usage"]["properties"]
    assert "byModel" in usage and "cacheCreationTokens" in usage


@pytest.mark.parametrize("spec", [{"flowRef": "pkg.mod:Cls"}, {"definition": {"name": "x", "methods": []}}])
def test_valid_specs_parse(spec: dict[str, Any]) -> None:
    FlowSpec.model_validate(spec)
