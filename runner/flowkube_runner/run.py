"""One run of one Flow: load it, kick off / resume / retry, and say how it ended.

``execute`` never raises for anything a flow or its state can do wrong; it turns every ending
into a ``RunReport`` whose reason and exit code tell the operator whether a retry can help.

crewAI stays behind ``engine``: a run drives a ``FlowSession`` and reads a ``UsageRecorder``, and
imports them (and with them crewAI, seconds of imports) only when it starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import logging
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from pydantic import ValidationError

from flowkube_api import constants as c
from flowkube_api.report import (
    Charge,
    CheckpointEntry,
    FeedbackApplied,
    FeedbackRequest,
    RunReport,
    SpansLost,
    SpentSoFar,
    TurnReport,
    Usage,
    excerpt,
)

from .config import Feedback, Message, RunnerConfig
from .engine.api import Ending, InvalidFlow, InvalidInputs
from .engine.checkpoints import CheckpointLog, ForkRefused, fork
from .engine.pricing import Pricer
from .engine.state import StateDocument
from .failures import RunFailure, chain, fallback_failure, is_api_error, is_connection_error, known_failure, permanent
from .store import Inbox, StateApiStore, StateCorrupt, StateStore
from .waiting import answered_and_open, paused_on, release_memory, wait_warm

if TYPE_CHECKING:
    from .engine.session import FlowSession
    from .engine.tracing import RunTracer
    from .engine.usage import UsageRecorder

log = logging.getLogger("flowkube_runner")
T = TypeVar("T")


INTERRUPTED_MESSAGE = "the runner stopped before finishing"
# How long the final report is sent again while operator replicas that do not lead answer it.
FINAL_REPORT_LEADER_SECONDS = 2.0
STOPPED_MESSAGE = (
    "the runner was stopped (SIGTERM) before the flow finished: the model call in flight was let finish "
    "and is counted, no new one was started; a retry continues after the last completed method"
)


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

    def update(self, counted: Callable[[], tuple[Usage, list[Charge] | None]], flow_id: str | None = None,
               checkpoints: list[CheckpointEntry] | None = None) -> None:
        """``counted``: the usage and its charges, read at one moment."""
        with self._lock:
            if self._closed:
                return
            usage, charges = counted()
            report = self._template.model_copy(update={"usage": usage, "flow_id": flow_id,
                                                       "checkpoints": checkpoints, "charges": charges})
            try:
                self._store.put(c.report_key(report.pod), report.encode())
            except Exception as e:
                # Losing an interim report costs only crash-safety of this call's tokens; the run goes on.
                log.warning("could not write the interim run report: %s", e)

    def close(self) -> None:
        with self._lock:
            self._closed = True


# Loading crewAI makes about 270,000 objects (its pydantic models and their schemas) that live as long
# as the process. With the collector's usual thresholds it walks that growing heap again and again
# while they load; with these, a seventh less CPU for `import crewai` (3.67 -> 3.15 s on this
# project's 2-core machine) for 3.5 MiB more peak memory (disabling it outright: 10 MiB).
_LOADING_THRESHOLD = (10_000, 50, 100)


@contextlib.contextmanager
def _loading_for_good() -> Iterator[None]:
    """Import what stays for the whole process with the cyclic collector mostly out of the way, then
    freeze it (``gc.freeze``): later collections, a model call's or a warm turn's, no longer walk it."""
    threshold = gc.get_threshold()
    gc.set_threshold(*_LOADING_THRESHOLD)
    try:
        yield
    finally:
        gc.freeze()
        gc.set_threshold(*threshold)


class _Run:
    def __init__(self, config: RunnerConfig, store: StateStore, stop: threading.Event | None) -> None:
        with _loading_for_good():  # crewAI loads here, when the run starts
            from .engine import session  # noqa: F401 - what `drive` names, loaded with the rest
            from .engine.usage import UsageRecorder

            self.tracer = _tracer(config)

        self.config = config
        self.store = store
        self.interim: InterimReport | None = None  # the current step's (see _attempt)
        self.stop = stop
        self.recorder: UsageRecorder = UsageRecorder(
            prior_total_tokens=config.prior_total_tokens,
            prior_cost=config.prior_cost,
            budget=config.spec.budget,
            pricer=Pricer(config.prices),
            on_call=self._after_model_call,
            stop=stop,
            # Spend quotas: the state API is the desk (a pod without one, e.g. a local run, has none).
            quota=store if config.quotas and isinstance(store, StateApiStore) else None,
            quota_heartbeat=config.quota_heartbeat_seconds,
            on_counted=self.tracer.counted if self.tracer is not None else None,
        )
        self.steps = 0
        self.session: FlowSession | None = None
        self.feedback_applied: FeedbackApplied | None = None
        taking = config.spec.checkpoints is None or config.spec.checkpoints.keep > 0
        self.checkpoints = CheckpointLog(store, self._spent, enabled=taking, on_taken=self._after_checkpoint)

    def _spent(self) -> SpentSoFar:
        """The Flow's spend so far: the earlier runs' and this one's."""
        usage = self.recorder.recorded()
        return SpentSoFar(total_tokens=self.config.prior_total_tokens + usage.total_tokens,
                          cost=self.config.prior_cost + usage.cost)

    def _after_model_call(self, recorder: UsageRecorder) -> None:
        if self.interim is not None:
            self.interim.update(recorder.recorded_with_charges, self.flow_id(), self.checkpoints.entries())

    def _after_checkpoint(self) -> None:
        """A checkpoint listed at once in the interim report: the index outlives a lost pod."""
        self._after_model_call(self.recorder)

    def flow_id(self) -> str | None:
        return self.session.flow_id() if self.session is not None else None

    def feedback_request(self) -> FeedbackRequest | None:
        return self.session.feedback_request() if self.session is not None else None

    # --- triggers ---

    def resume(self, session: FlowSession, document: StateDocument) -> Ending:
        pending = document.pending
        if pending is None:
            raise permanent(c.Reason.STATE_CORRUPT, "resume requested but the state has no pending feedback request")
        feedback = self.config.feedback
        if feedback is None:
            raise permanent(c.Reason.INTERNAL_ERROR, f"resume requested without {c.ENV_FEEDBACK}")
        if feedback.request_id and feedback.request_id != pending.request_id:
            raise permanent(
                c.Reason.FEEDBACK_REFUSED,
                f"feedback is for request {feedback.request_id!r}, but {pending.request_id!r} is pending",
            )
        text = feedback.text
        if feedback.timed_out:
            if not pending.default_outcome:
                raise permanent(
                    c.Reason.FEEDBACK_TIMED_OUT,
                    f"feedback request {pending.request_id} timed out and step "
                    f"{pending.method!r} has no default outcome",
                )
            # crewAI resolves empty feedback to the step's default outcome without asking a model.
            text = ""
        if feedback.outcome is not None and (not pending.emit or feedback.outcome not in pending.emit):
            raise permanent(
                c.Reason.FEEDBACK_REFUSED,
                f"outcome {feedback.outcome!r} is not one of the step's outcomes {pending.emit}",
            )
        outcome = feedback.outcome if not feedback.timed_out else None
        turn = self.config.message.turn if self.config.message is not None else None
        ending = session.resume(document, text, outcome=outcome, turn=turn)
        self.feedback_applied = FeedbackApplied(
            request_id=pending.request_id,
            method=pending.method,
            response=feedback.text,
            outcome=session.feedback_outcome(pending.method),
            timed_out=feedback.timed_out,
        )
        return ending

    def retry(self, session: FlowSession, document: StateDocument | None) -> Ending:
        if document is not None and document.pending is not None:
            if self.config.feedback is not None:
                return self.resume(session, document)
            # Paused is where the earlier run ended; report the same request again, running nothing.
            return Ending(paused=True)
        if document is None or not document.has_completed_methods:
            log.info("nothing completed yet: the retry starts the flow from the beginning")
            return session.kickoff(dict(self.config.spec.inputs or {}))
        return session.retry(document)

    def converse(self, session: FlowSession, document: StateDocument | None) -> Ending:
        """A conversation's run: open the session (no message yet), or answer one message (a
        message whose turn paused for feedback is answered by the resume)."""
        message = self.config.message
        if message is None:
            if self.config.spec.inputs:
                raise permanent(c.Reason.INVALID_INPUTS, "a conversation takes no spec.inputs: its input is "
                                 "the messages sent to it")
            return session.open_conversation(document)
        if document is not None and document.pending is not None:
            if self.config.feedback is None:
                return Ending(paused=True)  # paused is where the earlier run ended: report it again
            return self.resume(session, document)
        return session.turn(document, message.turn, message.text)

    def next_turn(self) -> Ending:
        """A warm turn: the next message (``config.message``), in this process, on the same session."""
        return self._warm_step(self.converse)

    def next_resume(self) -> Ending:
        """A warm resume: the answer (``config.feedback``) to the request this process paused on."""
        def resume(session: FlowSession, document: StateDocument | None) -> Ending:
            if document is None:
                raise RuntimeError("a warm resume without the state it paused in")
            return self.resume(session, document)

        return self._warm_step(resume)

    def _warm_step(self, act: Callable[[FlowSession, StateDocument | None], Ending]) -> Ending:
        session = self.session
        if session is None:
            raise RuntimeError("a warm step before the run's first")
        self.feedback_applied = None
        self._refuse_if_stopped()
        with self._recording():
            return act(session, session.document)

    @contextlib.contextmanager
    def _recording(self) -> Iterator[None]:
        """A step's model calls counted, and (tracing on) its spans under the run's span."""
        self.steps += 1
        traced = contextlib.nullcontext() if self.tracer is None else self.tracer.step(
            f"{self.config.pod}/{self.steps}", self.config.flow,
            {"flowkube.flow.name": self.config.flow, "k8s.namespace.name": self.config.namespace,
             "k8s.pod.name": self.config.pod, "flowkube.run.step": self.steps})
        with traced, self.recorder.recording():
            yield

    def _refuse_if_stopped(self) -> None:
        if self.stop is not None and self.stop.is_set():
            raise RunFailure(c.Reason.RUN_INTERRUPTED, STOPPED_MESSAGE, permanent=False)

    # --- the whole run ---

    def _document(self) -> StateDocument | None:
        trigger = self.config.trigger
        if trigger is c.Trigger.KICKOFF:
            return None
        try:
            document = StateDocument.load(self.store)
        except StateCorrupt as e:
            raise permanent(c.Reason.STATE_CORRUPT, str(e)) from e
        if document is None and trigger in (c.Trigger.RESUME, c.Trigger.FORK):
            raise permanent(c.Reason.STATE_CORRUPT, f"{trigger.value} requested but state key {c.STATE_KEY} is missing")
        if self.config.spec.fork_from is not None and document is not None and document.forked is None:
            # A fork's first run, or the retry of one that was lost before it saved its edits.
            document = self._fork(document)
        return document

    def _fork(self, document: StateDocument) -> StateDocument:
        """A fork's first run: the checkpoint copied into its state, with the edits, saved before anything
        runs (so every later run, a resume too, goes on under the fork's own flow id)."""
        spec = self.config.spec.fork_from
        if spec is None:
            raise permanent(c.Reason.INTERNAL_ERROR, "a fork's run without spec.forkFrom")
        try:
            forked = fork(document, spec)
        except ForkRefused as e:
            raise permanent(c.Reason.INVALID_INPUTS, str(e)) from e
        self.store.put(c.STATE_KEY, forked.encode())
        log.info("forked from %s: a new flow id %s", forked.forked, forked.flow_id)
        return forked

    def drive(self) -> Ending:
        from .engine.session import FlowSession

        trigger, spec = self.config.trigger, self.config.spec
        document = self._document()
        keep_tasks = spec.retries.keep_tasks if spec.retries is not None else True
        self.session = session = FlowSession(self.store, self.config.pod, document, keep_tasks=keep_tasks,
                                             checkpoints=self.checkpoints)
        session.load(definition=spec.definition_document(), flow_ref=spec.flow_ref)
        if self.recorder.budget_already_spent():
            self.recorder.exceeded = True
            raise permanent(c.Reason.BUDGET_EXCEEDED, self.recorder.budget_message())
        self._refuse_if_stopped()
        with self._recording():
            if session.is_conversation():
                return self.converse(session, document)
            if trigger is c.Trigger.KICKOFF:
                return session.kickoff(dict(spec.inputs or {}))
            if trigger is c.Trigger.RESUME:
                assert document is not None
                if document.pending is None and document.has_completed_methods:
                    # A warm pod took this answer and was lost after it settled the request: the
                    # answer is in the state; go on from the last completed method, like a retry.
                    log.info("the request was settled by an earlier pod: continuing after its last method")
                    return session.retry(document)
                return self.resume(session, document)
            return self.retry(session, document)  # a retry, or a fork's first run

    def refuse_if_stopped_by_spend(self) -> None:
        """A budget crossed, or a quota refused a call: the run ends so, even if the flow caught
        crewAI's exception and went on."""
        if self.recorder.exceeded:
            raise permanent(c.Reason.BUDGET_EXCEEDED, self.recorder.budget_message())
        if self.recorder.quota is not None and self.recorder.quota.refused is not None:
            raise permanent(c.Reason.QUOTA_EXHAUSTED, self.recorder.quota.refused)

    def classify(self, error: BaseException) -> RunFailure:
        if self.recorder.exceeded:
            return permanent(c.Reason.BUDGET_EXCEEDED, self.recorder.budget_message())
        if self.recorder.quota is not None and self.recorder.quota.refused is not None:
            return permanent(c.Reason.QUOTA_EXHAUSTED, self.recorder.quota.refused)
        causes = [*chain(error)]
        storage_failure = self.session.storage_failure if self.session is not None else None
        if storage_failure is not None:
            causes.insert(0, storage_failure)
        for cause in causes:
            if (known := known_failure(cause, self.config.spec.definition is not None)) is not None:
                return known
        if self.recorder.stopped:  # the stop refused a model call: that is why the flow ended here
            return RunFailure(c.Reason.RUN_INTERRUPTED, STOPPED_MESSAGE, permanent=False)
        for cause in causes:
            if is_connection_error(cause):
                return RunFailure(c.Reason.MODEL_UNREACHABLE, f"model connection lost: {cause}", permanent=False)
        for cause in causes:
            if is_api_error(cause):
                return RunFailure(c.Reason.FLOW_ERROR, f"model API error: {cause}", permanent=False)
        return RunFailure(c.Reason.FLOW_ERROR, f"{type(error).__name__}: {error}", permanent=False)


def execute(
    config: RunnerConfig,
    store: StateStore,
    *,
    started_at: datetime | None = None,
    stop: threading.Event | None = None,
    inbox: Inbox | None = None,
) -> RunReport:
    """``stop``, once set (the process got SIGTERM), lets the model call in flight finish and starts
    no new one; the run then ends ``RunInterrupted`` with a retryable exit code.

    With an ``inbox`` and ``config.keep_warm_seconds``, a conversation's run that answered its turn
    stays: it publishes the turn (a ``warm`` report), waits for the next message and answers it in
    this process with the same Flow instance, until the window passes with no message."""
    template = RunReport(
        pod=config.pod,
        flow=config.flow,
        trigger=config.trigger,
        result=c.RunResult.FAILED,
        reason=c.Reason.INTERNAL_ERROR,
        exit_code=c.EXIT_RETRYABLE,
        started_at=started_at or datetime.now(UTC),
    )
    try:
        run = _Run(config, store, stop)
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        return _attempt(template, None, error)
    report = _attempt(template, run, run.drive)
    if inbox is not None and (config.keep_warm_seconds > 0 or config.feedback_keep_warm_seconds > 0):
        report = _stay_warm(run, template, report, inbox)
    if run.tracer is not None:
        lost: dict[str, int] = _safe(run.tracer.close, {}, "the last spans")
        report.spans_lost = SpansLost(**lost)
    return report


def _tracer(config: RunnerConfig) -> RunTracer | None:
    """The run's tracer, when the operator traces (it gives the pod a traceparent and an endpoint)."""
    if not (config.traceparent and config.traces_endpoint):
        return None
    from .engine.tracing import RunTracer

    try:
        return RunTracer(config.traceparent, endpoint=config.traces_endpoint, content=config.traces_content,
                         resource={"k8s.namespace.name": config.namespace, "k8s.pod.name": config.pod,
                                   "flowkube.flow.name": config.flow})
    except ValueError as e:  # tracing is never a reason for a run to fail
        log.warning("no spans for this run: %s", e)
        return None


def _attempt(template: RunReport, run: _Run | None, step: Callable[[], Ending] | BaseException) -> RunReport:
    """One step of a run (its first, or a warm turn) as a report: ``execute`` never raises."""
    report = template.model_copy()
    interim = None
    if run is not None:
        interim = run.interim = InterimReport(run.store, report)
    try:
        if isinstance(step, BaseException):
            raise step
        if run is None:
            raise RuntimeError("no run to step")
        ending = step()
        usage, report.charges = run.recorder.counted()
        run.refuse_if_stopped_by_spend()
        report.usage = usage
        _record_ending(report, ending, run)
    except BaseException as error:
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise
        failure = run.classify(error) if run is not None else fallback_failure(error)
        if run is not None:
            report.usage = _safe(run.recorder.usage, Usage(), "usage")
            report.charges = _safe(run.recorder.charges, None, "charges")  # kept only if they add up
        expected = isinstance(error, RunFailure | InvalidFlow | InvalidInputs)  # no traceback for the flow's own faults
        log.error("run failed: %s: %s", failure.reason, failure, exc_info=not expected)
        report.result = c.RunResult.FAILED
        report.reason = failure.reason
        report.message = excerpt(str(failure))
        report.exit_code = c.EXIT_PERMANENT if failure.permanent else c.EXIT_RETRYABLE
    finally:
        if interim is not None:
            interim.close()  # from here on only the final report may be written under this run's key
    if run is not None:
        report.feedback_applied = run.feedback_applied
        report.flow_id = run.flow_id()
        report.checkpoints = run.checkpoints.entries()
    report.finished_at = datetime.now(UTC)
    return report


def _stay_warm(run: _Run, template: RunReport, report: RunReport, inbox: Inbox) -> RunReport:
    """While the run ends where someone must answer (a conversation's turn, or a pause for feedback)
    within a window: say so (a ``warm`` report), wait for the answer, and go on in this process."""
    # What exists now (crewAI, its models, the Flow) lives as long as the process: out of the cyclic
    # collector's way, so the collections that turns trigger do not walk it (a full one: 200 ms).
    gc.freeze()
    while not (run.stop is not None and run.stop.is_set()):
        step: Callable[[], Ending]
        poll: Callable[[float], dict[str, Any] | None]
        if answered_and_open(report) and run.config.keep_warm_seconds > 0:
            assert report.conversation is not None
            after = report.conversation.turn
            what, window = f"message {after + 1}", run.config.keep_warm_seconds
            poll = functools.partial(inbox.next_message, after)
        elif paused_on(report) and run.config.feedback_keep_warm_seconds > 0:
            assert report.feedback_request is not None
            request = report.feedback_request.id
            what, window = f"the answer to {request}", run.config.feedback_keep_warm_seconds
            poll = functools.partial(inbox.next_answer, request)
        else:
            return report
        try:
            run.store.put(c.report_key(report.pod), report.model_copy(update={"warm": True}).encode())
        except Exception as e:
            log.warning("could not say the run waits (%s); the pod ends and the answer starts another", e)
            return report
        release_memory()
        log.info("waiting up to %.0fs for %s", window, what)
        found = wait_warm(poll, window, run.stop)
        if found is None:
            return report
        try:
            if report.result == c.RunResult.PAUSED:
                run.config = dataclasses.replace(run.config, feedback=Feedback.model_validate(found))
                step = run.next_resume
            else:
                message = Message.model_validate(found)
                if message.turn != report.conversation.turn + 1:  # type: ignore[union-attr]
                    raise ValueError(f"message {message.turn} is not the next one")
                run.config = dataclasses.replace(run.config, message=message)
                step = run.next_turn
        except (ValidationError, ValueError) as e:
            log.warning("the operator sent what this pod cannot take (%s); the pod ends", e)
            return report
        log.info("%s taken (warm)", what)
        report = _attempt(template, run, step)
    return report


def _record_ending(report: RunReport, ending: Ending, run: _Run) -> None:
    """A run that ended well: paused on a feedback request, or finished (a conversation's turn too)."""
    report.exit_code = c.EXIT_OK
    if ending.paused:
        report.result, report.reason = c.RunResult.PAUSED, c.Reason.RUN_PAUSED
        report.feedback_request = run.feedback_request()
        report.message = (
            f"awaiting feedback on {report.feedback_request.method}" if report.feedback_request else "awaiting feedback"
        )
        return
    report.result, report.reason = c.RunResult.SUCCEEDED, c.Reason.RUN_SUCCEEDED
    report.output = excerpt(ending.output) if ending.output is not None else None
    report.message = "flow finished"
    t = ending.turn
    if t is not None:
        report.message = (f"message {t.turn} answered" if t.turn else "session opened") + (
            "; the conversation ended" if t.ended else "")
        reply = excerpt(t.reply) if t.reply is not None else None
        report.conversation = TurnReport(session_id=t.session_id, turn=t.turn, ended=t.ended, reply=reply)


def _safe(read: Callable[[], T], default: T, what: str) -> T:
    """``read()``, or ``default`` when it fails (logged): a report is written however the run ended."""
    try:
        return read()
    except Exception:
        log.exception("could not read the run's %s", what)
        return default


def publish(report: RunReport, store: StateStore | None, termination_log: Path) -> None:
    """The ConfigMap report is the record; the termination message backs it up. Both say ``final``:
    the operator ends the run as soon as it has this report."""
    # It ends now: a warm pod's last turn finished before its window passed.
    report = report.model_copy(update={"final": True, "finished_at": datetime.now(UTC)})
    if store is not None:
        try:
            # A replica that does not reconcile stores it and says so: sent again for a moment (through
            # the Service, likely to the leader, which then ends the run at once), else the leader
            # reads it when the pod has ended.
            store.put(c.report_key(report.pod), report.encode(), leader_for=FINAL_REPORT_LEADER_SECONDS)
        except Exception:
            log.exception("could not write the run report to the state object")
    try:
        termination_log.write_text(report.termination_summary(), encoding="utf-8")
    except OSError as e:
        log.warning("could not write termination message to %s: %s", termination_log, e)
