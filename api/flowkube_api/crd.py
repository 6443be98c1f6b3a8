"""The CustomResourceDefinitions (Flow, FlowTemplate, ClusterFlowTemplate, CronFlow, FlowQuota),
rendered from the pydantic models.

The output is committed as crds/flowkube.io_<plural>.yaml; `./dev generate` rewrites them and
`./dev test` fails when one is stale.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from flowkube_api import constants as c
from flowkube_api.models import CronFlowSpec, CronFlowStatus, FlowSpec, FlowStatus, FlowTemplateSpec
from flowkube_api.models.quota import ClusterFlowQuotaSpec, FlowQuotaSpec, FlowQuotaStatus

CRD_DIR = Path(__file__).resolve().parents[2] / "crds"
CRD_FILE = CRD_DIR / f"{c.GROUP}_{c.PLURAL}.yaml"
KINDS = (c.KIND, c.TEMPLATE_KIND, c.CLUSTER_TEMPLATE_KIND, c.CRONFLOW_KIND, c.QUOTA_KIND, c.CLUSTER_QUOTA_KIND)
PLURALS = {c.KIND: c.PLURAL, c.TEMPLATE_KIND: c.TEMPLATE_PLURAL, c.CLUSTER_TEMPLATE_KIND: c.CLUSTER_TEMPLATE_PLURAL,
           c.CRONFLOW_KIND: c.CRONFLOW_PLURAL, c.QUOTA_KIND: c.QUOTA_PLURAL,
           c.CLUSTER_QUOTA_KIND: c.CLUSTER_QUOTA_PLURAL}
CRD_FILES = {kind: CRD_DIR / f"{c.GROUP}_{plural}.yaml" for kind, plural in PLURALS.items()}

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
    if out.pop("x-flowkube-any", False):  # any JSON value: no type at all
        return {k: v for k, v in out.items() if k in ("description", "x-kubernetes-preserve-unknown-fields")}
    if out.get("x-kubernetes-preserve-unknown-fields"):
        out.pop("additionalProperties", None)
        out.setdefault("type", "object")
    if out.get("additionalProperties") == {}:
        out["additionalProperties"] = {"x-kubernetes-preserve-unknown-fields": True}
    if out.get("additionalProperties") is True:
        del out["additionalProperties"]
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _schema_of(model: type[Any]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(raw, defs)


def crd(kind: str = c.KIND) -> dict[str, Any]:
    """The CRD of ``kind`` (one of KINDS)."""
    if kind == c.CRONFLOW_KIND:
        return _cronflow_crd()
    if kind in (c.QUOTA_KIND, c.CLUSTER_QUOTA_KIND):
        return _quota_crd(kind == c.CLUSTER_QUOTA_KIND)
    if kind != c.KIND:
        return _template_crd(kind)
    printer_columns: list[dict[str, Any]] = [
        {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
        {"name": "Definition", "type": "string", "jsonPath": ".status.definition"},
        {"name": "Template", "type": "string", "jsonPath": ".spec.templateRef.name",
         "description": "The FlowTemplate or ClusterFlowTemplate the Flow runs"},
        {"name": "Tokens", "type": "integer", "jsonPath": ".status.usage.totalTokens"},
        {"name": "Cost", "type": "string", "jsonPath": ".status.usage.cost", "description": "USD spent by all runs"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Message", "type": "string", "jsonPath": ".status.message"},
        {"name": "Last-Run", "type": "string", "jsonPath": ".status.runs[-1:].pod", "priority": 1},
        {"name": "Turns", "type": "integer", "jsonPath": ".status.conversation.turns", "priority": 1,
         "description": "Messages a conversation answered"},
        {"name": "Flow-ID", "type": "string", "jsonPath": ".status.flowId", "priority": 1},
    ]
    schema = _object("A crewAI Flow run as Kubernetes runner pods.", FlowSpec, FlowStatus,
                     (63, "it is a label value on runner pods"))
    names = {"kind": c.KIND, "listKind": f"{c.KIND}List", "plural": c.PLURAL, "singular": c.SINGULAR,
             "shortNames": list(c.SHORT_NAMES), "categories": list(c.CATEGORIES)}
    return _definition(names, "Namespaced", schema, printer_columns, status=True)


def _template_crd(kind: str) -> dict[str, Any]:
    cluster = kind == c.CLUSTER_TEMPLATE_KIND
    plural = PLURALS[kind]
    printer_columns: list[dict[str, Any]] = [
        {"name": "Definition", "type": "string", "jsonPath": ".spec.template.definition.name"},
        {"name": "Flow-Ref", "type": "string", "jsonPath": ".spec.template.flowRef"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Description", "type": "string", "jsonPath": ".spec.description", "priority": 1},
    ]
    schema = _object("A Flow spec with declared parameters, shared by every namespace's Flows "
                     "(spec.templateRef.kind: ClusterFlowTemplate)." if cluster else
                     "A Flow spec with declared parameters, for the Flows of its namespace (spec.templateRef).",
                     FlowTemplateSpec)
    names = {"kind": kind, "listKind": f"{kind}List", "plural": plural, "singular": plural[:-1],
             "shortNames": ["cft" if cluster else "ft"], "categories": ["flowkube"]}
    return _definition(names, "Cluster" if cluster else "Namespaced", schema, printer_columns, status=False)


def _cronflow_crd() -> dict[str, Any]:
    printer_columns: list[dict[str, Any]] = [
        {"name": "Schedule", "type": "string", "jsonPath": ".spec.schedule"},
        {"name": "Time-Zone", "type": "string", "jsonPath": ".spec.timeZone"},
        {"name": "Suspend", "type": "boolean", "jsonPath": ".spec.suspend"},
        {"name": "Last-Schedule", "type": "date", "jsonPath": ".status.lastScheduleTime"},
        {"name": "Tokens", "type": "integer", "jsonPath": ".status.usage.totalTokens",
         "description": "Tokens of every Flow it started"},
        {"name": "Cost", "type": "string", "jsonPath": ".status.usage.cost",
         "description": "USD spent by every Flow it started"},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        {"name": "Active", "type": "string", "jsonPath": ".status.active", "priority": 1},
    ]
    schema = _object("Flows started on a schedule, as a CronJob starts Jobs.", CronFlowSpec, CronFlowStatus,
                     (c.CRONFLOW_NAME_LIMIT, "its Flows are named <name>-<scheduled minute>"))
    names = {"kind": c.CRONFLOW_KIND, "listKind": f"{c.CRONFLOW_KIND}List", "plural": c.CRONFLOW_PLURAL,
             "singular": "cronflow", "shortNames": ["cfl"], "categories": ["flowkube", "all"]}
    return _definition(names, "Namespaced", schema, printer_columns, status=True)


def _quota_crd(cluster: bool) -> dict[str, Any]:
    printer_columns: list[dict[str, Any]] = [
        {"name": "Used", "type": "string", "jsonPath": ".status.summary",
         "description": "Each limit's share used in its window"},
        {"name": "Exhausted", "type": "string", "jsonPath": ".status.conditions[?(@.type==\"Exhausted\")].status"},
        {"name": "Resets", "type": "date", "jsonPath": ".status.nextReset",
         "description": "When the first of its calendar windows resets"},
        {"name": "Action", "type": "string", "jsonPath": ".spec.action", "priority": 1},
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    if cluster:
        schema = _object("Spend and token limits over time windows for the Flows of every namespace its "
                         "namespaceSelector picks (a team spanning namespaces).", ClusterFlowQuotaSpec, FlowQuotaStatus)
        names = {"kind": c.CLUSTER_QUOTA_KIND, "listKind": f"{c.CLUSTER_QUOTA_KIND}List",
                 "plural": c.CLUSTER_QUOTA_PLURAL, "singular": "clusterflowquota", "shortNames": ["cfq"],
                 "categories": ["flowkube"]}
        return _definition(names, "Cluster", schema, printer_columns, status=True)
    schema = _object("Spend and token limits over time windows for the Flows of a namespace it selects "
                     "(a team's quota).", FlowQuotaSpec, FlowQuotaStatus)
    names = {"kind": c.QUOTA_KIND, "listKind": f"{c.QUOTA_KIND}List", "plural": c.QUOTA_PLURAL,
             "singular": "flowquota", "shortNames": ["fq"], "categories": ["flowkube"]}
    return _definition(names, "Namespaced", schema, printer_columns, status=True)


def _object(description: str, spec: type[Any], status: type[Any] | None = None,
            name_limit: tuple[int, str] | None = None) -> dict[str, Any]:
    """The openAPIV3Schema of a resource: its spec and status models, and a bound on its name (why)."""
    schema: dict[str, Any] = {"type": "object", "description": description, "required": ["spec"]}
    if name_limit is not None:
        schema["x-kubernetes-validations"] = [
            {"rule": f"size(self.metadata.name) <= {name_limit[0]}",
             "message": f"metadata.name must be at most {name_limit[0]} characters: {name_limit[1]}"}]
    schema["properties"] = {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                            "metadata": {"type": "object"}, "spec": _schema_of(spec)}
    if status is not None:
        schema["properties"]["status"] = _schema_of(status)
    return schema


def _definition(names: dict[str, Any], scope: str, schema: dict[str, Any], columns: list[dict[str, Any]], *,
                status: bool) -> dict[str, Any]:
    version: dict[str, Any] = {"name": c.VERSION, "served": True, "storage": True}
    if status:
        version["subresources"] = {"status": {}}
    version["additionalPrinterColumns"] = columns
    version["schema"] = {"openAPIV3Schema": schema}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{names['plural']}.{c.GROUP}",
            "labels": {"app.kubernetes.io/name": "flowkube", "app.kubernetes.io/part-of": "flowkube"},
        },
        "spec": {"group": c.GROUP, "scope": scope, "names": names, "versions": [version]},
    }


def render(kind: str = c.KIND) -> str:
    header = "# Generated by `./dev generate` from flowkube_api.models. Do not edit.\n"
    return header + yaml.safe_dump(crd(kind), sort_keys=False, width=120)
