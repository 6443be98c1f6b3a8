"""FlowTemplates and ClusterFlowTemplates: how a Flow's spec comes out of its template.

A Flow that names a template (`spec.templateRef`) runs the template's `spec.template` with the
Flow's own fields over it:

- a field the Flow sets replaces the template's, except
- `inputs`, merged key by key: the template's `inputs`, then its parameters' defaults, then the
  Flow's `inputs`;
- `env` and `notifications`, merged by `name` (the Flow's entry replaces the template's of the same
  name; the others are kept, the template's first).

When the template declares parameters, the Flow's `inputs` may hold only those, each of its
declared JSON Schema type, and every required one without a default must be there. The admission
webhook refuses a Flow that breaks this, naming the parameter; the operator checks it again at the
Flow's first reconcile, when it takes the template. From then on the Flow runs the template as it
took it: a later change of the template changes no Flow made before it.

The take stores the template once per generation, not once per Flow: a *snapshot*, an immutable
`apps/v1 ControllerRevision` in the Flow's namespace whose `data` is {kind, name, uid, generation,
resourceVersion, spec}, named by a hash of {kind, uid, generation, spec} (`snapshot_name`), so every
Flow that takes the same generation names the same object. `status.template` holds the reference
(`snapshot_ref`: kind, name, uid, generation, resourceVersion, the snapshot's name and the hash of its
data), no spec. A `status.template` an older operator wrote still holds the whole `spec`; such a Flow
keeps running from it (`taken_spec`).

Pure: shared by the webhook, the reconcile, the console and `kubectl flow` (standard library only).
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Mapping
from typing import Any

from flowkube_api import constants as c

Body = dict[str, Any]

PROBLEMS_SHOWN = 10  # problems (and names in one) a refusal lists: its size is bounded whatever the Flow holds
BY_NAME = ("env", "notifications")  # lists merged entry by entry, keyed by `name`

_TYPES = ("string", "integer", "number", "boolean", "object", "array")  # JSON Schema's, as parameters declare


def template_key(namespace: str, ref: Mapping[str, Any]) -> tuple[str, str, str]:
    """(kind, namespace, name) of the template a Flow in `namespace` refers to (namespace "" for a
    ClusterFlowTemplate)."""
    kind = str(ref.get("kind") or c.TEMPLATE_KIND)
    return kind, ("" if kind == c.CLUSTER_TEMPLATE_KIND else namespace), str(ref.get("name") or "")


def describe_ref(namespace: str, ref: Mapping[str, Any]) -> str:
    kind, ns, name = template_key(namespace, ref)
    return f'{kind} "{name}"' + (f' in namespace "{ns}"' if ns else "")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return "null"


def _type_ok(value: Any, want: str) -> bool:
    have = _json_type(value)
    if want == "integer" and have == "number":
        return float(value).is_integer()  # JSON has one number type: 3.0 is an integer to JSON Schema
    return have == want or (want == "number" and have == "integer")


def parameter_problems(template_spec: Mapping[str, Any], inputs: Mapping[str, Any] | None, what: str) -> list[str]:
    """Why `inputs` (a Flow's spec.inputs) do not fit the template's parameters, one line per
    parameter, each naming it. `what` names the template in the messages."""
    params = [p for p in template_spec.get("parameters") or [] if isinstance(p, Mapping)]
    given = dict(inputs or {})
    problems = []
    if params:
        names = {str(p.get("name")) for p in params}
        unknown = sorted(set(given) - names)
        if unknown:  # one line however many: a message never grows with the inputs times the parameters
            listed = ", ".join(f"{k[:64]!r}" for k in unknown[:PROBLEMS_SHOWN])
            more = f" and {len(unknown) - PROBLEMS_SHOWN} more" if len(unknown) > PROBLEMS_SHOWN else ""
            params_listed = ", ".join(sorted(names)[:PROBLEMS_SHOWN]) + (" ..." if len(names) > PROBLEMS_SHOWN else "")
            problems.append(f"spec.inputs.{unknown[0][:64]}: {what} has no parameter {listed}{more} "
                            f"(its parameters: {params_listed})")
    for p in params:
        name, want = str(p.get("name")), p.get("type")
        if name in given:
            value = given[name]
            if want in _TYPES and not _type_ok(value, str(want)):
                problems.append(f"spec.inputs.{name}: must be {want} (a parameter of {what}), not {_json_type(value)}")
        elif p.get("required") and "default" not in p:
            problems.append(f"spec.inputs.{name}: required by {what}"
                            + (f" ({str(p['description'])[:200]})" if p.get("description") else ""))
    if len(problems) > PROBLEMS_SHOWN:
        problems = [*problems[:PROBLEMS_SHOWN], f"and {len(problems) - PROBLEMS_SHOWN} more"]
    return problems


def _merge_by_name(base: list[Any], own: list[Any]) -> list[Any]:
    named = {e.get("name"): e for e in own if isinstance(e, Mapping)}
    out = [copy.deepcopy(named.pop(e.get("name"))) if isinstance(e, Mapping) and e.get("name") in named
           else copy.deepcopy(e) for e in base]
    return out + [copy.deepcopy(e) for e in own if not isinstance(e, Mapping) or e.get("name") in named]


def effective_spec(template_spec: Mapping[str, Any], flow_spec: Mapping[str, Any]) -> Body:
    """The spec a Flow runs: the template's `spec.template` with the Flow's own fields over it (see the
    module's docstring). `template_spec` is the template's `spec`."""
    out: Body = copy.deepcopy(dict(template_spec.get("template") or {}))
    for key, value in flow_spec.items():
        if key in ("templateRef", "inputs") or value is None:
            continue
        if key in BY_NAME and isinstance(value, list) and isinstance(out.get(key), list):
            out[key] = _merge_by_name(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    inputs: Body = dict(out.get("inputs") or {})
    for p in template_spec.get("parameters") or []:
        if isinstance(p, Mapping) and "default" in p and p.get("default") is not None:
            inputs[str(p.get("name"))] = copy.deepcopy(p["default"])
    inputs.update(copy.deepcopy(dict(flow_spec.get("inputs") or {})))
    if inputs:
        out["inputs"] = inputs
    return out


SNAPSHOT_API_VERSION = "apps/v1"
SNAPSHOT_KIND = "ControllerRevision"
SNAPSHOT_PLURAL = "controllerrevisions"
NAME_HASH_CHARS = 16  # hex digits of the content hash in a snapshot's name
NAME_PREFIX_CHARS = 200  # of the template's name in a snapshot's (a name may have 253)
LABEL_VALUE_CHARS = 63


def canonical(value: Any) -> bytes:
    """The JSON every hash here is taken of: sorted keys, no spaces, UTF-8 (the same bytes whoever
    computes it: operator, console, webhook)."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def snapshot(template: Mapping[str, Any]) -> Body:
    """A snapshot's `data` for a Flow that takes `template` (a FlowTemplate or ClusterFlowTemplate object)."""
    meta = template.get("metadata") or {}
    out: Body = {"kind": template.get("kind") or c.TEMPLATE_KIND, "name": meta.get("name", ""),
                 "uid": meta.get("uid"), "generation": meta.get("generation"),
                 "resourceVersion": meta.get("resourceVersion"), "spec": copy.deepcopy(template.get("spec") or {})}
    return {k: v for k, v in out.items() if v is not None}


def data_hash(data: Mapping[str, Any]) -> str:
    """sha256 (hex) of a snapshot's whole `data`: what `status.template.hash` holds and a read checks."""
    return hashlib.sha256(canonical(data)).hexdigest()


def _safe(name: str, chars: int) -> str:
    return name[:chars].rstrip("-.") or "template"


def snapshot_name(data: Mapping[str, Any]) -> str:
    """`<template name>-<16 hex>`: content-addressed by {kind, uid, generation, spec}, so every Flow that
    takes one generation of one template names the same snapshot (and a resourceVersion change without
    a new generation, a label, names no new one)."""
    key = {k: data.get(k) for k in ("kind", "uid", "generation", "spec")}
    digest = hashlib.sha256(canonical(key)).hexdigest()[:NAME_HASH_CHARS]
    return f"{_safe(str(data.get('name') or ''), NAME_PREFIX_CHARS)}-{digest}"


def snapshot_object(namespace: str, data: Mapping[str, Any], name: str | None = None) -> Body:
    """The ControllerRevision that stores `data` in `namespace` (the Flow's, a ClusterFlowTemplate's too).
    ``name``: `snapshot_name(data)` when the caller has it already (it hashes the whole spec)."""
    return {"apiVersion": SNAPSHOT_API_VERSION, "kind": SNAPSHOT_KIND,
            "metadata": {"name": name or snapshot_name(data), "namespace": namespace,
                         "labels": {c.LABEL_MANAGED_BY: c.MANAGED_BY,
                                    c.LABEL_TEMPLATE: _safe(str(data.get("name") or ""), LABEL_VALUE_CHARS)}},
            "data": dict(data), "revision": int(data.get("generation") or 0)}


def snapshot_ref(data: Mapping[str, Any]) -> Body:
    """`status.template` of a Flow that took the snapshot of `data`: the reference, not the spec."""
    out: Body = {k: data.get(k) for k in ("kind", "name", "uid", "generation", "resourceVersion")}
    out |= {"snapshot": snapshot_name(data), "hash": data_hash(data)}
    return {k: v for k, v in out.items() if v is not None}


def snapshot_problem(ref: Mapping[str, Any], obj: Mapping[str, Any] | None) -> str | None:
    """Why the ControllerRevision read for `ref` (a `status.template`) is not the template the Flow
    took: gone, or its data's hash is not the one the Flow recorded (never run something else)."""
    name = str(ref.get("snapshot") or "")
    if obj is None:
        return f"template snapshot {name!r} (ControllerRevision) is gone"
    data = obj.get("data")
    if not isinstance(data, Mapping) or data_hash(data) != ref.get("hash"):
        return (f"template snapshot {name!r} (ControllerRevision) does not hold what this Flow took "
                "(its data's hash differs)")
    return None


def taken_spec(taken: Any, loaded: Mapping[str, Any] | None = None) -> Body | None:
    """The template spec a Flow took: from `status.template.spec` (written by an operator before
    snapshots), else `loaded` (its snapshot's `data.spec`, read by the caller); None when neither."""
    if not isinstance(taken, Mapping):
        return None
    if isinstance(taken.get("spec"), Mapping):
        return dict(taken["spec"])
    return dict(loaded) if loaded is not None else None


def effective_flow(flow: Body, loaded: Mapping[str, Any] | None = None) -> Body:
    """The Flow as it runs: its spec resolved from the template it took (see `taken_spec`); a Flow
    without a template, whose template is not resolved yet, or whose taken spec is not at hand, as it is."""
    spec = flow.get("spec") or {}
    tspec = taken_spec((flow.get("status") or {}).get("template"), loaded)
    if not spec.get("templateRef") or tspec is None:
        return flow
    return {**flow, "spec": effective_spec(tspec, spec)}


def problems(template: Mapping[str, Any], namespace: str, flow_spec: Mapping[str, Any]) -> tuple[Body, list[str]]:
    """(the effective spec, why the Flow's inputs do not fit the template's parameters)."""
    ref = flow_spec.get("templateRef") or {}
    tspec = template.get("spec") or {}
    return (effective_spec(tspec, flow_spec),
            parameter_problems(tspec, flow_spec.get("inputs"), describe_ref(namespace, ref)))


__all__ = ["canonical", "data_hash", "describe_ref", "effective_flow", "effective_spec", "parameter_problems",
           "problems", "snapshot", "snapshot_name", "snapshot_object", "snapshot_problem", "snapshot_ref",
           "taken_spec", "template_key"]
