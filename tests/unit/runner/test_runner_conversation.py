"""Conversations through ``python -m flowkube_runner``: every turn in a fresh process, as in a pod.

The session is opened by a kickoff run; each message is one ``turn`` run that restores the session
from the state and answers it with crewAI's ``handle_turn``. Usage is compared with the stub's ledger.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest

from flowkube_api import constants as c
from flowkube_api.report import RunReport, TurnReport
from flowkube_devstack.cluster import wait_for
from flowkube_devstack.stubmodel import Rules, StubModel, ledger_usage

from .test_runner_flows import (
    MODEL,
    RULES,
    Finished,
    Harness,
    article_definition,
    kill_during_held_call,
    succeeded,
)

pytestmark = pytest.mark.slow

SUPPORT = {
    "schema": "crewai.flow/v1",
    "name": "Support",
    "conversational": {"llm": MODEL, "system_prompt": "You are a support agent."},
    "methods": {"handle_refund": {"listen": "refund", "do": {"call": "expression", "expr": "'Refund started'"}}},
}
SPEC = {"definition": SUPPORT}
CHAT_RULES: dict[str, Any] = {
    "default": "A plain reply.",
    "rules": [
        {"contains": "refund", "structured": True, "reply": "refund"},
        {"contains": "garble", "structured": True, "reply": "this is not JSON", "raw": True},
        {"contains": "my name is", "structured": False, "reply": "Nice to meet you."},
        {"contains": "What is my name", "structured": False, "reply": "Your name is Ana."},
    ],
}


def say(harness: Harness, turn: int, text: str) -> Finished:
    return harness.run(c.Trigger.TURN, SPEC, extra_env={c.ENV_MESSAGE: json.dumps({"turn": turn, "text": text})})


def answered(run: Finished, turn: int) -> TurnReport:
    report = succeeded(run)
    assert report.conversation is not None, run.describe()
    assert report.conversation.turn == turn, run.describe()
    return report.conversation


def transcript(harness: Harness) -> list[tuple[str, str]]:
    state = harness.state()
    assert state is not None
    return [(m["role"], m["content"]) for m in state["state"]["messages"]]


def test_a_session_answers_each_message_once_in_fresh_processes(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(CHAT_RULES))
    reports: list[RunReport] = []

    opened = succeeded(harness.run(c.Trigger.KICKOFF, SPEC))
    assert opened.conversation is not None and opened.conversation.turn == 0
    assert opened.usage.successful_requests == 0, "opening a session calls no model"
    session = opened.conversation.session_id
    reports.append(opened)

    run = say(harness, 1, "Hi, my name is Ana")
    assert answered(run, 1).reply == "Nice to meet you."
    reports.append(run.report)  # type: ignore[arg-type]
    run = say(harness, 2, "What is my name?")
    assert answered(run, 2).reply == "Your name is Ana."
    reports.append(run.report)  # type: ignore[arg-type]
    # The second turn's chat call carried the first turn's messages: the session was restored.
    chat_calls = [e for e in stub.ledger() if "Hi, my name is Ana" in json.dumps(e)]
    assert len(chat_calls) >= 3, "turn 1's router and chat calls, and turn 2's calls with the history"

    run = say(harness, 3, "I want a refund")
    assert answered(run, 3).reply == "Refund started"  # a custom route, chosen by the router's answer
    reports.append(run.report)  # type: ignore[arg-type]

    # A router answer crewAI cannot parse falls back to chatting; the provider billed it, so it counts.
    run = say(harness, 4, "garble this")
    assert answered(run, 4).reply == "A plain reply."
    reports.append(run.report)  # type: ignore[arg-type]
    assert run.report is not None and run.report.usage.successful_requests == 2

    # Message 4 again (its run died before reporting): reported from the state, not answered twice.
    calls = len(stub.ledger())
    again = say(harness, 4, "garble this")
    assert answered(again, 4).reply == "A plain reply."
    assert len(stub.ledger()) == calls and again.report is not None and again.report.usage.successful_requests == 0

    run = say(harness, 5, "exit")
    ended = answered(run, 5)
    assert ended.ended and ended.reply == "Conversation ended."
    reports.append(run.report)  # type: ignore[arg-type]

    assert all(r.conversation and r.conversation.session_id == session for r in reports)
    users = [text for role, text in transcript(harness) if role == "user"]
    assert users == ["Hi, my name is Ana", "What is my name?", "I want a refund", "garble this", "exit"]
    total = reports[0].usage
    for r in reports[1:]:
        total = total + r.usage
    # Every call, the router's and the unparseable one's, once.
    assert total.model_dump() == ledger_usage(stub.ledger()).model_dump()


def test_a_turn_killed_mid_call_leaves_the_previous_turn_and_is_answered_once_by_the_retry(
    harness: Harness, stub: StubModel
) -> None:
    stub.set_rules(Rules.from_json({**CHAT_RULES, "rules": [
        {"contains": "slow question", "structured": False, "hold": True, "times": 1}, *CHAT_RULES["rules"]]}))
    succeeded(harness.run(c.Trigger.KICKOFF, SPEC))
    answered(say(harness, 1, "Hi, my name is Ana"), 1)
    before = transcript(harness)
    calls = len(stub.ledger())

    pod, proc = harness.spawn(c.Trigger.TURN, SPEC,
                              extra_env={c.ENV_MESSAGE: json.dumps({"turn": 2, "text": "slow question"})})
    try:
        killed = kill_during_held_call(harness, stub, pod, proc, calls_before=calls)
        assert killed.report is not None and killed.report.reason == c.Reason.RUN_INTERRUPTED
        assert killed.report.usage.successful_requests == 1, "the router's call was answered before the kill"
        assert transcript(harness) == before, "a turn is saved whole or not at all"

        message = json.dumps({"turn": 2, "text": "slow question"})
        retry = harness.run(c.Trigger.RETRY, SPEC, extra_env={c.ENV_MESSAGE: message})
        assert answered(retry, 2).reply == "A plain reply."
        users = [text for role, text in transcript(harness) if role == "user"]
        assert users == ["Hi, my name is Ana", "slow question"]
        # The killed run's router call and the retry's calls are all answered, and all counted (the
        # held call, still unanswered, is not in the ledger until it is released below).
        assert retry.report is not None
        assert (killed.report.usage + retry.report.usage) == ledger_usage(stub.ledger()[calls:])
    finally:
        stub.release_held()


def test_a_conversation_takes_no_inputs(harness: Harness) -> None:
    run = harness.run(c.Trigger.KICKOFF, {**SPEC, "inputs": {"topic": "x"}})
    assert run.report is not None and run.report.reason == c.Reason.INVALID_INPUTS, run.describe()
    assert run.exit_code == c.EXIT_PERMANENT


def test_a_turn_that_asks_for_feedback_pauses_and_its_resume_gives_the_reply(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(CHAT_RULES))
    approval = {**SUPPORT, "methods": {"handle_refund": {
        "listen": "refund", "do": {"call": "expression", "expr": "'Refund of 10 EUR'"},
        "human_feedback": {"message": "Approve the refund?"}}}}
    spec = {"definition": approval}
    message = {c.ENV_MESSAGE: json.dumps({"turn": 1, "text": "I want a refund"})}
    succeeded(harness.run(c.Trigger.KICKOFF, spec))
    paused = harness.run(c.Trigger.TURN, spec, extra_env=message)
    assert paused.report is not None and paused.report.result == c.RunResult.PAUSED, paused.describe()
    request = paused.report.feedback_request
    assert request is not None and request.message == "Approve the refund?"

    resumed = harness.run(c.Trigger.RESUME, spec, extra_env=message,
                          feedback={"requestId": request.id, "text": "yes"})
    assert answered(resumed, 1).reply == "Refund of 10 EUR"
    assert transcript(harness) == [("user", "I want a refund"), ("assistant", "Refund of 10 EUR")]


def test_a_conversational_class_with_its_own_exit_commands(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(CHAT_RULES))
    spec = {"flowRef": "flowkube_runner.examples.support:SupportFlow"}
    opened = succeeded(harness.run(c.Trigger.KICKOFF, spec))
    assert opened.conversation is not None and opened.conversation.turn == 0

    def turn(n: int, text: str) -> TurnReport:
        return answered(harness.run(c.Trigger.TURN, spec, extra_env={
            c.ENV_MESSAGE: json.dumps({"turn": n, "text": text})}), n)

    assert turn(1, "I want a refund").reply == "Refund started"
    assert turn(2, "Bye").ended  # the class's own exit command
    late = succeeded(harness.run(c.Trigger.TURN, spec, extra_env={
        c.ENV_MESSAGE: json.dumps({"turn": 3, "text": "still there?"})}))
    assert late.conversation is not None and (late.conversation.turn, late.conversation.ended) == (2, True)
    assert late.usage.successful_requests == 0, "an ended session answers nothing more"
    assert [role for role, _ in transcript(harness)] == ["user", "assistant", "user", "assistant"]


def test_the_routers_end_route_ends_the_session(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json({**CHAT_RULES, "rules": [
        {"contains": "that is all", "structured": True, "reply": "end"}, *CHAT_RULES["rules"]]}))
    succeeded(harness.run(c.Trigger.KICKOFF, SPEC))
    ended = answered(say(harness, 1, "thanks, that is all"), 1)
    assert ended.ended and ended.reply == "Conversation ended."  # crewAI's built-in end_conversation


# -- warm: one process answers message after message ------------------------------------------------


def waiting_warm(harness: Harness, pod: str, on: Callable[[RunReport], bool], what: str,
                 timeout: float = 120) -> RunReport:
    """Wait (with a deadline) until the pod's report says it waits warm, ``on`` what the test expects."""
    found: list[RunReport] = []

    def ready() -> bool:
        data = harness.store.get(c.report_key(pod))
        report = RunReport.decode(data) if data else None
        if report is not None and report.warm and on(report):
            found.append(report)
            return True
        return False

    wait_for(ready, timeout, f"{pod} to {what} and wait warm", interval=0.01)
    return found[-1]


def warm_report(harness: Harness, pod: str, turn: int) -> RunReport:
    return waiting_warm(harness, pod, lambda r: r.conversation is not None and r.conversation.turn == turn,
                        f"answer message {turn}")


def send_file(harness: Harness, turn: int, text: str) -> None:
    """What the operator's long poll hands a warm pod; the file store's stand-in is a file."""
    path = harness.state_dir / f"message.{turn}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"turn": turn, "text": text}))
    tmp.replace(path)


def test_a_warm_runner_answers_each_message_in_the_same_process(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(CHAT_RULES))
    pod, proc = harness.spawn(c.Trigger.KICKOFF, SPEC, extra_env={c.ENV_KEEP_WARM_SECONDS: "30"})
    try:
        opened = warm_report(harness, pod, 0)
        assert proc.poll() is None, "the pod stays up after opening the session"
        seconds = []
        for turn, (text, reply) in enumerate([("Hi, my name is Ana", "Nice to meet you."),
                                              ("What is my name?", "Your name is Ana."),
                                              ("I want a refund", "Refund started")], start=1):
            started = time.perf_counter()
            send_file(harness, turn, text)
            report = warm_report(harness, pod, turn)
            seconds.append(time.perf_counter() - started)
            assert report.conversation is not None and report.conversation.reply == reply
            assert report.conversation.session_id == opened.conversation.session_id  # type: ignore[union-attr]
            assert proc.poll() is None
        print(f"\nwarm turns in one process: {', '.join(f'{s * 1000:.0f} ms' for s in seconds)}")
        # Each user message is once in the transcript, in order; usage is cumulative and exact.
        users = [text for role, text in transcript(harness) if role == "user"]
        assert users == ["Hi, my name is Ana", "What is my name?", "I want a refund"]
        assert report.usage.totals() == ledger_usage(stub.ledger()).totals()
        # An exit command ends the session, and the pod with it (no more waiting).
        send_file(harness, 4, "exit")
        run = harness.finish(pod, proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    final = answered(run, 4)
    assert final.ended and not run.report.warm  # type: ignore[union-attr]
    assert run.report.usage.totals() == ledger_usage(stub.ledger()).totals()  # type: ignore[union-attr]


def test_a_warm_runner_exits_when_its_window_passes_or_it_is_stopped(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(CHAT_RULES))
    pod, proc = harness.spawn(c.Trigger.KICKOFF, SPEC, extra_env={c.ENV_KEEP_WARM_SECONDS: "2"})
    warm_report(harness, pod, 0)
    run = harness.finish(pod, proc, timeout=60)  # nobody writes: the window passes
    assert answered(run, 0).turn == 0 and not run.report.warm  # type: ignore[union-attr]

    # The next message starts a fresh process that restores the session and waits warm in turn.
    pod, proc = harness.spawn(c.Trigger.TURN, SPEC, extra_env={
        c.ENV_KEEP_WARM_SECONDS: "600", c.ENV_MESSAGE: json.dumps({"turn": 1, "text": "Hi, my name is Ana"})})
    warm_report(harness, pod, 1)
    proc.send_signal(signal.SIGTERM)  # deleted while it waits: it ends well, long before its window would
    run = harness.finish(pod, proc, timeout=30)
    assert answered(run, 1).reply == "Nice to meet you." and run.exit_code == c.EXIT_OK


def warm_paused_on(harness: Harness, pod: str, method: str) -> RunReport:
    return waiting_warm(harness, pod, lambda r: r.feedback_request is not None and r.feedback_request.method == method,
                        f"pause on {method}")


def test_a_warm_paused_runner_resumes_each_answer_in_the_same_process(harness: Harness, stub: StubModel) -> None:
    stub.set_rules(Rules.from_json(RULES))
    spec = {"definition": article_definition()}
    pod, proc = harness.spawn(c.Trigger.KICKOFF, spec, extra_env={c.ENV_FEEDBACK_KEEP_WARM_SECONDS: "60"})
    try:
        first = warm_paused_on(harness, pod, "review")
        assert proc.poll() is None and first.result == c.RunResult.PAUSED
        request = first.feedback_request.id  # type: ignore[union-attr]
        (harness.state_dir / f"answer.{request}.json").write_text(json.dumps({"requestId": request, "text": "LGTM"}))
        second = warm_paused_on(harness, pod, "final_review")
        assert second.feedback_applied is not None and second.feedback_applied.outcome == "approved"
        request = second.feedback_request.id  # type: ignore[union-attr]
        (harness.state_dir / f"answer.{request}.json").write_text(json.dumps({"requestId": request, "text": "ship it"}))
        run = harness.finish(pod, proc, timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = succeeded(run)
    assert done.output == "Operators, polished. | LGTM | ship it", "polish read the draft of the same process"
    assert done.usage == ledger_usage(stub.ledger()), "every call of the three steps, once"
