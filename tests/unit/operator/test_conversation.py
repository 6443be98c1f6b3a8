"""Conversations in the pure reconcile and the admission review: a session opened by its first run,
one turn per accepted message, refusals that lose nothing, and the endings a user sees."""

from __future__ import annotations

from typing import Any

from flowkube_api.constants import Phase, Reason, RunResult, Trigger
from flowkube_api.report import FeedbackRequest, RunReport, TurnReport
from flowkube_operator.flows.reconcile import Plan
from flowkube_operator.serve.webhook import review_status_write

from .test_reconcile import cond, flow, pod, report, step, usage


def turn_report(name: str, turn: int, reply: str | None = None, ended: bool = False,
                trigger: Trigger = Trigger.TURN) -> RunReport:
    return report(name, RunResult.SUCCEEDED, trigger=trigger, usage=usage(10 * (turn + 1), 5),
                  conversation=TurnReport(session_id="s1", turn=turn, reply=reply, ended=ended))


def opened(**spec: Any) -> dict[str, Any]:
    body = flow(**spec)
    step(body)
    step(body, pod("f-0", "Succeeded", exit_code=0), turn_report("f-0", 0, trigger=Trigger.KICKOFF), at=1)
    return body


def send(body: dict[str, Any], text: str, by: str | None = "ana", at: float = 2) -> Plan:
    body["status"].setdefault("conversation", {})["inbox"] = {"text": text, **({"sentBy": by} if by else {})}
    return step(body, pod("f-0", "Succeeded", exit_code=0), at=at)


def answer(body: dict[str, Any], index: int, turn: int, reply: str, at: float, ended: bool = False) -> Plan:
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod(f"f-{index}", "Succeeded", exit_code=0, at=at)}
    return step(body, pods, turn_report(f"f-{index}", turn, reply, ended), at=at + 6)


def test_the_first_run_opens_the_session_and_the_flow_waits_for_a_message() -> None:
    body = opened()
    st = body["status"]
    assert st["phase"] == Phase.AWAITING_MESSAGE
    assert st["conversation"]["sessionId"] == "s1" and st["conversation"]["turns"] == 0
    assert cond(body, "AwaitingMessage")["status"] == "True"
    assert cond(body, "Succeeded")["status"] == "Unknown"


def test_each_accepted_message_is_one_turn_with_its_sender_and_its_reply() -> None:
    body = opened()
    p = send(body, "Hi, I am Ana")
    conv = body["status"]["conversation"]
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.TURN and p.create_pod.index == 1
    assert p.create_pod.message == {"turn": 1, "text": "Hi, I am Ana", "sender": "ana"}
    assert "inbox" not in conv and conv["pending"]["turn"] == 1
    assert body["status"]["phase"] == Phase.PENDING
    # Replanned (a restart, a missed event): the same pod, not a second turn.
    again = step(body, pod("f-0", "Succeeded", exit_code=0), at=3)
    assert again.create_pod is not None and again.create_pod.index == 1 and len(body["status"]["runs"]) == 2

    answer(body, 1, 1, "Hello Ana", at=4)
    st = body["status"]
    conv = st["conversation"]
    assert st["phase"] == Phase.AWAITING_MESSAGE and conv["turns"] == 1 and "pending" not in conv
    assert conv["lastReply"] == "Hello Ana"
    assert [(m["role"], m["content"], m.get("sender")) for m in conv["messages"]] == [
        ("user", "Hi, I am Ana", "ana"), ("assistant", "Hello Ana", None)]
    assert st["usage"]["totalTokens"] == (10 + 5) + (20 + 5), "the opening run and the turn, once each"


def test_a_failed_turn_is_retried_with_the_same_message() -> None:
    body = opened(retries={"limit": 1, "backoffSeconds": 0})
    send(body, "question")
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Failed", exit_code=3, at=3)}
    p = step(body, pods, report("f-1", RunResult.FAILED, reason=Reason.MODEL_UNREACHABLE, exit_code=3,
                                trigger=Trigger.TURN), at=9)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RETRY
    assert p.create_pod.message == {"turn": 1, "text": "question", "sender": "ana"}


def test_messages_at_the_wrong_time_or_empty_are_refused_and_nothing_is_lost() -> None:
    body = opened()
    p = send(body, "   ")
    assert p.create_pod is None and any(e[1] == Reason.MESSAGE_REFUSED for e in p.events)
    assert body["status"]["phase"] == Phase.AWAITING_MESSAGE and "inbox" not in body["status"]["conversation"]
    assert cond(body, "AwaitingMessage")["reason"] == Reason.MESSAGE_REFUSED

    send(body, "first")  # accepted: a turn is now running
    p = send(body, "second, too early", at=3)
    assert any(e[1] == Reason.MESSAGE_REFUSED and "in progress" in e[2] for e in p.events)
    conv = body["status"]["conversation"]
    assert conv["pending"]["text"] == "first" and "inbox" not in conv, "the accepted message stays pending"

    plain = flow()
    step(plain)
    plain["status"]["conversation"] = {"inbox": {"text": "hello"}}
    p = step(plain, at=1)
    assert any("not a conversation" in e[2] for e in p.events) and "conversation" not in plain["status"]


def test_the_session_ends_by_its_end_route_by_max_turns_and_when_idle() -> None:
    body = opened()
    send(body, "bye")
    answer(body, 1, 1, "Conversation ended.", at=4, ended=True)
    st = body["status"]
    assert st["phase"] == Phase.SUCCEEDED and cond(body, "Succeeded")["reason"] == Reason.CONVERSATION_ENDED
    assert st["result"]["output"] == "Conversation ended."
    p = send(body, "anyone there?", at=20)
    assert any("ended" in e[2] for e in p.events if e[1] == Reason.MESSAGE_REFUSED)

    body = opened(conversation={"maxTurns": 1})
    send(body, "one")
    answer(body, 1, 1, "one answer", at=4)
    assert body["status"]["phase"] == Phase.SUCCEEDED
    assert cond(body, "Succeeded")["reason"] == Reason.MAX_TURNS_REACHED

    body = opened(conversation={"idleTimeoutSeconds": 60})
    p = step(body, pod("f-0", "Succeeded", exit_code=0), at=30)
    assert body["status"]["phase"] == Phase.AWAITING_MESSAGE and p.requeue_after is not None
    step(body, pod("f-0", "Succeeded", exit_code=0), at=62)
    assert body["status"]["phase"] == Phase.SUCCEEDED
    assert cond(body, "Succeeded")["reason"] == Reason.CONVERSATION_IDLE
    # The ending is kept by later reconciles.
    step(body, pod("f-0", "Succeeded", exit_code=0), at=90)
    assert cond(body, "Succeeded")["reason"] == Reason.CONVERSATION_IDLE


def test_admission_accepts_a_message_only_when_the_flow_awaits_one() -> None:
    body = opened()
    old = {"status": body["status"]}

    def write(text: Any, **extra: Any) -> str | None:
        new_status = {**body["status"], "conversation": {**body["status"]["conversation"],
                                                          "inbox": {"text": text, **extra}}}
        return review_status_write(old, {"status": new_status}, by_operator=False, username="ana")

    assert write("hello") is None
    assert write("hello", sentBy="ana") is None
    assert "sentBy" in (write("hello", sentBy="bob") or "")
    assert "non-empty" in (write("  ") or "")
    assert "characters" in (write("x" * 70000) or "")
    assert "unknown" in (write("hi", turn=3) or "")
    running = {"status": {**body["status"], "phase": Phase.RUNNING}}
    new = {"status": {**running["status"], "conversation": {**body["status"]["conversation"], "inbox": {"text": "hi"}}}}
    assert "in progress" in (review_status_write(running, new, by_operator=False, username="ana") or "")
    other = {"status": {**body["status"], "conversation": {**body["status"]["conversation"], "turns": 9}}}
    assert "only status.feedback.response" in (review_status_write(old, other, by_operator=False) or "")


def test_a_long_conversation_drops_old_run_reports_in_batches() -> None:
    body = opened()
    pruned: list[list[str]] = []
    for turn in range(1, 45):
        p = send(body, f"message {turn}", at=10 * turn)
        assert p.create_pod is not None and p.create_pod.index == turn
        pruned.append(p.prune_reports)
        pods = {name: view for i in range(turn + 1)
                for name, view in pod(f"f-{i}", "Succeeded", exit_code=0, at=10 * i).items()}
        step(body, pods, turn_report(f"f-{turn}", turn, f"reply {turn}"), at=10 * turn + 6)
    batches = [(turn, names) for turn, names in enumerate(pruned, 1) if names]
    # Runs 0..19 go when run 40 starts: the newest 20 reports always stay.
    assert batches == [(40, [f"f-{i}" for i in range(20)])]
    assert body["status"]["conversation"]["turns"] == 44


def test_a_turn_that_asks_for_feedback_is_answered_by_the_resume_of_that_turn() -> None:
    body = opened()
    send(body, "I want a refund")
    asked = report("f-1", RunResult.PAUSED, trigger=Trigger.TURN, reason=Reason.RUN_PAUSED,
                   feedback_request=FeedbackRequest(id="r-1", method="handle_refund", message="Approve?"))
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Succeeded", exit_code=0, at=3)}
    step(body, pods, asked, at=9)
    assert body["status"]["phase"] == Phase.AWAITING_FEEDBACK
    refused = send(body, "hello?", at=10)
    assert any(e[1] == Reason.MESSAGE_REFUSED for e in refused.events), "no message while feedback is pending"
    body["status"]["feedback"]["response"] = {"text": "yes"}
    p = step(body, pods, at=11)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RESUME
    assert p.create_pod.message == {"turn": 1, "text": "I want a refund", "sender": "ana"}
    assert p.create_pod.feedback is not None and p.create_pod.feedback["text"] == "yes"
    answer(body, 2, 1, "Refund of 10 EUR", at=12)
    assert body["status"]["phase"] == Phase.AWAITING_MESSAGE
    assert body["status"]["conversation"]["lastReply"] == "Refund of 10 EUR"


def test_a_run_that_ends_well_without_answering_its_message_fails_the_flow_rather_than_loop() -> None:
    body = opened()
    send(body, "hello")
    pods = {**pod("f-0", "Succeeded", exit_code=0), **pod("f-1", "Succeeded", exit_code=0, at=3)}
    p = step(body, pods, turn_report("f-1", 0), at=9)  # the run reported the session, not the message
    assert p.create_pod is None and body["status"]["phase"] == Phase.FAILED
    assert "without answering message 1" in body["status"]["message"]
    assert body["status"]["conversation"]["pending"]["text"] == "hello", "the message stays visible"


def test_a_patch_of_both_inboxes_is_checked_for_both() -> None:
    body = opened()
    new_status = {**body["status"], "conversation": {**body["status"]["conversation"], "inbox": {"text": "hi"}},
                  "feedback": {"response": {"text": "approved"}}}
    problem = review_status_write({"status": body["status"]}, {"status": new_status}, by_operator=False)
    assert problem is not None and "no feedback request is pending" in problem


# -- warm runners: the pod that answered a turn stays up for the next message ----------------------


def warm(name: str, turn: int, reply: str | None = None, ended: bool = False,
         trigger: Trigger = Trigger.KICKOFF) -> RunReport:
    return turn_report(name, turn, reply, ended, trigger=trigger).model_copy(update={"warm": True})


def warm_opened(conversation: dict[str, Any] | None = None, **spec: Any) -> dict[str, Any]:
    body = flow(conversation={"keepWarmSeconds": 60, **(conversation or {})}, **spec)
    p = step(body)
    assert p.create_pod is not None and p.create_pod.keep_warm_seconds == 60
    step(body, pod("f-0", "Running"), warm("f-0", 0), at=1)
    return body


def test_a_warm_pod_answers_message_after_message_in_one_run() -> None:
    body = warm_opened(activeDeadlineSeconds=100)
    st = body["status"]
    assert st["phase"] == Phase.AWAITING_MESSAGE and st["conversation"]["sessionId"] == "s1"
    assert "finishedAt" not in st["runs"][0], "the pod waits warm: its run goes on"
    # A message is taken by the waiting pod (the state API's long poll), not by a new pod.
    body["status"]["conversation"]["inbox"] = {"text": "hi", "sentBy": "ana"}
    p = step(body, pod("f-0", "Running"), at=31)
    assert p.create_pod is None and len(body["status"]["runs"]) == 1
    assert body["status"]["phase"] == Phase.RUNNING and body["status"]["conversation"]["pending"]["turn"] == 1
    assert body["status"]["runs"][0]["warmSeconds"] == 30.0
    # Its turn is folded in when it says so, and it waits again.
    step(body, pod("f-0", "Running"), warm("f-0", 1, "hello Ana"), at=32)
    st = body["status"]
    assert st["phase"] == Phase.AWAITING_MESSAGE and st["conversation"]["turns"] == 1
    assert st["conversation"]["lastReply"] == "hello Ana" and "pending" not in st["conversation"]
    assert st["usage"]["totalTokens"] == 25 and "finishedAt" not in st["runs"][0]
    # The same report again (a restart, a resent hint) changes nothing.
    again = step(body, pod("f-0", "Running"), warm("f-0", 1, "hello Ana"), at=33)
    assert again.events == [] and body["status"]["conversation"]["turns"] == 1
    # Waiting is not working: 200 s warm does not reach activeDeadlineSeconds=100.
    p = step(body, pod("f-0", "Running"), at=233)
    assert p.delete_pods == [] and body["status"]["phase"] == Phase.AWAITING_MESSAGE


def test_the_window_passing_ends_the_run_well_and_a_message_then_starts_a_new_pod() -> None:
    body = warm_opened()
    ended = turn_report("f-0", 0, trigger=Trigger.KICKOFF)  # its last word, not warm any more
    step(body, pod("f-0", "Succeeded", exit_code=0, at=1), ended, at=70)
    run = body["status"]["runs"][0]
    assert run["result"] == RunResult.SUCCEEDED and body["status"]["phase"] == Phase.AWAITING_MESSAGE
    assert run["warmSeconds"] > 0
    p = send(body, "hello", at=80)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.TURN and p.create_pod.index == 1


def test_a_message_accepted_as_the_window_closed_goes_to_a_new_pod_not_lost() -> None:
    body = warm_opened()
    body["status"]["conversation"]["inbox"] = {"text": "late", "sentBy": "ana"}
    step(body, pod("f-0", "Running"), at=60)  # accepted for the warm pod...
    assert body["status"]["conversation"]["pending"]["turn"] == 1
    # ...which ended without taking it.
    p = step(body, pod("f-0", "Succeeded", exit_code=0, at=1), turn_report("f-0", 0, trigger=Trigger.KICKOFF),
             at=61)
    assert p.create_pod is not None and p.create_pod.message == {"turn": 1, "text": "late", "sender": "ana"}
    assert body["status"]["phase"] == Phase.PENDING


def test_a_warm_pod_killed_while_it_waits_is_no_failure() -> None:
    body = warm_opened({"idleTimeoutSeconds": 600})
    step(body, pod("f-0", "Running"), warm("f-0", 1, "one"), at=5)
    killed = pod("f-0", "Failed", exit_code=137, at=1)
    p = step(body, killed, warm("f-0", 1, "one"), at=20)
    run = body["status"]["runs"][0]
    assert run["result"] == RunResult.SUCCEEDED and p.create_pod is None
    assert body["status"]["phase"] == Phase.AWAITING_MESSAGE
    # Gone without a trace in the cache (deleted while no one watched): the same.
    body = warm_opened()
    step(body, {}, warm("f-0", 0), at=20)
    assert body["status"]["runs"][0]["result"] == RunResult.SUCCEEDED
    assert body["status"]["phase"] == Phase.AWAITING_MESSAGE


def test_idle_timeout_and_max_turns_close_the_warm_run_and_stop_its_pod() -> None:
    body = warm_opened({"idleTimeoutSeconds": 30})
    p = step(body, pod("f-0", "Running"), at=40)
    assert body["status"]["phase"] == Phase.SUCCEEDED and [d.name for d in p.delete_pods] == ["f-0"]
    assert body["status"]["runs"][0]["result"] == RunResult.SUCCEEDED
    assert cond(body, "Succeeded")["reason"] == Reason.CONVERSATION_IDLE

    body = warm_opened({"maxTurns": 1})
    body["status"]["conversation"]["inbox"] = {"text": "only one"}
    step(body, pod("f-0", "Running"), at=2)
    p = step(body, pod("f-0", "Running"), warm("f-0", 1, "the one answer"), at=3)
    assert body["status"]["phase"] == Phase.SUCCEEDED and [d.name for d in p.delete_pods] == ["f-0"]
    assert cond(body, "Succeeded")["reason"] == Reason.MAX_TURNS_REACHED


def test_a_warm_pod_killed_mid_turn_hands_its_message_to_a_retry() -> None:
    body = warm_opened(retries={"limit": 1, "backoffSeconds": 0})
    body["status"]["conversation"]["inbox"] = {"text": "question"}
    step(body, pod("f-0", "Running"), at=2)
    mid = report("f-0", RunResult.FAILED, reason=Reason.RUN_INTERRUPTED, exit_code=3, usage=usage(30, 5))
    p = step(body, pod("f-0", "Failed", exit_code=137, at=1), mid, at=10)
    assert p.create_pod is not None and p.create_pod.message is not None and p.create_pod.message["turn"] == 1
    assert body["status"]["usage"]["totalTokens"] == 35, "what the killed pod reported counts"


def test_cold_conversations_and_plain_flows_never_wait_warm() -> None:
    p = step(flow(conversation={"keepWarmSeconds": 0}))
    assert p.create_pod is not None and p.create_pod.keep_warm_seconds == 0
    p = step(flow())  # a flowRef not yet known to be a conversation
    assert p.create_pod is not None and p.create_pod.keep_warm_seconds == 0
    inline = flow(definition={"name": "chat", "conversational": {"enabled": True}})
    del inline["spec"]["flowRef"]
    p = step(inline)
    assert p.create_pod is not None and p.create_pod.keep_warm_seconds == 120


# -- warm feedback: the paused pod waits for the answer and resumes in its own process ----------------


def warm_paused(**spec: Any) -> tuple[dict[str, Any], RunReport]:
    body = flow(feedback={"keepWarmSeconds": 300, **spec.pop("feedback", {})}, **spec)
    p = step(body)
    assert p.create_pod is not None and p.create_pod.feedback_keep_warm_seconds == 300
    fr = FeedbackRequest(id="req-1", method="review", message="Approve?", emit=["approved", "rejected"],
                         output="draft text")
    rep = report("f-0", RunResult.PAUSED, reason=Reason.RUN_PAUSED, feedback_request=fr, usage=usage(3, 2),
                 warm=True)
    step(body, pod("f-0", "Running"), rep, at=5)
    return body, rep


def test_a_warm_paused_pod_takes_the_answer_without_a_new_pod() -> None:
    body, rep = warm_paused()
    st = body["status"]
    assert st["phase"] == Phase.AWAITING_FEEDBACK and st["feedback"]["request"]["id"] == "req-1"
    assert "finishedAt" not in st["runs"][0] and st["usage"]["totalTokens"] == 5
    again = step(body, pod("f-0", "Running"), rep, at=6)  # the same report again: nothing new
    assert again.events == []
    body["status"]["feedback"]["response"] = {"text": "ship it", "requestId": "req-1"}
    p = step(body, pod("f-0", "Running"), at=25)
    st = body["status"]
    assert p.create_pod is None and len(st["runs"]) == 1 and st["phase"] == Phase.RUNNING
    assert "request" not in st["feedback"] and st["feedback"]["history"][0]["response"] == "ship it"
    assert st["runs"][0]["warmSeconds"] == 20.0
    done = report("f-0", RunResult.SUCCEEDED, usage=usage(10, 4), output="shipped")
    step(body, pod("f-0", "Succeeded", exit_code=0, at=0), done, at=30)
    assert body["status"]["phase"] == Phase.SUCCEEDED and body["status"]["usage"]["totalTokens"] == 14


def test_a_warm_paused_pod_that_ends_first_leaves_the_request_or_hands_the_answer_to_a_new_pod() -> None:
    body, rep = warm_paused()
    asked = body["status"]["feedback"]["request"]["requestedAt"]
    final = rep.model_copy(update={"warm": False})
    step(body, pod("f-0", "Succeeded", exit_code=0, at=0), final, at=300)  # the window passed
    st = body["status"]
    assert st["runs"][0]["result"] == RunResult.PAUSED and st["phase"] == Phase.AWAITING_FEEDBACK
    assert st["feedback"]["request"]["requestedAt"] == asked, "the same request, not asked again"

    body, rep = warm_paused()
    body["status"]["feedback"]["response"] = {"text": "ok"}
    step(body, pod("f-0", "Running"), at=299)  # accepted for the waiting pod...
    p = step(body, pod("f-0", "Succeeded", exit_code=0, at=0), rep.model_copy(update={"warm": False}), at=301)
    assert p.create_pod is not None and p.create_pod.trigger == Trigger.RESUME  # ...which never took it
    assert p.create_pod.feedback is not None and p.create_pod.feedback["text"] == "ok"


def test_a_warm_paused_pod_is_stopped_when_the_request_times_out() -> None:
    body, _ = warm_paused(feedback={"timeoutSeconds": 60})
    p = step(body, pod("f-0", "Running"), at=70)
    assert body["status"]["phase"] == Phase.FAILED and [d.name for d in p.delete_pods] == ["f-0"]
    assert body["status"]["runs"][0]["result"] == RunResult.PAUSED
