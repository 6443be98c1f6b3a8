"""crewAI's persistence and human-feedback extension points, routed to the runner's state object."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from typing import Any, Literal

from crewai.flow.async_feedback.types import HumanFeedbackPending, PendingFeedbackContext
from crewai.flow.flow import Flow
from crewai.flow.flow_config import flow_config
from crewai.flow.persistence.base import FlowPersistence
from crewai.flow.persistence.factory import set_flow_persistence_factory
from pydantic import BaseModel, PrivateAttr

from flowkube_api.constants import STATE_KEY

from ..store import StateCorrupt, StateStore, StateTooLarge
from .checkpoints import CheckpointLog
from .runtime import resumed_step_output, snapshot_runtime, state_dict
from .state import PendingRequest, StateDocument
from .tasks import Slots, TaskCache


class StorePersistence(FlowPersistence):  # type: ignore[misc]
    """crewAI persistence backed by the flow's state object, one document per flow.

    A process runs one flow, so this is a singleton bound to it: ``save_state`` reads the bound
    flow's runtime alongside the state crewAI hands over. Writes are serialised and take the
    snapshot under the lock, so the last write always carries the newest runtime.
    """

    persistence_type: str = "flowkube"
    _store: StateStore | None = PrivateAttr(default=None)
    _flow: Flow[Any] | None = PrivateAttr(default=None)
    _document: StateDocument | None = PrivateAttr(default=None)
    _pod: str = PrivateAttr(default="")
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)
    _failure: BaseException | None = PrivateAttr(default=None)
    _held: bool = PrivateAttr(default=False)
    _tasks: TaskCache | None = PrivateAttr(default=None)
    _checkpoints: CheckpointLog | None = PrivateAttr(default=None)
    _written: bytes | None = PrivateAttr(default=None)

    def bind(self, store: StateStore, pod: str, document: StateDocument | None, *,
             keep_tasks: bool = True, checkpoints: CheckpointLog | None = None) -> TaskCache:
        """Bind to the flow's state; the cache of finished tasks it keeps, from ``document``'s.
        ``checkpoints``: where a method's end and a pause are sent as checkpoints (None: nowhere)."""
        self._store = store
        self._pod = pod
        self._document = document
        self._checkpoints = checkpoints if checkpoints is not None and checkpoints.enabled else None
        self._tasks = TaskCache(document.tasks if document is not None else {}, self.save_tasks, enabled=keep_tasks)
        return self._tasks

    def attach(self, flow: Flow[Any]) -> None:
        self._flow = flow

    @property
    def document(self) -> StateDocument | None:
        return self._document

    @property
    def failure(self) -> BaseException | None:
        """The storage error behind a failed save; crewAI wraps it in a generic RuntimeError."""
        return self._failure

    def init_db(self) -> None:
        """Nothing to set up: the operator pre-creates the state object."""

    def hold(self) -> None:
        """Keep crewAI's saves in memory until ``commit``: a conversation turn is saved whole or not
        at all (a pause for feedback is still written at once: it must outlive the process)."""
        with self._lock:
            self._held = True

    def commit(self, document: StateDocument | None = None, *, turn: int) -> StateDocument:
        """Write ``document`` (default: the held one) as the state after conversation message ``turn``."""
        with self._lock:
            document = (document or self._document or StateDocument(flow_id="", state={})).model_copy()
            document.conversation_turn = turn
            self._held = False
            self._write(document)
            return document

    def _write(self, document: StateDocument, *, durable: bool = False, best_effort: bool = False) -> None:
        """``best_effort``: a failure is the caller's to handle, not the run's (``failure``)."""
        if self._store is None:
            raise RuntimeError("StorePersistence used before bind()")
        document.pod = self._pod
        document.updated_at = datetime.now(UTC)
        if self._held and not durable:
            self._document = document
            return
        data = None
        try:
            data = document.encode()
            self._store.put(STATE_KEY, data)
        except Exception as e:
            if not best_effort:
                self._failure = e
            raise
        self._document, self._written = document, data

    def _settle_tasks(self, document: StateDocument, method: str) -> None:
        """``method`` completed (or paused) in this write: a retry no longer runs its tasks."""
        if self._tasks is not None:
            self._tasks.method_done(method)
            document.tasks = self._tasks.snapshot()

    def _numbered(self, document: StateDocument) -> bool:
        """Number ``document`` as the next checkpoint, if this write is one (not a held turn's)."""
        if self._checkpoints is None or self._held:
            return False
        document.checkpoint += 1
        return True

    def _checkpoint(self, document: StateDocument, kind: Literal["Completed", "Paused"], method: str) -> None:
        if self._checkpoints is not None and self._written is not None and self._document is document:
            self._checkpoints.take(document, self._written, kind, method)

    def _write_settled(self, document: StateDocument, *, durable: bool = False) -> None:
        """Write a method's end. The finished tasks of other methods still running never make it
        too large: without them it is written (they are then paid again after a pod loss)."""
        try:
            self._write(document, durable=durable, best_effort=True)
        except StateTooLarge as e:
            if not document.tasks or self._tasks is None:
                self._failure = e
                raise
            self._tasks.forget()
            document.tasks = {}
            self._write(document, durable=durable)
        except Exception as e:
            self._failure = e
            raise

    def save_tasks(self, slots: Slots) -> None:
        """A task finished: the document as last written, with the finished tasks kept (the flow's
        state stays as of its last completed method: a retry runs the method again, from there)."""
        with self._lock:
            flow_id = str(self._flow.flow_id) if self._flow is not None and self._flow.flow_id else ""
            document = self._base(flow_id)
            document.tasks = slots
            self._write(document, best_effort=True)

    def _base(self, flow_uuid: str) -> StateDocument:
        current = self._document
        if current is not None and current.flow_id == flow_uuid:
            return current.model_copy()
        return StateDocument(flow_id=flow_uuid, state={})

    def save_state(self, flow_uuid: str, method_name: str, state_data: dict[str, Any] | BaseModel) -> None:
        with self._lock:
            document = self._base(flow_uuid)
            document.state = state_dict(state_data)
            if self._flow is not None:
                document.runtime = snapshot_runtime(self._flow)
                document.runtime["methodOutputs"].extend(resumed_step_output(self._flow, method_name))
            document.last_method = method_name
            self._settle_tasks(document, method_name)
            # Completing the step that asked for feedback settles the request in the same write,
            # so a crash right after cannot make a retry consume the same answer twice.
            if document.pending is not None and document.pending.method == method_name:
                document.pending = None
            numbered = self._numbered(document)
            self._write_settled(document)
            if numbered:
                self._checkpoint(document, "Completed", method_name)

    def load_state(self, flow_uuid: str) -> dict[str, Any] | None:
        document = self._document
        if document is None or document.flow_id != flow_uuid:
            return None
        return dict(document.state)

    def save_pending_feedback(
        self, flow_uuid: str, context: PendingFeedbackContext, state_data: dict[str, Any] | BaseModel
    ) -> None:
        with self._lock:
            document = self._base(flow_uuid)
            document.state = state_dict(state_data)
            if self._flow is not None:
                document.runtime = snapshot_runtime(self._flow)
            document.feedback_count += 1
            request_id = f"{context.method_name}-{document.feedback_count}"
            document.pending = PendingRequest(request_id=request_id, context=context.to_dict())
            self._settle_tasks(document, context.method_name)
            numbered = self._numbered(document)
            self._write_settled(document, durable=True)
            if numbered:
                self._checkpoint(document, "Paused", context.method_name)

    def load_pending_feedback(self, flow_uuid: str) -> tuple[dict[str, Any], PendingFeedbackContext] | None:
        document = self._document
        if document is None or document.flow_id != flow_uuid or document.pending is None:
            return None
        try:
            context = PendingFeedbackContext.from_dict(document.pending.context)
        except (KeyError, TypeError, ValueError) as e:
            raise StateCorrupt(f"pending feedback context is malformed: {e}") from e
        return dict(document.state), context

    def clear_pending_feedback(self, flow_uuid: str) -> None:
        with self._lock:
            document = self._base(flow_uuid)
            if document.pending is None:
                return
            document.pending = None
            self._write(document)


class PauseForFeedback:
    """The HITL provider: never blocks a pod on a human; crewAI then persists and returns."""

    def request_feedback(self, context: PendingFeedbackContext, flow: Flow[Any]) -> str:
        raise HumanFeedbackPending(context=context)


def install(persistence: StorePersistence) -> None:
    """Route crewAI's default persistence and human feedback to the runner.

    Must happen before a ``flowRef`` module is imported: a bare ``@persist`` resolves the default
    backend at decoration time.
    """
    set_flow_persistence_factory(lambda: persistence)
    flow_config.hitl_provider = PauseForFeedback()
