"""Human feedback through the Flow status, with the admission webhook installed (as the chart does).

The runner here is the scripted fake (it pauses and resumes as told, and echoes the feedback it
was given); the crewAI runner's own pause/resume is covered by the runner tests and the e2e test.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows

REVIEW = {"id": "req-1", "method": "review", "message": "Publish this draft?",
          "emit": ["approved", "rejected"], "output": "the draft"}


def paused_then(*later: dict[str, Any], default: str | None = None) -> dict[str, Any]:
    fb = {**REVIEW, "defaultOutcome": default} if default else REVIEW
    return {"plan": [{"result": "Paused", "feedback": fb, "tokens": 2}, *later]}


def answer(text: str, request_id: str | None = None) -> dict[str, Any]:
    resp: dict[str, Any] = {"text": text}
    if request_id:
        resp["requestId"] = request_id
    return {"status": {"feedback": {"response": resp}}}


pytestmark = pytest.mark.usefixtures("operator")


def test_pause_answer_resume_succeeds_and_records_who_answered(flows: Flows) -> None:
    flows.apply("fb", {"flowRef": "a:Review", "inputs": paused_then({"tokens": 3}),
                       "feedback": {"timeoutSeconds": 3600}})
    st = flows.wait_phase("fb", "AwaitingFeedback")
    req = st["feedback"]["request"]
    assert req["id"] == "req-1" and req["emit"] == ["approved", "rejected"] and req["output"] == "the draft"
    assert req["deadline"] and req["requestedAt"]
    assert [p["status"]["phase"] for p in flows.pods("fb")] == ["Succeeded"]  # nothing runs while waiting

    rc, out = flows.patch_status("fb", answer("approved"))
    assert rc == 0, out
    st = flows.wait_phase("fb", "Succeeded")
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "resume"]
    assert '"text":"approved"' in st["runs"][1]["message"]  # the runner received the answer
    (h,) = st["feedback"]["history"]
    assert h["requestId"] == "req-1" and h["response"] == "approved" and h["respondedBy"] == "flowkube-admin"
    assert "request" not in st["feedback"] and "response" not in st["feedback"]
    assert st["usage"]["totalTokens"] == 5


def test_two_rounds(flows: Flows) -> None:
    second = {**REVIEW, "id": "req-2", "method": "final_check"}
    flows.apply("twice", {"flowRef": "a:Review", "inputs": {"plan": [
        {"result": "Paused", "feedback": REVIEW}, {"result": "Paused", "feedback": second}, {}]}})
    flows.wait_phase("twice", "AwaitingFeedback")
    assert flows.patch_status("twice", answer("looks good", "req-1"))[0] == 0
    flows.wait("twice", lambda s: (s.get("feedback") or {}).get("request", {}).get("id") == "req-2",
               "the second request")
    assert flows.patch_status("twice", answer("ship it", "req-2"))[0] == 0
    st = flows.wait_phase("twice", "Succeeded")
    assert [h["response"] for h in st["feedback"]["history"]] == ["looks good", "ship it"]
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "resume", "resume"]


def test_the_same_patch_three_times_resumes_exactly_once(flows: Flows) -> None:
    flows.apply("thrice", {"flowRef": "a:Review", "inputs": paused_then({"sleep": 2})})
    flows.wait_phase("thrice", "AwaitingFeedback")
    results = [flows.patch_status("thrice", answer("approved")) for _ in range(3)]
    assert results[0][0] == 0
    st = flows.wait_phase("thrice", "Succeeded")
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "resume"]
    assert len(st["feedback"]["history"]) == 1
    for rc, out in results[1:]:
        assert rc == 0 or "nothing" in out or "no feedback request is pending" in out


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        (answer("approved", "req-stale"), "requestId 'req-stale' is not the pending request 'req-1'"),
        (answer("   "), "response.text must be a non-empty string"),
        ({"status": {"feedback": {"response": {"txt": "typo"}}}}, "unknown field"),
        ({"status": {"phase": "Succeeded"}},
         "only status.feedback.response and status.conversation.inbox may be written by users"),
    ],
)
def test_bad_answers_are_refused_at_patch_time_and_the_request_stays(
        flows: Flows, patch: dict[str, Any], expected: str) -> None:
    flows.apply("picky", {"flowRef": "a:Review", "inputs": paused_then({})})
    flows.wait_phase("picky", "AwaitingFeedback")
    rc, out = flows.patch_status("picky", patch)
    assert rc != 0 and expected in out, out
    st = flows.status("picky")
    assert st["phase"] == "AwaitingFeedback" and st["feedback"]["request"]["id"] == "req-1"
    assert "response" not in st["feedback"]
    assert flows.patch_status("picky", answer("fine"))[0] == 0
    flows.wait_phase("picky", "Succeeded")


def test_answer_while_running_is_refused(flows: Flows) -> None:
    flows.apply("busy", {"flowRef": "a:B", "inputs": {"plan": [{"sleep": 30}]}})
    flows.wait_phase("busy", "Running")
    rc, out = flows.patch_status("busy", answer("approved"))
    assert rc != 0 and "no feedback request is pending" in out
    assert len(flows.status("busy")["runs"]) == 1


def test_timeout_resumes_with_the_default_outcome(flows: Flows) -> None:
    flows.apply("lazy", {"flowRef": "a:Review", "feedback": {"timeoutSeconds": 2},
                         "inputs": paused_then({}, default="approved")})
    st = flows.wait_phase("lazy", "Succeeded", timeout=60)
    (h,) = st["feedback"]["history"]
    assert h["timedOut"] is True and h["outcome"] == "approved"
    assert '"timedOut":true' in st["runs"][1]["message"]


def test_timeout_without_default_fails(flows: Flows) -> None:
    flows.apply("stuck", {"flowRef": "a:Review", "feedback": {"timeoutSeconds": 2}, "inputs": paused_then({})})
    st = flows.wait_phase("stuck", "Failed", timeout=60)
    assert next(c for c in st["conditions"] if c["type"] == "Succeeded")["reason"] == "FeedbackTimedOut"
    assert len(st["runs"]) == 1


def test_operator_restarts_while_waiting_and_while_an_answer_sits_in_the_inbox(
        flows: Flows, operator: ChartOperator) -> None:
    flows.apply("patient", {"flowRef": "a:Review", "inputs": paused_then({})})
    flows.wait_phase("patient", "AwaitingFeedback")
    operator.kill()
    operator.start()
    st = flows.wait_phase("patient", "AwaitingFeedback")
    assert st["feedback"]["request"]["id"] == "req-1"

    operator.kill()  # the answer arrives while nobody is there to process it (webhook down: Ignore)
    rc, out = flows.patch_status("patient", answer("approved"))
    assert rc == 0, out
    assert flows.status("patient")["feedback"]["response"]["text"] == "approved"
    operator.start()
    st = flows.wait_phase("patient", "Succeeded")
    assert [r["trigger"] for r in st["runs"]] == ["kickoff", "resume"]
    assert st["feedback"]["history"][0]["response"] == "approved"
    assert json.dumps(st).count("req-1") >= 1


def test_kubectl_flow_plugin_answers_and_shows_the_flow(flows: Flows, cluster: LocalCluster) -> None:
    import os
    import subprocess

    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig), "KUBECTL": str(cluster.bins["kubectl"])}

    def plugin(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "flowkube_kubectl", "-n", flows.ns, *args],
                              capture_output=True, text=True, env=env, timeout=60)

    flows.apply("plug", {"flowRef": "a:Review", "inputs": paused_then({"tokens": 1})})
    flows.wait_phase("plug", "AwaitingFeedback")
    shown = plugin("get", "plug")
    assert shown.returncode == 0 and "Publish this draft?" in shown.stdout and "req-1" in shown.stdout
    stale = plugin("feedback", "plug", "approved", "--request-id", "nope")
    assert stale.returncode != 0 and "is not the pending request" in stale.stderr
    assert plugin("feedback", "plug", "approved", "--request-id", "req-1").returncode == 0
    flows.wait_phase("plug", "Succeeded")
    assert "Usage: 3 tokens" in plugin("get", "plug").stdout


def test_without_the_webhook_a_bad_answer_is_refused_later_and_the_request_stays(
        flows: Flows, operator: ChartOperator) -> None:
    flows.apply("offline", {"flowRef": "a:Review", "inputs": paused_then({})})
    flows.wait_phase("offline", "AwaitingFeedback")
    operator.kill()  # the status webhooks fail open (Ignore): the stale answer gets into the inbox
    rc, out = flows.patch_status("offline", answer("approved", "req-stale"))
    assert rc == 0, out
    operator.start()
    st = flows.wait("offline", lambda s: "response" not in (s.get("feedback") or {}), "the inbox to be emptied")
    assert st["phase"] == "AwaitingFeedback" and st["feedback"]["request"]["id"] == "req-1"
    awaiting = next(c for c in st["conditions"] if c["type"] == "AwaitingFeedback")
    assert "refused" in awaiting["message"] and "req-stale" in awaiting["message"]
    def refusal_event() -> bool:
        return bool(flows.cluster.kubectl(
            "get", "events", "-n", flows.ns, "--field-selector",
            "involvedObject.name=offline,reason=FeedbackRefused,type=Warning", "-o", "name").stdout.strip())

    wait_for(refusal_event, 30, "a Warning Event recording the refusal")
    assert flows.patch_status("offline", answer("approved", "req-1"))[0] == 0
    st = flows.wait_phase("offline", "Succeeded")
    assert [h["requestId"] for h in st["feedback"]["history"]] == ["req-1"]
