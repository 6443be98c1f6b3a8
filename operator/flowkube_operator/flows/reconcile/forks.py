"""The pure side of checkpoints and forks (``flows.checkpoints`` is the I/O side): how many a Flow
keeps, the index the reconcile folds from run reports, and what a fork's first reconcile read."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from flowkube_api.models import CheckpointsSpec, FlowSpec
from flowkube_api.report import CheckpointEntry

Body = dict[str, Any]


def kept(spec: Body | FlowSpec | None) -> int:
    """``spec.checkpoints.keep`` of a Flow's own spec (the model's default when unset or not valid)."""
    raw = spec.checkpoints if isinstance(spec, FlowSpec) else (spec or {}).get("checkpoints")
    try:
        return CheckpointsSpec.model_validate(raw or {}).keep
    except ValidationError:
        return CheckpointsSpec().keep


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


