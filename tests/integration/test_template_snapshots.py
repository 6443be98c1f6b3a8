"""A template is stored once per generation, not once per Flow (issue 37, item 2).

Twenty suspended Flows of one template near the size bound (about 240 KiB) take it: one
ControllerRevision holds it, each Flow's status.template names it (and holds no copy); a change of
the template after the takes moves none of them; deleting every Flow removes the snapshots after the
sweeps' grace (the sweep period is set short through the chart, so nothing here sleeps for it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_api import templates
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows, scripted_operator
from tests.integration.test_abuse import restarts

pytestmark = pytest.mark.slow

FLOWS = 20
BLOB = 240 * 1024  # a parameter's default near the template's 256 KiB bound; each Flow sets its own value


@pytest.fixture(scope="module")
def quick_sweeps(cluster: LocalCluster) -> Iterator[ChartOperator]:
    op = scripted_operator(cluster, values=["templateSnapshots.sweepSeconds=1"]).start()
    try:
        yield op
    finally:
        op.stop()


def bulky(label: str) -> dict[str, Any]:
    return {"apiVersion": "flowkube.io/v1alpha1", "kind": "FlowTemplate", "metadata": {"name": "bulky"},
            "spec": {"parameters": [{"name": "blob", "type": "string", "default": label * BLOB}],
                     "template": {"flowRef": "a:B"}}}


def snapshots(cluster: LocalCluster, namespace: str) -> list[dict[str, Any]]:
    out = cluster.kubectl("get", "controllerrevisions", "-n", namespace, "-l",
                          "app.kubernetes.io/managed-by=flowkube,flowkube.io/template", "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def put_template(cluster: LocalCluster, namespace: str, obj: dict[str, Any]) -> None:
    # replace, not apply: kubectl's last-applied annotation would double the object.
    verb = "replace" if cluster.kubectl("get", "flowtemplate", "bulky", "-n", namespace, check=False).returncode == 0 \
        else "create"
    cluster.kubectl(verb, "-n", namespace, "-f", "-", input=json.dumps(obj))


def test_flows_of_one_large_template_share_one_snapshot_that_goes_with_the_last_of_them(
        quick_sweeps: ChartOperator, cluster: LocalCluster, flows: Flows) -> None:
    before = restarts(quick_sweeps)
    put_template(cluster, flows.ns, bulky("a"))
    for i in range(FLOWS):
        flows.apply(f"f{i}", {"templateRef": {"name": "bulky"}, "inputs": {"blob": "small"}, "suspend": True})
    taken = [flows.wait(f"f{i}", lambda s: bool((s.get("template") or {}).get("snapshot")), "its template taken")
             for i in range(FLOWS)]
    refs = [st["template"] for st in taken]
    assert len({r["snapshot"] for r in refs}) == 1 and all("spec" not in r for r in refs), refs[0]
    (snapshot,) = snapshots(cluster, flows.ns)
    assert snapshot["metadata"]["name"] == refs[0]["snapshot"]
    assert snapshot["data"]["generation"] == 1 and snapshot["revision"] == 1
    assert snapshot["data"]["spec"]["parameters"][0]["default"] == "a" * BLOB
    assert all(r["hash"] == templates.data_hash(snapshot["data"]) for r in refs), "each Flow names what is stored"
    flow_bytes = len(cluster.kubectl("get", "flows", "-n", flows.ns, "-o", "json").stdout)
    assert flow_bytes < FLOWS * 16 * 1024, f"the Flows hold no copy of the template: {flow_bytes} bytes"

    # The template changes after the takes: a Flow made now takes generation 2 (so the operator has
    # seen the change), and every earlier Flow still names generation 1's snapshot.
    put_template(cluster, flows.ns, bulky("b"))
    flows.apply("later", {"templateRef": {"name": "bulky"}, "inputs": {"blob": "small"}, "suspend": True})
    later = flows.wait("later", lambda s: (s.get("template") or {}).get("generation") == 2, "generation 2 taken")
    assert later["template"]["snapshot"] != refs[0]["snapshot"]
    for i in range(FLOWS):
        assert flows.status(f"f{i}")["template"] == refs[i]
    assert sorted(s["data"]["generation"] for s in snapshots(cluster, flows.ns)) == [1, 2]

    # Every Flow deleted: no Flow names either snapshot any more, and both go after the grace.
    cluster.kubectl("delete", "flows", "--all", "-n", flows.ns, "--wait=true")
    wait_for(lambda: not snapshots(cluster, flows.ns), 60, "the unreferenced snapshots deleted", interval=0.5)
    assert restarts(quick_sweeps) == before


def test_a_flow_whose_snapshot_is_deleted_under_it_fails_naming_it(
        quick_sweeps: ChartOperator, cluster: LocalCluster, flows: Flows) -> None:
    put_template(cluster, flows.ns, bulky("c"))
    flows.apply("victim", {"templateRef": {"name": "bulky"}, "inputs": {"blob": "small"}, "suspend": True})
    st = flows.wait("victim", lambda s: bool((s.get("template") or {}).get("snapshot")), "its template taken")
    name = st["template"]["snapshot"]
    cluster.kubectl("delete", "controllerrevision", name, "-n", flows.ns)
    # The running operator still has the spec in its LRU (checked when it was read); a restarted one
    # reads the snapshot again at its first reconcile of every Flow, and finds it gone.
    cluster.kubectl("rollout", "restart", f"deployment/{quick_sweeps.fullname}", "-n", quick_sweeps.namespace)
    st = flows.wait_phase("victim", "Failed", timeout=180)
    assert name in st["message"] and "TemplateSnapshotUnusable" in json.dumps(st["conditions"])
