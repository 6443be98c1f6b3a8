"""Bounds on the free-form parts of a Flow spec: what a tenant may make the operator and its pods hold.

The CRD keeps ``spec.inputs``, ``spec.definition`` and the pod-shaped fields schemaless (they are
crewAI's and Kubernetes' shapes), so the API server bounds neither their size nor their depth. The
admission webhook refuses a spec over these bounds at ``kubectl apply``, naming the field; the
reconcile checks the same rule before it makes a pod (a Flow that got in while the webhook was off
fails ``InvalidSpec`` instead of making a pod that cannot start).

- **Size:** a runner pod gets ``definition`` (or ``flowRef``), ``inputs`` and ``budget`` as one JSON
  environment variable (``FLOWKUBE_SPEC``), and Linux refuses to start a process with an environment
  string over 128 KiB (``MAX_ARG_STRLEN``): beyond that, no runner could start anyway. The bound
  measures the very text the pod gets (``runspec.runner_spec_env``). Each pod-shaped field is
  bounded on its own.
- **Depth:** JSON nested deeper than any flow's inputs need is refused: deep nesting costs recursion
  in every parser on the way (the operator's, the runner's, crewAI's).
- **Pod metadata:** ``podTemplate.metadata`` holds at most ``METADATA_KEYS_LIMIT`` labels and as many
  annotations (Kubernetes bounds neither count, only the annotations' total of 256 KiB, which the
  64 KiB field bound is under), and a label value is at most 63 characters, as Kubernetes requires
  of a pod's: refused at apply, naming the key, instead of a pod the API server refuses later.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.models import FlowSpec
from flowkube_api.runspec import runner_spec_env, spec_error_text

SPEC_ENV_LIMIT = 128 * 1024 - len(c.ENV_SPEC) - 2  # "NAME=value\0" within the kernel's 128 KiB
POD_FIELD_LIMIT = 64 * 1024  # bytes of JSON per pod-shaped field (env, envFrom, tolerations, affinity)
DEPTH_LIMIT = 32  # nesting levels of objects and lists in any free-form field
METADATA_KEYS_LIMIT = 64  # labels, and annotations, of a Flow's pods (spec.podTemplate.metadata)
LABEL_VALUE_LIMIT = 63  # Kubernetes' bound on a label value
_POD_FIELDS = (("env",), ("envFrom",), ("podTemplate", "tolerations"), ("podTemplate", "affinity"),
               ("podTemplate", "nodeSelector"), ("podTemplate", "metadata"))


def depth_over(value: Any, limit: int = DEPTH_LIMIT) -> bool:
    """Whether ``value`` nests objects/lists more than ``limit`` levels deep. Iterative, and it stops
    at the first path over the limit: bounded work and no recursion, whatever it is given."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, level = stack.pop()
        children = item.values() if isinstance(item, Mapping) else item if isinstance(item, list) else None
        if children is None:
            continue
        if level > limit:
            return True
        stack.extend((child, level + 1) for child in children)
    return False


def _json_size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":")).encode("utf-8"))


def template_problem(spec: Mapping[str, Any], what: str = "spec") -> str | None:
    """Why a FlowTemplate's spec is too big (each generation its Flows take is stored whole in a
    snapshot, and read whole by the webhook and the operator), or None."""
    size = _json_size(spec)
    if size > c.TEMPLATE_SPEC_LIMIT:
        return (f"{what} is {size} bytes as JSON; a template's limit is {c.TEMPLATE_SPEC_LIMIT} (the Flows of it "
                "run it from a stored snapshot)")
    return None


def metadata_problem(metadata: Any) -> str | None:
    """Why a podTemplate's labels or annotations are over their count, or a label value over its length."""
    if not isinstance(metadata, Mapping):
        return None
    for part in ("labels", "annotations"):
        values = metadata.get(part)
        if isinstance(values, Mapping) and len(values) > METADATA_KEYS_LIMIT:
            return f"spec.podTemplate.metadata.{part} has {len(values)} keys; the limit is {METADATA_KEYS_LIMIT}"
    labels = metadata.get("labels")
    for key, value in (labels.items() if isinstance(labels, Mapping) else ()):
        if isinstance(value, str) and len(value) > LABEL_VALUE_LIMIT:
            return (f"spec.podTemplate.metadata.labels[{json.dumps(key)}] is {len(value)} characters; a label "
                    f"value's limit is {LABEL_VALUE_LIMIT}")
    return None


def spec_problem(spec: Mapping[str, Any], *, own: bool = False) -> str | None:
    """Why this Flow spec is over a bound, naming the field, or None. ``own``: only the Flow's own
    fields of a Flow of a template (before it is merged with its template's: its size and depth)."""
    pod_fields: list[tuple[str, Any]] = []
    for path in _POD_FIELDS:
        value: Any = spec
        for part in path:
            value = value.get(part) if isinstance(value, Mapping) else None
        pod_fields.append(("spec." + ".".join(path), value))
    for name, value in [(f"spec.{k}", spec.get(k)) for k in ("inputs", "definition")] + pod_fields:
        if value is not None and depth_over(value):
            return f"{name} nests objects and lists more than {DEPTH_LIMIT} levels deep; the limit is {DEPTH_LIMIT}"
    for name, value in pod_fields:
        if value is not None and (size := _json_size(value)) > POD_FIELD_LIMIT:
            return f"{name} is {size} bytes as JSON; the limit is {POD_FIELD_LIMIT}"
    if too_many := metadata_problem(dict(pod_fields)["spec.podTemplate.metadata"]):
        return too_many
    if own:
        inputs = spec.get("inputs")
        if inputs is not None and (size := _json_size(inputs)) > SPEC_ENV_LIMIT:
            return f"spec.inputs is {size} bytes as JSON; the limit is {SPEC_ENV_LIMIT}"
        return None
    try:  # the text the runner pods would get (the API server checked the schema before the webhook)
        size = len(runner_spec_env(FlowSpec.model_validate(spec)).encode("utf-8"))
    except ValidationError as e:
        return spec_error_text(e)
    if size > SPEC_ENV_LIMIT:
        parts = ", ".join(f"spec.{k} {_json_size(spec[k])}" for k in ("inputs", "definition")
                          if spec.get(k) is not None)
        return (f"spec.inputs and spec.definition are {size} bytes as JSON together ({parts}); a runner pod "
                f"receives them in one environment variable, and the limit is {SPEC_ENV_LIMIT} bytes")
    return None


__all__ = ["DEPTH_LIMIT", "LABEL_VALUE_LIMIT", "METADATA_KEYS_LIMIT", "POD_FIELD_LIMIT", "SPEC_ENV_LIMIT",
           "depth_over", "metadata_problem", "runner_spec_env", "spec_problem", "template_problem"]
