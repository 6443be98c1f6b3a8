"""A Flow's checkpoints: their storage, their index, and a fork's copy of one.

Storage. A runner sends each checkpoint (its state document right after a method completed or paused)
to the state API as ``checkpoint.<n>``. It is kept in a ring of ``spec.checkpoints.keep`` ConfigMaps
owned by the Flow: checkpoint n in ``<flow>-cp-<n mod keep>``, annotated with n. However many a
runner sends, and in whatever order, a Flow has at most ``keep`` (at most 10) of them, each under
the state's own size bound; they go with the Flow.

Index. The runner lists the checkpoints it took in its run report; the reconcile folds them into
``status.checkpoints`` (``reconcile.forks.fold``), the last ``keep`` by id: what the ring holds.

Forks. A Flow whose ``spec.forkFrom`` names a checkpoint of another Flow copies that checkpoint's
ConfigMap into its own state at its first reconcile (``fork_source`` reads it, the plan records
``status.forkedFrom``, ``copy_into_state`` writes it before that status write). From then on the
fork depends on nothing of its origin.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from flowkube_api import constants as c
from flowkube_api.report import CheckpointEntry
from flowkube_operator.flows import resources
from flowkube_operator.flows.reconcile.forks import ForkSource, kept
from flowkube_operator.kube.client import ApiError, Kube, delete_namesake_garbage, flow_path, ns_path
from flowkube_operator.meta import owner_uid

Body = dict[str, Any]


class CheckpointRefused(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


async def store(kube: Kube, flow: Body, checkpoint: int, keep: int, data: bytes) -> None:
    """Put checkpoint ``checkpoint`` into its slot of ``flow``'s ring (``flow``: its metadata)."""
    if keep <= 0:
        raise CheckpointRefused(409, "spec.checkpoints.keep is 0: this Flow keeps no checkpoints")

    def later_held(existing: Body) -> bool:
        """A later checkpoint is in the slot already (this one was sent late): it stays."""
        held = ((existing["metadata"].get("annotations") or {}).get(c.CHECKPOINT_ANNOTATION) or "")
        return held.isdigit() and int(held) > checkpoint

    obj = resources.checkpoint_configmap(flow, checkpoint, keep, data)
    await _put_owned(kube, obj, flow, keep_existing=later_held)


async def _put_owned(kube: Kube, obj: Body, flow: Body, keep_existing: Callable[[Body], bool] | None = None) -> None:
    """Create ``obj``, a ConfigMap owned by ``flow``, or write its annotations and binaryData into the one
    of that name if it is ``flow``'s (its uid a precondition: never into a namesake's), unless
    ``keep_existing`` says the one there stays. One an earlier Flow of the same name left behind is
    deleted first; one that is not ``flow``'s is a 409 ``CheckpointRefused``."""
    meta = obj["metadata"]
    path = ns_path(meta["namespace"], "configmaps", meta["name"])
    uid = flow["metadata"]["uid"]
    for _ in range(3):
        if await kube.create(ns_path(meta["namespace"], "configmaps"), obj) is not None:
            return
        existing = await kube.get(path)
        if existing is None:
            continue  # deleted in between: create it again
        if await delete_namesake_garbage(kube, path, existing, flow["metadata"]["name"], uid):
            continue
        if owner_uid(existing["metadata"]) != uid:
            raise CheckpointRefused(409, f"configmap {meta['name']} still belongs to an earlier Flow of the same "
                                         "name; retry once it is garbage-collected")
        if keep_existing is not None and keep_existing(existing):
            return
        try:
            await kube.merge_patch(path, {"metadata": {"uid": existing["metadata"]["uid"],
                                                       **({"annotations": meta["annotations"]}
                                                          if "annotations" in meta else {})},
                                          "binaryData": obj["binaryData"]})
            return
        except ApiError as e:
            if e.status == 404 or (e.status in (409, 422) and "uid" in str(e).lower()):
                continue
            raise
    raise CheckpointRefused(409, f"configmap {meta['name']} keeps changing; retry")


async def fork_source(kube: Kube, fork: Body, *, across_namespaces: bool) -> ForkSource | None:
    """The checkpoint a Flow with ``spec.forkFrom`` starts from, for its first reconcile (None: the
    Flow is no fork, or copied its checkpoint already). ``across_namespaces``: the admission webhook
    checked that whoever created the fork may get its origin; without it, only an origin of the fork's
    own namespace is read (the operator would otherwise copy any namespace's state for anyone)."""
    ref, status = (fork.get("spec") or {}).get("forkFrom"), fork.get("status") or {}
    if not isinstance(ref, dict) or status.get("forkedFrom") or status.get("runs") or status.get("phase") in (
            c.Phase.SUCCEEDED, c.Phase.FAILED):
        return None
    namespace = str(ref.get("namespace") or fork["metadata"]["namespace"])
    name = str(ref.get("name") or "")
    what = f"Flow {namespace}/{name}"
    if namespace != fork["metadata"]["namespace"] and not across_namespaces:
        return ForkSource(namespace, name, problem=f"{what} is in another namespace: forks across namespaces need "
                          "the admission webhook, failing closed, which checks that their creator may get the origin")
    try:
        return await _read_source(kube, ref, namespace, name, what)
    except ApiError as e:
        if e.status not in (401, 403):
            raise
        return ForkSource(namespace, name, problem=f"the operator may not read {what} or its checkpoints ({e.status}): "
                          "it watches only some namespaces, or its RBAC does not reach that one")


async def _read_source(kube: Kube, ref: Body, namespace: str, name: str, what: str) -> ForkSource:
    number = ref.get("checkpoint")
    origin = await kube.get(flow_path(namespace, name))
    if origin is None:
        return ForkSource(namespace, name, problem=f"{what} does not exist: there is no checkpoint to fork from")
    uid = str(origin["metadata"].get("uid") or "")
    if ref.get("uid") and ref["uid"] != uid:
        return ForkSource(namespace, name, problem=f"{what} is not the one spec.forkFrom.uid names "
                                                   f"({ref['uid']}): it was deleted and made again")
    entries = (origin.get("status") or {}).get("checkpoints") or []
    found = next((e for e in entries if isinstance(e, dict) and e.get("id") == number), None)
    listed = ", ".join(str(e.get("id")) for e in entries if isinstance(e, dict)) or "none"
    if found is None:
        return ForkSource(namespace, name, uid, problem=f"{what} has no checkpoint {number} (it lists: {listed})")
    entry = CheckpointEntry.model_validate(found)
    keep = kept(origin.get("spec"))
    cm = await kube.get(ns_path(namespace, "configmaps",
                                c.checkpoint_configmap_name(name, entry.id, keep))) if keep > 0 else None
    held = ((cm or {}).get("metadata") or {}).get("annotations") or {}
    value = ((cm or {}).get("binaryData") or {}).get(c.STATE_KEY)
    mine = cm is not None and owner_uid(cm["metadata"]) == uid
    if not mine or held.get(c.CHECKPOINT_ANNOTATION) != str(entry.id) or not value:
        return ForkSource(namespace, name, uid, entry, problem=f"checkpoint {entry.id} of {what} is no longer kept "
                          f"(it keeps the last spec.checkpoints.keep={keep}; it lists: {listed})")
    return ForkSource(namespace, name, uid, entry, base64.b64decode(value))


async def copy_into_state(kube: Kube, fork: Body, data: bytes) -> None:
    """The fork's own state, made from the checkpoint (before the status write that says it forked:
    until then nothing of the fork ran, so writing it again after a crash changes nothing). A
    ConfigMap of that name not yet the fork's is an ``ApiError`` 409: the reconcile is tried again."""
    value = {c.STATE_KEY: base64.b64encode(data).decode("ascii")}
    try:
        await _put_owned(kube, {**resources.state_configmap(fork), "binaryData": value}, fork)
    except CheckpointRefused as e:
        path = ns_path(fork["metadata"]["namespace"], "configmaps", c.state_configmap_name(fork["metadata"]["name"]))
        raise ApiError(409, str(e), "POST", path) from e
