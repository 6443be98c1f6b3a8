"""The Flow CustomResourceDefinition, rendered from the pydantic models.

The output is committed as crds/flowkube.io_flows.yaml; `./dev generate` rewrites it and
`./dev test` fails when it is stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flowkube_api import constants as c
from flowkube_api.models import FlowSpec, FlowStatus

CRD_FILE = Path(__file__).resolve().parents[2] / "crds" / f"{c.GROUP}_{c.PLURAL}.yaml"

_DROP = {"title", "default"}  # defaults are applied by the operator, not stored by the API server


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Inline $refs and turn pydantic's JSON Schema into a Kubernetes structural schema."""
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return _structural(merged, defs)
    if "anyOf" in schema:
        return _one_of_any(schema, defs)
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: _structural(sub, defs) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = _structural(value, defs)
        elif key == "enum":
            out[key] = list(value)
        elif key == "const":
            out["enum"] = [value]
        else:
            out[key] = value
    return _open_maps(out)


def _one_of_any(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """An optional field (anyOf: [X, null]) is X; int-or-string keeps its marker; anything else
    cannot be said in a structural schema."""
    options = [o for o in schema["anyOf"] if o.get("type") != "null"]
    rest = {k: v for k, v in schema.items() if k != "anyOf"}
    if schema.get("x-kubernetes-int-or-string"):
        return {k: v for k, v in rest.items() if k not in _DROP}
    if len(options) != 1:
        raise ValueError(f"cannot express anyOf {schema['anyOf']} structurally")
    return _structural({**options[0], **rest}, defs)


def _open_maps(out: dict[str, Any]) -> dict[str, Any]:
    """Free-form maps as the API server says them: x-kubernetes-preserve-unknown-fields."""
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
        out.setdefault("type", "object")
    if out.get("additionalProperties") == {}:
        out["additionalProperties"] = {"x-kubernetes-preserve-unknown-fields": True}
    if out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _schema_of(model: type[FlowSpec] | type[FlowStatus]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def crd() -> dict[str, Any]:
    printer_columns = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Definition", "type": "string", "jsonPath": ".status.definition"},
        {"name": "Tokens", "type": "integer", "jsonPath": ".status.usage.totalTokens"},
        {"name": "Cost", "type": "string", "jsonPath": ".status.usage.cost", "description": "USD spent by all runs"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Message", "type": "string", "jsonPath": ".status.message"},
        {"name": "Last-Run", "type": "string", "jsonPath": ".status.runs[-1:].pod", "priority": 1},
        {"name": "Turns", "type": "integer", "jsonPath": ".status.conversation.turns", "priority": 1,
         "description": "Messages a conversation answered"},
        {"name": "Flow-ID", "type": "string", "jsonPath": ".status.flowId", "priority": 1},
    ]
    schema = {
        "type": "object",
        "description": "A crewAI Flow run as Kubernetes runner pods.",
        "required": ["spec"],
        "x-kubernetes-validations": [
            {"rule": "size(self.metadata.name) <= 63",
             "message": "metadata.name must be at most 63 characters: it is a label value on runner pods"},
        ],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": _schema_of(FlowSpec),
            "status": _schema_of(FlowStatus),
        },
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{c.PLURAL}.{c.GROUP}",
            "labels": {"app.kubernetes.io/name": "flowkube", "app.kubernetes.io/part-of": "flowkube"},
        },
        "spec": {
            "group": c.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": c.KIND,
                "listKind": f"{c.KIND}List",
                "plural": c.PLURAL,
                "singular": c.SINGULAR,
                "shortNames": list(c.SHORT_NAMES),
                "categories": list(c.CATEGORIES),
            },
            "versions": [
                {
                    "name": c.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": printer_columns,
                    "schema": {"openAPIV3Schema": schema},
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `./dev generate` from flowkube_api.models. Do not edit.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
