"""`kubectl flow fork`: a new Flow that starts from a checkpoint of another Flow (its origin), with edits.

The fork's spec is the origin's, copied whole (its definition, flowRef or templateRef, inputs, pods,
budget, ...), less the origin's own ``forkFrom`` and ``suspend``, plus ``spec.forkFrom``: the origin, the
checkpoint and the edits. The operator copies that checkpoint into the fork's own state at its first
reconcile; from then on the fork does not depend on the origin.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from flowkube_api.constants import GROUP, KIND, SINGULAR
from flowkube_api.forks import fork_flow
from flowkube_kubectl.args import Args, UsageError, flag_on, namespace_of
from flowkube_kubectl.kube import KubectlError, kubectl_json
from flowkube_kubectl.start import param_value, read_params


def checkpoint_entry(origin: dict[str, Any], at: int) -> dict[str, Any]:
    """The origin's ``status.checkpoints`` entry ``at``; a UsageError naming --at and the ids it has."""
    meta = origin.get("metadata") or {}
    what = f"Flow {meta.get('namespace', '')}/{meta.get('name', '')}"
    entries = [e for e in (origin.get("status") or {}).get("checkpoints") or [] if isinstance(e, dict)]
    entry = next((e for e in entries if e.get("id") == at), None)
    if entry is not None:
        return entry
    if not entries:
        raise UsageError(f"--at {at}: {what} has no checkpoints to fork from (no method has completed or paused "
                         "yet, or its spec.checkpoints.keep is 0)")
    ids = ", ".join(str(e.get("id")) for e in entries)
    raise UsageError(f"--at {at}: {what} has no checkpoint {at}; it has {ids} (kubectl flow get {meta.get('name')})")


def _get_origin(a: Args, from_namespace: str | None) -> dict[str, Any]:
    """The origin Flow, read in --from-namespace (else in the fork's namespace); a UsageError when it
    is not there."""
    kube = a.kube if from_namespace is None else [
        *(k for k in a.kube if not k.startswith("--namespace=")), f"--namespace={from_namespace}"]
    try:
        return kubectl_json(["get", SINGULAR, a.pos[0]], kube)
    except KubectlError as e:
        if "(NotFound)" not in str(e):
            raise
        namespace = from_namespace or namespace_of(a)
        where = f'in namespace "{namespace}"' if namespace else "in the current namespace"
        hint = "" if from_namespace else "; a Flow of another namespace: --from-namespace NS"
        raise UsageError(f'NAME: {KIND} "{a.pos[0]}" not found {where} (kubectl flow get{hint})') from None


def fork(a: Args) -> int:
    """Read the origin, check --at against its checkpoints, then create the fork (or print it)."""
    inputs = {k: param_value(v) for k, v in read_params(a.lists.get("--input", []), "--input").items()}
    outputs = read_params(a.lists.get("--output", []), "--output", "METHOD=TEXT")
    at = int(a.opts["--at"])
    from_namespace = a.opts.get("--from-namespace")
    origin = _get_origin(a, from_namespace)
    entry = checkpoint_entry(origin, at)
    same_namespace = from_namespace is None or from_namespace == namespace_of(a)
    body = fork_flow(origin, at, inputs=inputs, outputs=outputs, name=a.opts.get("--name"),
                     same_namespace=same_namespace)
    if flag_on(a, "--dry-run"):
        print(json.dumps(body, indent=2))
        return 0
    try:
        created = kubectl_json(["create", "-f", "-"], a.kube, json.dumps(body))
    except KubectlError as e:
        if "(AlreadyExists)" not in str(e):
            raise
        sys.stderr.write(str(e))
        print("kubectl flow: name the fork with --name NEW", file=sys.stderr)
        return e.returncode
    meta = origin["metadata"]
    print(f"{SINGULAR}.{GROUP}/{created['metadata']['name']} created (fork of {meta.get('namespace', '')}/"
          f"{meta['name']} at checkpoint {at}: {entry.get('kind', '')} {entry.get('method', '')})")
    return 0
