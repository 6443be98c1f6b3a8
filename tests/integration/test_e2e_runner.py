"""End to end with the REAL runner: crewAI flows in runner pods on the local stack.

Operator, admission webhook, the definition validator (``flowkube-runner validate-server``), the
local node running ``flowkube-runner`` as the pods' user, and a stub model whose ledger is the
truth the flows' ``status.usage`` must equal.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster
from tests.integration.conftest import Flows
from tests.integration.realrunner import MODEL, RealRunnerStack, real_runner_stack

pytestmark = pytest.mark.slow

DRAFT = "Operators reconcile desired state."
PUBLISHED = "Published: operators, reconciled."
RULES = {
    "default": "A plain reply.",
    "rules": [
        {"contains": "DRAFT about", "reply": DRAFT},
        {"contains": "PUBLISH", "reply": PUBLISHED},
        # crewAI asks the step's model to map the human's words onto one of the outcomes.
        {"contains": "approved", "anywhere": True, "reply": "approved"},
    ],
}
WRITER = {"role": "Writer", "goal": "Write clearly", "backstory": "A careful writer.", "settings": {"llm": MODEL}}
RUN_TIMEOUT = 180  # a runner pod imports crewAI (seconds on a busy machine) before its first call


def review_definition() -> dict[str, Any]:
    return {
        "schema": "crewai.flow/v1",
        "name": "ReviewedArticle",
        "state": {"type": "dict", "default": {"topic": "operators"}},
        "methods": {
            "draft": {"start": True,
                      "do": {"call": "agent", "with": {**WRITER, "input": "DRAFT about ${state.topic}"}}},
            "review": {
                "listen": "draft",
                "do": {"call": "expression", "expr": "outputs.draft.raw"},
                "human_feedback": {"message": "Publish this draft?", "emit": ["approved", "rejected"],
                                   "default_outcome": "rejected", "llm": MODEL},
            },
            "publish": {"listen": "approved",
                        "do": {"call": "agent", "with": {**WRITER, "input": "PUBLISH ${outputs.draft.raw}"}}},
            "shelve": {"listen": "rejected", "do": {"call": "expression", "expr": "'shelved'"}},
        },
    }


LOOP = {"name": "Loop", "methods": {"again": {"start": True, "listen": "again",
                                              "do": {"call": "expression", "expr": "1"}}}}
LOOP_MESSAGE = "A listener triggered by its own completion creates an infinite loop"


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[RealRunnerStack]:
    with real_runner_stack(cluster, RULES, "e2e") as s:
        yield s


def usage_of(status: dict[str, Any]) -> Usage:
    return Usage.model_validate(status["usage"])


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == ctype)


def test_inline_definition_pauses_for_feedback_and_resumes_on_a_raw_status_patch(
        stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("review", {"definition": review_definition(), "feedback": {"timeoutSeconds": 3600}})

    st = flows.wait_phase("review", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    req = st["feedback"]["request"]
    assert (req["method"], req["message"]) == ("review", "Publish this draft?")
    assert req["emit"] == ["approved", "rejected"] and req["defaultOutcome"] == "rejected"
    assert req["output"] == DRAFT and req["id"] and req["deadline"]
    assert st["runs"][0]["result"] == "Paused" and st["flowId"]

    # Exactly the documented command, as a user types it.
    stack.cluster.kubectl("patch", "flow", "review", "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')

    st = flows.wait_phase("review", "Succeeded", timeout=RUN_TIMEOUT)
    assert [(r["trigger"], r["result"]) for r in st["runs"]] == [("kickoff", "Paused"), ("resume", "Succeeded")]
    assert st["result"]["output"] == PUBLISHED  # publish read ${outputs.draft.raw} from before the pause
    (answered,) = st["feedback"]["history"]
    assert (answered["requestId"], answered["response"], answered["method"]) == (req["id"], "approved", "review")
    assert "request" not in st["feedback"]
    assert any("PUBLISH " + DRAFT in e["lastUser"] for e in stack.stub.ledger()[mark:])

    ledger = stack.usage_since(mark)
    assert usage_of(st) == ledger, "status.usage must equal what the model served, each call once"
    assert set(st["usage"]["byModel"]) == {MODEL}
    assert sum(usage_of({"usage": r["usage"]}).successful_requests for r in st["runs"]) == ledger.successful_requests


def test_class_flow_by_reference(stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("article", {"flowRef": "flowkube_runner.examples.article:ArticleFlow",
                            "inputs": {"topic": "cats"}})
    st = flows.wait_phase("article", "Succeeded", timeout=RUN_TIMEOUT)
    assert st["definition"] == "ArticleFlow"
    assert st["result"]["output"] == "A plain reply."
    assert usage_of(st) == stack.usage_since(mark) and usage_of(st).successful_requests == 2
    assert "cats" in stack.stub.ledger()[mark]["lastUser"]


def test_invalid_definition_is_refused_at_apply_time_with_crewais_message(
        stack: RealRunnerStack, flows: Flows) -> None:
    obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "loop"},
           "spec": {"definition": LOOP}}
    out = stack.cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(obj), check=False)
    assert out.returncode != 0, f"admitted: {out.stdout}"
    assert "spec.definition.methods.again.listen" in out.stderr and LOOP_MESSAGE in out.stderr, out.stderr
    assert flows.get("loop") is None


def test_without_the_validator_an_invalid_definition_fails_once_and_is_not_retried(
        stack: RealRunnerStack, flows: Flows) -> None:
    with stack.validator_down():
        flows.apply("loop", {"definition": LOOP, "retries": {"limit": 3, "backoffSeconds": 0}})
        st = flows.wait_phase("loop", "Failed", timeout=RUN_TIMEOUT)
    assert cond(st, "Accepted")["status"] == "False", json.dumps(st, indent=1)
    assert cond(st, "Accepted")["reason"] == cond(st, "Succeeded")["reason"] == "InvalidDefinition"
    assert LOOP_MESSAGE in st["message"] and "methods.again.listen" in st["message"]
    (run,) = st["runs"]
    assert (run["result"], run["reason"], run["exitCode"]) == ("Failed", "InvalidDefinition", 2)
    assert len(flows.pods("loop")) <= 1
