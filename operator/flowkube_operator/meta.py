"""What the operator reads off Kubernetes objects.

Pure: plain dicts in, plain values out. The reconcile (`reconcile.plan`) and the I/O edges (`kube`,
`stateapi`, `controller`) share these, so none of the edges needs the state machine for them.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, NamedTuple

from flowkube_api import constants as c
from flowkube_api.base import parse_time

Body = dict[str, Any]


# -- owners -----------------------------------------------------------------------------------------


def owner_uid(meta: Body) -> str:
    return next((r.get("uid", "") for r in meta.get("ownerReferences") or [] if r.get("controller")), "")


def orphaned_by_namesake(meta: Body, flow_name: str, flow_uid: str) -> bool:
    """Is this object controlled by an earlier Flow of the same name? Names are unique, so that Flow
    is gone and the object is garbage the garbage collector has not removed yet (or never will: when
    a Flow is deleted and re-created during a break in its watch, its relist sees one update)."""
    ref = next((r for r in meta.get("ownerReferences") or [] if r.get("controller")), None)
    return (ref is not None and ref.get("kind") == c.KIND and str(ref.get("apiVersion")).split("/")[0] == c.GROUP
            and ref.get("name") == flow_name and bool(ref.get("uid")) and ref.get("uid") != flow_uid)


class Doomed(NamedTuple):
    """An object a plan decided to delete, as the plan saw it: the DELETE carries this uid as its
    precondition, so an object made again under the name since (a re-created Flow's new pod, a new
    Flow of the name) is never deleted by a decision about the one before it."""

    name: str
    uid: str


# -- runner pods ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PodView:
    """What the reconcile needs to know of a runner pod."""

    name: str
    phase: str
    created_at: dt.datetime | None
    deleting: bool = False
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    finished_at: dt.datetime | None = None
    resource_version: int = 0
    owner_uid: str = ""  # the Flow this pod belongs to (a re-created Flow of the same name is another)
    uid: str = ""
    # Why Kubernetes took the pod away, when it did: the DisruptionTarget condition's reason
    # (EvictionByEvictionAPI, PreemptionByScheduler, DeletionByTaintManager, TerminationByKubelet,
    # ...) or the kubelet's Evicted.
    disruption: str | None = None
    trigger: str | None = None  # what started the run (the pod's flowkube.io/trigger label)
    # Why a pod that has not started is stuck, in Kubernetes' words: (reason, message) of the
    # scheduler's PodScheduled=False (Unschedulable) or of a container waiting on something the
    # user must fix (ImagePullBackOff, CreateContainerConfigError: a missing Secret, ...).
    waiting: tuple[str, str] | None = None

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @classmethod
    def from_pod(cls, pod: Body) -> PodView:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        exit_code = reason = message = finished = None
        for cs in status.get("containerStatuses") or []:
            term = (cs.get("state") or {}).get("terminated")
            if term:
                exit_code, reason = term.get("exitCode"), term.get("reason")
                message, finished = term.get("message"), term.get("finishedAt")
        disruption = next((cond.get("reason") or "DisruptionTarget" for cond in status.get("conditions") or []
                           if cond.get("type") == "DisruptionTarget" and cond.get("status") == "True"),
                          "Evicted" if status.get("reason") == "Evicted" else None)
        return cls(
            waiting=_waiting(status),
            name=meta.get("name", ""),
            phase=status.get("phase") or "Pending",
            created_at=parse_time(meta.get("creationTimestamp")),
            deleting=bool(meta.get("deletionTimestamp")),
            exit_code=exit_code,
            reason=status.get("reason") or reason,
            message=message or status.get("message"),
            finished_at=parse_time(finished),
            resource_version=int(meta.get("resourceVersion") or 0),
            owner_uid=owner_uid(meta),
            uid=meta.get("uid") or "",
            disruption=disruption,
            trigger=(meta.get("labels") or {}).get(c.LABEL_TRIGGER),
        )


# Container waiting reasons that last until someone changes something (ContainerCreating and
# PodInitializing pass by themselves).
STUCK_REASONS = frozenset({"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                           "CreateContainerConfigError", "CreateContainerError", "RunContainerError"})


def _waiting(status: Body) -> tuple[str, str] | None:
    """(reason, message) of a not-yet-running pod's obstacle, from its conditions and containers."""
    if status.get("phase") not in (None, "Pending"):
        return None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False":
            return str(cond.get("reason") or "Unschedulable"), str(cond.get("message") or "not scheduled")
    for cs in status.get("containerStatuses") or []:
        waiting = (cs.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            return str(waiting["reason"]), str(waiting.get("message") or waiting["reason"])
    return None
