"""Tenants who do not cooperate, against the real operator (the chart's pod on the real node).

Each test is one way a Flow author, a runner pod or a ConfigMap editor could take the operator down
or hide spend, tried as they would try it; each failed on the main branch before its fix:
- a runner pod PUTs a gzip bomb (about 900 MiB of zeros in under the 900 KiB value limit) as its
  report: the state API decompressed it whole and the operator container was OOMKilled;
- a bomb written straight into a Flow's state ConfigMap: every leader re-read it;
- a Flow with megabytes of `spec.inputs`: refused by the webhook's HTTP server with a bare 413 that
  named no field (and forty of them crash-looped the operator).
The operator must stay up (no container restart), keep its memory, and still count the tokens.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from flowkube_api import constants as c
from flowkube_devstack.cluster import LocalCluster
from flowkube_devstack.operator import ChartOperator
from tests.abuse import gzip_bomb
from tests.integration.conftest import Flows
from tests.integration.test_ha import container_rss_mb

pytestmark = pytest.mark.slow

BOMB_MIB = 900  # compresses to about 874 KiB: under the state API's and a ConfigMap's value limits


def restarts(op: ChartOperator) -> dict[str, int]:
    return {p["metadata"]["name"]: s.get("restartCount", 0) for p in op.pods()
            for s in p.get("status", {}).get("containerStatuses", []) if s["name"] == "operator"}


def operator_rss(op: ChartOperator, cluster: LocalCluster) -> float:
    (pod,) = op.pods()
    (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == "operator"]
    return container_rss_mb(cluster, status["containerID"].removeprefix("containerd://"))


def test_a_runner_pods_gzip_bomb_is_refused_and_its_real_report_still_counts(
        flows: Flows, operator: ChartOperator, cluster: LocalCluster) -> None:
    before = restarts(operator)
    flows.apply("bomber", {"flowRef": "a:B", "inputs": {"plan": [{"bomb": BOMB_MIB, "tokens": 3}]}})
    st = flows.wait_phase("bomber", "Succeeded", timeout=120)
    assert st["usage"]["totalTokens"] == 3 and len(st["runs"]) == 1
    log = cluster.kubectl("logs", "bomber-0", "-n", flows.ns).stdout
    assert "bomb: refused: StateTooLarge" in log, log
    assert restarts(operator) == before, operator.diagnose()
    rss = operator_rss(operator, cluster)
    print(f"\noperator RSS after a {BOMB_MIB} MiB gzip bomb was PUT: {rss:.0f} MB")
    assert rss < 400


def test_a_gzip_bomb_in_a_flows_state_configmap_is_an_unreadable_report(
        flows: Flows, operator: ChartOperator, cluster: LocalCluster) -> None:
    """Someone who may edit ConfigMaps in the namespace writes a bomb where the run's report goes;
    the pod then ends without a report of its own, so the operator reads the bomb."""
    before = restarts(operator)
    flows.apply("victim", {"flowRef": "a:B", "retries": {"limit": 0},
                           "inputs": {"plan": [{"sleep": 10, "no_report": True}]}})
    st = flows.wait_phase("victim", "Running")
    uid = (flows.get("victim") or {})["metadata"]["uid"]
    cm = {"apiVersion": "v1", "kind": "ConfigMap",
          "metadata": {"name": c.state_configmap_name("victim"), "namespace": flows.ns,
                       "ownerReferences": [{"apiVersion": c.API_VERSION, "kind": c.KIND, "name": "victim",
                                            "uid": uid, "controller": True}]},
          "binaryData": {c.report_key("victim-0"): base64.b64encode(gzip_bomb(BOMB_MIB << 20)).decode()}}
    cluster.kubectl("create", "-f", "-", input=json.dumps(cm))
    st = flows.wait_phase("victim", "Failed", timeout=90)
    assert [r["pod"] for r in st["runs"]] == ["victim-0"]
    assert restarts(operator) == before, operator.diagnose()
    assert "decompresses to more than" in operator.logs()
    rss = operator_rss(operator, cluster)
    print(f"\noperator RSS after reading a {BOMB_MIB} MiB gzip bomb from a state ConfigMap: {rss:.0f} MB")
    assert rss < 400


def nested_lists(count: int) -> list[Any]:
    """`count` empty lists in one list: 3 bytes of JSON each, about 60 bytes of Python each."""
    return [[] for _ in range(count)]


@pytest.mark.parametrize(("inputs", "expected"), [
    ({"items": nested_lists(400_000)}, "spec.inputs and spec.definition are "),  # 1.2 MB: once a bare 413
    ({"items": nested_lists(50_000)}, "a runner pod receives them in one environment variable"),
    ({"deep": json.loads("[" * 40 + "]" * 40)}, "spec.inputs nests objects and lists more than 32 levels"),
])
def test_oversized_or_deep_inputs_are_refused_at_apply_naming_the_field(
        flows: Flows, operator: ChartOperator, inputs: dict[str, Any], expected: str) -> None:
    obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": "big"},
           "spec": {"flowRef": "a:B", "suspend": True, "inputs": inputs}}
    out = flows.cluster.kubectl("create", "-n", flows.ns, "-f", "-", input=json.dumps(obj), check=False)
    assert out.returncode != 0 and expected in out.stderr, out.stderr[:2000]
    assert "413" not in out.stderr
    assert flows.get("big") is None


def test_a_flow_still_runs_with_inputs_up_to_the_bound(flows: Flows, operator: ChartOperator) -> None:
    plan = [{"tokens": 2}]
    flows.apply("roomy", {"flowRef": "a:B", "inputs": {"plan": plan, "notes": "x" * 100_000}})
    st = flows.wait_phase("roomy", "Succeeded", timeout=90)
    assert st["usage"]["totalTokens"] == 2


def test_an_image_outside_the_runner_policy_is_refused_at_apply_even_with_only_a_flowref(
        flows: Flows, operator: ChartOperator) -> None:
    """A Flow with `flowRef` and `image` and no other field the webhook matched was admitted without
    the webhook, and its pod silently ran the operator's own runner image instead."""
    operator.upgrade("runnerPolicy.images={registry.example.com/team/*}")
    try:
        for name, image, admitted in (("miner", "evil.example.com/miner:1", False),
                                      ("team", "registry.example.com/team/runner:1", True)):
            obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name},
                   "spec": {"flowRef": "a:B", "suspend": True, "image": image}}
            out = flows.cluster.kubectl("create", "-n", flows.ns, "-f", "-", input=json.dumps(obj), check=False)
            if admitted:
                assert out.returncode == 0, out.stderr
            else:
                assert out.returncode != 0 and "spec.image" in out.stderr, out.stderr[:2000]
                assert flows.get(name) is None
    finally:
        operator.upgrade()


def test_a_report_with_every_field_at_its_bound_is_folded_and_one_over_is_refused_naming_it(
        flows: Flows, operator: ChartOperator, cluster: LocalCluster) -> None:
    """A runner sends a report over a field's bound (65 outcomes), then one with every field of its
    feedback request at its bound: the first is refused naming the field, the second is the status."""
    before = restarts(operator)
    request = {"id": "r" * 253, "method": "m" * 240, "message": "x" * 4096,
               "emit": [f"{i:03d}" + "o" * 237 for i in range(64)], "defaultOutcome": "000" + "o" * 237}
    over = {"result": "Paused", "reason": "RunPaused", "exitCode": 0,
            "feedbackRequest": {**request, "emit": [*request["emit"], "one-more"]}}
    flows.apply("wide", {"flowRef": "a:B", "inputs": {"plan": [
        {"result": "Paused", "feedback": request, "tokens": 2, "raw_report": over}]}})
    st = flows.wait_phase("wide", "AwaitingFeedback", timeout=120)
    got = st["feedback"]["request"]
    assert (len(got["id"]), len(got["method"]), len(got["message"]), len(got["emit"])) == (253, 240, 4096, 64)
    assert st["usage"]["totalTokens"] == 2
    log = cluster.kubectl("logs", "wide-0", "-n", flows.ns).stdout
    assert "raw: refused: StoreError" in log and "HTTP 422" in log, log
    assert "feedbackRequest.emit has 65 items; the limit is 64" in log, log
    assert restarts(operator) == before, operator.diagnose()


def namespace_series(text: str, namespace: str) -> list[str]:
    return [line for line in text.splitlines() if not line.startswith("#") and f'namespace="{namespace}"' in line]


def test_made_up_names_by_the_thousand_created_and_deleted_leave_at_most_the_series_budget(
        flows: Flows, operator: ChartOperator, cluster: LocalCluster) -> None:
    """Thousands of definition names and cronflow labels (forged: no CronFlow owns these Flows), and
    a few dozen runs each with its own definition and model, all deleted: the namespace keeps at
    most its documented budget of series (docs/api.md, 763 at 20 names), and its spend, counted once."""
    before = restarts(operator)
    forged = [{"apiVersion": c.API_VERSION, "kind": c.KIND,
               "metadata": {"name": f"made-up-{i}", "labels": {c.LABEL_CRONFLOW: f"cron-{i}", "abuse": "names"}},
               "spec": {"flowRef": f"a:Made{i}", "suspend": True}} for i in range(2000)]
    for start in range(0, len(forged), 250):
        cluster.kubectl("apply", "-n", flows.ns, "-f", "-", timeout=180,
                        input=json.dumps({"apiVersion": "v1", "kind": "List", "items": forged[start:start + 250]}))
    runs = 40
    for i in range(runs):
        cluster.kubectl("apply", "-n", flows.ns, "-f", "-", input=json.dumps({
            "apiVersion": c.API_VERSION, "kind": c.KIND,
            "metadata": {"name": f"spender-{i}", "labels": {"abuse": "names"}},
            "spec": {"flowRef": f"a:Def{i}", "inputs": {"plan": [{"tokens": 3, "cost": "0.01", "model": f"m-{i}"}]}}}))
    for i in range(runs):
        flows.wait_phase(f"spender-{i}", "Succeeded", timeout=300)
    text = operator.metrics()
    assert f'namespace="{flows.ns}",flow="made-up-0",' in text  # while they exist
    definitions = {part for line in namespace_series(text, flows.ns) for part in line.split(",")
                   if part.startswith("definition=")}
    assert len(definitions) <= 21, sorted(definitions)  # 20 names and "other"
    assert "cronflow=" not in "".join(namespace_series(text, flows.ns))  # a forged label is no label value
    cluster.kubectl("delete", "flows", "-n", flows.ns, "-l", "abuse=names", "--wait=true", timeout=600)
    series = namespace_series(operator.metrics(), flows.ns)
    print(f"\nseries of namespace {flows.ns} after 2040 made-up names came and went: {len(series)}")
    assert len(series) <= 763, "\n".join(series[:50])
    spend = [float(line.rsplit(" ", 1)[1]) for line in series if line.startswith("flowkube_namespace_cost_usd_total")]
    assert abs(sum(spend) - 0.01 * runs) < 1e-9
    assert any('definition="other"' in line and 'model="other"' in line for line in series)
    assert restarts(operator) == before, operator.diagnose()
