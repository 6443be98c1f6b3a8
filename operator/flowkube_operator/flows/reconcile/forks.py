"""The pure side of checkpoints and forks (``flows.checkpoints`` is the I/O side): how many a Flow
keeps, the index the reconcile folds from run reports, and what a fork's first reconcile read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flowkube_api import constants as c
from flowkube_api.models import FlowSpec
from flowkube_api.report import CheckpointEntry

Body = dict[str, Any]


def kept(spec: Body | FlowSpec | None) -> int:
    """``spec.checkpoints.keep`` of a Flow's own spec (default when unset)."""
    if isinstance(spec, FlowSpec):
        return spec.checkpoints.keep if spec.checkpoints is not None else c.DEFAULT_CHECKPOINTS_KEPT
    keep = ((spec or {}).get("checkpoints") or {}).get("keep", c.DEFAULT_CHECKPOINTS_KEPT)
    return keep if isinstance(keep, int) and 0 <= keep <= c.CHECKPOINTS_KEPT_LIMIT else c.DEFAULT_CHECKPOINTS_KEPT


def fold(old: list[CheckpointEntry] | None, reported: list[CheckpointEntry] | None, keep: int,
         ) -> list[CheckpointEntry] | None:
    """``status.checkpoints`` with a report's entries in: the last ``keep`` by id, oldest first."""
    if not reported:
        return old
    by_id = {e.id: e for e in old or []}
    by_id.update({e.id: e for e in reported})
    entries = [by_id[i] for i in sorted(by_id)][-keep:] if keep > 0 else []
    return entries or None


@dataclass(frozen=True)
class ForkSource:
    """What a fork's first reconcile read of its origin: the checkpoint's bytes and its entry in the
    origin's index, or why they cannot be had (the fork then fails, saying so)."""

    namespace: str
    name: str
    uid: str = ""
    entry: CheckpointEntry | None = None
    data: bytes | None = None
    problem: str | None = None


