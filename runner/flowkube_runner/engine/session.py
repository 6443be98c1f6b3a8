"""The one crewAI flow of a runner process, as the run drives it: load, build, kick off / resume /
retry, and what came back, in the runner's own types."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from crewai.flow.async_feedback.types import HumanFeedbackPending, PendingFeedbackContext
from crewai.flow.flow import Flow
from crewai.flow.flow_definition import FlowDefinition
from crewai.flow.human_feedback import HumanFeedbackResult
from crewai.llms.base_llm import BaseLLM
from pydantic import BaseModel, ValidationError

from flowkube_api.constants import EXIT_COMMANDS
from flowkube_api.report import FeedbackRequest, excerpt

from ..store import StateCorrupt, StateStore, StateTooLarge
from .api import Ending, InvalidFlow, InvalidInputs, Turn
from .checkpoints import CheckpointLog
from .definitions import automatic_memory, import_flow_class, load_definition, uses_memory
from .persistence import StorePersistence, install
from .rebuilds import serialize_model_rebuilds
from .runtime import json_safe, restore_runtime, state_dict
from .state import StateDocument
from .tasks import install as install_task_cache
from .tls import share_default_contexts

# What crewAI 1.15.30 raises (a ValueError) when kickoff inputs do not validate against a structured state.
_CREWAI_INVALID_INPUTS = "Invalid inputs for structured state"


class FlowSession:
    """The flow this process runs, behind crewAI's persistence and feedback extension points.

    Built before the flow is loaded: a ``flowRef`` module's bare ``@persist`` resolves crewAI's
    default persistence when it is imported, so the runner's must be installed first.
    """

    def __init__(self, store: StateStore, pod: str, document: StateDocument | None, *,
                 keep_tasks: bool = True, checkpoints: CheckpointLog | None = None) -> None:
        self._persistence = StorePersistence()
        self.tasks = self._persistence.bind(store, pod, document, keep_tasks=keep_tasks, checkpoints=checkpoints)
        install(self._persistence)
        install_task_cache(self.tasks)
        share_default_contexts()  # before crewAI builds its first model client
        serialize_model_rebuilds()  # before a flow's threads build its first model answers
        self._definition: FlowDefinition | None = None
        self._flow_class: Any = None
        self._flow: Flow[Any] | None = None
        # The instance that holds the conversation in this process: a warm runner answers each next
        # message with it (crewAI keeps one instance per session; a new one per turn costs its build).
        self._conversing: Flow[Any] | None = None

    # --- what the run reads back ---

    @property
    def document(self) -> StateDocument | None:
        """The state document as last written (or loaded)."""
        return self._persistence.document

    @property
    def storage_failure(self) -> BaseException | None:
        """The storage error behind a failed save; crewAI wraps it in a generic RuntimeError."""
        return self._persistence.failure

    def flow_id(self) -> str | None:
        if self._flow is not None and self._flow.flow_id:
            return str(self._flow.flow_id)
        if self._persistence.document is not None:
            return self._persistence.document.flow_id
        return None

    def feedback_request(self) -> FeedbackRequest | None:
        """The pending request in the state document, as the run reports it."""
        document = self._persistence.document
        if document is None or document.pending is None:
            return None
        pending = document.pending
        return FeedbackRequest(
            id=pending.request_id,
            method=pending.method,
            message=pending.message,
            emit=pending.emit,
            default_outcome=pending.default_outcome,
            output=excerpt(render_output(pending.context.get("method_output")) or ""),
            requested_at=pending.requested_at,
        )

    def feedback_outcome(self, method: str) -> str | None:
        """The outcome crewAI routed the latest answer to ``method``'s request to."""
        history = self._flow.human_feedback_history if self._flow is not None else []
        return next((h.outcome for h in reversed(history) if h.method_name == method), None)

    # --- loading and building ---

    def load(self, *, definition: dict[str, Any] | None = None, flow_ref: str | None = None) -> None:
        """Raises ``InvalidFlow``."""
        if definition is not None:
            self._definition = load_definition(definition)
            self._flow_class = Flow
            wanted = uses_memory(self._definition)
        elif flow_ref is not None:
            self._flow_class = import_flow_class(flow_ref)
            wanted = uses_memory(self._flow_class.flow_definition(), self._flow_class)
        else:
            raise InvalidFlow("neither a definition nor a flowRef to load")
        automatic_memory(self._flow_class, wanted)

    def _construct(self, build: Callable[[], Flow[Any]]) -> Flow[Any]:
        """crewAI resolves actions and state when the instance is built; failures there are the
        definition's fault, not the run's."""
        if self._flow_class is None:
            raise RuntimeError("FlowSession used before load()")
        try:
            flow = build()
        except (ValueError, TypeError, ImportError, ValidationError) as e:
            raise InvalidFlow(f"{type(e).__name__}: {e}") from e
        return self._drive(flow)

    def _drive(self, flow: Flow[Any]) -> Flow[Any]:
        """``flow`` is the instance this process runs now: crewAI's saves read its runtime."""
        self._persistence.attach(flow)
        self._flow = flow
        return flow

    def _new_flow(self) -> Flow[Any]:
        if self._definition is not None:
            definition = self._definition
            return self._construct(lambda: self._flow_class.from_declaration(contents=definition))
        return self._construct(lambda: self._flow_class())

    # --- the three triggers ---

    def kickoff(self, inputs: dict[str, Any]) -> Ending:
        """A new flow from its start methods. Raises ``InvalidFlow`` and ``InvalidInputs``."""
        flow = self._new_flow()
        _check_inputs(flow, inputs)
        try:
            return _ending(flow.kickoff(inputs=inputs or None))
        except ValueError as e:
            if str(e).startswith(_CREWAI_INVALID_INPUTS):
                raise InvalidInputs(str(e)) from e
            raise

    def resume(self, document: StateDocument, text: str, *, outcome: str | None = None,
               turn: int | None = None) -> Ending:
        """Answer the pending request with ``text``; ``outcome`` routes there without asking a model.
        ``turn``: the conversation message whose turn paused for this request (it ends with the resume)."""
        flow_id, persistence, definition = document.flow_id, self._persistence, self._definition

        def build() -> Flow[Any]:
            if definition is not None:
                return self._flow_class.from_pending(flow_id, persistence, definition=definition)
            return self._flow_class.from_pending(flow_id, persistence)

        flow = self._construct(build)
        restore_runtime(flow, document.runtime, completed=False)
        if outcome is not None:
            _choose_outcome(flow.pending_feedback, outcome)
        if turn is None:
            return _ending(flow.resume(text))
        self._persistence.hold()
        result = flow.resume(text)
        if isinstance(result, HumanFeedbackPending):
            return Ending(paused=True)
        state = state_dict(flow.state)
        if not _replied(state):  # handle_turn makes a turn's result its reply; a resumed turn's is made here
            flow.append_assistant_message(render_output(result) or "")
            state = state_dict(flow.state)
        held = self._persistence.document or document
        return self._answered(turn, self._persistence.commit(held.model_copy(update={"state": state}), turn=turn))

    def retry(self, document: StateDocument) -> Ending:
        """Continue after the last completed method, replaying (not re-running) the ones before."""
        flow = self._new_flow()
        restore_runtime(flow, document.runtime, completed=True, state=document.state)
        return _ending(flow.kickoff())


    # --- conversations ---

    def is_conversation(self) -> bool:
        """The definition has an enabled ``conversational`` block, or the class is conversational."""
        if self._definition is not None:
            block = self._definition.conversational
            return block is not None and bool(block.enabled)
        return bool(getattr(self._flow_class, "conversational", False))

    def exit_commands(self) -> set[str]:
        """Messages that end the session (compared without case): crewAI's default, or the class's."""
        own = getattr(self._flow_class, "exit_commands", None) if self._definition is None else None
        return {str(x).strip().lower() for x in (own or EXIT_COMMANDS)}

    def open_conversation(self, document: StateDocument | None) -> Ending:
        """Start the session: its id and empty transcript are saved before any message is taken."""
        if document is not None:  # opened before (this is a retry): the session stands
            return self._answered(document.conversation_turn or 0, document)
        flow = self._conversing = self._new_flow()
        state = flow.state
        session = str(getattr(state, "id", "") or flow.flow_id)
        saved = self._persistence.commit(StateDocument(flow_id=session, state=state_dict(state)), turn=0)
        return self._answered(0, saved)

    def turn(self, document: StateDocument | None, turn: int, text: str) -> Ending:
        """Answer message ``turn`` once: a turn already saved (its run died before reporting) is
        reported from the state, not run again."""
        if document is None or document.conversation_turn is None:
            raise StateCorrupt(f"message {turn} is for a conversation whose session has no saved state")
        if document.conversation_turn >= turn or document.state.get("ended"):
            return self._answered(document.conversation_turn, document)
        if text.strip().lower() in self.exit_commands():
            state = dict(document.state)
            state["messages"] = [*state.get("messages", []), {"role": "user", "content": text, "metadata": {}},
                                 {"role": "assistant", "content": "Conversation ended.", "metadata": {}}]
            state["ended"] = True
            return self._answered(turn, self._persistence.commit(document.model_copy(update={"state": state}),
                                                                 turn=turn))
        flow = self._conversing = self._new_flow() if self._conversing is None else self._drive(self._conversing)
        self._persistence.hold()
        result = flow.handle_turn(text, session_id=document.flow_id)
        if isinstance(result, HumanFeedbackPending):
            return Ending(paused=True)
        try:
            saved = self._persistence.commit(turn=turn)
        except StateTooLarge as e:  # refused whole: the transcript up to the last turn stays as saved
            raise StateTooLarge(e.size, e.limit, f"the conversation's transcript reached it with message {turn}, "
                                "which is not saved; the session ends here (start a new conversation)") from e
        return self._answered(turn, saved)

    @staticmethod
    def _answered(turn: int, document: StateDocument) -> Ending:
        state = document.state
        reply = _replied(state)
        ended = bool(state.get("ended"))
        return Ending(paused=False, output=reply,
                      turn=Turn(session_id=document.flow_id, turn=turn, reply=reply, ended=ended))


def _replied(state: dict[str, Any]) -> str | None:
    """The assistant's reply to the latest user message in a conversation state, if it has one."""
    for message in reversed(state.get("messages") or []):
        role = message.get("role") if isinstance(message, dict) else None
        if role == "user":
            return None
        if role == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else json.dumps(content, default=str)
    return None


def _check_inputs(flow: Flow[Any], inputs: dict[str, Any]) -> None:
    state = flow.state
    if not inputs or not isinstance(state, BaseModel):
        return
    try:
        type(state).model_validate({**state.model_dump(), **inputs})
    except ValidationError as e:
        raise InvalidInputs(f"inputs do not fit the flow state: {e}") from e


def _ending(result: Any) -> Ending:
    if isinstance(result, HumanFeedbackPending):
        return Ending(paused=True)
    return Ending(paused=False, output=render_output(result))


def render_output(value: Any) -> str | None:
    """The text a human would call the flow's output: an agent's raw answer, not its envelope."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, HumanFeedbackResult):
        return render_output(value.output)
    raw = value.get("raw") if isinstance(value, dict) else getattr(value, "raw", None)
    if isinstance(raw, str):
        return raw
    return json.dumps(json_safe(value), ensure_ascii=False, default=str)


def _choose_outcome(context: PendingFeedbackContext, outcome: str) -> None:
    """Make the resume route to ``outcome`` without asking a model to classify the text.

    crewAI collapses feedback through whatever LLM the context names; handing it one that
    always answers ``outcome`` keeps the rest of its resume path (history, routing) unchanged.
    """

    class ChosenOutcome(BaseLLM):  # type: ignore[misc]
        def call(self, *_args: Any, **_kwargs: Any) -> str:
            return json.dumps({"outcome": outcome})

    context.llm = ChosenOutcome(model="flowkube/chosen-outcome")
