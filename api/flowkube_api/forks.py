"""The Flow a fork is: its origin's spec with ``spec.forkFrom``. Standard library only: the kubectl
plugin (`kubectl flow fork`) and the console ("Fork from here") make it with this one function."""

from __future__ import annotations

from typing import Any

from flowkube_api.constants import API_VERSION, KIND, PREFIX

FLOW_NAME_LIMIT = 63  # a Flow's name is a label value on its runner pods (the CRD's rule)
LABEL_VALUE_LIMIT = 63  # Kubernetes' bound on a label value
LABEL_FORKED_FROM = f"{PREFIX}/forked-from"  # on a fork made by the plugin or the console: the origin's name
_NOT_COPIED = ("forkFrom", "suspend")  # the origin's spec fields a fork does not take


def fork_name(origin: str, checkpoint: int) -> str:
    """``<origin>-fork-<checkpoint>``, the origin's name cut so that it fits a Flow's name."""
    suffix = f"-fork-{checkpoint}"
    return origin[: FLOW_NAME_LIMIT - len(suffix)].rstrip("-.") + suffix


def fork_flow(origin: dict[str, Any], checkpoint: int, *, inputs: dict[str, Any] | None = None,
              outputs: dict[str, str] | None = None, name: str | None = None,
              same_namespace: bool = True) -> dict[str, Any]:
    """The Flow `fork` creates: the origin's spec with ``spec.forkFrom`` (``namespace`` only when the
    fork is made in another namespace than the origin's), named NAME or ``<origin>-fork-<checkpoint>``."""
    meta = origin.get("metadata") or {}
    spec = {k: v for k, v in (origin.get("spec") or {}).items() if k not in _NOT_COPIED}
    fork_from: dict[str, Any] = {"name": meta["name"]}
    if not same_namespace and meta.get("namespace"):
        fork_from["namespace"] = meta["namespace"]
    if meta.get("uid"):
        fork_from["uid"] = meta["uid"]
    fork_from["checkpoint"] = checkpoint
    if inputs:
        fork_from["inputs"] = inputs
    if outputs:
        fork_from["outputs"] = outputs
    spec["forkFrom"] = fork_from
    metadata: dict[str, Any] = {"name": name or fork_name(meta["name"], checkpoint)}
    if len(meta["name"]) <= LABEL_VALUE_LIMIT:
        metadata["labels"] = {LABEL_FORKED_FROM: meta["name"]}
    return {"apiVersion": API_VERSION, "kind": KIND, "metadata": metadata, "spec": spec}


