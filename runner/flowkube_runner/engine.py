"""Everything that touches crewAI: persistence, the feedback provider, usage, loading flows.

crewAI is imported here and nowhere else, once, when a run starts. The pieces plug into crewAI's
own extension points (``set_flow_persistence_factory``, ``flow_config.hitl_provider``, the event
bus, model-call hooks); the few private attributes used are confined to ``snapshot_runtime`` /
``restore_runtime`` and say why.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from crewai.events.event_bus import crewai_event_bus
from crewai.events.types.llm_events import LLMCallCompletedEvent
from crewai.flow.async_feedback.types import HumanFeedbackPending, PendingFeedbackContext
from crewai.flow.flow import Flow
from crewai.flow.flow_config import flow_config
from crewai.flow.flow_definition import FlowDefinition, FlowPersistenceDefinition
from crewai.flow.human_feedback import HumanFeedbackResult
from crewai.flow.persistence.base import FlowPersistence
from crewai.flow.persistence.factory import set_flow_persistence_factory
from crewai.flow.runtime import Flow as RuntimeFlow
from crewai.hooks.dispatch import HookAborted, InterceptionPoint, register, unregister
from crewai.types.usage_metrics import UsageMetrics
from crewai.utilities.serialization import to_serializable
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError
from pydantic.alias_generators import to_camel

from flowkube_api.constants import STATE_KEY
from flowkube_api.report import TokenUsage, Usage

from .store import StateCorrupt, StateStore, decode_json, encode_json

__all__ = [
    "DefinitionProblem",
    "Flow",
    "FlowDefinition",
    "HumanFeedbackPending",
    "InvalidFlow",
    "PauseForFeedback",
    "PendingRequest",
    "StateDocument",
    "StorePersistence",
    "UsageRecorder",
    "check_definition",
    "import_flow_class",
    "install",
    "load_definition",
    "restore_runtime",
]

STATE_VERSION = 1


class InvalidFlow(Exception):
    pass


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore")


class PendingRequest(_Camel):
    request_id: str
    context: dict[str, Any]


class StateDocument(_Camel):
    """The runner's durable record of a flow: crewAI state plus what crewAI does not persist."""

    version: int = STATE_VERSION
    flow_id: str
    state: dict[str, Any]
    runtime: dict[str, Any] = Field(default_factory=dict)
    pending: PendingRequest | None = None
    last_method: str | None = None
    feedback_count: int = 0
    pod: str = ""
    updated_at: datetime | None = None

    def encode(self) -> bytes:
        return encode_json(self.model_dump(mode="json", by_alias=True))

    @classmethod
    def load(cls, store: StateStore) -> StateDocument | None:
        data = store.get(STATE_KEY)
        if data is None:
            return None
        raw = decode_json(data, f"state key {STATE_KEY}")
        try:
            document = cls.model_validate(raw)
        except ValidationError as e:
            raise StateCorrupt(f"state key {STATE_KEY} does not hold a flow state: {e}") from e
        if document.version != STATE_VERSION:
            raise StateCorrupt(f"state version {document.version} is not supported (expected {STATE_VERSION})")
        return document


# --- the runtime bits crewAI 1.15.30 leaves out of persistence ---------------------------------


def _json_safe(value: Any) -> Any:
    return to_serializable(value, max_depth=0)


def snapshot_runtime(flow: Flow[Any]) -> dict[str, Any]:
    """What an uninterrupted process would still hold in memory after the last completed method.

    crewAI persists only ``state``; a definition flow restored in a new process loses the earlier
    methods' outputs (``${outputs.draft.raw}`` then fails), the completed set a retry needs to
    skip finished work, and the partial progress of and/or joins. Copies are taken with ``list`` /
    ``dict`` / ``set`` so a parallel branch appending meanwhile cannot break the iteration.
    """
    return {
        "completedMethods": sorted(str(m) for m in set(flow._completed_methods)),
        "methodOutputs": _json_safe(list(flow._method_outputs)),
        "methodExecutionCounts": {str(k): v for k, v in dict(flow._method_execution_counts).items()},
        "methodCallCounts": {str(k): v for k, v in dict(flow._method_call_counts).items()},
        "pendingEvents": {str(k): sorted(v) for k, v in dict(flow._pending_events).items()},
        "firedOrListeners": sorted(str(m) for m in set(flow._fired_or_listeners)),
        "humanFeedbackHistory": _json_safe(list(flow.human_feedback_history)),
    }


def _resumed_step_output(flow: Flow[Any], method_name: str) -> list[Any]:
    """The output entry of a feedback step being completed by a resume, which crewAI 1.15.30
    appends only after persisting; without it a crash before the next save loses the step's
    output and feedback (and a retry would not know the route it took)."""
    context = flow._pending_feedback_context
    result = flow.last_human_feedback
    if context is None or context.method_name != method_name or result is None:
        return []
    entry: dict[str, Any] = {"method": method_name, "output": result.output if context.emit else result}
    if context.emit:
        entry["human_feedback"] = result
    return [_json_safe(entry)]


def _feedback_result(data: dict[str, Any]) -> HumanFeedbackResult:
    timestamp = data.get("timestamp")
    return HumanFeedbackResult(
        output=data.get("output"),
        feedback=str(data.get("feedback", "")),
        outcome=data.get("outcome"),
        timestamp=datetime.fromisoformat(timestamp) if isinstance(timestamp, str) else datetime.now(),
        method_name=str(data.get("method_name", "")),
        metadata=dict(data.get("metadata") or {}),
    )


def restore_runtime(
    flow: Flow[Any], runtime: dict[str, Any], *, completed: bool, state: dict[str, Any] | None = None
) -> None:
    """Put a snapshot back. ``completed`` (a retry) goes through crewAI's checkpoint restore, so
    the next kickoff replays past finished methods instead of running them (and their LLM calls)
    again; a resume only needs the set for cycle detection."""
    entries = []
    for entry in runtime.get("methodOutputs", []):
        if not isinstance(entry, dict) or "method" not in entry:
            raise StateCorrupt(f"malformed method output entry in state: {entry!r:.200}")
        restored = dict(entry)
        if isinstance(entry.get("human_feedback"), dict):
            restored["human_feedback"] = _feedback_result(entry["human_feedback"])
        entries.append(restored)
    flow._method_outputs = entries
    flow._method_execution_counts = dict(runtime.get("methodExecutionCounts", {}))
    flow._method_call_counts = dict(runtime.get("methodCallCounts", {}))
    flow._pending_events = {k: set(v) for k, v in runtime.get("pendingEvents", {}).items()}
    flow._fired_or_listeners = set(runtime.get("firedOrListeners", []))
    history = [_feedback_result(h) for h in runtime.get("humanFeedbackHistory", []) if isinstance(h, dict)]
    flow.human_feedback_history = history
    flow.last_human_feedback = history[-1] if history else None
    if completed:
        flow.checkpoint_completed_methods = set(runtime.get("completedMethods", []))
        flow.checkpoint_state = state
        flow._restore_from_checkpoint()
        _replay_router_outcomes(flow, entries)
    else:
        flow._completed_methods = set(runtime.get("completedMethods", []))


def _router_outcomes(flow: Flow[Any], entries: list[dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    """The route each completed router last took, with the payload its listeners received."""
    outcomes: dict[str, tuple[str, Any]] = {}
    for entry in entries:
        method = str(entry["method"])
        if method not in flow._definition.methods or not flow._is_router(method):
            continue
        feedback = entry.get("human_feedback")
        if isinstance(feedback, HumanFeedbackResult) and feedback.outcome:
            outcomes[method] = (feedback.outcome, feedback)
        elif isinstance(entry.get("output"), str):
            outcomes[method] = (entry["output"], entry["output"])
    return outcomes


def _replay_router_outcomes(flow: Flow[Any], entries: list[dict[str, Any]]) -> None:
    """Make crewAI's replay follow the routes completed routers took.

    When a retry replays past a completed router, crewAI 1.15.30 continues only the listeners of
    the router's name, never those of the outcome it emitted, so everything downstream of a
    routed feedback step is silently dropped and the flow "succeeds" early. Wrapping the two
    replay entry points on this one instance re-fires the recorded outcome right after.
    """
    outcomes = _router_outcomes(flow, entries)
    if not outcomes:
        return
    single = flow._execute_single_listener
    start = flow._execute_start_method

    async def fire(method: str) -> None:
        outcome, payload = outcomes.pop(method)
        await flow._execute_listeners(outcome, payload)

    async def single_listener(name: Any, result: Any, triggering_event_id: str | None = None) -> Any:
        replaying = flow._is_execution_resuming and name in flow._completed_methods and str(name) in outcomes
        value = await single(name, result, triggering_event_id)
        if replaying:
            await fire(str(name))
        return value

    async def start_method(name: Any) -> None:
        replaying = flow._is_execution_resuming and name in flow._completed_methods and str(name) in outcomes
        await start(name)
        if replaying:
            await fire(str(name))

    object.__setattr__(flow, "_execute_single_listener", single_listener)
    object.__setattr__(flow, "_execute_start_method", start_method)


# --- crewAI extension points ---------------------------------------------------------------------


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

    def bind(self, store: StateStore, pod: str, document: StateDocument | None) -> None:
        self._store = store
        self._pod = pod
        self._document = document

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

    def _write(self, document: StateDocument) -> None:
        if self._store is None:
            raise RuntimeError("StorePersistence used before bind()")
        document.pod = self._pod
        document.updated_at = datetime.now(UTC)
        try:
            self._store.put(STATE_KEY, document.encode())
        except Exception as e:
            self._failure = e
            raise
        self._document = document

    def _state_dict(self, state_data: dict[str, Any] | BaseModel) -> dict[str, Any]:
        data = state_data.model_dump(mode="json") if isinstance(state_data, BaseModel) else state_data
        return dict(_json_safe(data))

    def _base(self, flow_uuid: str) -> StateDocument:
        current = self._document
        if current is not None and current.flow_id == flow_uuid:
            return current.model_copy()
        return StateDocument(flow_id=flow_uuid, state={})

    def save_state(self, flow_uuid: str, method_name: str, state_data: dict[str, Any] | BaseModel) -> None:
        with self._lock:
            document = self._base(flow_uuid)
            document.state = self._state_dict(state_data)
            if self._flow is not None:
                document.runtime = snapshot_runtime(self._flow)
                document.runtime["methodOutputs"].extend(_resumed_step_output(self._flow, method_name))
            document.last_method = method_name
            # Completing the step that asked for feedback settles the request in the same write,
            # so a crash right after cannot make a retry consume the same answer twice.
            if document.pending is not None and document.pending.context.get("method_name") == method_name:
                document.pending = None
            self._write(document)

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
            document.state = self._state_dict(state_data)
            if self._flow is not None:
                document.runtime = snapshot_runtime(self._flow)
            document.feedback_count += 1
            request_id = f"{context.method_name}-{document.feedback_count}"
            document.pending = PendingRequest(request_id=request_id, context=context.to_dict())
            self._write(document)

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


class UsageRecorder:
    """Per-run token totals from crewAI's ``LLMCallCompletedEvent``, plus the token budget.

    The bus runs handlers on a worker pool, so every reading flushes it first: a handler still
    queued would otherwise drop its call's tokens from the report. ``on_call`` runs in the handler
    after each counted call (the run keeps an interim report current with it).
    """

    def __init__(
        self,
        *,
        prior_total_tokens: int = 0,
        max_total_tokens: int | None = None,
        on_call: Callable[[UsageRecorder], None] | None = None,
    ) -> None:
        self._prior = prior_total_tokens
        self._cap = max_total_tokens
        self._on_call = on_call
        self._lock = threading.Lock()
        self._totals = UsageMetrics()
        self._by_model: dict[str, UsageMetrics] = {}
        self.exceeded = False

    def _on_llm_call_completed(self, _source: Any, event: LLMCallCompletedEvent) -> None:
        metrics = UsageMetrics.from_provider_dict(event.usage)
        if metrics is None:
            return
        model = event.model or "unknown"
        with self._lock:
            self._totals.add_usage_metrics(metrics)
            self._by_model.setdefault(model, UsageMetrics()).add_usage_metrics(metrics)
            if self._cap is not None and self._prior + self._totals.total_tokens > self._cap:
                self.exceeded = True
        if self._on_call is not None:
            self._on_call(self)

    def _over(self, *, before_call: bool) -> bool:
        if self._cap is None:
            return False
        crewai_event_bus.flush()
        with self._lock:
            spent = self._prior + self._totals.total_tokens
        # Before a call, reaching the cap is enough: any call adds tokens and would cross it.
        return bool(spent >= self._cap if before_call else spent > self._cap)

    def budget_message(self) -> str:
        return (
            f"token budget exceeded: {self._prior} tokens from earlier runs + "
            f"{self.usage().total_tokens} in this run > maxTotalTokens {self._cap}"
        )

    def _check_before_call(self, _ctx: Any) -> None:
        if self._over(before_call=True):
            self.exceeded = True
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def _check_after(self, _ctx: Any) -> None:
        if self._over(before_call=False):
            self.exceeded = True
            raise HookAborted(self.budget_message(), source="flowkube budget")

    def budget_already_spent(self) -> bool:
        return self._cap is not None and self._prior >= self._cap

    @contextmanager
    def recording(self) -> Iterator[UsageRecorder]:
        crewai_event_bus.on(LLMCallCompletedEvent)(self._on_llm_call_completed)
        hooks = [
            (InterceptionPoint.PRE_MODEL_CALL, self._check_before_call),
            (InterceptionPoint.POST_MODEL_CALL, self._check_after),
            (InterceptionPoint.POST_STEP, self._check_after),
        ]
        if self._cap is not None:
            for point, hook in hooks:
                register(point, hook)
        try:
            yield self
        finally:
            crewai_event_bus.flush()
            if self._cap is not None:
                for point, hook in hooks:
                    unregister(point, hook)
            crewai_event_bus.off(LLMCallCompletedEvent, self._on_llm_call_completed)

    def usage(self) -> Usage:
        crewai_event_bus.flush()
        usage = self.recorded()
        if self._cap is not None and self._prior + usage.total_tokens > self._cap:
            self.exceeded = True
        return usage

    def recorded(self) -> Usage:
        """What the handlers have counted so far, without flushing the bus: safe inside a handler,
        where a flush would wait for the very handler calling it."""
        with self._lock:
            totals = self._totals.model_copy()
            by_model = {m: u.model_copy() for m, u in self._by_model.items()}
        return Usage(**_tokens(totals).model_dump(), by_model={m: _tokens(u) for m, u in by_model.items()})


def _tokens(metrics: UsageMetrics) -> TokenUsage:
    return TokenUsage(
        total_tokens=metrics.total_tokens,
        prompt_tokens=metrics.prompt_tokens,
        completion_tokens=metrics.completion_tokens,
        cached_prompt_tokens=metrics.cached_prompt_tokens,
        reasoning_tokens=metrics.reasoning_tokens,
        cache_creation_tokens=metrics.cache_creation_tokens,
        successful_requests=metrics.successful_requests,
    )


def install(persistence: StorePersistence) -> None:
    """Route crewAI's default persistence and human feedback to the runner.

    Must happen before a ``flowRef`` module is imported: a bare ``@persist`` resolves the default
    backend at decoration time.
    """
    set_flow_persistence_factory(lambda: persistence)
    flow_config.hitl_provider = PauseForFeedback()


# --- loading -------------------------------------------------------------------------------------

_RUNNER_PERSISTENCE = FlowPersistenceDefinition(enabled=True)


def with_runner_persistence(definition: FlowDefinition) -> FlowDefinition:
    """Persist after every method, always to the runner's store.

    Retry and resume need every completed method on record, whatever the definition asked for;
    a backend named in the definition (a SQLite file, say) would not survive the pod anyway.
    """
    methods = {
        name: method.model_copy(update={"persist": None}) if method.persist is not None else method
        for name, method in definition.methods.items()
    }
    return definition.model_copy(update={"persist": _RUNNER_PERSISTENCE, "methods": methods})


@dataclass(frozen=True)
class DefinitionProblem:
    """One finding of crewAI's about a definition; ``loc`` is a path into the definition's JSON."""

    loc: tuple[str | int, ...]
    msg: str

    def render(self) -> str:
        path = ".".join(str(part) for part in self.loc)
        return f"{path}: {self.msg}" if path else self.msg


class _IssueCollector(logging.Handler):
    """crewAI's error-severity definition issues, which it logs instead of raising.

    Only records of the collecting thread are kept: the validate server checks definitions on
    several threads at once through the one shared crewAI logger.
    """

    _ISSUE_FORMAT = "Flow definition issue for %s%s [%s]: %s"

    def __init__(self) -> None:
        super().__init__(level=logging.ERROR)
        self.thread = threading.get_ident()
        self.problems: list[DefinitionProblem] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.thread != self.thread:
            return
        args = record.args
        if record.msg == self._ISSUE_FORMAT and isinstance(args, tuple) and len(args) == 4:
            location, message = str(args[1]), str(args[3])
            self.problems.append(DefinitionProblem(_split_path(location.removeprefix(" at ")), message))
        else:
            self.problems.append(DefinitionProblem((), record.getMessage()))


_TOP_LEVEL = sorted({f.alias or n for n, f in FlowDefinition.model_fields.items()}, key=len, reverse=True)
# crewAI names the place in the message of its model-level errors ("... at methods.a.do.expr: ...",
# "methods.a.listen listen condition ..."); pydantic only gives those an empty location.
_PATH_IN_MESSAGE = re.compile(rf"(?<![\w.])((?:{'|'.join(_TOP_LEVEL)})(?:\.\w+|\[\d+\])+)")


def _split_path(path: str) -> tuple[str | int, ...]:
    parts: list[str | int] = []
    for piece in path.split("."):
        name, *indexes = piece.replace("]", "").split("[")
        if name:
            parts.append(name)
        parts.extend(int(i) for i in indexes if i.isdigit())
    return tuple(parts)


Loc = tuple[str | int, ...]


def _data_path(raw: Any, loc: Loc) -> tuple[Loc, Loc]:
    """pydantic's location split into the path through the user's JSON and the union branch:
    where the union sits plus the member labels pydantic inserts (``FlowCodeActionDefinition``,
    ``function-after[...]``, a tag value)."""
    path: list[str | int] = []
    labels: list[str | int] = []
    branch: Loc = ()
    node: Any = raw
    for index, part in enumerate(loc):
        in_data = (isinstance(node, dict) and part in node) or (
            isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        )
        if in_data:
            node = node[part]
        elif index < len(loc) - 1:
            # Not in the data and not the missing field itself: a union member's label.
            labels.append(part)
            branch = (*path, *labels)
            continue
        path.append(part)
    return tuple(path), branch


def _validation_problems(raw: Any, error: ValidationError) -> list[DefinitionProblem]:
    """crewAI's errors by JSON path. Where a value matched no member of a union (``do`` with a
    misspelt ``call``), pydantic reports every member's complaints; only the members whose
    literal tag (``call: agent``) the value did carry are kept, or else one merged "should be"."""
    problems: list[DefinitionProblem] = []
    branches: list[tuple[Loc, DefinitionProblem, Any]] = []
    for detail in error.errors(include_url=False, include_input=False):
        msg = str(detail["msg"]).removeprefix("Value error, ")
        loc, branch = _data_path(raw, tuple(detail["loc"]))
        if not loc and (found := _PATH_IN_MESSAGE.search(msg)):
            loc = _split_path(found.group(1))
        if branch:
            branches.append((branch, DefinitionProblem(loc, msg), detail))
        else:
            problems.append(DefinitionProblem(loc, msg))
    tag_mismatch = {branch for branch, _, d in branches if d["type"] == "literal_error"}
    expected: dict[Loc, list[str]] = {}
    for branch, problem, detail in branches:
        siblings = {b for b, _, _ in branches if b[:-1] == branch[:-1]}
        if siblings - tag_mismatch:  # some member's tag matched: its complaints are the real ones
            if branch not in tag_mismatch:
                problems.append(problem)
        elif detail["type"] == "literal_error":
            expected.setdefault(problem.loc, []).append(str((detail.get("ctx") or {}).get("expected", "")))
    for loc, values in expected.items():
        values = list(dict.fromkeys(values))
        options = values[0] if len(values) == 1 else ", ".join(values[:-1]) + f" or {values[-1]}"
        problems.append(DefinitionProblem(loc, f"Input should be {options}"))
    return problems


def check_definition(raw: Any) -> tuple[FlowDefinition | None, list[DefinitionProblem]]:
    """crewAI's own verdict on an inline definition: its ``FlowDefinition`` model, plus the
    error-severity issues its loader only logs (an invalid ``default_outcome``, say).

    What ``Flow.from_declaration`` adds on top (importing ``code``/``tool`` refs, reading crew
    files, the script-execution switch) depends on the image and env of the flow's own pod, so
    it is left to the run; it fails there with ``InvalidDefinition`` too.
    """
    if not isinstance(raw, dict):
        return None, [DefinitionProblem((), "a flow definition must be a JSON object")]
    collector = _IssueCollector()
    definition_logger = logging.getLogger("crewai.flow.flow_definition")
    definition_logger.addHandler(collector)
    try:
        definition = FlowDefinition.from_declaration(contents=raw)
    except ValidationError as e:
        return None, _dedupe(_validation_problems(raw, e))
    except (ValueError, TypeError) as e:
        return None, [DefinitionProblem((), str(e))]
    finally:
        definition_logger.removeHandler(collector)
    if collector.problems:
        return None, _dedupe(collector.problems)
    return definition, []


def _dedupe(problems: list[DefinitionProblem]) -> list[DefinitionProblem]:
    return list(dict.fromkeys(problems))


def load_definition(raw: dict[str, Any]) -> FlowDefinition:
    """Validate exactly as the admission webhook's validator does (``check_definition``)."""
    definition, problems = check_definition(raw)
    if definition is None:
        raise InvalidFlow("; ".join(p.render() for p in problems))
    return with_runner_persistence(definition)


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
    return json.dumps(_json_safe(value), ensure_ascii=False, default=str)


def import_flow_class(ref: str) -> Any:
    module_name, sep, attr = ref.partition(":")
    if not sep or not module_name or not attr:
        raise InvalidFlow(f"flowRef {ref!r} is not of the form 'package.module:ClassName'")
    try:
        target: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            target = getattr(target, part)
    except Exception as e:
        raise InvalidFlow(f"flowRef {ref!r} does not import: {type(e).__name__}: {e}") from e
    if not (isinstance(target, type) and issubclass(target, RuntimeFlow)):
        raise InvalidFlow(f"flowRef {ref!r} is not a crewAI Flow subclass")
    flow_class: Any = target
    try:
        definition = flow_class.flow_definition()
    except Exception as e:
        raise InvalidFlow(f"flowRef {ref!r}: crewAI cannot build its definition: {e}") from e
    # The class-level cache is what every instance reads, so this is where persistence is forced.
    flow_class._flow_definition = with_runner_persistence(definition)
    return flow_class


def choose_outcome(context: PendingFeedbackContext, outcome: str) -> None:
    """Make the resume route to ``outcome`` without asking a model to classify the text.

    crewAI collapses feedback through whatever LLM the context names; handing it one that
    always answers ``outcome`` keeps the rest of its resume path (history, routing) unchanged.
    """
    from crewai.llms.base_llm import BaseLLM

    class ChosenOutcome(BaseLLM):  # type: ignore[misc]
        def call(self, *_args: Any, **_kwargs: Any) -> str:
            return json.dumps({"outcome": outcome})

    context.llm = ChosenOutcome(model="flowkube/chosen-outcome")
