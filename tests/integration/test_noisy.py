"""The noisy neighbour: one tenant writes as much as the API lets it, beside another tenant's warm
paused Flow, against the operator every namespace shares (the chart's two replicas, the REAL runner,
the stub model).

The tenant holds only what a namespace editor holds (Secrets, Flows, FlowTemplates of its own
namespace). What it writes, each scaled to this 2-core machine:

- labelled Secrets near 1 MiB by the dozen (every replica once kept them whole: 300 of them
  OOM-killed the follower five times);
- suspended Flows of one template near the template size bound (each kept a full copy in its status,
  and the operator kept every Flow whole);
- Flows with distinct definition names and forged `flowkube.io/cronflow` labels, created and deleted
  (metric label values a tenant picks).

The follower is then restarted, so it lists all of it again, as after an upgrade or a drain; the
leader took it in through its watches. It asserts: no operator container restarts but that one, each
replica's peak resident memory (VmHWM, from /proc) under the bound of docs/operations.md, the Lease
renewed at least every 7 s throughout, no forged label value in /metrics, and the warm Flow's usage
equal to the stub's ledger once it is answered.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_api import constants as c
from flowkube_api.report import Usage
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from tests.integration.conftest import Flows, LeaseWatch
from tests.integration.realrunner import RealRunnerStack, real_runner_stack
from tests.integration.test_e2e_runner import RULES, RUN_TIMEOUT, review_definition
from tests.integration.test_ha import container_rss_mb

pytestmark = pytest.mark.slow

SECRETS = 100  # labelled Secrets of SECRET_BYTES each: 88 MiB of Secrets, listed in one page once
SECRET_BYTES = 900 * 1024
TEMPLATE_FLOWS = 60  # suspended Flows of one template near the 256 KiB bound
LABELLED_FLOWS = 200  # Flows with a distinct definition name and a forged cronflow label each
PEAK_MB = 300  # an operator replica's peak RSS through all of it (docs/operations.md, capacity)
LEASE_GAP_SECONDS = 7.0


def operator_containers(op: ChartOperator) -> dict[str, tuple[str, int]]:
    """pod name -> (operator container id, restarts)."""
    out = {}
    for pod in op.pods():
        for s in pod.get("status", {}).get("containerStatuses", []):
            if s["name"] == "operator" and s.get("containerID"):
                cid = str(s["containerID"]).removeprefix("containerd://")
                out[pod["metadata"]["name"]] = (cid, int(s.get("restartCount", 0)))
    return out


def create_all(cluster: LocalCluster, namespace: str, objects: list[dict[str, Any]], batch: int = 20) -> None:
    """Create the objects with kubectl, `batch` to a List (a List of 40 MiB would pass no API server)."""
    for i in range(0, len(objects), batch):
        items = {"apiVersion": "v1", "kind": "List", "items": objects[i:i + batch]}
        cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(items))


def labelled_secrets(count: int) -> list[dict[str, Any]]:
    """Secrets a tenant labels for notifications, each a sink's URL and a key no sink reads, near the
    1 MiB Secret limit."""
    pad = base64.b64encode(b"x" * SECRET_BYTES).decode()
    return [{"apiVersion": "v1", "kind": "Secret",
             "metadata": {"name": f"hook-{i}", "labels": {c.LABEL_NOTIFICATIONS: "sink"}},
             "data": {"url": base64.b64encode(b"http://receiver.example/").decode(), "padding": pad}}
            for i in range(count)]


def big_template() -> dict[str, Any]:
    """A FlowTemplate near the 256 KiB bound of its spec: every Flow of it once kept a full copy."""
    env = [{"name": f"PAD_{i}", "value": "e" * 1000} for i in range(60)]  # about 62 KiB (64 KiB per field)
    annotations = {f"pad-{i}": "a" * 1000 for i in range(60)}  # about 62 KiB of pod metadata
    return {"apiVersion": c.API_VERSION, "kind": c.TEMPLATE_KIND, "metadata": {"name": "big"},
            "spec": {"template": {"definition": review_definition(), "env": env,
                                  "podTemplate": {"metadata": {"annotations": annotations}},
                                  "inputs": {"notes": "n" * 100_000}, "suspend": True}}}


def template_flows(count: int) -> list[dict[str, Any]]:
    return [{"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": f"of-big-{i}"},
             "spec": {"templateRef": {"name": "big"}, "suspend": True}} for i in range(count)]


def labelled_flows(count: int) -> list[dict[str, Any]]:
    """Suspended Flows, each of its own definition name and with a forged CronFlow label."""
    out = []
    for i in range(count):
        definition = {**review_definition(), "name": f"Noisy{i:05d}"}
        out.append({"apiVersion": c.API_VERSION, "kind": c.KIND,
                    "metadata": {"name": f"noisy-{i}", "labels": {c.LABEL_CRONFLOW: f"forged-{i}"}},
                    "spec": {"definition": definition, "suspend": True}})
    return out


def synced(op: ChartOperator, pod: str) -> bool:
    """The replica's caches hold what exists: every watch has delivered its first list."""
    try:
        text = op.pod_metrics(pod)
    except OSError:
        return False
    lines = [ln for ln in text.splitlines() if ln.startswith("flowkube_operator_cache_synced{")]
    return bool(lines) and all(ln.endswith(" 1.0") or ln.endswith(" 1") for ln in lines)


@pytest.fixture(scope="module")
def stack(cluster: LocalCluster) -> Iterator[RealRunnerStack]:
    with real_runner_stack(cluster, RULES, "noisy", values=["replicaCount=2"]) as s:
        yield s


@pytest.mark.budget(420)
def test_a_noisy_tenant_restarts_no_operator_delays_no_lease_and_changes_no_other_tenants_usage(
        stack: RealRunnerStack, flows: Flows, cluster: LocalCluster) -> None:
    """One scenario, because each attack must be tried beside the others and the warm Flow (the
    budget: a real runner's kickoff and resume, a replica's restart and its list, about 400 objects)."""
    op = stack.operator
    mark = len(stack.stub.ledger())
    flows.apply("warm", {"definition": review_definition(), "feedback": {"keepWarmSeconds": 600}})
    flows.wait_phase("warm", "AwaitingFeedback", timeout=RUN_TIMEOUT)
    noisy = f"noisy-{flows.ns[-6:]}"
    cluster.kubectl("create", "namespace", noisy)
    try:
        lease = LeaseWatch(op.lease)
        before = operator_containers(op)
        create_all(cluster, noisy, labelled_secrets(SECRETS), batch=4)
        cluster.kubectl("create", "-n", noisy, "-f", "-", input=json.dumps(big_template()))
        create_all(cluster, noisy, template_flows(TEMPLATE_FLOWS))
        create_all(cluster, noisy, labelled_flows(LABELLED_FLOWS), batch=50)
        Flows(cluster, noisy).wait("of-big-0", lambda s: bool(s.get("template")), "the template taken",
                                   timeout=120)

        # The forged CronFlow labels are no label values; definition names are capped per namespace.
        leader = op.leader()
        wait_for(lambda: f'flow="noisy-{LABELLED_FLOWS - 1}"' in op.pod_metrics(leader), 120,
                 "the last noisy Flow in /metrics")
        scrape = op.pod_metrics(leader)
        assert 'cronflow="forged-' not in scrape
        definitions = set(re.findall(rf'namespace="{noisy}"[^}}]*definition="([^"]*)"', scrape))
        print(f"\n/metrics of the leader: {len(scrape.splitlines())} lines, "
              f"{len(definitions)} definition values for {LABELLED_FLOWS} definitions")

        # The follower lists everything again, as after an upgrade or a drain.
        (follower,) = [p for p in before if p != leader]
        op.kill_container(follower)
        wait_for(lambda: operator_containers(op).get(follower, ("", 0))[0] not in ("", before[follower][0])
                 and synced(op, follower), 180, f"{follower} restarted and its caches synced")
        peaks = {p: container_rss_mb(cluster, cid, "VmHWM") for p, (cid, _) in operator_containers(op).items()}
        print("operator replicas' peak RSS (the follower listing the noisy namespace again): "
              + ", ".join(f"{p}: {v:.0f} MB" for p, v in peaks.items()))
        longest = lease.stop()
        print(f"the Lease's longest time without a renewal: {longest:.1f}s")

        after = operator_containers(op)
        assert {p: r for p, (_, r) in after.items()} == {p: r + (p == follower) for p, (_, r) in before.items()}, \
            "only the kill restarted a container: " + op.diagnose()
        assert op.leader() == leader
        assert all(v < PEAK_MB for v in peaks.values()), peaks
        assert longest < LEASE_GAP_SECONDS

        stack.cluster.kubectl("patch", "flow", "warm", "-n", flows.ns, "--subresource=status", "--type=merge",
                              "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
        st = flows.wait_phase("warm", "Succeeded", timeout=RUN_TIMEOUT)
        assert Usage.model_validate(st["usage"]) == stack.usage_since(mark)
    finally:
        cluster.kubectl("delete", "namespace", noisy, "--wait=false", check=False)
