"""Checkpoints a Flow can be forked from, and a fork's start from one. crewAI-free.

A checkpoint is the state document as written right after a method completed or paused for
feedback: everything a new process needs to go on from there (``runtime.py``). The runner numbers
them over the Flow's life (``StateDocument.checkpoint``, written in the document itself), sends each
one's bytes to the state API under ``checkpoint.<n>``, where the operator keeps the last
``spec.checkpoints.keep`` in a ring of ConfigMaps, and lists them in its run report, from which the
operator keeps the index in ``status.checkpoints``. Sending one is best effort: a checkpoint that
could not be kept is only a point nobody can fork from; the run goes on.

A fork's first run (trigger ``fork``) finds the checkpoint the operator copied into its own state,
and applies ``spec.forkFrom``'s edits to it once (``fork``), under a new flow id.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal

from flowkube_api.constants import checkpoint_key
from flowkube_api.models import ForkFrom
from flowkube_api.report import CHECKPOINTS_REPORTED, CheckpointEntry, SpentSoFar

from ..store import StateStore
from .state import StateDocument

log = logging.getLogger("flowkube_runner")


class CheckpointLog:
    """The checkpoints this run took, sent to the state API as they are taken."""

    def __init__(self, store: StateStore, spent: Callable[[], SpentSoFar], *, enabled: bool = True,
                 on_taken: Callable[[], None] | None = None) -> None:
        self._store = store
        self._spent = spent
        self.enabled = enabled
        self._on_taken = on_taken
        self._lock = threading.Lock()
        self._entries: list[CheckpointEntry] = []

    def entries(self) -> list[CheckpointEntry] | None:
        """The last ones, oldest first, as the run report carries them (None: none taken)."""
        with self._lock:
            return list(self._entries[-CHECKPOINTS_REPORTED:]) or None

    def take(self, document: StateDocument, data: bytes, kind: Literal["Completed", "Paused"], method: str) -> None:
        """``data`` is ``document`` as just written; its number is ``document.checkpoint``."""
        spent = self._spent()  # as of the write (a parallel branch's call may land while it is sent)
        try:
            self._store.put(checkpoint_key(document.checkpoint), data)
        except Exception as e:
            log.warning("checkpoint %d (after %s) was not kept: %s", document.checkpoint, method, e)
            return
        entry = CheckpointEntry(id=document.checkpoint, method=method, kind=kind,
                                time=document.updated_at or datetime.now(UTC), usage=spent)
        with self._lock:
            self._entries = [*self._entries[-(CHECKPOINTS_REPORTED - 1):], entry]
        if self._on_taken is not None:
            self._on_taken()


class ForkRefused(ValueError):
    """``spec.forkFrom``'s edits do not fit the checkpoint (a method that has no output there)."""


def fork(document: StateDocument, spec: ForkFrom) -> StateDocument:
    """The checkpoint ``document`` with the fork's edits, under a new flow id (crewAI's own fork keeps
    the state and gives the run a new lineage). Applied once: the result says it is a fork.

    - ``inputs`` set state fields (a flow's kickoff inputs are its first state);
    - ``outputs`` replace the output of a method (an agent's or a crew's raw answer, or a plain
      value), as ``outputs.<method>`` and the replay read it; what completed after that method is
      dropped, so it runs again, as a feedback request pending at the checkpoint is asked again.
    """
    forked = document.model_copy(deep=True)
    flow_id = str(uuid.uuid4())
    forked.flow_id = flow_id
    if "id" in forked.state:
        forked.state["id"] = flow_id
    for name, value in (spec.inputs or {}).items():
        forked.state[name] = value
    if spec.outputs:
        _edit_outputs(forked, spec.outputs)
    if forked.pending is not None and "flow_id" in forked.pending.context:
        forked.pending.context["flow_id"] = flow_id
    forked.forked = f"{spec.namespace or ''}/{spec.name}#{spec.checkpoint}"
    return forked


def _edit_outputs(document: StateDocument, outputs: dict[str, str]) -> None:
    runtime = document.runtime
    entries: list[Any] = list(runtime.get("methodOutputs") or [])
    first_edited = len(entries)
    for method, text in outputs.items():
        index = next((i for i in range(len(entries) - 1, -1, -1)
                      if isinstance(entries[i], dict) and entries[i].get("method") == method), None)
        if index is None:
            done = sorted({str(e.get("method")) for e in entries if isinstance(e, dict)})
            raise ForkRefused(f"spec.forkFrom.outputs.{method}: method {method!r} has no output at checkpoint "
                              f"{document.checkpoint} (completed there: {', '.join(done) or 'none'})")
        entry = dict(entries[index])
        entry["output"] = _replaced(entry.get("output"), text)
        if isinstance(entry.get("human_feedback"), dict):
            entry["human_feedback"] = {**entry["human_feedback"], "output": entry["output"]}
        entries[index] = entry
        first_edited = min(first_edited, index)
    kept, dropped = entries[:first_edited + 1], entries[first_edited + 1:]
    again = {str(e.get("method")) for e in dropped if isinstance(e, dict)} - {
        str(e.get("method")) for e in kept if isinstance(e, dict)}
    runtime["methodOutputs"] = kept
    runtime["completedMethods"] = [m for m in runtime.get("completedMethods") or [] if m not in again]
    for counts_key in ("methodExecutionCounts", "methodCallCounts"):
        counts = dict(runtime.get(counts_key) or {})
        for e in dropped:
            method = str(e.get("method")) if isinstance(e, dict) else ""
            if counts.get(method, 0) > 0:
                counts[method] -= 1
        runtime[counts_key] = {m: n for m, n in counts.items() if n > 0}
    # What the dropped methods set off is undone too, so their listeners (an or_ that fired, an and_
    # half met) fire again as they run again; their answers leave the feedback history.
    runtime["firedOrListeners"] = [m for m in runtime.get("firedOrListeners") or [] if m not in again]
    runtime["pendingEvents"] = {k: [t for t in v if t not in again]
                                for k, v in (runtime.get("pendingEvents") or {}).items() if k not in again}
    runtime["humanFeedbackHistory"] = [h for h in runtime.get("humanFeedbackHistory") or []
                                       if not (isinstance(h, dict) and h.get("method_name") in again)]
    document.pending = None  # asked about what came before the edit: asked again, about the new output
    document.tasks = {}


def _replaced(output: Any, text: str) -> Any:
    """An agent's or crew's output (a dict with ``raw``) keeps its shape with ``raw`` replaced; anything
    else becomes the text."""
    if isinstance(output, dict) and "raw" in output:
        return {**{k: v for k, v in output.items() if k not in ("pydantic", "json_dict")}, "raw": text}
    return text
