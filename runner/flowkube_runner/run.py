"""One run of one Flow: load it, kick off / resume / retry, and say how it ended.

``execute`` never raises for anything a flow or its state can do wrong; it turns every ending
into a ``RunReport`` whose reason and exit code tell the operator whether a retry can help.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from flowkube_api import constants as c
from flowkube_api.report import FeedbackApplied, FeedbackRequest, RunReport, Usage, excerpt

from .config import RunnerConfig
from .store import StateCorrupt, StateStore, StateTooLarge, StoreError

if TYPE_CHECKING:
    from .engine import StateDocument, StorePersistence, UsageRecorder

log = logging.getLogger("flowkube_runner")


class RunFailure(Exception):
    def __init__(self, reason: c.Reason, message: str, *, permanent: bool) -> None:
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent


def _permanent(reason: c.Reason, message: str) -> RunFailure:
    return RunFailure(reason, message, permanent=True)


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    pending: list[BaseException] = []
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        for linked in (current.__cause__, current.__context__):
            if linked is not None:
                pending.append(linked)
        current = pending.pop(0) if pending else None


_CONNECTION_ERRORS = {
    ("openai", "APIConnectionError"),
    ("openai", "APITimeoutError"),
    ("httpx", "TransportError"),
    ("httpcore", "ConnectError"),
}


def _is_connection_error(error: BaseException) -> bool:
    for cls in type(error).__mro__:
        if (cls.__module__.split(".")[0], cls.__name__) in _CONNECTION_ERRORS:
            return True
    return isinstance(error, ConnectionError)


def _is_api_error(error: BaseException) -> bool:
    providers = ("openai", "anthropic", "litellm")
    return any(cls.__module__.split(".")[0] in providers for cls in type(error).__mro__)


INTERRUPTED_MESSAGE = "the runner stopped before finishing"


class InterimReport:
    """This run's report as it stands if the process dies now: Failed, ``RunInterrupted``, with the
    tokens counted so far.

    It is rewritten under the run's report key after every model call, so a SIGKILLed or OOM-killed
    runner (which writes nothing on its way out) still hands the operator its tokens; the final
    report overwrites it. Writes are serialised and read the usage under the same lock, so the last
    write always carries the newest count; after ``close()`` nothing is written, so a late model-call
    handler can never replace the final report.
    """

    def __init__(self, store: StateStore, template: RunReport) -> None:
        self._store = store
        self._template = template.model_copy(
            update={
                "result": c.RunResult.FAILED,
                "reason": c.Reason.RUN_INTERRUPTED,
                "message": INTERRUPTED_MESSAGE,
                # Not an exit code the process returned (it never returns): "a retry may help".
                "exit_code": c.EXIT_RETRYABLE,
            }
        )
        self._lock = threading.Lock()
        self._closed = False

    def update(self, usage: Callable[[], Usage], flow_id: str | None = None) -> None:
        with self._lock:
            if self._closed:
                return
            report = self._template.model_copy(update={"usage": usage(), "flow_id": flow_id})
            try:
                self._store.put(c.report_key(report.pod), report.encode())
            except Exception as e:
                # Losing an interim report costs only crash-safety of this call's tokens; the run goes on.
                log.warning("could not write the interim run report: %s", e)

    def close(self) -> None:
        with self._lock:
            self._closed = True


class _Run:
    def __init__(self, config: RunnerConfig, store: StateStore, engine: Any, interim: InterimReport) -> None:
        self.config = config
        self.store = store
        self.engine = engine  # the module, imported late: see execute()
        self.persistence: StorePersistence = engine.StorePersistence()
        self.interim = interim
        self.recorder: UsageRecorder = engine.UsageRecorder(
            prior_total_tokens=config.prior_total_tokens,
            max_total_tokens=config.spec.budget.max_total_tokens,
            on_call=self._after_model_call,
        )
        self.definition: Any = None
        self.flow_class: Any = None
        self.flow: Any = None
        self.feedback_applied: FeedbackApplied | None = None

    def _after_model_call(self, recorder: UsageRecorder) -> None:
        self.interim.update(recorder.recorded, self.flow_id())

    def flow_id(self) -> str | None:
        if self.flow is not None and self.flow.flow_id:
            return str(self.flow.flow_id)
        if self.persistence.document is not None:
            return self.persistence.document.flow_id
        return None

    # --- loading ---

    def load(self) -> None:
        spec = self.config.spec
        try:
            if spec.definition is not None:
                self.definition = self.engine.load_definition(spec.definition)
                self.flow_class = self.engine.Flow
            else:
                assert spec.flow_ref is not None
                self.flow_class = self.engine.import_flow_class(spec.flow_ref)
        except self.engine.InvalidFlow as e:
            reason = c.Reason.INVALID_DEFINITION if spec.definition is not None else c.Reason.INVALID_FLOW_REF
            raise _permanent(reason, str(e)) from e

    def _construct(self, build: Any) -> Any:
        """crewAI resolves actions and state when the instance is built; failures there are the
        definition's fault, not the run's."""
        try:
            flow = build()
        except (ValueError, TypeError, ImportError, ValidationError) as e:
            reason = c.Reason.INVALID_DEFINITION if self.definition is not None else c.Reason.INVALID_FLOW_REF
            raise _permanent(reason, f"{type(e).__name__}: {e}") from e
        self.persistence.attach(flow)
        self.flow = flow
        return flow

    def new_flow(self) -> Any:
        if self.definition is not None:
            return self._construct(lambda: self.flow_class.from_declaration(contents=self.definition))
        return self._construct(self.flow_class)

    def validate_inputs(self, flow: Any, inputs: dict[str, Any]) -> None:
        state = flow.state
        if not inputs or not isinstance(state, BaseModel):
            return
        try:
            type(state).model_validate({**state.model_dump(), **inputs})
        except ValidationError as e:
            raise _permanent(c.Reason.INVALID_INPUTS, f"inputs do not fit the flow state: {e}") from e

    # --- triggers ---

    def kickoff(self) -> Any:
        flow = self.new_flow()
        inputs = dict(self.config.spec.inputs)
        self.validate_inputs(flow, inputs)
        return flow.kickoff(inputs=inputs or None)

    def resume(self, document: StateDocument) -> Any:
        pending = document.pending
        if pending is None:
            raise _permanent(c.Reason.STATE_CORRUPT, "resume requested but the state has no pending feedback request")
        feedback = self.config.feedback
        if feedback is None:
            raise _permanent(c.Reason.INTERNAL_ERROR, f"resume requested without {c.ENV_FEEDBACK}")
        if feedback.request_id and feedback.request_id != pending.request_id:
            raise _permanent(
                c.Reason.FEEDBACK_REFUSED,
                f"feedback is for request {feedback.request_id!r}, but {pending.request_id!r} is pending",
            )
        context = pending.context
        emit = context.get("emit") or None
        default_outcome = context.get("default_outcome")
        text = feedback.text
        if feedback.timed_out:
            if not default_outcome:
                raise _permanent(
                    c.Reason.FEEDBACK_TIMED_OUT,
                    f"feedback request {pending.request_id} timed out and step "
                    f"{context.get('method_name')!r} has no default outcome",
                )
            # crewAI resolves empty feedback to the step's default outcome without asking a model.
            text = ""
        if feedback.outcome is not None and (not emit or feedback.outcome not in emit):
            raise _permanent(
                c.Reason.FEEDBACK_REFUSED,
                f"outcome {feedback.outcome!r} is not one of the step's outcomes {emit}",
            )

        def build() -> Any:
            flow_id, persistence = document.flow_id, self.persistence
            if self.definition is not None:
                return self.flow_class.from_pending(flow_id, persistence, definition=self.definition)
            return self.flow_class.from_pending(flow_id, persistence)

        flow = self._construct(build)
        self.engine.restore_runtime(flow, document.runtime, completed=False)
        if feedback.outcome is not None and not feedback.timed_out:
            self.engine.choose_outcome(flow.pending_feedback, feedback.outcome)
        method = str(context.get("method_name", ""))
        result = flow.resume(text)
        outcome = next(
            (h.outcome for h in reversed(flow.human_feedback_history) if h.method_name == method),
            None,
        )
        self.feedback_applied = FeedbackApplied(
            request_id=pending.request_id,
            method=method,
            response=feedback.text,
            outcome=outcome,
            timed_out=feedback.timed_out,
        )
        return result

    def retry(self, document: StateDocument | None) -> Any:
        if document is None or not document.runtime.get("completedMethods"):
            log.info("nothing completed yet: the retry starts the flow from the beginning")
            return self.kickoff()
        if document.pending is not None:
            if self.config.feedback is not None:
                return self.resume(document)
            # Paused is where the earlier run ended; report the same request again.
            return _StillPaused()
        flow = self.new_flow()
        self.engine.restore_runtime(flow, document.runtime, completed=True, state=document.state)
        return flow.kickoff()

    # --- the whole run ---

    def drive(self) -> Any:
        trigger = self.config.trigger
        document = None
        if trigger is not c.Trigger.KICKOFF:
            try:
                document = self.engine.StateDocument.load(self.store)
            except StateCorrupt as e:
                raise _permanent(c.Reason.STATE_CORRUPT, str(e)) from e
            if document is None and trigger is c.Trigger.RESUME:
                raise _permanent(c.Reason.STATE_CORRUPT, f"resume requested but state key {c.STATE_KEY} is missing")
        self.persistence.bind(self.store, self.config.pod, document)
        self.engine.install(self.persistence)
        self.load()
        if self.recorder.budget_already_spent():
            self.recorder.exceeded = True
            raise _permanent(c.Reason.BUDGET_EXCEEDED, self.recorder.budget_message())
        with self.recorder.recording():
            if trigger is c.Trigger.KICKOFF:
                return self.kickoff()
            if trigger is c.Trigger.RESUME:
                assert document is not None
                return self.resume(document)
            return self.retry(document)

    def classify(self, error: BaseException) -> RunFailure:
        if self.recorder.exceeded:
            return _permanent(c.Reason.BUDGET_EXCEEDED, self.recorder.budget_message())
        causes = [*_chain(error)]
        if self.persistence.failure is not None:
            causes.insert(0, self.persistence.failure)
        for cause in causes:
            if isinstance(cause, RunFailure):
                return cause
            if isinstance(cause, StateTooLarge):
                return _permanent(c.Reason.STATE_TOO_LARGE, str(cause))
            if isinstance(cause, StateCorrupt):
                return _permanent(c.Reason.STATE_CORRUPT, str(cause))
            if isinstance(cause, StoreError):
                return RunFailure(c.Reason.INTERNAL_ERROR, f"state store: {cause}", permanent=False)
        for cause in causes:
            if isinstance(cause, ValueError) and str(cause).startswith("Invalid inputs for structured state"):
                return _permanent(c.Reason.INVALID_INPUTS, str(cause))
            if _is_connection_error(cause):
                return RunFailure(c.Reason.MODEL_UNREACHABLE, f"model connection lost: {cause}", permanent=False)
        for cause in causes:
            if _is_api_error(cause):
                return RunFailure(c.Reason.FLOW_ERROR, f"model API error: {cause}", permanent=False)
        return RunFailure(c.Reason.FLOW_ERROR, f"{type(error).__name__}: {error}", permanent=False)


class _StillPaused:
    """Marker result: the retried run had already paused; nothing ran."""


def execute(config: RunnerConfig, store: StateStore, *, started_at: datetime | None = None) -> RunReport:
    started_at = started_at or datetime.now(UTC)
    report = RunReport(
        pod=config.pod,
        flow=config.flow,
        trigger=config.trigger,
        result=c.RunResult.FAILED,
        reason=c.Reason.INTERNAL_ERROR,
        exit_code=c.EXIT_RETRYABLE,
        started_at=started_at,
    )
    run: _Run | None = None
    interim = InterimReport(store, report)
    try:
        from . import engine  # the one crewAI import of the process

        run = _Run(config, store, engine, interim)
        result = run.drive()
        usage = run.recorder.usage()
        if run.recorder.exceeded:
            raise _permanent(c.Reason.BUDGET_EXCEEDED, run.recorder.budget_message())
        report.usage = usage
        if isinstance(result, engine.HumanFeedbackPending | _StillPaused):
            report.result, report.reason = c.RunResult.PAUSED, c.Reason.RUN_PAUSED
            report.exit_code = c.EXIT_OK
            report.feedback_request = _feedback_request(run.persistence.document)
            report.message = (
                f"awaiting feedback on {report.feedback_request.method}"
                if report.feedback_request
                else "awaiting feedback"
            )
        else:
            report.result, report.reason, report.exit_code = (
                c.RunResult.SUCCEEDED,
                c.Reason.RUN_SUCCEEDED,
                c.EXIT_OK,
            )
            text = engine.render_output(result)
            report.output = excerpt(text) if text is not None else None
            report.message = "flow finished"
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        failure = run.classify(error) if run is not None else _fallback_failure(error)
        if run is not None:
            report.usage = _safe_usage(run)
        log.error("run failed: %s: %s", failure.reason, failure, exc_info=not isinstance(error, RunFailure))
        report.result = c.RunResult.FAILED
        report.reason = failure.reason
        report.message = str(failure)
        report.exit_code = c.EXIT_PERMANENT if failure.permanent else c.EXIT_RETRYABLE
    finally:
        interim.close()  # from here on only the final report may be written under this run's key
    if run is not None:
        report.feedback_applied = run.feedback_applied
        report.flow_id = run.flow_id()
    report.finished_at = datetime.now(UTC)
    return report


def _fallback_failure(error: BaseException) -> RunFailure:
    if isinstance(error, RunFailure):
        return error
    return RunFailure(c.Reason.INTERNAL_ERROR, f"{type(error).__name__}: {error}", permanent=False)


def _safe_usage(run: _Run) -> Usage:
    try:
        return run.recorder.usage()
    except Exception:
        log.exception("could not read usage")
        return Usage()


def _feedback_request(document: StateDocument | None) -> FeedbackRequest | None:
    if document is None or document.pending is None:
        return None
    from . import engine

    context = document.pending.context
    requested_at = context.get("requested_at")
    return FeedbackRequest(
        id=document.pending.request_id,
        method=str(context.get("method_name", "")),
        message=str(context.get("message", "")),
        emit=context.get("emit"),
        default_outcome=context.get("default_outcome"),
        output=excerpt(engine.render_output(context.get("method_output")) or ""),
        requested_at=datetime.fromisoformat(requested_at) if isinstance(requested_at, str) else None,
    )


def publish(report: RunReport, store: StateStore | None, termination_log: Path) -> None:
    """The ConfigMap report is the record; the termination message backs it up."""
    if store is not None:
        try:
            store.put(c.report_key(report.pod), report.encode())
        except Exception:
            log.exception("could not write the run report to the state object")
    try:
        termination_log.write_text(report.termination_summary(), encoding="utf-8")
    except OSError as e:
        log.warning("could not write termination message to %s: %s", termination_log, e)
