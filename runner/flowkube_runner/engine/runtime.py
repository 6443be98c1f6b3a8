"""The runtime bits crewAI 1.15.30 leaves out of persistence, and the private attributes they live in.

Everything here reads or writes crewAI's private ``Flow`` attributes, each for a reason written next
to it; nothing else in the runner does.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from crewai.flow.flow import Flow
from crewai.flow.human_feedback import HumanFeedbackResult
from crewai.utilities.serialization import to_serializable
from pydantic import BaseModel

from ..store import StateCorrupt


def json_safe(value: Any) -> Any:
    return to_serializable(value, max_depth=0)


def state_dict(state: Any) -> dict[str, Any]:
    """A flow's state (a pydantic model or a dict) as the JSON-safe dict the state document keeps."""
    data = state.model_dump(mode="json") if isinstance(state, BaseModel) else dict(state)
    return dict(json_safe(data))


def snapshot_runtime(flow: Flow[Any]) -> dict[str, Any]:
    """What an uninterrupted process would still hold in memory after the last completed method.

    crewAI persists only ``state``; a definition flow restored in a new process loses the earlier
    methods' outputs (``${outputs.draft.raw}`` then fails), the completed set a retry needs to
    skip finished work, and the partial progress of and/or joins. Copies are taken with ``list`` /
    ``dict`` / ``set`` so a parallel branch appending meanwhile cannot break the iteration.
    """
    return {
        "completedMethods": sorted(str(m) for m in set(flow._completed_methods)),
        "methodOutputs": json_safe(list(flow._method_outputs)),
        "methodExecutionCounts": {str(k): v for k, v in dict(flow._method_execution_counts).items()},
        "methodCallCounts": {str(k): v for k, v in dict(flow._method_call_counts).items()},
        "pendingEvents": {str(k): sorted(v) for k, v in dict(flow._pending_events).items()},
        "firedOrListeners": sorted(str(m) for m in set(flow._fired_or_listeners)),
        "humanFeedbackHistory": json_safe(list(flow.human_feedback_history)),
    }


def resumed_step_output(flow: Flow[Any], method_name: str) -> list[Any]:
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
    return [json_safe(entry)]


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
