"""The Helm chart on the real API server: its manifests apply, its RBAC is enough and no more,
its webhooks are wired as documented, and `helm install/upgrade/uninstall` work.

Most tests check what the API server itself decides (their operator pods, from the public image,
cannot be pulled here); the last one installs the chart with the locally built images and runs it.
"""

from __future__ import annotations

import json
import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowkube_api import constants as c
from flowkube_devstack import build, chart
from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import adopt_crd
from tests.integration.conftest import scripted_operator

CHART = chart.CHART_DIR
CRD_NAME = f"{c.PLURAL}.{c.GROUP}"
Obj = dict[str, Any]


@pytest.fixture(scope="module")
def helm() -> Path:
    return build.ensure(build.helm(), quiet=True) / "helm"


def run_helm(helm: Path, cluster: LocalCluster, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), "--kubeconfig", str(cluster.kubeconfig), *args],
                          capture_output=True, text=True, timeout=180)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
    return proc


def release_name() -> str:
    return f"fk{secrets.token_hex(3)}"


def template(helm: Path, cluster: LocalCluster, release: str, namespace: str, *args: str) -> str:
    return run_helm(helm, cluster, "template", release, str(CHART), "--namespace", namespace,
                    "--set", f"watchNamespaces={{{namespace}}}", *args).stdout


def docs(text: str) -> list[Obj]:
    return [d for d in yaml.safe_load_all(text) if d]


def crd_established(cluster: LocalCluster) -> bool:
    out = cluster.kubectl("get", "crd", CRD_NAME, "-o", "json", check=False)
    if out.returncode != 0:
        return False
    conds = json.loads(out.stdout).get("status", {}).get("conditions", [])
    return any(x["type"] == "Established" and x["status"] == "True" for x in conds)


def delete_cluster_scoped(cluster: LocalCluster, objs: list[Obj]) -> None:
    """Namespace deletion takes the rest; the CRD stays (other tests and Flows use it)."""
    for o in objs:
        if "namespace" not in o["metadata"] and o["kind"] != "CustomResourceDefinition":
            cluster.kubectl("delete", o["kind"].lower(), o["metadata"]["name"], "--ignore-not-found",
                            "--wait=false", check=False)


def can_i(cluster: LocalCluster, user: str, *args: str) -> bool:
    out = cluster.kubectl("auth", "can-i", "--as", user, *args, check=False)
    return out.stdout.strip() == "yes"


@pytest.fixture
def restricted_namespace(cluster: LocalCluster, namespace: str) -> str:
    # The operator pod must be admitted under the strictest Pod Security Standard.
    cluster.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    return namespace


def a_flow(name: str, namespace: str) -> str:
    """An inline definition: what the Flow webhook checks (flowRef Flows do not call it)."""
    definition = {"schema": "crewai.flow/v1", "name": "Research", "methods": {"start": {"start": True}}}
    return json.dumps({"apiVersion": c.API_VERSION, "kind": c.KIND,
                       "metadata": {"name": name, "namespace": namespace},
                       "spec": {"definition": definition}})


def operator_grants_are_sufficient(cluster: LocalCluster, ns: str, sa: str, release: str) -> None:
    """What the operator does, it may; nothing that would let it hand out or read credentials."""
    user = f"system:serviceaccount:{ns}:{sa}"
    for verb, resource in [("create", "pods"), ("delete", "pods"), ("watch", "pods"), ("create", "configmaps"),
                           ("patch", "configmaps"), ("patch", f"{c.PLURAL}.{c.GROUP}"), ("create", "events"),
                           ("create", "events.events.k8s.io")]:
        assert can_i(cluster, user, verb, resource, "-n", ns), (verb, resource)
    assert can_i(cluster, user, "patch", f"{c.PLURAL}.{c.GROUP}", "--subresource=status", "-n", ns)
    assert can_i(cluster, user, "create", "tokenreviews.authentication.k8s.io")  # runner pods' tokens
    for verb in ("get", "patch"):  # its CA Secret, by name
        assert can_i(cluster, user, verb, f"secrets/{release}-flowkube-ca", "-n", ns), verb
    for verb, resource in [("get", "secrets"), ("create", "secrets"), ("list", "configmaps"),
                           ("create", "deployments.apps"), ("update", "pods"),
                           ("create", "serviceaccounts"), ("create", "serviceaccounts/token"),
                           ("create", "roles.rbac.authorization.k8s.io"),
                           ("create", "rolebindings.rbac.authorization.k8s.io"),
                           ("create", "clusterroles.rbac.authorization.k8s.io"),
                           ("escalate", "roles.rbac.authorization.k8s.io"),
                           ("bind", "roles.rbac.authorization.k8s.io")]:
        assert not can_i(cluster, user, verb, resource, "-n", ns), (verb, resource)


@pytest.mark.slow
@pytest.mark.parametrize("values", ["default-values.yaml", "namespaced-values.yaml"])
def test_rendered_manifests_apply_and_grant_what_the_operator_needs(
        cluster: LocalCluster, helm: Path, restricted_namespace: str, values: str) -> None:
    ns, release = restricted_namespace, release_name()
    rendered = template(helm, cluster, release, ns, "-f", str(CHART / "ci" / values))
    objs = docs(rendered)
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)
        wait_for(lambda: crd_established(cluster), 60, "the Flow CRD Established")
        sa = f"{release}-flowkube"
        operator_grants_are_sufficient(cluster, ns, sa, release)
        # With watchNamespaces set (template() sets it), whatever rbac.scope says, the operator holds
        # rights in that namespace only: no pods elsewhere (kube-system included), no namespace list.
        for other in ("default", "kube-system"):
            assert not can_i(cluster, f"system:serviceaccount:{ns}:{sa}", "create", "pods", "-n", other)
        assert not can_i(cluster, f"system:serviceaccount:{ns}:{sa}", "list", "namespaces")

        def operator_pod_admitted() -> bool:
            pods = cluster.kubectl("get", "pods", "-n", ns, "-l", "app.kubernetes.io/component=operator",
                                   "-o", "name").stdout
            return bool(pods.strip())

        # The ReplicaSet controller creates the pod only if the namespace's `restricted` policy admits it.
        wait_for(operator_pod_admitted, 90, f"an operator pod admitted in {ns} (restricted PSS)", interval=0.5)
    finally:
        delete_cluster_scoped(cluster, objs)


@pytest.mark.slow
def test_webhooks_gate_spec_and_feedback_as_documented(cluster: LocalCluster, helm: Path, namespace: str) -> None:
    """Without a running operator: spec writes fail closed, feedback and metadata-only writes go through."""
    release = release_name()
    # Nothing answers at the webhook Service: keep each failing call short.
    rendered = template(helm, cluster, release, namespace, "--set", "webhook.timeoutSeconds=2")
    objs = docs(rendered)
    crd_only = [o for o in objs if o["kind"] == "CustomResourceDefinition"]
    try:
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                        input="\n---\n".join(yaml.safe_dump(o) for o in crd_only))
        wait_for(lambda: crd_established(cluster), 60, "the Flow CRD Established")
        cluster.kubectl("apply", "-f", "-", input=a_flow("before", namespace))
        cluster.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-", input=rendered)

        def webhook_refuses_create() -> bool:
            out = cluster.kubectl("create", "-f", "-", input=a_flow("after", namespace), check=False)
            return out.returncode != 0 and "flows.validate.flowkube.io" in out.stderr

        wait_for(webhook_refuses_create, 30, "the Flow webhook to be in force (failurePolicy Fail)", interval=0.5)
        spec = cluster.kubectl("patch", "flow", "before", "-n", namespace, "--type=merge",
                               "-p", '{"spec":{"inputs":{"topic":"x"}}}', check=False)
        assert spec.returncode != 0 and "flows.validate.flowkube.io" in spec.stderr
        cluster.kubectl("label", "flow", "before", "-n", namespace, "reviewed=yes")  # matchConditions skip it
        cluster.kubectl("patch", "flow", "before", "-n", namespace, "--subresource=status", "--type=merge",
                        "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')  # Ignore
        got = json.loads(cluster.kubectl("get", "flow", "before", "-n", namespace, "-o", "json").stdout)
        assert got["status"]["feedback"]["response"] == {"text": "approved"}

        # With no operator (so no status webhook), the API server's own policy still keeps users to the
        # inbox: no rewriting the phase or the usage, no answering in someone else's name.
        def refused(patch: str) -> str:  # server-side dry run: admission runs, nothing is written
            out = cluster.kubectl("patch", "flow", "before", "-n", namespace, "--subresource=status",
                                  "--type=merge", "-p", patch, "--dry-run=server", check=False)
            return out.stderr if out.returncode != 0 else ""

        wait_for(lambda: "belongs to the flowkube operator" in refused('{"status":{"phase":"Succeeded"}}'), 30,
                 "the status policy in force", interval=0.5)
        assert "belongs to the flowkube operator" in refused('{"status":{"usage":{"totalTokens":0}}}')
        assert "not set by users" in refused(
            '{"status":{"feedback":{"response":{"text":"no","respondedBy":"someone-else"}}}}')
        cluster.kubectl("patch", "flow", "before", "-n", namespace, "--subresource=status", "--type=merge",
                        "-p", '{"status":{"feedback":{"response":{"text":"rejected"}}}}')
        # Outside watchNamespaces no webhook applies at all.
        other = f"{namespace[:50]}-other"
        cluster.kubectl("create", "namespace", other)
        try:
            cluster.kubectl("create", "-f", "-", input=a_flow("elsewhere", other))
        finally:
            cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)
    finally:
        delete_cluster_scoped(cluster, objs)
        cluster.kubectl("delete", "flow", "--all", "-n", namespace, "--wait=false", check=False)


def status(helm: Path, cluster: LocalCluster, release: str, namespace: str) -> Obj:
    out = run_helm(helm, cluster, "status", release, "-n", namespace, "-o", "json").stdout
    data: Obj = json.loads(out)
    return data


@pytest.fixture
def installed(cluster: LocalCluster, helm: Path, restricted_namespace: str) -> Iterator[tuple[str, str]]:
    ns, release = restricted_namespace, release_name()
    adopt_crd(cluster, release, ns)
    # No --wait: the operator's image cannot run here, only the objects are checked.
    run_helm(helm, cluster, "install", release, str(CHART), "-n", ns,
             "--set", f"watchNamespaces={{{ns}}}", "--set", "dashboards.enabled=true")
    try:
        yield release, ns
    finally:
        run_helm(helm, cluster, "uninstall", release, "-n", ns, "--wait=false", check=False)


@pytest.mark.slow
def test_helm_install_upgrade_uninstall(cluster: LocalCluster, helm: Path, installed: tuple[str, str]) -> None:
    release, ns = installed
    st = status(helm, cluster, release, ns)
    assert st["info"]["status"] == "deployed"
    assert "--subresource=status" in st["info"]["notes"]
    full = f"{release}-flowkube"
    for kind, name in [("deployment", full), ("serviceaccount", full), ("service", f"{full}-metrics"),
                       ("service", f"{full}-webhook"), ("configmap", f"{full}-dashboards")]:
        cluster.kubectl("get", kind, name, "-n", ns)
    webhook_config = f"{full}-{ns}.flowkube.io"
    for kind in ("validatingwebhookconfiguration", "mutatingwebhookconfiguration"):
        cluster.kubectl("get", kind, webhook_config)
    for role in ("operator", "flow-viewer", "flow-editor", "feedback-responder"):
        cluster.kubectl("get", "clusterrole", f"{full}-{role}")
    crd_obj = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
    assert crd_obj["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert crd_obj["metadata"]["annotations"]["meta.helm.sh/release-name"] == release

    # The operator patches its CA into the webhook configurations; an upgrade must keep it.
    ca = "dGVzdC1jYQ=="
    patch = json.dumps([{"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": ca}])
    cluster.kubectl("patch", "validatingwebhookconfiguration", webhook_config, "--type=json", "-p", patch)
    run_helm(helm, cluster, "upgrade", release, str(CHART), "-n", ns, "--reuse-values",
             "--set", "log.level=DEBUG")
    st = status(helm, cluster, release, ns)
    assert (st["info"]["status"], st["version"]) == ("deployed", 2)
    vwc = json.loads(cluster.kubectl("get", "validatingwebhookconfiguration", webhook_config, "-o", "json").stdout)
    assert vwc["webhooks"][0]["clientConfig"]["caBundle"] == ca
    deploy = json.loads(cluster.kubectl("get", "deployment", full, "-n", ns, "-o", "json").stdout)
    env = {e["name"]: e.get("value") for e in deploy["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FLOWKUBE_LOG_LEVEL"] == "DEBUG"

    run_helm(helm, cluster, "uninstall", release, "-n", ns)
    assert cluster.kubectl("get", "clusterrole", f"{full}-operator", check=False).returncode != 0
    assert cluster.kubectl("get", "validatingwebhookconfiguration", webhook_config, check=False).returncode != 0
    cluster.kubectl("get", "crd", CRD_NAME)  # kept: deleting it would delete every Flow


@pytest.mark.slow
def test_user_roles_grant_what_they_say(cluster: LocalCluster, helm: Path, installed: tuple[str, str]) -> None:
    release, ns = installed
    full = f"{release}-flowkube"
    flows = f"{c.PLURAL}.{c.GROUP}"
    for user, role in [("alice", "feedback-responder"), ("bob", "flow-editor"), ("carol", "flow-viewer")]:
        cluster.kubectl("create", "rolebinding", f"{user}-{role}", "-n", ns, f"--clusterrole={full}-{role}",
                        f"--user={user}")

    def allowed(user: str, *args: str) -> bool:
        return can_i(cluster, user, *args, "-n", ns)

    wait_for(lambda: allowed("alice", "patch", flows, "--subresource=status"), 30, "the RoleBindings in force")
    assert allowed("alice", "watch", flows) and allowed("alice", "get", flows, "--subresource=status")
    for verb in ("create", "update", "patch", "delete"):
        assert not allowed("alice", verb, flows), verb
    assert not allowed("alice", "update", flows, "--subresource=status")

    assert allowed("bob", "create", flows) and allowed("bob", "delete", flows)
    assert not allowed("bob", "patch", flows, "--subresource=status")

    assert allowed("carol", "list", flows) and not allowed("carol", "create", flows)

    # Aggregation into the built-in roles (the controller-manager fills them in).
    cluster.kubectl("create", "rolebinding", "dave-edit", "-n", ns, "--clusterrole=edit", "--user=dave")
    cluster.kubectl("create", "rolebinding", "erin-view", "-n", ns, "--clusterrole=view", "--user=erin")
    wait_for(lambda: allowed("dave", "patch", flows, "--subresource=status") and allowed("dave", "create", flows),
             60, "flow roles aggregated into `edit`", interval=0.5)
    wait_for(lambda: allowed("erin", "list", flows), 60, "flow roles aggregated into `view`", interval=0.5)
    assert not allowed("erin", "patch", flows, "--subresource=status")


@pytest.mark.slow
def test_helm_installed_operator_runs_a_flow_in_a_restricted_namespace(
        cluster: LocalCluster, restricted_namespace: str) -> None:
    """`helm install --wait` of the chart as users run it: the operator's pod from its image, with the
    chart's RBAC, Services, webhooks and state API, in a namespace that enforces the `restricted` Pod
    Security Standard (so do its runner pods). A Flow goes through feedback to Succeeded, answered by a
    feedback-responder; the operator's log shows no request refused by RBAC. Only the runner is scripted."""
    namespace, release = restricted_namespace, release_name()
    op = scripted_operator(cluster, release=release, namespace=namespace,
                           values=[f"watchNamespaces={{{namespace}}}"])
    full = op.fullname
    try:
        op.start()
        review = {"id": "req-1", "method": "review", "message": "Ship it?", "emit": ["approved", "rejected"]}
        flow = {"apiVersion": c.API_VERSION, "kind": c.KIND, "metadata": {"name": "charted", "namespace": namespace},
                "spec": {"flowRef": "pkg.flows:Research",
                         "inputs": {"plan": [{"result": "Paused", "feedback": review, "tokens": 2},
                                             {"tokens": 3, "output": "shipped"}]}}}
        cluster.kubectl("apply", "-f", "-", input=json.dumps(flow))

        def phase() -> str:
            got = json.loads(cluster.kubectl("get", "flow", "charted", "-n", namespace, "-o", "json").stdout)
            return str(got.get("status", {}).get("phase", ""))

        wait_for(lambda: phase() == "AwaitingFeedback", 90, "AwaitingFeedback", interval=0.5)
        cluster.kubectl("create", "rolebinding", "alice", "-n", namespace,
                        f"--clusterrole={full}-feedback-responder", "--user=alice")
        cluster.kubectl("patch", "flow", "charted", "-n", namespace, "--as=alice", "--subresource=status",
                        "--type=merge", "-p", '{"status":{"feedback":{"response":{"text":"approved"}}}}')
        wait_for(lambda: phase() == "Succeeded", 90, "Succeeded after the answer", interval=0.5)
        got = json.loads(cluster.kubectl("get", "flow", "charted", "-n", namespace, "-o", "json").stdout)
        assert got["status"]["usage"]["totalTokens"] == 5
        assert got["status"]["feedback"]["history"][-1]["respondedBy"] == "alice"
        assert "flowkube_flow_tokens_total" in op.metrics()
        log = op.logs()
        denied = re.findall(r".{0,200}(?:\b403 |forbidden).{0,200}", log, flags=re.IGNORECASE)
        assert denied == [], denied[:3]
    finally:
        cluster.kubectl("delete", "flow", "--all", "-n", namespace, "--wait=false", check=False)
        op.stop()
