"""End to end through ``python -m flowkube_runner``: every run in a fresh process, as in a pod."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flowkube_api import constants as c
from flowkube_api.report import RunReport, Usage, matching_charges
from flowkube_devstack.cluster import wait_for
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage
from flowkube_runner.__main__ import STOP_LOG
from flowkube_runner.run import STOPPED_MESSAGE
from flowkube_runner.store import FileStore, decode_json
from tests.definitions import crew_definition, part_rules, parts_of, quiet_crewai_env
from tests.runnerforks import ForkedRun, runner_forks

Runner = subprocess.Popen[str] | ForkedRun

pytestmark = pytest.mark.slow

MODEL = "gpt-4o-mini"


@dataclass
class Finished:
    exit_code: int
    report: RunReport | None
    termination: str
    stderr: str

    def describe(self) -> str:
        return f"exit={self.exit_code} report={self.report!r}\nstderr tail:\n{self.stderr[-3000:]}"


class Harness:
    def __init__(self, root: Path, stub: StubModel, flow: str = "demo", fresh: bool = False) -> None:
        self.root = root
        self.fresh = fresh  # a new interpreter per run instead of a fork
        self.stub = stub
        self.flow = flow
        self.state_dir = root / "state"
        self.store = FileStore(self.state_dir)
        self.runs = 0

    def env(
        self,
        pod: str,
        trigger: c.Trigger,
        spec: dict[str, Any],
        feedback: dict[str, Any] | None = None,
        prior_total_tokens: int = 0,
        extra_env: dict[str, str] | None = None,
    ) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OPENAI_", "FLOWKUBE_"))}
        env.update(quiet_crewai_env(self.root / "home"))
        env.update(
            {
                "OPENAI_BASE_URL": self.stub.base_url,
                c.ENV_FLOW_NAME: self.flow,
                c.ENV_NAMESPACE: "test",
                c.ENV_POD_NAME: pod,
                c.ENV_TRIGGER: str(trigger),
                c.ENV_SPEC: json.dumps(spec),
                c.ENV_PRIOR_TOTAL_TOKENS: str(prior_total_tokens),
                "FLOWKUBE_STATE_DIR": str(self.state_dir),
                "FLOWKUBE_TERMINATION_LOG": str(self.root / f"{pod}.termination"),
            }
        )
        if feedback is not None:
            env[c.ENV_FEEDBACK] = json.dumps(feedback)
        env.update(extra_env or {})
        return env

    def next_pod(self) -> str:
        self.runs += 1
        return f"{self.flow}-{self.runs}"

    def spawn(self, trigger: c.Trigger, spec: dict[str, Any], **kwargs: Any) -> tuple[str, Runner]:
        """A runner process for this run: forked from one that has crewAI loaded (tests.runnerforks:
        its own process and environment, only the import shared), or with ``fresh`` a new interpreter."""
        pod = self.next_pod()
        stderr = self.root / f"{pod}.stderr"
        stderr.write_text("")
        env = self.env(pod, trigger, spec, **kwargs)
        if not self.fresh:
            return pod, runner_forks().spawn(env, stderr)
        with stderr.open("w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "flowkube_runner"], env=env, stdout=subprocess.DEVNULL,
                                    stderr=err, text=True)
        return pod, proc

    def stderr(self, pod: str) -> str:
        """The runner's log so far (it writes to a file, so a test can read it while it runs)."""
        return (self.root / f"{pod}.stderr").read_text()

    def finish(self, pod: str, proc: Runner, timeout: float = 120) -> Finished:
        exit_code = proc.wait(timeout=timeout)
        data = self.store.get(c.report_key(pod))
        termination = self.root / f"{pod}.termination"
        return Finished(
            exit_code=exit_code,
            report=RunReport.decode(data) if data is not None else None,
            termination=termination.read_text() if termination.exists() else "",
            stderr=self.stderr(pod),
        )

    def run(self, trigger: c.Trigger, spec: dict[str, Any], **kwargs: Any) -> Finished:
        pod, proc = self.spawn(trigger, spec, **kwargs)
        return self.finish(pod, proc)

    def state(self) -> dict[str, Any] | None:
        data = self.store.get(c.STATE_KEY)
        return None if data is None else dict(decode_json(data, "state"))


WRITER = {"role": "Writer", "goal": "Write well", "backstory": "A careful writer.", "settings": {"llm": MODEL}}
ARTICLE_FLOW = "flowkube_runner.examples.article:ArticleFlow"


def article_definition() -> dict[str, Any]:
    """Two feedback steps; ``polish`` reads ``outputs.draft`` from before the first pause."""
    feedback_llm = {"llm": MODEL}
    return {
        "schema": "crewai.flow/v1",
        "name": "Article",
        "state": {"type": "dict", "default": {"topic": "operators"}},
        "methods": {
            "draft": {
                "start": True,
                "do": {"call": "agent", "with": {**WRITER, "input": "DRAFT about ${state.topic}"}},
            },
            "review": {
                "listen": "draft",
                "do": {"call": "expression", "expr": "outputs.draft.raw"},
                "human_feedback": {
                    "message": "Approve the draft?",
                    "emit": ["approved", "rejected"],
                    "default_outcome": "rejected",
                    **feedback_llm,
                },
            },
            "polish": {
                "listen": "approved",
                "do": {"call": "agent", "with": {**WRITER, "input": "POLISH ${outputs.draft.raw}"}},
            },
            "final_review": {
                "listen": "polish",
                "do": {"call": "expression", "expr": "outputs.polish.raw"},
                "human_feedback": {
                    "message": "Publish?",
                    "emit": ["publish", "discard"],
                    "default_outcome": "discard",
                    **feedback_llm,
                },
            },
            "release": {
                "listen": "publish",
                "do": {
                    "call": "expression",
                    "expr": (
                        "outputs.polish.raw + ' | ' + outputs.review.feedback + ' | ' + outputs.final_review.feedback"
                    ),
                },
            },
            "shelve": {"listen": "rejected", "do": {"call": "expression", "expr": "'shelved: ' + outputs.draft.raw"}},
        },
    }


RULES = {
    "default": "A plain reply.",
    "rules": [
        {"contains": "DRAFT about", "reply": "Operators reconcile desired state."},
        {"contains": "POLISH", "reply": "Operators, polished."},
        {"contains": "LGTM", "reply": "approved"},
        {"contains": "ship it", "reply": "publish"},
    ],
}


def succeeded(run: Finished) -> RunReport:
    assert run.report is not None, run.describe()
    assert run.report.result == c.RunResult.SUCCEEDED, run.describe()
    assert run.exit_code == c.EXIT_OK
    return run.report


def paused(run: Finished) -> RunReport:
    assert run.report is not None, run.describe()
    assert run.report.result == c.RunResult.PAUSED, run.describe()
    assert run.exit_code == c.EXIT_OK
    assert run.report.feedback_request is not None
    return run.report


def failed(run: Finished, reason: c.Reason, exit_code: int) -> RunReport:
    assert run.report is not None, run.describe()
    assert (run.report.result, run.report.reason, run.exit_code) == (c.RunResult.FAILED, reason, exit_code), (
        run.describe()
    )
    # The termination message is a parseable backup of the same verdict.
    backup = RunReport.model_validate_json(run.termination)
    assert (backup.result, backup.reason) == (run.report.result, run.report.reason)
    return run.report


def test_inline_definition_runs_to_completion(harness: Harness, stub: StubModel) -> None:
    definition = {
        "name": "TwoSteps",
        "state": {"type": "dict", "default": {"topic": "cats"}},
        "methods": {
            "draft": {
                "start": True,
                "do": {"call": "agent", "with": {**WRITER, "input": "DRAFT about ${state.topic}"}},
            },
            "polish": {
                "listen": "draft",
                "do": {"call": "agent", "with": {**WRITER, "input": "POLISH ${outputs.draft.raw}"}},
            },
        },
    }
    report = succeeded(harness.run(c.Trigger.KICKOFF, {"definition": definition, "inputs": {"topic": "dogs"}}))
    assert report.output == "Operators, polished."
    assert report.flow_id
    ledger = stub.ledger()
    assert "DRAFT about dogs" in ledger[0]["lastUser"]  # inputs reached the state
    assert report.usage == ledger_usage(ledger)
    assert report.usage.successful_requests == 2


def test_class_flow_runs_to_completion(harness: Harness, stub: StubModel) -> None:
    report = succeeded(harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}}))
    assert report.output == "A plain reply."
    assert report.usage == ledger_usage(stub.ledger())
    assert report.usage.by_model[MODEL].successful_requests == 2
    state = harness.state()
    assert state is not None and state["state"]["topic"] == "cats"


def test_two_feedback_steps_pause_and_resume_in_fresh_processes(harness: Harness, stub: StubModel) -> None:
    spec = {"definition": article_definition()}
    seen = 0
    reports: list[RunReport] = []

    def usage_matches_ledger(report: RunReport) -> None:
        nonlocal seen
        ledger = stub.ledger()
        assert report.usage == ledger_usage(ledger[seen:])
        seen = len(ledger)
        reports.append(report)

    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    usage_matches_ledger(first)
    assert first.feedback_request is not None
    assert first.feedback_request.method == "review"
    assert first.feedback_request.emit == ["approved", "rejected"]
    assert first.feedback_request.default_outcome == "rejected"
    assert first.feedback_request.output == "Operators reconcile desired state."

    # polish renders ${outputs.draft.raw}: a method that ran in the previous process.
    second = paused(
        harness.run(c.Trigger.RESUME, spec, feedback={"requestId": first.feedback_request.id, "text": "LGTM"})
    )
    usage_matches_ledger(second)
    assert second.flow_id == first.flow_id
    assert second.feedback_applied is not None
    assert (second.feedback_applied.outcome, second.feedback_applied.response) == ("approved", "LGTM")
    assert second.feedback_request is not None and second.feedback_request.method == "final_review"
    assert second.feedback_request.id != first.feedback_request.id
    assert any("POLISH Operators reconcile desired state." in e["lastUser"] for e in stub.ledger())

    third = succeeded(
        harness.run(c.Trigger.RESUME, spec, feedback={"requestId": second.feedback_request.id, "text": "ship it"})
    )
    usage_matches_ledger(third)
    assert third.output == "Operators, polished. | LGTM | ship it"
    assert third.feedback_applied is not None and third.feedback_applied.outcome == "publish"

    total = Usage()
    for report in reports:
        total = total + report.usage
    assert total == ledger_usage(stub.ledger())
    assert total.successful_requests == 4  # draft, collapse, polish, collapse: nothing twice


def test_timed_out_feedback_takes_the_default_outcome(harness: Harness, stub: StubModel) -> None:
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    calls = len(stub.ledger())
    assert first.feedback_request is not None
    run = harness.run(
        c.Trigger.RESUME, spec, feedback={"requestId": first.feedback_request.id, "text": "", "timedOut": True}
    )
    report = succeeded(run)
    assert report.output == "shelved: Operators reconcile desired state."
    assert report.feedback_applied is not None
    assert (report.feedback_applied.outcome, report.feedback_applied.timed_out) == ("rejected", True)
    assert len(stub.ledger()) == calls  # the default needs no model to classify anything


def test_explicit_outcome_routes_without_a_model(harness: Harness, stub: StubModel) -> None:
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    calls = len(stub.ledger())
    assert first.feedback_request is not None
    feedback = {"requestId": first.feedback_request.id, "text": "not this time", "outcome": "rejected"}
    report = succeeded(harness.run(c.Trigger.RESUME, spec, feedback=feedback))
    assert report.output == "shelved: Operators reconcile desired state."
    assert report.feedback_applied is not None
    assert (report.feedback_applied.outcome, report.feedback_applied.response) == ("rejected", "not this time")
    assert len(stub.ledger()) == calls


def test_feedback_for_another_request_is_refused_and_the_request_stays(harness: Harness, stub: StubModel) -> None:
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    run = harness.run(c.Trigger.RESUME, spec, feedback={"requestId": "someone-else-1", "text": "LGTM"})
    failed(run, c.Reason.FEEDBACK_REFUSED, c.EXIT_PERMANENT)
    state = harness.state()
    assert state is not None and state["pending"] is not None

    # A replacement pod for a paused flow (no feedback yet) reports the same request, running nothing.
    calls = len(stub.ledger())
    again = paused(harness.run(c.Trigger.RETRY, spec))
    assert again.feedback_request is not None and first.feedback_request is not None
    assert again.feedback_request.id == first.feedback_request.id
    assert again.usage == Usage() and len(stub.ledger()) == calls


GAP_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from crewai.flow.async_feedback.types import HumanFeedbackPending
    from crewai.flow.flow import Flow
    from crewai.flow.flow_config import flow_config
    from crewai.flow.persistence import SQLiteFlowPersistence

    class Pause:
        def request_feedback(self, context, flow):
            raise HumanFeedbackPending(context=context)

    flow_config.hitl_provider = Pause()
    definition, db, phase = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    persistence = SQLiteFlowPersistence(db)
    if phase == "kickoff":
        flow = Flow.from_declaration(contents=definition, persistence=persistence)
        result = flow.kickoff()
        print(json.dumps({"flow_id": result.context.flow_id}))
    else:
        flow = Flow.from_pending(phase, persistence, definition=Flow.from_declaration(contents=definition)._definition)
        try:
            flow.resume("LGTM")
        except Exception as e:
            print(json.dumps({"error": str(e)}))
        else:
            print(json.dumps({"error": None}))
    """
)


def test_crewai_alone_loses_earlier_outputs_across_processes(tmp_path: Path, stub: StubModel) -> None:
    """The crewAI 1.15.30 gap the runner closes; if this starts failing, crewAI fixed it upstream."""
    env = {**os.environ, **quiet_crewai_env(tmp_path / "home"), "OPENAI_BASE_URL": stub.base_url}
    definition = json.dumps(article_definition())
    db = str(tmp_path / "flows.db")

    def phase(arg: str) -> dict[str, Any]:
        out = subprocess.run(
            [sys.executable, "-c", GAP_SCRIPT, definition, db, arg],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        return dict(json.loads(out.stdout.strip().splitlines()[-1]))

    flow_id = phase("kickoff")["flow_id"]
    error = phase(flow_id)["error"]
    assert error is not None and "no such member in mapping: 'draft'" in error


def kill_during_held_call(
    harness: Harness, stub: StubModel, pod: str, proc: Runner, *, calls_before: int = 0
) -> Finished:
    """SIGKILL the runner while the stub holds one of its model calls, once the interim report
    counts every call of this run answered before it (crewAI's event handler writes it just after
    each call, on its own thread). ``calls_before``: ledger entries of earlier runs."""
    try:
        assert stub.wait_held(1, timeout=120), "the model call to hold never arrived"
        answered = len(stub.ledger()) - calls_before

        def interim_is_current() -> bool:
            data = harness.store.get(c.report_key(pod))
            return data is not None and RunReport.decode(data).usage.successful_requests == answered

        wait_for(interim_is_current, 30, f"the interim report of {pod} to count {answered} call(s)")
        os.kill(proc.pid, signal.SIGKILL)
        return harness.finish(pod, proc)
    finally:
        if proc.poll() is None:
            proc.kill()


def interrupted(run: Finished) -> RunReport:
    assert run.exit_code == -signal.SIGKILL, run.describe()
    assert run.report is not None, run.describe()
    assert (run.report.result, run.report.reason, run.report.message) == (
        c.RunResult.FAILED,
        c.Reason.RUN_INTERRUPTED,
        "the runner stopped before finishing",
    )
    return run.report


def test_sigkilled_run_leaves_a_report_with_exactly_its_tokens(harness: Harness, stub: StubModel) -> None:
    hold_polish = {"contains": "POLISH", "hold": True, "times": 1}
    stub.set_rules(Rules.from_json({**RULES, "rules": [hold_polish, *RULES["rules"]]}))
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    assert first.feedback_request is not None
    calls_before = len(stub.ledger())
    pod, proc = harness.spawn(c.Trigger.RESUME, spec, feedback={"requestId": first.feedback_request.id, "text": "LGTM"})

    report = interrupted(kill_during_held_call(harness, stub, pod, proc, calls_before=calls_before))

    ledger = stub.ledger()[calls_before:]
    assert len(ledger) == 1, "the feedback collapse call was answered; polish was held"
    assert report.usage == ledger_usage(ledger)
    assert (report.pod, report.trigger, report.flow_id) == (pod, c.Trigger.RESUME, first.flow_id)
    assert report.termination_summary()  # still a well-formed report
    assert first.usage + report.usage == ledger_usage(stub.ledger())  # each call counted once overall


def test_killed_run_retries_from_the_last_completed_method(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(
        Rules.from_json({"default": "A plain reply.", "rules": [{"contains": "Summarise", "hold": True, "times": 1}]})
    )
    spec = {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}}
    pod, proc = harness.spawn(c.Trigger.KICKOFF, spec)
    killed = kill_during_held_call(harness, stub, pod, proc)
    state = harness.state()
    assert state is not None and state["runtime"]["completedMethods"] == ["write_draft"]
    assert interrupted(killed).usage == ledger_usage(stub.ledger())
    calls_before_retry = len(stub.ledger())
    assert calls_before_retry == 1

    report = succeeded(harness.run(c.Trigger.RETRY, spec))
    ledger = stub.ledger()
    drafts = [e for e in ledger if "Write a short draft" in e["lastUser"]]
    assert len(drafts) == 1, "write_draft completed before the kill and must not run again"
    assert report.usage == ledger_usage(ledger[calls_before_retry:])
    assert report.usage.successful_requests == 1
    state = harness.state()
    assert state is not None and state["state"]["topic"] == "cats" and state["state"]["summary"] == "A plain reply."


def test_sigterm_lets_the_call_in_flight_finish_counts_it_and_starts_no_new_one(
    harness: Harness, stub: StubModel
) -> None:
    """A graceful stop (the pod deleted or evicted): the answered call is reported, the state holds
    the method it completed, and the exit code asks for a retry, which finishes the flow."""
    stub.set_rules(Rules.from_json({"default": "A plain reply.", "rules": [{"contains": "Write a short draft",
                                                                            "hold": True, "times": 1}]}))
    spec = {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}}
    pod, proc = harness.spawn(c.Trigger.KICKOFF, spec)
    try:
        assert stub.wait_held(1, timeout=120), "the model call to hold never arrived"
        proc.send_signal(signal.SIGTERM)
        wait_for(lambda: STOP_LOG in harness.stderr(pod), 30, f"{pod} to take the SIGTERM")
        stub.release_held()
        stopped = harness.finish(pod, proc)
    finally:
        if proc.poll() is None:
            proc.kill()

    report = failed(stopped, c.Reason.RUN_INTERRUPTED, c.EXIT_RETRYABLE)
    assert report.message == STOPPED_MESSAGE
    ledger = stub.ledger()
    assert [("Write a short draft" in e["lastUser"]) for e in ledger] == [True], "summarize must not start"
    assert report.usage == ledger_usage(ledger) and report.usage.successful_requests == 1
    state = harness.state()
    assert state is not None and state["runtime"]["completedMethods"] == ["write_draft"]

    retried = succeeded(harness.run(c.Trigger.RETRY, spec))
    ledger = stub.ledger()
    assert len(ledger) == 2 and "Summarise" in ledger[1]["lastUser"], "the retry runs only summarize"
    assert retried.usage == ledger_usage(ledger[1:])
    assert report.usage + retried.usage == ledger_usage(ledger)  # every answered call counted once


def test_invalid_definition_fails_permanently_with_crewai_message(harness: Harness, stub: StubModel) -> None:
    definition = {
        "name": "Loop",
        "methods": {"again": {"start": True, "listen": "again", "do": {"call": "expression", "expr": "1"}}},
    }
    report = failed(
        harness.run(c.Trigger.KICKOFF, {"definition": definition}), c.Reason.INVALID_DEFINITION, c.EXIT_PERMANENT
    )
    assert "A listener triggered by its own completion creates an infinite loop" in report.message
    assert stub.ledger() == []


def test_flow_ref_that_does_not_import_fails_permanently(harness: Harness) -> None:
    run = harness.run(c.Trigger.KICKOFF, {"flowRef": "no_such_package.flows:Missing"})
    report = failed(run, c.Reason.INVALID_FLOW_REF, c.EXIT_PERMANENT)
    assert "no_such_package" in report.message


def test_inputs_the_state_rejects_fail_permanently(harness: Harness, stub: StubModel) -> None:
    run = harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW, "inputs": {"topic": {"not": "a string"}}})
    failed(run, c.Reason.INVALID_INPUTS, c.EXIT_PERMANENT)
    assert stub.ledger() == []


def test_corrupt_state_fails_permanently(harness: Harness) -> None:
    harness.store.put(c.STATE_KEY, b"definitely not gzip")
    run = harness.run(c.Trigger.RETRY, {"flowRef": ARTICLE_FLOW})
    failed(run, c.Reason.STATE_CORRUPT, c.EXIT_PERMANENT)


BIG_STATE_FLOW = textwrap.dedent(
    """
    import base64, os
    from crewai.flow.flow import Flow, start

    class BigState(Flow):
        @start()
        def fill(self):
            self.state["blob"] = base64.b64encode(os.urandom(1_200_000)).decode()
            return "filled"
    """
)


def test_state_over_the_limit_fails_with_state_too_large(harness: Harness, tmp_path: Path) -> None:
    (tmp_path / "bigstate.py").write_text(BIG_STATE_FLOW)
    run = harness.run(c.Trigger.KICKOFF, {"flowRef": "bigstate:BigState"}, extra_env={"PYTHONPATH": str(tmp_path)})
    report = failed(run, c.Reason.STATE_TOO_LARGE, c.EXIT_PERMANENT)
    assert "limit" in report.message
    assert harness.state() is None  # refused, not truncated


def test_budget_exceeded_stops_the_flow(harness: Harness, stub: StubModel) -> None:
    # The first call alone (about 20 tokens) plus earlier runs' 100 crosses 110.
    spec = {"flowRef": ARTICLE_FLOW, "budget": {"maxTotalTokens": 110}}
    report = failed(
        harness.run(c.Trigger.KICKOFF, spec, prior_total_tokens=100), c.Reason.BUDGET_EXCEEDED, c.EXIT_PERMANENT
    )
    ledger = stub.ledger()
    assert len(ledger) == 1, "no model call may start once the budget is crossed"
    assert report.usage == ledger_usage(ledger)


def test_lost_model_connection_is_retryable(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json({"rules": [{"fail": "drop"}]}))
    report = failed(
        harness.run(c.Trigger.KICKOFF, {"flowRef": ARTICLE_FLOW}), c.Reason.MODEL_UNREACHABLE, c.EXIT_RETRYABLE
    )
    assert "connection" in report.message.lower()


def test_retry_after_a_routed_feedback_step_continues_down_the_chosen_route(harness: Harness, stub: StubModel) -> None:
    """crewAI's replay skips a completed router without re-firing its outcome; the runner must not."""
    rules = {**RULES, "rules": [{"contains": "POLISH", "hold": True, "times": 1}, *RULES["rules"]]}
    stub.set_rules(Rules.from_json(rules))
    spec = {"definition": article_definition()}
    first = paused(harness.run(c.Trigger.KICKOFF, spec))
    assert first.feedback_request is not None
    calls_before = len(stub.ledger())
    pod, proc = harness.spawn(c.Trigger.RESUME, spec, feedback={"requestId": first.feedback_request.id, "text": "LGTM"})
    interrupted(kill_during_held_call(harness, stub, pod, proc, calls_before=calls_before))
    state = harness.state()
    assert state is not None and state["pending"] is None
    assert state["runtime"]["completedMethods"] == ["draft", "review"]
    calls = len(stub.ledger())

    report = paused(harness.run(c.Trigger.RETRY, spec))
    assert report.feedback_request is not None and report.feedback_request.method == "final_review"
    ledger = stub.ledger()[calls:]
    assert [("POLISH" in e["lastUser"]) for e in ledger] == [True], "only polish runs again"
    assert report.usage == ledger_usage(ledger)



def test_a_retry_after_a_lost_pod_skips_the_crews_finished_tasks(harness: Harness, stub: StubModel) -> None:
    """Killed while task 3 of a four-task crew waits for the model: the retry's model calls are those
    of tasks 3 and 4 only, task 4 still reads what tasks 1 and 2 wrote, and every call counts once."""
    stub.set_rules(Rules.from_json({"default": "A plain reply.",
                                    "rules": [{"contains": "PART3 of", "hold": True, "times": 1}, *part_rules()]}))
    spec = {"definition": crew_definition(WRITER)}
    pod, proc = harness.spawn(c.Trigger.KICKOFF, spec)
    killed = interrupted(kill_during_held_call(harness, stub, pod, proc))
    assert parts_of(stub.ledger()) == ["PART1", "PART2"]
    state = harness.state()
    assert state is not None and [len(v) for v in state["tasks"].values()] == [2], "tasks 1 and 2 are kept"
    before = len(stub.ledger())

    report = succeeded(harness.run(c.Trigger.RETRY, spec))
    retried = stub.ledger()[before:]
    assert parts_of(retried) == ["PART3", "PART4"], "tasks 1 and 2 finished before the kill: not paid again"
    assert "fact-1" in retried[-1]["lastUser"] and "fact-2" in retried[-1]["lastUser"], "task 4 reads their outputs"
    assert report.usage == ledger_usage(retried)
    assert killed.usage + report.usage == ledger_usage(stub.ledger()), "each answered call counted once"
    assert report.output == "Part 4 says: fact-4."
    state = harness.state()
    assert state is not None and state["tasks"] == {}, "the method completed: its tasks are dropped"


def test_with_keep_tasks_off_a_retry_runs_the_whole_crew_again(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json({"default": "A plain reply.",
                                    "rules": [{"contains": "PART3 of", "hold": True, "times": 1}, *part_rules()]}))
    spec = {"definition": crew_definition(WRITER), "retries": {"limit": 1, "keepTasks": False}}
    pod, proc = harness.spawn(c.Trigger.KICKOFF, spec)
    interrupted(kill_during_held_call(harness, stub, pod, proc))
    assert harness.state() is None, "nothing kept: no method completed"
    before = len(stub.ledger())
    report = succeeded(harness.run(c.Trigger.RETRY, spec))
    assert parts_of(stub.ledger()[before:]) == ["PART1", "PART2", "PART3", "PART4"]
    assert report.usage == ledger_usage(stub.ledger()[before:])


def test_checkpoints_are_kept_and_forks_run_from_them_with_their_own_usage(
        harness: Harness, stub: StubModel, tmp_path: Path) -> None:
    """The origin pauses at its review: a checkpoint after `draft` and one at the pause. A fork of the
    first with `draft`'s output edited asks the review about the edited text and polishes it; a fork of
    the second, answered the other way, takes the other branch. Nothing before a checkpoint is called
    again, and each run's usage is its own calls."""
    spec: dict[str, Any] = {"definition": article_definition()}
    origin = paused(harness.run(c.Trigger.KICKOFF, spec))
    ledger = stub.ledger()
    assert origin.usage == ledger_usage(ledger)
    assert origin.checkpoints is not None
    assert [(e.id, e.kind, e.method) for e in origin.checkpoints] == [
        (1, "Completed", "draft"), (2, "Paused", "review")]
    assert origin.checkpoints[0].usage.total_tokens == origin.usage.total_tokens  # draft made the only call
    assert matching_charges(origin.usage, origin.charges), "its charges by quarter hour add up to its usage"
    snapshots = {n: harness.store.get(c.checkpoint_key(n)) for n in (1, 2)}
    assert all(snapshots.values())
    assert decode_json(snapshots[1] or b"", "checkpoint")["runtime"]["completedMethods"] == ["draft"]

    def fork_of(n: int, name: str, **edits: Any) -> tuple[Harness, dict[str, Any]]:
        fork = Harness(tmp_path / name, stub, flow=name)
        fork.store.put(c.STATE_KEY, snapshots[n] or b"")  # what the operator copies at the fork's first reconcile
        return fork, {**spec, "forkFrom": {"name": harness.flow, "checkpoint": n, **edits}}

    edited, edited_spec = fork_of(1, "edited", outputs={"draft": "EDITED facts."})
    first = paused(edited.run(c.Trigger.FORK, edited_spec))
    assert len(stub.ledger()) == len(ledger)  # draft is not called again: the review shows the edit
    assert first.feedback_request is not None and first.feedback_request.output == "EDITED facts."
    assert first.flow_id and first.flow_id != origin.flow_id
    assert first.usage == Usage()
    assert (edited.state() or {})["forked"] == "/demo#1"
    answer = {"requestId": first.feedback_request.id, "text": "LGTM", "outcome": "approved"}
    second = paused(edited.run(c.Trigger.RESUME, edited_spec, feedback=answer))
    calls = stub.ledger()[len(ledger):]
    assert len(calls) == 1 and "POLISH EDITED facts." in calls[0]["lastUser"]
    assert second.usage == ledger_usage(calls)
    assert second.flow_id == first.flow_id
    # Its own checkpoints go on from the origin's numbers.
    assert [(e.id, e.kind, e.method) for e in first.checkpoints or []] == [(2, "Paused", "review")]
    assert [(e.id, e.kind, e.method) for e in second.checkpoints or []] == [
        (3, "Completed", "review"), (4, "Completed", "polish"), (5, "Paused", "final_review")]

    answered, answered_spec = fork_of(2, "other-way")
    waiting = paused(answered.run(c.Trigger.FORK, answered_spec))
    assert waiting.feedback_request is not None and waiting.feedback_request.method == "review"
    assert waiting.feedback_request.output == "Operators reconcile desired state."
    before = len(stub.ledger())
    no = {"requestId": waiting.feedback_request.id, "text": "no", "outcome": "rejected"}
    done = succeeded(answered.run(c.Trigger.RESUME, answered_spec, feedback=no))
    assert done.output == "shelved: Operators reconcile desired state."
    assert len(stub.ledger()) == before and done.usage == Usage()
    assert harness.state() is not None and (harness.state() or {})["pending"] is not None  # the origin is unchanged


def test_a_fork_whose_edit_names_a_method_without_output_fails_naming_it(
        harness: Harness, stub: StubModel, tmp_path: Path) -> None:
    spec: dict[str, Any] = {"definition": article_definition()}
    paused(harness.run(c.Trigger.KICKOFF, spec))
    fork = Harness(tmp_path / "bad", stub, flow="bad")
    fork.store.put(c.STATE_KEY, harness.store.get(c.checkpoint_key(1)) or b"")
    bad = {**spec, "forkFrom": {"name": "demo", "checkpoint": 1, "outputs": {"polish": "x"}}}
    report = failed(fork.run(c.Trigger.FORK, bad), c.Reason.INVALID_INPUTS, c.EXIT_PERMANENT)
    assert "spec.forkFrom.outputs.polish" in report.message and "completed there: draft" in report.message


def test_a_fork_retried_before_it_saved_its_edits_still_applies_them(
        harness: Harness, stub: StubModel, tmp_path: Path) -> None:
    """Its first pod was lost before it wrote the edited state: the retry (trigger retry, not fork)
    starts from the copied checkpoint as it is, and must apply the edits, under a new flow id."""
    spec: dict[str, Any] = {"definition": article_definition()}
    origin = paused(harness.run(c.Trigger.KICKOFF, spec))
    fork = Harness(tmp_path / "retried", stub, flow="retried")
    fork.store.put(c.STATE_KEY, harness.store.get(c.checkpoint_key(1)) or b"")
    edited = {**spec, "forkFrom": {"name": "demo", "checkpoint": 1, "outputs": {"draft": "EDITED facts."}}}
    report = paused(fork.run(c.Trigger.RETRY, edited))
    assert report.feedback_request is not None and report.feedback_request.output == "EDITED facts."
    assert report.flow_id and report.flow_id != origin.flow_id


def test_a_fork_of_a_class_flow_with_a_state_field_edited_runs_on_from_it(
        harness: Harness, stub: StubModel, tmp_path: Path) -> None:
    """A Flow class keeps its results in its state: a fork sets a field (`inputs`) and the next method
    reads it, under a new flow id; the method before the checkpoint is not called again."""
    spec: dict[str, Any] = {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}}
    origin = succeeded(harness.run(c.Trigger.KICKOFF, spec))
    assert [(e.id, e.method) for e in origin.checkpoints or []] == [(1, "write_draft"), (2, "summarize")]
    fork = Harness(tmp_path / "class-fork", stub, flow="class-fork")
    fork.store.put(c.STATE_KEY, harness.store.get(c.checkpoint_key(1)) or b"")
    mark = len(stub.ledger())
    edited = {**spec, "forkFrom": {"name": "demo", "checkpoint": 1, "inputs": {"draft": "EDITED draft on dogs"}}}
    report = succeeded(fork.run(c.Trigger.FORK, edited))
    calls = stub.ledger()[mark:]
    assert len(calls) == 1 and "Summarise in one line: EDITED draft on dogs" in calls[0]["lastUser"]
    assert report.usage == ledger_usage(calls) and report.flow_id != origin.flow_id
    state = fork.state()
    assert state is not None and state["state"]["draft"] == "EDITED draft on dogs"
    assert state["state"]["id"] == report.flow_id, "the state's own id is the fork's new flow id"
