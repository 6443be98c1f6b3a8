"""Conversations end to end with the REAL runner: a chat session as a Flow, its turns answered by a warm
runner pod (one process, message after message) or, once the pod's window passed, by a new pod that
restores the session from the state.

The operator from its chart (webhooks, status policy), runner pods from the runner image, crewAI's
conversational flow as the engine, the stub model answering the router's structured call and the
chat calls. The transcript lives in the flow's state; ``status.conversation`` shows the latest.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import redirect_stderr, redirect_stdout
from typing import Any

import pytest

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.jaeger import Jaeger
from flowkube_devstack.stubmodel import Rules
from flowkube_kubectl import cli
from flowkube_runner.__main__ import STOP_LOG
from tests.integration.conftest import Flows
from tests.integration.realrunner import MODEL, RealRunnerStack, real_runner_stack

pytestmark = pytest.mark.slow

RULES: dict[str, Any] = {
    "default": "A plain reply.",
    "rules": [
        {"contains": "refund", "structured": True, "reply": "refund"},
        {"contains": "my name is", "structured": False, "reply": "Nice to meet you."},
        {"contains": "What is my name", "structured": False, "reply": "Your name is Ana."},
    ],
}
SUPPORT = {
    "schema": "crewai.flow/v1",
    "name": "Support",
    "conversational": {"llm": MODEL, "system_prompt": "You are a support agent."},
    "methods": {"handle_refund": {"listen": "refund", "do": {"call": "expression", "expr": "'Refund started'"}}},
}
TURN_TIMEOUT = 180  # every turn is a fresh runner pod importing crewAI (seconds on a busy machine)


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, jaeger: Jaeger) -> Iterator[RealRunnerStack]:
    with real_runner_stack(cluster, RULES, "chat", jaeger=jaeger) as s:  # traced: a conversation is one trace
        yield s


def patch_message(stack: RealRunnerStack, flows: Flows, name: str, text: str) -> Any:
    body = json.dumps({"status": {"conversation": {"inbox": {"text": text}}}})
    return stack.cluster.kubectl("patch", "flow", name, "-n", flows.ns, "--subresource=status", "--type=merge",
                                 "-p", body, check=False)


def answered(flows: Flows, name: str, turns: int) -> dict[str, Any]:
    def done(s: dict[str, Any]) -> bool:
        if s.get("phase") == "Failed":
            raise AssertionError(f"{name} failed: {s.get('message')}")
        conv = s.get("conversation") or {}
        return conv.get("turns", 0) >= turns and "pending" not in conv and s.get("phase") != "Running"

    return flows.wait(name, done, f"{turns} answered message(s)", timeout=TURN_TIMEOUT)


def kubectl_flow(stack: RealRunnerStack, monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[int, str, str]:
    """``kubectl flow ARGS --kubeconfig ...`` as the plugin runs: it calls the cluster's kubectl."""
    monkeypatch.setenv("KUBECTL", str(stack.cluster.bins["kubectl"]))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = cli.main([*args, "--kubeconfig", str(stack.cluster.kubeconfig)])
    return code, out.getvalue(), err.getvalue()


def test_a_chat_session_answers_each_message_once_and_ends_by_exit(
        stack: RealRunnerStack, flows: Flows, monkeypatch: pytest.MonkeyPatch) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("support", {"definition": SUPPORT})
    st = flows.wait_phase("support", "AwaitingMessage", timeout=TURN_TIMEOUT)
    session = st["conversation"]["sessionId"]
    assert session and st["conversation"]["turns"] == 0 and st["runs"][0]["trigger"] == "kickoff"

    # The documented raw patch, as a user types it, three times: one turn. The webhook records who sent it.
    first = [patch_message(stack, flows, "support", "Hi, my name is Ana") for _ in range(3)]
    assert first[0].returncode == 0, first[0].stderr
    assert all(o.returncode == 0 or "AwaitingMessage" in o.stderr for o in first[1:]), first
    refused = patch_message(stack, flows, "support", "and another thing")  # a turn is under way
    assert refused.returncode != 0 and "AwaitingMessage" in refused.stderr + refused.stdout, refused
    st = answered(flows, "support", 1)
    assert [m["content"] for m in st["conversation"]["messages"] if m["role"] == "user"] == ["Hi, my name is Ana"]
    assert st["phase"] == "AwaitingMessage" and st["conversation"]["lastReply"] == "Nice to meet you."
    first = st["conversation"]["messages"][0]
    assert (first["role"], first["content"], first["sender"]) == ("user", "Hi, my name is Ana", "flowkube-admin")

    # The kubectl plugin, flags after the arguments as in kubectl: a later turn remembers an earlier one.
    code, out_text, err = kubectl_flow(stack, monkeypatch, "say", "support", "What is my name?", "-n", flows.ns)
    assert code == 0 and out_text.strip() == "Your name is Ana.", err

    # A custom route, chosen by the router's structured answer.
    code, out_text, err = kubectl_flow(stack, monkeypatch, "say", "support", "I want a refund", "-n", flows.ns)
    assert code == 0 and out_text.strip() == "Refund started", err

    code, out_text, err = kubectl_flow(stack, monkeypatch, "say", "support", "exit", "-n", flows.ns)
    assert code == 0 and "ended" in err, (out_text, err)
    st = flows.wait_phase("support", "Succeeded", timeout=TURN_TIMEOUT)
    conv = st["conversation"]
    assert conv["ended"] and conv["turns"] == 4 and conv["sessionId"] == session
    assert next(c for c in st["conditions"] if c["type"] == "Succeeded")["reason"] == "ConversationEnded"
    users = [m["content"] for m in conv["messages"] if m["role"] == "user"]
    assert users == ["Hi, my name is Ana", "What is my name?", "I want a refund", "exit"], "each message once"
    # Warm: the pod that opened the session answered every message, and ended with the session.
    assert [(r["trigger"], r["result"]) for r in st["runs"]] == [("kickoff", "Succeeded")]
    late = patch_message(stack, flows, "support", "hello again")
    assert late.returncode != 0, "an ended conversation takes no message"

    assert Usage.model_validate(st["usage"]) == stack.usage_since(mark), "router and chat calls, each once"
    assert f'flowkube_flow_turns_total{{namespace="{flows.ns}",flow="support",definition="Support"}} 4' in (
        stack.operator.metrics())
    assert "flowkube_conversation_turn_seconds_count" in stack.operator.metrics()


def test_a_session_without_messages_ends_when_idle(stack: RealRunnerStack, flows: Flows) -> None:
    flows.apply("idle", {"definition": SUPPORT, "conversation": {"idleTimeoutSeconds": 5}})
    st = flows.wait_phase("idle", "Succeeded", timeout=TURN_TIMEOUT)
    assert next(c for c in st["conditions"] if c["type"] == "Succeeded")["reason"] == "ConversationIdle"
    assert st["conversation"]["turns"] == 0 and len(st["runs"]) == 1


def test_a_message_to_a_flow_that_is_not_a_conversation_is_refused(stack: RealRunnerStack, flows: Flows) -> None:
    flows.apply("plain", {"flowRef": "flowkube_runner.examples.article:ArticleFlow", "inputs": {"topic": "x"}})
    out = patch_message(stack, flows, "plain", "hello")
    assert out.returncode != 0 and "AwaitingMessage" in out.stderr, out


def status(flows: Flows, name: str) -> dict[str, Any]:
    found = flows.get(name)
    assert found is not None, f"flow {name} is gone"
    result: dict[str, Any] = found.get("status") or {}
    return result


def test_the_window_passing_between_messages_restores_the_session_in_a_new_pod(
        stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("brief", {"definition": SUPPORT, "conversation": {"keepWarmSeconds": 4}})

    def pod_gone(s: dict[str, Any]) -> bool:  # the last run ended: its pod's window passed
        return s.get("phase") == "AwaitingMessage" and bool(s["runs"][-1].get("finishedAt"))

    flows.wait("brief", pod_gone, "the opening pod to end after its window", timeout=TURN_TIMEOUT)
    assert patch_message(stack, flows, "brief", "Hi, my name is Ana").returncode == 0
    assert answered(flows, "brief", 1)["conversation"]["lastReply"] == "Nice to meet you."
    flows.wait("brief", pod_gone, "the first turn's pod to end after its window", timeout=TURN_TIMEOUT)
    assert patch_message(stack, flows, "brief", "What is my name?").returncode == 0
    st = answered(flows, "brief", 2)
    assert st["conversation"]["lastReply"] == "Your name is Ana.", "a new pod restored the session from the state"
    assert [(r["trigger"], r.get("result")) for r in st["runs"]] == [
        ("kickoff", "Succeeded"), ("turn", "Succeeded"), ("turn", None)]
    assert all(r.get("warmSeconds", 0) > 0 for r in st["runs"][:2]), st["runs"]
    flows.wait("brief", pod_gone, "the last pod to end", timeout=TURN_TIMEOUT)
    st = status(flows, "brief")
    assert Usage.model_validate(st["usage"]) == stack.usage_since(mark)
    # Three pods, one trace: each turn's crewAI spans under the run of the pod that answered it (the
    # opening pod runs no flow step), every turn's model calls counted once.
    spans = stack.one_trace(st)
    runs = {sp.span_id: sp.name for name in ("run 0 kickoff", "run 1 turn", "run 2 turn") for sp in spans[name]}
    steps = [sp for sp in spans["invoke_workflow Support"] if sp.service == "flowkube-runner"]
    assert sorted(runs[sp.parent_id] for sp in steps) == ["run 1 turn", "run 2 turn"]


def test_a_warm_pod_stopped_mid_turn_or_killed_while_it_waits_loses_no_message(
        stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("sturdy", {"definition": SUPPORT, "conversation": {"keepWarmSeconds": 600}})
    flows.wait_phase("sturdy", "AwaitingMessage", timeout=TURN_TIMEOUT)
    assert patch_message(stack, flows, "sturdy", "Hi, my name is Ana").returncode == 0
    answered(flows, "sturdy", 1)

    # Deleted (SIGTERM, as a drain does) during the turn's model call: the call in flight is let
    # finish and counted, the turn is not saved, and a new pod answers the same message.
    stack.stub.set_rules(Rules.from_json({**RULES, "rules": [
        {"contains": "slow question", "hold": True, "times": 1, "reply": "held"}, *RULES["rules"]]}))
    try:
        assert patch_message(stack, flows, "sturdy", "a slow question").returncode == 0
        assert stack.stub.wait_held(1, timeout=TURN_TIMEOUT), "the warm pod took the message"
        pod = status(flows, "sturdy")["runs"][-1]["pod"]
        stack.cluster.kubectl("delete", "pod", pod, "-n", flows.ns, "--wait=false")

        def took_sigterm() -> bool:  # the kubelet's SIGTERM reached the runner while its call was held
            out = stack.cluster.kubectl("logs", pod, "-n", flows.ns, check=False)
            return STOP_LOG in out.stdout + out.stderr

        wait_for(took_sigterm, 60, f"runner pod {pod} to take the SIGTERM")
    finally:
        stack.stub.release_held()
    st = answered(flows, "sturdy", 2)
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "retry"], st["runs"]
    assert st["runs"][0]["reason"] in ("Disrupted", "PodDeleted"), st["runs"][0]

    # Killed outright while it waits warm: nothing was under way, so nothing failed; the next message
    # goes to a new pod.
    pod = st["runs"][-1]["pod"]
    stack.cluster.kubectl("delete", "pod", pod, "-n", flows.ns, "--grace-period=0", "--force")
    flows.wait("sturdy", lambda s: bool(s["runs"][-1].get("finishedAt")), "the killed pod's run to end", 120)
    st = status(flows, "sturdy")
    assert st["runs"][-1]["result"] == "Succeeded" and st["phase"] == "AwaitingMessage", st["runs"][-1]
    assert patch_message(stack, flows, "sturdy", "What is my name?").returncode == 0
    st = answered(flows, "sturdy", 3)
    assert st["conversation"]["lastReply"] == "Your name is Ana."
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "retry", "turn"]
    users = [m["content"] for m in st["conversation"]["messages"] if m["role"] == "user"]
    assert users == ["Hi, my name is Ana", "a slow question", "What is my name?"], "each message once"
    assert Usage.model_validate(st["usage"]) == stack.usage_since(mark), "every answered call, once"
