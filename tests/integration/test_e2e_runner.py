"""End to end with the REAL runner: crewAI flows in runner pods on the local stack.

Operator, admission webhook, the definition validator (``flowkube-runner validate-server``), the
local node running ``flowkube-runner`` as the pods' user, and a stub model whose ledger is the
truth the flows' ``status.usage`` must equal.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flowkube_api.base import money_text
from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.jaeger import Jaeger
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, ledger_cost, ledger_usage
from flowkube_runner.__main__ import STOP_LOG
from tests.definitions import crew_definition, part_rules, parts_of
from tests.integration.conftest import Flows, require_last_in_module
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
        {"contains": "shelve it", "anywhere": True, "reply": "rejected"},  # (its prompt lists "approved" too)
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


ARTICLE_FLOW = "flowkube_runner.examples.article:ArticleFlow"
LOOP = {"name": "Loop", "methods": {"again": {"start": True, "listen": "again",
                                              "do": {"call": "expression", "expr": "1"}}}}
LOOP_MESSAGE = "A listener triggered by its own completion creates an infinite loop"


RECOVERY_SECONDS = 6


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster, jaeger: Jaeger) -> Iterator[RealRunnerStack]:
    # FlowQuotas enforced: every runner pod of this module reserves each model request at the operator
    # first, so every exactness test here holds with the quota gate in the path.
    # recoverySeconds 6: runner pods remind the leader of their calls in flight every 2 s (a third).
    # Traced to the lane's Jaeger: every test here runs with tracing on, some read their trace back.
    values = ["quotas.enabled=true", "quotas.statusSeconds=0.5", f"quotas.recoverySeconds={RECOVERY_SECONDS}"]
    with real_runner_stack(cluster, RULES, "e2e", values=values, jaeger=jaeger) as s:
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

    # One trace for the pause, the person's wait and the resume in a new pod, in that order.
    spans = stack.one_trace(st)
    (paused,), (wait,), (resumed,) = spans["run 0 kickoff"], spans["wait_for_feedback review"], spans["run 1 resume"]
    assert paused.end_us <= wait.end_us <= resumed.start_us + 1_000_000, "the wait sits between the two runs"
    assert wait.tags["flowkube.feedback.request_id"] == req["id"] and wait.tags["flowkube.feedback.outcome"] == (
        "approved")
    workflows = spans["invoke_workflow ReviewedArticle"]
    assert sorted(sp.parent_id for sp in workflows if sp.service == "flowkube-runner") == sorted(
        [paused.span_id, resumed.span_id]), "each pod's crewAI spans under its run"


def test_a_warm_paused_pod_takes_the_answer_and_resumes_in_its_own_process(
        stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("warm-review", {"definition": review_definition(), "feedback": {"keepWarmSeconds": 600}})
    st = flows.wait_phase("warm-review", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    assert "finishedAt" not in st["runs"][0], "the paused pod waits warm: its run goes on"
    pods = [p["metadata"]["name"] for p in flows.pods("warm-review")]
    stack.cluster.kubectl("patch", "flow", "warm-review", "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
    st = flows.wait_phase("warm-review", "Succeeded", timeout=RUN_TIMEOUT)
    assert [(r["trigger"], r["result"]) for r in st["runs"]] == [("kickoff", "Succeeded")], "one pod, one run"
    assert [p["metadata"]["name"] for p in flows.pods("warm-review")] == pods
    assert st["result"]["output"] == PUBLISHED
    assert st["feedback"]["history"][0]["outcome"] == "approved"
    assert usage_of(st) == stack.usage_since(mark), "the draft, the answer's collapse and publish, once each"
    spans = stack.one_trace(st)
    (run,), (wait,) = spans["run 0 kickoff"], spans["wait_for_feedback review"]
    steps = [sp for sp in spans["invoke_workflow ReviewedArticle"] if sp.service == "flowkube-runner"]
    assert [sp.parent_id for sp in steps] == [run.span_id] * 2, "the warm pod's two steps, under its one run"
    assert run.start_us <= wait.start_us <= wait.end_us <= run.end_us


def spans_counted(operator: ChartOperator) -> dict[tuple[str, str], float]:
    """flowkube_operator_trace_spans_total by (source, result), from the operator's /metrics."""
    return {(sample.labels["source"], sample.labels["result"]): sample.value
            for family in text_string_to_metric_families(operator.metrics())
            if family.name == "flowkube_operator_trace_spans" for sample in family.samples
            if sample.name.endswith("_total")}


def test_with_the_collector_down_a_flow_runs_as_ever_and_its_lost_spans_are_counted(
        stack: RealRunnerStack, flows: Flows, jaeger: Jaeger) -> None:
    """Jaeger stopped (the collector's port refuses): the Flow runs and counts as ever; what could not be
    sent is counted, the pod's in its run (status.runs[0].spansLost) and both in the operator's metric."""
    before = spans_counted(stack.operator)
    mark = len(stack.stub.ledger())
    jaeger.stop()
    try:
        flows.apply("untraced", {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}})
        st = flows.wait_phase("untraced", "Succeeded", timeout=RUN_TIMEOUT)
        assert usage_of(st) == stack.usage_since(mark)
        assert st["runs"][0].get("spansLost", 0) > 0, st["runs"][0]
        lost = ("queue_full", "export_failed", "unflushed")

        def counted() -> bool:
            now = spans_counted(stack.operator)
            return (now.get(("runner", "lost"), 0) > before.get(("runner", "lost"), 0)
                    and sum(now.get(("operator", r), 0) for r in lost) > sum(before.get(("operator", r), 0)
                                                                             for r in lost))

        wait_for(counted, 60, "the runner's and the operator's lost spans in the metric")
    finally:
        jaeger.start()


def test_class_flow_by_reference(stack: RealRunnerStack, flows: Flows) -> None:
    mark = len(stack.stub.ledger())
    flows.apply("article", {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "cats"}})
    st = flows.wait_phase("article", "Succeeded", timeout=RUN_TIMEOUT)
    assert st["definition"] == "ArticleFlow"
    assert st["result"]["output"] == "A plain reply."
    assert usage_of(st) == stack.usage_since(mark) and usage_of(st).successful_requests == 2
    assert "cats" in stack.stub.ledger()[mark]["lastUser"]
    # Spend: each call the model served, its tokens priced by the genai-prices table at the time
    # (cached prompt tokens at the cache-read price), summed exactly, to the last decimal place.
    served = stack.stub.ledger()[mark:]
    costs = [cost for e in served if (cost := ledger_cost(e)) is not None]
    assert len(costs) == len(served) == 2 and all(cost > 0 for cost in costs)
    spent = money_text(sum(costs, Decimal(0)))
    assert (st["usage"]["cost"], st["usage"]["currency"], st["usage"]["unpricedTokens"]) == (spent, "USD", 0)
    assert st["usage"]["byModel"][MODEL]["cost"] == spent and st["runs"][0]["usage"]["cost"] == spent


def test_a_runner_pod_that_cannot_start_is_explained_in_the_flows_status(stack: RealRunnerStack, flows: Flows) -> None:
    """The real scheduler and kubelet's reasons reach `kubectl get flows`: no silent Pending."""
    flows.apply("too-big", {"flowRef": ARTICLE_FLOW, "resources": {"requests": {"cpu": "64"}}})
    flows.apply("no-secret", {"flowRef": ARTICLE_FLOW, "envFrom": [{"secretRef": {"name": "model-key"}}]})
    st = flows.wait("too-big", lambda s: has_condition(s, "Running", "Unschedulable"), "the scheduler's reason",
                    timeout=60)
    assert st["phase"] == "Pending" and "Insufficient cpu" in st["message"], st["message"]
    st = flows.wait("no-secret", lambda s: has_condition(s, "Running", "CreateContainerConfigError"),
                    "the kubelet's reason", timeout=60)
    assert st["phase"] == "Pending" and 'secret "model-key" not found' in st["message"], st["message"]


def has_condition(status: dict[str, Any], ctype: str, reason: str) -> bool:
    return any(c["type"] == ctype and c["reason"] == reason for c in status.get("conditions") or [])


def test_invalid_definition_is_refused_at_apply_time_with_crewais_message(
        stack: RealRunnerStack, flows: Flows) -> None:
    obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "loop"},
           "spec": {"definition": LOOP}}
    out = stack.cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps(obj), check=False)
    assert out.returncode != 0, f"admitted: {out.stdout}"
    assert "spec.definition.methods.again.listen" in out.stderr and LOOP_MESSAGE in out.stderr, out.stderr
    assert flows.get("loop") is None


def test_a_pod_deleted_during_a_model_call_reports_the_call_and_a_retry_finishes_the_flow(
        stack: RealRunnerStack, flows: Flows) -> None:
    """``kubectl delete pod`` (30 s grace, as a drain or an eviction) while each flow's first model call
    is in flight: the runner lets the call finish, starts no new one, reports it and exits retryable.
    ``graceful`` has retries and finishes on its next run without calling the model for the completed
    step again; ``graceful-once`` has none. Each Flow's usage must equal the calls the model served it.
    (One test for both: the stub releases held calls once, for good.)"""
    topics = {"graceful": "dogs", "graceful-once": "owls"}
    # Each topic's draft reply names it, so the summarize call that follows is the flow's too.
    held = [{"contains": f"draft about {t}.", "hold": True, "times": 1, "reply": f"A draft on {t}."}
            for t in topics.values()]
    stack.stub.set_rules(Rules.from_json({**RULES, "rules": [*held, *RULES["rules"]]}))
    mark = len(stack.stub.ledger())
    try:
        flows.apply("graceful", {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "dogs"},
                                 "retries": {"limit": 1, "backoffSeconds": 0}})
        flows.apply("graceful-once", {"flowRef": ARTICLE_FLOW, "inputs": {"topic": "owls"}})
        assert stack.stub.wait_held(2, timeout=RUN_TIMEOUT), "both flows' first model calls should be held"
        pods = [flows.status(name)["runs"][0]["pod"] for name in topics]
        for pod in pods:
            stack.cluster.kubectl("delete", "pod", pod, "-n", flows.ns, "--wait=false")

        def took_sigterm(pod: str) -> bool:
            out = stack.cluster.kubectl("logs", pod, "-n", flows.ns, check=False)
            return STOP_LOG in out.stdout + out.stderr

        for pod in pods:  # the kubelet's SIGTERM reached the runner while its call was still held
            wait_for(functools.partial(took_sigterm, pod), 60, f"runner pod {pod} to take the SIGTERM")
    finally:
        stack.stub.release_held()
        stack.stub.set_rules(Rules.from_json(RULES))

    st = flows.wait_phase("graceful", "Succeeded", timeout=RUN_TIMEOUT)
    once = flows.wait("graceful-once", lambda s: s.get("phase") in ("Succeeded", "Failed"), "an end",
                      timeout=RUN_TIMEOUT)
    served = stack.stub.ledger()[mark:]
    for name, status in (("graceful", st), ("graceful-once", once)):
        calls = [e for e in served if topics[name] in e["lastUser"]]
        stopped = status["runs"][0]
        assert usage_of({"usage": stopped["usage"]}) == ledger_usage(calls[:1]), json.dumps(status, indent=1)
        assert usage_of(status) == ledger_usage(calls), f"{name}: each answered call counted once"
    drafts = [e for e in served if "Write a short draft about dogs" in e["lastUser"]]
    assert len(drafts) == 1, "the retry must not call the model for the step completed before the stop"
    assert [r["result"] for r in st["runs"]] == ["Failed", "Succeeded"], json.dumps(st, indent=1)
    assert st["result"]["output"] == "A plain reply."
    # The lost run and its retry are one trace; the call the stopped pod finished is in it, counted once.
    spans = stack.one_trace(st)
    assert {sp.tags["flowkube.run.result"] for sp in spans["run 0 kickoff"] + spans["run 1 retry"]} == {
        "Failed", "Succeeded"}
    # Without retries the operator decides (issue 16: a disruption should not fail the flow).
    print(f"graceful-once ended {once['phase']} ({once.get('reason')}): {once.get('message')}; "
          f"runs: {[(r['result'], r.get('reason'), r.get('exitCode')) for r in once['runs']]}; graceful's runs: "
          f"{[(r['result'], r.get('reason'), r.get('exitCode')) for r in st['runs']]}")


def test_a_pod_lost_during_a_crews_third_task_is_retried_without_paying_tasks_one_and_two(
        stack: RealRunnerStack, flows: Flows) -> None:
    """One step runs a four-task crew; its pod is force-deleted (no grace: the call in flight is lost
    with it) while task 3 waits for the model. The retry calls the model for tasks 3 and 4 only, task 4
    reads what tasks 1 and 2 wrote, and ``status.usage`` equals the calls the model answered the pods."""
    stack.stub.arm_holds()
    stack.stub.set_rules(Rules.from_json({**RULES, "rules": [{"contains": "PART3 of", "hold": True, "times": 1},
                                                             *part_rules(), *RULES["rules"]]}))
    mark = len(stack.stub.ledger())
    try:
        flows.apply("crew-lost", {"definition": crew_definition(WRITER),
                                  "retries": {"limit": 1, "backoffSeconds": 0}})
        assert stack.stub.wait_held(1, timeout=RUN_TIMEOUT), "task 3's model call should be held"
        pod = flows.status("crew-lost")["runs"][0]["pod"]
        stack.cluster.kubectl("delete", "pod", pod, "-n", flows.ns, "--grace-period=0", "--force", "--wait=false")
        st = flows.wait_phase("crew-lost", "Succeeded", timeout=RUN_TIMEOUT)
        # Read before the held call is let go: the model never answered it (its pod is gone).
        served = stack.stub.ledger()[mark:]
    finally:
        stack.stub.release_held()
        stack.stub.set_rules(Rules.from_json(RULES))
    assert parts_of(served) == ["PART1", "PART2", "PART3", "PART4"], "tasks 1 and 2 are not paid again"
    assert "fact-1" in served[-1]["lastUser"] and "fact-2" in served[-1]["lastUser"], "task 4 reads their outputs"
    lost, retried = st["runs"]
    assert lost["result"] == "Failed" and retried["result"] == "Succeeded", json.dumps(st, indent=1)
    assert usage_of({"usage": retried["usage"]}) == ledger_usage(served[2:])
    assert usage_of(st) == ledger_usage(served), "each answered call counted once"
    assert st["result"]["output"] == "Part 4 says: fact-4."


# -- templates ---------------------------------------------------------------------------------------

def apply_object(stack: RealRunnerStack, obj: dict[str, Any], namespace: str | None = None,
                 check: bool = True) -> Any:
    args = ["apply", "-f", "-"] + (["-n", namespace] if namespace else [])
    return stack.cluster.kubectl(*args, input=json.dumps(obj), check=check)


def review_template(publish_input: str = "PUBLISH ${outputs.draft.raw}") -> dict[str, Any]:
    definition = review_definition()
    definition["methods"]["publish"]["do"]["with"]["input"] = publish_input
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate", "metadata": {"name": "review"},
            "spec": {"description": "A draft a person approves before it is published.",
                     "parameters": [{"name": "topic", "required": True, "type": "string",
                                     "description": "what the draft is about"}],
                     "template": {"definition": definition, "feedback": {"timeoutSeconds": 3600}}}}


def test_a_flow_from_a_template_runs_its_parameters_and_a_template_change_does_not_change_it(
        stack: RealRunnerStack, flows: Flows) -> None:
    apply_object(stack, review_template(), flows.ns)
    mark = len(stack.stub.ledger())
    flows.apply("from-template", {"templateRef": {"name": "review"}, "inputs": {"topic": "templates"}})
    st = flows.wait_phase("from-template", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    taken = st["template"]
    assert (taken["kind"], taken["name"], taken["generation"]) == ("FlowTemplate", "review", 1)
    # Stored once, in a snapshot (a ControllerRevision in the Flow's namespace) the status names.
    assert "spec" not in taken and taken["snapshot"].startswith("review-") and len(taken["hash"]) == 64
    snapshot = json.loads(stack.cluster.kubectl("get", "controllerrevision", taken["snapshot"], "-n", flows.ns,
                                                "-o", "json").stdout)
    assert snapshot["data"]["generation"] == 1 and snapshot["data"]["spec"]["parameters"][0]["name"] == "topic"
    assert st["definition"] == "ReviewedArticle" and st["feedback"]["request"]["message"] == "Publish this draft?"
    assert "DRAFT about templates" in stack.stub.ledger()[mark]["lastUser"], "the parameter reached the flow"
    columns = stack.cluster.kubectl("get", "flow", "from-template", "-n", flows.ns).stdout
    assert "TEMPLATE" in columns.splitlines()[0] and "review" in columns.splitlines()[1], columns

    # The template changes while the Flow waits: its resume runs the template it started with.
    apply_object(stack, review_template("REWRITTEN ${outputs.draft.raw}"), flows.ns)
    template = json.loads(stack.cluster.kubectl("get", "flowtemplate", "review", "-n", flows.ns, "-o", "json").stdout)
    assert template["metadata"]["generation"] == 2
    flows.patch_status("from-template", {"status": {"feedback": {"response": {"text": "approved"}}}})
    st = flows.wait_phase("from-template", "Succeeded", timeout=RUN_TIMEOUT)
    assert st["result"]["output"] == PUBLISHED, "the resume ran generation 1's publish step"
    assert st["template"]["generation"] == 1 and st["template"]["snapshot"] == taken["snapshot"]
    assert not any("REWRITTEN" in e["lastUser"] for e in stack.stub.ledger()[mark:])
    assert usage_of(st) == stack.usage_since(mark), "status.usage equals what the model served, each call once"

    # A Flow made after the change runs the new generation.
    flows.apply("after-change", {"templateRef": {"name": "review"}, "inputs": {"topic": "later"}})
    st = flows.wait_phase("after-change", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    assert st["template"]["generation"] == 2 and st["template"]["snapshot"] != taken["snapshot"]


def test_a_cluster_template_serves_every_namespace_and_bad_uses_are_refused_at_apply(
        stack: RealRunnerStack, flows: Flows) -> None:
    name = f"shared-article-{flows.ns[-6:]}"
    shared = {"apiVersion": "flowkube.io/v1alpha1", "kind": "ClusterFlowTemplate", "metadata": {"name": name},
              "spec": {"parameters": [{"name": "topic", "required": True, "type": "string"},
                                      {"name": "words", "type": "integer", "default": 300}],
                       "template": {"flowRef": ARTICLE_FLOW}}}
    apply_object(stack, shared)
    try:
        ref = {"name": name, "kind": "ClusterFlowTemplate"}

        def refused(spec: dict[str, Any], obj_name: str = "bad") -> str:
            obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": obj_name}, "spec": spec}
            out = apply_object(stack, obj, flows.ns, check=False)
            assert out.returncode != 0, f"admitted: {spec}"
            assert flows.get(obj_name) is None
            return str(out.stderr)

        assert f'spec.inputs.topic: required by ClusterFlowTemplate "{name}"' in refused({"templateRef": ref})
        assert "spec.inputs.words: must be integer" in refused({"templateRef": ref,
                                                                "inputs": {"topic": "t", "words": "many"}})
        assert "has no parameter 'topik'" in refused({"templateRef": ref, "inputs": {"topic": "t", "topik": 1}})
        assert 'spec.templateRef: FlowTemplate "nowhere"' in refused({"templateRef": {"name": "nowhere"}})
        assert "exactly one of spec.definition, spec.flowRef or spec.templateRef" in refused(
            {"templateRef": ref, "flowRef": ARTICLE_FLOW})
        bad_template: dict[str, Any] = {
                        "apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate", "metadata": {"name": "loop"},
                        "spec": {"parameters": [{"name": "n", "type": "integer", "default": "three"}],
                                 "template": {"definition": LOOP}}}
        out = apply_object(stack, bad_template, flows.ns, check=False)
        assert out.returncode != 0 and "spec.parameters[n].default: must be integer" in out.stderr, out.stderr
        del bad_template["spec"]["parameters"]
        out = apply_object(stack, bad_template, flows.ns, check=False)
        assert out.returncode != 0 and "spec.template.definition.methods.again.listen" in out.stderr, out.stderr

        mark = len(stack.stub.ledger())
        flows.apply("shared", {"templateRef": ref, "inputs": {"topic": "dogs"}})
        st = flows.wait_phase("shared", "Succeeded", timeout=RUN_TIMEOUT)
        assert st["definition"] == "ArticleFlow" and st["template"]["kind"] == "ClusterFlowTemplate"
        assert "dogs" in stack.stub.ledger()[mark]["lastUser"]
        assert usage_of(st) == stack.usage_since(mark)
        # The template names the Flow's template for good: a Flow cannot be moved to another one.
        patch = json.dumps({"spec": {"templateRef": {"name": "review"}}})
        out = stack.cluster.kubectl("patch", "flow", "shared", "-n", flows.ns, "--type=merge", "-p", patch, check=False)
        assert out.returncode != 0 and "spec.templateRef is immutable" in out.stderr, out.stderr
    finally:
        stack.cluster.kubectl("delete", "clusterflowtemplate", name, "--ignore-not-found", check=False)


def test_forks_start_from_checkpoints_with_an_edit_or_the_other_answer_and_outlive_their_origin(
        stack: RealRunnerStack, flows: Flows) -> None:
    """The origin drafts, pauses at its review, is approved and publishes. A fork after `draft` with the
    draft edited publishes the edited text; a fork at the pause, answered the other way, shelves, after
    its origin is deleted. Nothing before a checkpoint is called again; each usage is its own calls."""
    spec: dict[str, Any] = {"definition": review_definition(), "feedback": {"timeoutSeconds": 3600}}
    mark = len(stack.stub.ledger())
    flows.apply("origin", spec)
    flows.wait_phase("origin", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    stack.cluster.kubectl("patch", "flow", "origin", "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
    origin = flows.wait_phase("origin", "Succeeded", timeout=RUN_TIMEOUT)
    assert usage_of(origin) == stack.usage_since(mark)
    index = [(e["id"], e["kind"], e["method"]) for e in origin["checkpoints"]]
    assert index == [(1, "Completed", "draft"), (2, "Paused", "review"), (3, "Completed", "review"),
                     (4, "Completed", "publish")]
    after_draft = origin["checkpoints"][0]["usage"]["totalTokens"]
    assert after_draft == ledger_usage(stack.stub.ledger()[mark:mark + 1]).total_tokens
    ring = json.loads(stack.cluster.kubectl("get", "configmaps", "-n", flows.ns, "-l",
                                            "flowkube.io/flow=origin,flowkube.io/component=checkpoint",
                                            "-o", "json").stdout)["items"]
    assert len(ring) == 4 and all(cm["metadata"]["ownerReferences"][0]["name"] == "origin" for cm in ring)

    # A fork of a Flow the person may not read is refused at apply (a fork copies the origin's state).
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": "fork-only"},
            "rules": [{"apiGroups": ["flowkube.io"], "resources": ["flows"], "verbs": ["create"]}]}
    binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": "bob"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "fork-only"},
               "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "bob"}]}
    for obj in (role, binding):
        apply_object(stack, obj, flows.ns)
    # (A flowRef and nothing else: a spec the webhook's matchConditions let through unless it forks.)
    fork = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "bobs"},
            "spec": {"flowRef": ARTICLE_FLOW, "forkFrom": {"name": "origin", "checkpoint": 1}}}
    refused = stack.cluster.kubectl("create", "-n", flows.ns, "--as=bob", "-f", "-", input=json.dumps(fork),
                                    check=False)
    assert refused.returncode != 0 and "may not get Flow" in refused.stderr and "origin" in refused.stderr
    assert flows.get("bobs") is None

    # Fork after `draft`, with the draft edited: the review shows the edit, publish polishes it.
    mark = len(stack.stub.ledger())
    uid = stack.cluster.kubectl("get", "flow", "origin", "-n", flows.ns, "-o", "jsonpath={.metadata.uid}").stdout
    flows.apply("edited", {**spec, "forkFrom": {"name": "origin", "uid": uid, "checkpoint": 1,
                                                "outputs": {"draft": "EDITED facts."}}})
    st = flows.wait_phase("edited", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    assert st["feedback"]["request"]["output"] == "EDITED facts."
    assert st["forkedFrom"] == {"namespace": flows.ns, "name": "origin", "uid": uid, "checkpoint": 1,
                                "method": "draft", "kind": "Completed"}
    assert st["inheritedUsage"]["totalTokens"] == after_draft and st["runs"][0]["trigger"] == "fork"
    stack.cluster.kubectl("patch", "flow", "edited", "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
    st = flows.wait_phase("edited", "Succeeded", timeout=RUN_TIMEOUT)
    calls = stack.stub.ledger()[mark:]
    assert not any("DRAFT about" in call["lastUser"] for call in calls), "nothing before the checkpoint again"
    assert any("PUBLISH EDITED facts." in call["lastUser"] for call in calls)
    assert usage_of(st) == stack.usage_since(mark), "the fork counts its own calls, once"
    assert usage_of(flows.status("origin")) == usage_of(origin), "the origin is unchanged"

    # Fork at the pause; the origin is deleted; answered the other way, it takes the other branch.
    mark = len(stack.stub.ledger())
    flows.apply("other-way", {**spec, "forkFrom": {"name": "origin", "checkpoint": 2}})
    st = flows.wait_phase("other-way", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    assert st["feedback"]["request"]["output"] == DRAFT and len(stack.stub.ledger()) == mark
    stack.cluster.kubectl("delete", "flow", "origin", "-n", flows.ns)
    stack.cluster.kubectl("patch", "flow", "other-way", "-n", flows.ns, "--subresource=status", "--type=merge",
                          "-p", '{"status":{"feedback":{"response":{"text":"shelve it"}}}}')
    st = flows.wait_phase("other-way", "Succeeded", timeout=RUN_TIMEOUT)
    assert st["result"]["output"] == "shelved" and st["feedback"]["history"][0]["outcome"] == "rejected"
    assert usage_of(st) == stack.usage_since(mark)


# -- spend quotas (issue 41) -------------------------------------------------------------------------

CAPPED_WRITER = {**WRITER, "settings": {"llm": {"model": MODEL, "max_tokens": 64}}}


def quota_object(name: str, max_tokens: int, team: str) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowQuota", "metadata": {"name": name},
            "spec": {"selector": {"matchLabels": {"team": team}},
                     "limits": [{"name": "tokens", "maxTotalTokens": max_tokens,
                                 "window": {"kind": "Day", "timeZone": "Europe/Berlin"}}]}}


def labelled_flow(name: str, team: str | None, topic: str) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow",
            "metadata": {"name": name, **({"labels": {"team": team}} if team else {})},
            "spec": {"definition": crew_definition(CAPPED_WRITER, 4), "inputs": {"topic": topic}}}


def quota_status(stack: RealRunnerStack, namespace: str, name: str) -> dict[str, Any]:
    quota = stack.cluster.get(f"/apis/flowkube.io/v1alpha1/namespaces/{namespace}/flowquotas/{name}")
    status: dict[str, Any] = (quota or {}).get("status") or {}
    return status


def wait_quota(stack: RealRunnerStack, namespace: str, name: str, predicate: Any, what: str) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    def check() -> bool:
        seen.clear()
        seen.update(quota_status(stack, namespace, name))
        return bool(predicate(seen))

    wait_for(check, 60, f"FlowQuota {name}: {what}", interval=0.2)
    return seen


def test_a_flowquota_stops_a_flow_at_the_call_that_would_pass_it_and_counts_what_the_model_served(
        stack: RealRunnerStack, flows: Flows) -> None:
    """A probe Flow (its own generous quota) shows what each of a four-call crew's requests weighs; a
    second quota is set to let two such calls through and not the third's worst case. The capped Flow
    makes exactly two calls, ends QuotaExhausted naming the quota, its limit and reset; the quota's
    used equals the stub's ledger and nothing stays reserved. A Flow outside the selector is not held.
    With the limit then set just above what was used, the next Flow of the team makes no call at all."""
    ns = flows.ns
    example = Path(__file__).resolve().parents[2] / "examples" / "quotas" / "team-quota.yaml"
    stack.cluster.kubectl("apply", "--dry-run=server", "-n", ns, "-f", str(example))  # the documented example
    bad = quota_object("bad", 10, "x")
    bad["spec"]["limits"][0]["window"] = {"kind": "Rolling"}
    refused = apply_object(stack, bad, ns, check=False)
    assert refused.returncode != 0 and "window.hours is set for a Rolling window" in refused.stderr
    apply_object(stack, quota_object("probe", 10**9, "probe"), ns)
    wait_quota(stack, ns, "probe", lambda s: any(x["type"] == "Ready" and x["status"] == "True"
                                                 for x in s.get("conditions") or []), "Ready")
    mark = len(stack.stub.ledger())
    apply_object(stack, labelled_flow("probe", "probe", "probe"), ns)
    flows.wait_phase("probe", "Succeeded", timeout=RUN_TIMEOUT)
    probe = stack.stub.ledger()[mark:]
    assert parts_of(probe) == ["PART1", "PART2", "PART3", "PART4"] and all(e["maxTokens"] == 64 for e in probe)
    used = [e["usage"]["total_tokens"] for e in probe]
    worst = [e["bytes"] + 64 for e in probe]
    assert all(w > u for w, u in zip(worst, used, strict=True))
    wait_quota(stack, ns, "probe", lambda s: s["limits"][0]["used"].get("totalTokens") == sum(used), "probe's use")

    # "quota" is as long as "probe": the capped Flow's requests weigh what the probe's did.
    limit = used[0] + used[1] + worst[2] - 1
    apply_object(stack, quota_object("writers", limit, "writers"), ns)
    wait_quota(stack, ns, "writers", lambda s: any(x["type"] == "Ready" and x["status"] == "True"
                                                   for x in s.get("conditions") or []), "Ready")
    mark = len(stack.stub.ledger())
    capped_flow = labelled_flow("capped", "writers", "quota")
    capped_flow["spec"]["retries"] = {"limit": 2, "backoffSeconds": 0}  # a quota's refusal is not retried
    apply_object(stack, capped_flow, ns)
    apply_object(stack, labelled_flow("free", None, "freer"), ns)
    st = flows.wait_phase("capped", "Failed", timeout=RUN_TIMEOUT)
    flows.wait_phase("free", "Succeeded", timeout=RUN_TIMEOUT)
    served = stack.stub.ledger()[mark:]
    capped = [e for e in served if "about quota" in e["lastUser"]]
    assert parts_of(capped) == ["PART1", "PART2"], "the third call is not sent"
    assert parts_of([e for e in served if "about freer" in e["lastUser"]]) == ["PART1", "PART2", "PART3", "PART4"]
    assert cond(st, "Succeeded")["reason"] == "QuotaExhausted", json.dumps(st, indent=1)
    assert len(st["runs"]) == 1 and st["runs"][0]["reason"] == "QuotaExhausted", "not retried"
    assert st["message"].startswith(f"FlowQuota {ns}/writers: limit tokens (maxTotalTokens={limit}, per day in "
                                    "Europe/Berlin)"), st["message"]
    assert "the window resets at" in st["message"]
    assert usage_of(st) == ledger_usage(capped), "the Flow counts what the model served it"
    spent = ledger_usage(capped).total_tokens
    assert spent <= limit
    status = wait_quota(stack, ns, "writers", lambda s: s["limits"][0]["used"].get("totalTokens") == spent,
                        "the ledger's tokens")
    (tokens,) = status["limits"]
    assert tokens["reserved"].get("totalTokens", 0) == 0 and tokens["resetsAt"] and tokens["windowStart"]
    assert status["summary"] == f"tokens {100 * spent / limit:.0f}%"
    columns = stack.cluster.kubectl("get", "flowquota", "writers", "-n", ns).stdout
    assert f"tokens {100 * spent / limit:.0f}%" in columns and "RESETS" in columns

    # Room for less than any request weighs: the next Flow of the team is refused at its first call.
    patched = quota_object("writers", spent + 50, "writers")
    apply_object(stack, patched, ns)
    wait_quota(stack, ns, "writers", lambda s: s.get("summary") == f"tokens {100 * spent / (spent + 50):.0f}%",
               "the new limit")
    mark = len(stack.stub.ledger())
    apply_object(stack, labelled_flow("next", "writers", "later"), ns)
    nxt = flows.wait_phase("next", "Failed", timeout=RUN_TIMEOUT)
    assert cond(nxt, "Succeeded")["reason"] == "QuotaExhausted" and f"FlowQuota {ns}/writers" in nxt["message"]
    assert [e for e in stack.stub.ledger()[mark:] if "about later" in e["lastUser"]] == []
    assert usage_of(nxt).total_tokens == 0

    # Used up (the limit at what was used): a new Flow of the team is refused at apply (action Refuse)...
    used = wait_quota(stack, ns, "writers", lambda s: "limits" in s, "its use")["limits"][0]["used"]["totalTokens"]
    apply_object(stack, quota_object("writers", used, "writers"), ns)
    wait_quota(stack, ns, "writers", lambda s: any(x["type"] == "Exhausted" and x["status"] == "True"
                                                   for x in s.get("conditions") or []), "Exhausted")
    refused = apply_object(stack, labelled_flow("refused", "writers", "never"), ns, check=False)
    assert refused.returncode != 0 and "denied the request" in refused.stderr, refused.stderr
    assert f"FlowQuota {ns}/writers: limit tokens" in refused.stderr and "is exhausted" in refused.stderr
    assert "spec.action: Refuse" in refused.stderr
    # ... and with action Queue it is admitted and waits, Pending, until the limit is raised.
    queued_quota = quota_object("writers", used, "writers")
    queued_quota["spec"]["action"] = "Queue"
    apply_object(stack, queued_quota, ns)
    wait_for(lambda: apply_object(stack, labelled_flow("queued", "writers", "queue"), ns,
                                  check=False).returncode == 0, 30, "the Queue action to reach the webhook")
    held = flows.wait("queued", lambda s: cond(s, "Running").get("reason") == "QuotaExhausted" if s.get(
        "conditions") else False, "held by the quota")
    assert held["phase"] == "Pending" and not held.get("runs") and "is exhausted" in held["message"]
    assert not flows.pods("queued"), "no runner pod while the quota is used up"
    queued_quota["spec"]["limits"][0]["maxTotalTokens"] = 10**9
    apply_object(stack, queued_quota, ns)
    done = flows.wait_phase("queued", "Succeeded", timeout=RUN_TIMEOUT)
    assert [r["trigger"] for r in done["runs"]] == ["kickoff"]


BRANCHES = 6


def branches_flow(name: str, topic: str) -> dict[str, Any]:
    """Six agent calls at once (each a start method: crewAI runs them on threads, in parallel)."""
    methods = {f"branch_{i}": {"start": True, "do": {"call": "agent", "with": {
        **CAPPED_WRITER, "input": f"BRANCH{i} about ${{state.topic}}"}}} for i in range(1, BRANCHES + 1)}
    definition = {"schema": "crewai.flow/v1", "name": "Branches", "methods": methods,
                  "state": {"type": "dict", "default": {"topic": topic}}}
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name, "labels": {"team": "par"}},
            "spec": {"definition": definition}}


def test_parallel_calls_never_pass_a_quota_together_even_across_an_operator_sigkill(
        stack: RealRunnerStack, flows: Flows) -> None:
    """A model that bills every token a request allows (the stub's greedy rule: prompt = the body's
    bytes, answer = max_tokens), so a call uses exactly its reserved worst case W and an overspend
    would be real. Limit: 9 W. Flow alpha's six parallel calls are reserved and held at the model;
    the operator is SIGKILLed and comes back, and Flow bravo's six parallel calls ask while alpha's
    are still in flight, and stay in flight past the new leader's recovery (6 s): alpha's pod, in
    the middle of its calls, reminds the leader of what it holds (every 2 s), so exactly three of
    bravo's fit and bravo ends QuotaExhausted while alpha still waits. (Without the reminders the
    recovery ends with alpha unheard, and all six of bravo's are sent.) Released, alpha's calls are
    counted: the model served 9 W, the limit, not a token more; the quota's used equals the ledger,
    each Flow's usage its own calls."""
    ns = flows.ns
    greedy = [{"contains": "about alpha", "hold": True, "greedy": True, "reply": "Alpha branch."},
              {"contains": "BRANCH", "greedy": True, "reply": "A branch."}]
    stack.stub.set_rules(Rules.from_json({**RULES, "rules": [*greedy, *RULES["rules"]]}))
    stack.stub.arm_holds()
    try:
        # The probe: what one branch request weighs (topics of one length weigh the same).
        probe_quota = quota_object("probe", 10**9, "probe-par")
        apply_object(stack, probe_quota, ns)
        wait_quota(stack, ns, "probe", lambda s: s.get("summary") is not None, "Ready")
        mark = len(stack.stub.ledger())
        probe = branches_flow("probe", "gamma")
        probe["metadata"]["labels"]["team"] = "probe-par"
        apply_object(stack, probe, ns)
        flows.wait_phase("probe", "Succeeded", timeout=RUN_TIMEOUT)
        weights = {e["usage"]["total_tokens"] for e in stack.stub.ledger()[mark:]}
        assert len(weights) == 1, f"every branch request weighs the same: {weights}"
        (w,) = weights
        limit = 9 * w
        quota = quota_object("par", limit, "par")
        quota["spec"]["limits"][0]["window"] = {"kind": "Lifetime"}
        apply_object(stack, quota, ns)
        wait_quota(stack, ns, "par", lambda s: s.get("summary") == "tokens 0%", "Ready")

        mark = len(stack.stub.ledger())
        apply_object(stack, branches_flow("alpha", "alpha"), ns)
        assert stack.stub.wait_held(BRANCHES, timeout=RUN_TIMEOUT), "alpha's six calls should be in flight"
        wait_quota(stack, ns, "par", lambda s: s["limits"][0]["reserved"].get("totalTokens") == 6 * w,
                   "alpha's six reservations")
        stack.operator.kill()
        restarted = time.monotonic()
        stack.operator.start()
        apply_object(stack, branches_flow("bravo", "bravo"), ns)
        bravo = flows.wait_phase("bravo", "Failed", timeout=RUN_TIMEOUT)
        assert time.monotonic() - restarted > RECOVERY_SECONDS, "bravo asked after the recovery could have ended"
        assert not [e for e in stack.stub.ledger()[mark:] if "about alpha" in e["lastUser"]], "alpha still waits"
    finally:
        stack.stub.release_held()
    alpha = flows.wait_phase("alpha", "Succeeded", timeout=RUN_TIMEOUT)
    stack.stub.set_rules(Rules.from_json(RULES))
    served = stack.stub.ledger()[mark:]
    alpha_calls = [e for e in served if "about alpha" in e["lastUser"]]
    bravo_calls = [e for e in served if "about bravo" in e["lastUser"]]
    runs = [(r.get("reason"), (r.get("message") or "")[:300]) for r in bravo.get("runs") or []]
    assert (len(alpha_calls), len(bravo_calls)) == (6, 3), (
        f"six of alpha's and exactly three of bravo's fit 9 W; bravo: {bravo.get('message')}; runs {runs}\n"
        f"{stack.operator.diagnose()[-4000:]}\n--- bravo-0\n"
        f"{stack.cluster.kubectl('logs', 'bravo-0', '-n', ns, check=False).stdout[-3000:]}")
    assert cond(bravo, "Succeeded")["reason"] == "QuotaExhausted"
    spent = ledger_usage(served).total_tokens
    assert spent == limit, f"the model served {spent} tokens against a limit of {limit}"
    assert usage_of(alpha) == ledger_usage(alpha_calls) and usage_of(bravo) == ledger_usage(bravo_calls)
    stack.one_trace(alpha)  # its calls went on across the operator's SIGKILL: still one trace, root included
    # A settle carries the run's charges so far, which may hold a parallel call whose own settle is
    # still on its way: for that moment the call is counted in both used and reserved (never less).
    # What the quota ends with: the ledger's tokens used, nothing reserved.
    status = wait_quota(stack, ns, "par", lambda s: s["limits"][0]["used"].get("totalTokens") == spent
                        and s["limits"][0]["reserved"].get("totalTokens", 0) == 0,
                        "the ledger's tokens used, nothing reserved")
    exhausted = next(x for x in status["conditions"] if x["type"] == "Exhausted")
    assert exhausted["status"] == "True" and exhausted["message"] == "tokens at 100%"


def test_a_cluster_quota_sums_a_teams_namespaces_and_refuses_the_next_flow_in_another(
        stack: RealRunnerStack, flows: Flows) -> None:
    """A ClusterFlowQuota over the namespaces labelled with the team's org: the spend of a Flow in one
    counts, as the stub's ledger served it; once the limit is at that spend, a new Flow in the other
    namespace is refused at apply, naming the cluster quota."""
    import secrets

    cluster, ns = stack.cluster, flows.ns
    org, other = f"org-{secrets.token_hex(3)}", f"{flows.ns[:40]}-two"
    cluster.kubectl("create", "namespace", other)
    name = f"team-{org}"
    try:
        for namespace in (ns, other):
            cluster.kubectl("label", "namespace", namespace, f"flowkube-test-org={org}")
        quota: dict[str, Any] = {"apiVersion": "flowkube.io/v1alpha1", "kind": "ClusterFlowQuota",
                                 "metadata": {"name": name},
                 "spec": {"namespaceSelector": {"matchLabels": {"flowkube-test-org": org}},
                          "limits": [{"name": "tokens", "maxTotalTokens": 10**9, "window": {"kind": "Lifetime"}}]}}
        apply_object(stack, quota)

        def status() -> dict[str, Any]:
            out = cluster.kubectl("get", "clusterflowquota", name, "-o", "json")
            found: dict[str, Any] = json.loads(out.stdout).get("status") or {}
            return found

        wait_for(lambda: status().get("summary") == "tokens 0%", 60, "the cluster quota in use")
        mark = len(stack.stub.ledger())
        flows.apply("one", {"definition": {"schema": "crewai.flow/v1", "name": "One", "methods": {"draft": {
            "start": True, "do": {"call": "agent", "with": {**CAPPED_WRITER, "input": "DRAFT about orgs"}}}}}})
        flows.wait_phase("one", "Succeeded", timeout=RUN_TIMEOUT)
        spent = ledger_usage(stack.stub.ledger()[mark:]).total_tokens
        assert spent > 0
        wait_for(lambda: status()["limits"][0]["used"].get("totalTokens") == spent, 60, "the ledger's tokens")
        quota["spec"]["limits"][0]["maxTotalTokens"] = spent
        apply_object(stack, quota)
        wait_for(lambda: any(x["type"] == "Exhausted" and x["status"] == "True" for x in status()["conditions"]),
                 60, "Exhausted")
        refused = apply_object(stack, labelled_flow("two", None, "other"), other, check=False)
        assert refused.returncode != 0 and f"ClusterFlowQuota {name}: limit tokens" in refused.stderr, refused.stderr
        assert "is exhausted" in refused.stderr
        columns = cluster.kubectl("get", "clusterflowquotas", name).stdout
        assert "tokens 100%" in columns and "True" in columns
    finally:
        cluster.kubectl("delete", "clusterflowquota", name, "--ignore-not-found")
        cluster.kubectl("delete", "namespace", other, "--wait=false")


@pytest.fixture(scope="module")
def without_validator(stack: RealRunnerStack, request: pytest.FixtureRequest) -> RealRunnerStack:
    """The webhook cannot ask (failure-open): the runner has the last word. The chart is upgraded
    without its validator sidecar, for good: the tests taking this come last."""
    require_last_in_module(request)
    stack.operator.upgrade("validator.enabled=false")
    return stack


def test_without_the_validator_an_invalid_definition_fails_once_and_is_not_retried(
        without_validator: RealRunnerStack, flows: Flows) -> None:
    flows.apply("loop", {"definition": LOOP, "retries": {"limit": 3, "backoffSeconds": 0}})
    st = flows.wait_phase("loop", "Failed", timeout=RUN_TIMEOUT)
    assert cond(st, "Accepted")["status"] == "False", json.dumps(st, indent=1)
    assert cond(st, "Accepted")["reason"] == cond(st, "Succeeded")["reason"] == "InvalidDefinition"
    assert LOOP_MESSAGE in st["message"] and "methods.again.listen" in st["message"]
    (run,) = st["runs"]
    assert (run["result"], run["reason"], run["exitCode"]) == ("Failed", "InvalidDefinition", 2)
    assert len(flows.pods("loop")) <= 1
