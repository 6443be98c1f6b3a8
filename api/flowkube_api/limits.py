"""Bounds on the free-form parts of a Flow spec: what a tenant may make the operator and its pods hold.

The CRD keeps ``spec.inputs``, ``spec.definition`` and the pod-shaped fields schemaless (they are
crewAI's and Kubernetes' shapes), so the API server bounds neither their size nor their depth. The
admission webhook refuses a spec over these bounds at ``kubectl apply``, naming the field; the
reconcile checks the same rule before it makes a pod (a Flow that got in while the webhook was off
fails ``InvalidSpec`` instead of making a pod that cannot start).

- **Size:** a runner pod gets ``definition``, ``inputs`` and ``budget`` as one JSON environment
  variable (``FLOWKUBE_SPEC``), and Linux refuses to start a process with an environment string over
  128 KiB (``MAX_ARG_STRLEN``): beyond that, no runner could start anyway. Each pod-shaped field is
  bounded on its own.
- **Depth:** JSON nested deeper than any flow's inputs need is refused: deep nesting costs recursion
  in every parser on the way (the operator's, the runner's, crewAI's).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from flowkube_api import constants as c

SPEC_ENV_LIMIT = 128 * 1024 - len(c.ENV_SPEC) - 2  # "NAME=value\0" within the kernel's 128 KiB
POD_FIELD_LIMIT = 64 * 1024  # bytes of JSON per pod-shaped field (env, envFrom, tolerations, affinity)
DEPTH_LIMIT = 32  # nesting levels of objects and lists in any free-form field

# The fields the runner reads from FLOWKUBE_SPEC, in the order they are written.
RUNNER_SPEC_FIELDS = ("definition", "flowRef", "inputs", "budget")
_POD_FIELDS = (("env",), ("envFrom",), ("podTemplate", "tolerations"), ("podTemplate", "affinity"),
               ("podTemplate", "nodeSelector"), ("podTemplate", "metadata"))


def runner_spec_env(spec: Mapping[str, Any]) -> str:
    """The part of the Flow spec the runner needs, as it needs it (JSON in FLOWKUBE_SPEC)."""
    keep = {k: spec[k] for k in RUNNER_SPEC_FIELDS if spec.get(k) is not None}
    return json.dumps(keep, separators=(",", ":"), sort_keys=True)


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


def spec_problem(spec: Mapping[str, Any]) -> str | None:
    """Why this Flow spec is over a bound, naming the field, or None."""
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
    size = len(runner_spec_env(spec).encode("utf-8"))
    if size > SPEC_ENV_LIMIT:
        parts = ", ".join(f"spec.{k} {_json_size(spec[k])}" for k in ("inputs", "definition")
                          if spec.get(k) is not None)
        return (f"spec.inputs and spec.definition are {size} bytes as JSON together ({parts}); a runner pod "
                f"receives them in one environment variable, and the limit is {SPEC_ENV_LIMIT} bytes")
    return None
