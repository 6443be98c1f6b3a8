"""The Helm chart without a cluster: lint, render every ci/ value set, and check what it grants."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from flowkube_api import constants as c
from flowkube_api import crd
from flowkube_devstack import build, chart

REPO = Path(__file__).resolve().parents[3]
CHART = chart.CHART_DIR
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
Obj = dict[str, Any]


@pytest.fixture(scope="session")
def helm() -> Path:
    return build.ensure(build.helm(), quiet=True) / "helm"


def run_helm(helm: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)}:\n{proc.stderr}"
    return proc


def render(helm: Path, *args: str, release: str = "flowkube", namespace: str = "flowkube-system") -> list[Obj]:
    out = run_helm(helm, "template", release, str(CHART), "--namespace", namespace, *args).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def of_kind(objs: list[Obj], kind: str) -> list[Obj]:
    return [o for o in objs if o["kind"] == kind]


def named(objs: list[Obj], kind: str, name: str) -> Obj:
    found = [o for o in of_kind(objs, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


def containers(objs: list[Obj], everywhere: bool = False) -> Iterator[Obj]:
    """The operator pod's containers (every Deployment's with ``everywhere``: the console's too)."""
    for o in of_kind(objs, "Deployment"):
        if everywhere or o["metadata"]["labels"].get("app.kubernetes.io/component") == "operator":
            spec = o["spec"]["template"]["spec"]
            yield from spec.get("initContainers", []) + spec["containers"]


def env_of(container: Obj) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container.get("env", [])}


# -- generated files --------------------------------------------------------------------------------


def test_a_changed_crd_makes_the_chart_copy_stale() -> None:
    changed = crd.render().replace("A crewAI Flow run as Kubernetes runner pods.", "Something else.")
    assert changed != crd.render()
    assert chart.render(changed) != chart.CHART_CRD_FILE.read_text()


def test_rendered_crds_are_the_generated_crds(helm: Path) -> None:
    rendered = {o["spec"]["names"]["kind"]: o for o in of_kind(render(helm), "CustomResourceDefinition")}
    assert sorted(rendered) == sorted(crd.KINDS)
    for kind in crd.KINDS:
        generated = crd.crd(kind)
        assert rendered[kind]["spec"] == generated["spec"]
        labels = rendered[kind]["metadata"]["labels"]
        assert labels.items() >= generated["metadata"]["labels"].items()
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert rendered[kind]["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert rendered["ClusterFlowTemplate"]["spec"]["scope"] == "Cluster"


def test_crd_keep_and_install_switches(helm: Path) -> None:
    kept = of_kind(render(helm, "--set", "crds.keep=false"), "CustomResourceDefinition")[0]
    assert "helm.sh/resource-policy" not in (kept["metadata"].get("annotations") or {})
    assert of_kind(render(helm, "--set", "crds.install=false"), "CustomResourceDefinition") == []


def test_status_policy_is_generated_from_the_status_model() -> None:
    from flowkube_api.models import ConversationStatus, FeedbackStatus, FlowStatus

    rule = chart.status_policy_rule()
    # A new status field is protected the day it is added; only the two inboxes are left to users.
    for section, model, inbox in (("", FlowStatus, None), ("feedback.?", FeedbackStatus, "response"),
                                  ("conversation.?", ConversationStatus, "inbox")):
        for name, field in model.model_fields.items():
            alias = field.alias or name
            if (alias in ("feedback", "conversation") and not section) or alias == inbox:
                assert f"{section}{alias} ==" not in rule, alias
            else:
                assert f"object.?status.?{section}{alias} ==" in rule, alias


def _leaves(values: Any, prefix: str = "") -> Iterator[str]:
    if isinstance(values, dict) and values:
        for k, v in values.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else k)
    else:
        yield prefix


def test_every_value_is_documented_and_typed() -> None:
    values = yaml.safe_load(chart.VALUES_FILE.read_text())
    documented = {d.key for d in chart.values_docs()}
    for leaf in _leaves(values):
        parts = leaf.split(".")
        assert any(".".join(parts[:i]) in documented for i in range(1, len(parts) + 1)), leaf
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    assert set(values) <= set(schema["properties"])


def test_an_undocumented_value_is_refused() -> None:
    with pytest.raises(chart.UndocumentedValueError, match=r"`a\.b`"):
        chart.values_docs("# -- documented\nx: 1\na:\n  b: 2\n")


def test_dashboard_placeholder_is_valid_json() -> None:
    for path in (CHART / "dashboards").glob("*.json"):
        assert json.loads(path.read_text())["title"]


# -- lint and render -------------------------------------------------------------------------------


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_lint(helm: Path, values: Path) -> None:
    run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values))


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_render_is_restricted_and_least_privilege(helm: Path, values: Path) -> None:
    objs = render(helm, "-f", str(values), "--api-versions", "monitoring.coreos.com/v1")
    deploy = named(objs, "Deployment", "flowkube")
    pod = deploy["spec"]["template"]["spec"]
    # Two replicas; the Lease, not the strategy, keeps Flow status to one writer, so a rollout may
    # start the new pod before the old one goes (the state API and the webhooks stay served).
    assert deploy["spec"]["replicas"] == 2
    assert deploy["spec"]["strategy"] == {"type": "RollingUpdate",
                                          "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for ctr in containers(objs, everywhere=True):
        sc = ctr["securityContext"]
        # The validator sidecar runs as another user than the operator (none of its files); the
        # console is the operator image's other program.
        uid = {"operator": 65532, "console": 65532}.get(ctr["name"], 65533)
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid, ctr["name"]
        assert sc["readOnlyRootFilesystem"] is True, ctr["name"]
        assert sc["allowPrivilegeEscalation"] is False, ctr["name"]
        assert sc["capabilities"] == {"drop": ["ALL"]}, ctr["name"]
        assert sc["seccompProfile"] == {"type": "RuntimeDefault"}, ctr["name"]
        assert ctr["resources"].get("requests"), ctr["name"]
    for role in of_kind(objs, "ClusterRole") + of_kind(objs, "Role"):
        for rule in role["rules"]:
            for key in ("verbs", "resources", "apiGroups", "resourceNames", "nonResourceURLs"):
                assert "*" not in rule.get(key, []), (role["metadata"]["name"], rule)
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
    _assert_no_per_flow_rbac_and_least_configmap_access(objs)


def test_the_console_is_on_by_default_behind_a_service_and_holds_no_credentials(helm: Path) -> None:
    objs = render(helm)
    deploy = named(objs, "Deployment", "flowkube-console")
    pod = deploy["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False and "serviceAccountName" not in pod
    assert not any("serviceAccountToken" in str(v) for v in pod.get("volumes", []))
    (ctr,) = pod["containers"]
    assert ctr["command"] == ["flowkube-console"] and ctr["image"] == named(objs, "Deployment", "flowkube")[
        "spec"]["template"]["spec"]["containers"][0]["image"]
    env = {e["name"]: e for e in ctr["env"]}
    assert env["FLOWKUBE_CONSOLE_SESSION_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "flowkube-console"
    service = named(objs, "Service", "flowkube-console")
    assert service["spec"]["selector"]["app.kubernetes.io/component"] == "console"
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert not [o for o in render(helm, "--set", "console.enabled=false") if "console" in o["metadata"]["name"]]
    own = render(helm, "--set", "console.existingSecret=my-key")
    assert not [o for o in own if o["kind"] == "Secret" and o["metadata"]["name"] == "flowkube-console"]
    ctr = named(own, "Deployment", "flowkube-console")["spec"]["template"]["spec"]["containers"][0]
    key = next(e for e in ctr["env"] if e["name"] == "FLOWKUBE_CONSOLE_SESSION_KEY")
    assert key["valueFrom"]["secretKeyRef"] == {"name": "my-key", "key": "session-key"}


def _operator_rules(objs: list[Obj]) -> list[Obj]:
    roles = [o for o in of_kind(objs, "ClusterRole") + of_kind(objs, "Role")
             if o["metadata"]["name"] == "flowkube-operator"]
    assert roles
    return [rule for role in roles for rule in role["rules"]]


def _assert_no_per_flow_rbac_and_least_configmap_access(objs: list[Obj]) -> None:
    """Runner pods hold no API credentials, so the operator makes no per-Flow RBAC: it needs no
    ServiceAccounts, Roles or RoleBindings, and only get/create/patch/delete on ConfigMaps (the state
    it writes for runners, authenticated by TokenReview)."""
    rules = _operator_rules(objs)
    resources = {r for rule in rules for r in rule.get("resources", [])}
    assert not resources & {"serviceaccounts", "serviceaccounts/token", "roles", "rolebindings",
                            "clusterroles", "clusterrolebindings"}, resources
    assert "rbac.authorization.k8s.io" not in {g for rule in rules for g in rule.get("apiGroups", [])}
    for rule in rules:
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"]), rule
        if "configmaps" in rule.get("resources", []):
            assert sorted(rule["verbs"]) == ["create", "delete", "get", "patch"], rule
    grants = _grants(rules)
    assert grants[("", "configmaps")] == {"get", "create", "patch", "delete"}
    assert grants[("authentication.k8s.io", "tokenreviews")] == {"create"}


def _grants(rules: list[Obj]) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in rules:
        assert not rule.get("resourceNames") or rule["apiGroups"] == ["admissionregistration.k8s.io"]
        for group in rule.get("apiGroups", []):
            for res in rule.get("resources", []):
                out.setdefault((group, res), set()).update(rule["verbs"])
        for url in rule.get("nonResourceURLs", []):
            out.setdefault(("nonResourceURL", url), set()).update(rule["verbs"])
    return out


def test_feedback_responder_can_only_read_flows_and_patch_status(helm: Path) -> None:
    role = named(render(helm), "ClusterRole", "flowkube-feedback-responder")
    assert _grants(role["rules"]) == {
        (c.GROUP, c.PLURAL): {"get", "list", "watch"},
        (c.GROUP, f"{c.PLURAL}/status"): {"get", "patch"},  # kubectl reads before it patches
    }
    assert role["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"


def test_user_roles(helm: Path) -> None:
    objs = render(helm)
    viewer = named(objs, "ClusterRole", "flowkube-flow-viewer")
    editor = named(objs, "ClusterRole", "flowkube-flow-editor")
    assert _grants(viewer["rules"]) == {(c.GROUP, "flows"): {"get", "list", "watch"},
                                        (c.GROUP, "flows/status"): {"get", "list", "watch"},
                                        (c.GROUP, "flowtemplates"): {"get", "list", "watch"},
                                        (c.GROUP, "cronflows"): {"get", "list", "watch"},
                                        (c.GROUP, "cronflows/status"): {"get", "list", "watch"},
                                        (c.GROUP, "flowquotas"): {"get", "list", "watch"},
                                        (c.GROUP, "flowquotas/status"): {"get", "list", "watch"},
                                        (c.GROUP, "clusterflowtemplates"): {"get", "list", "watch"},
                                        (c.GROUP, "clusterflowquotas"): {"get", "list", "watch"},
                                        (c.GROUP, "clusterflowquotas/status"): {"get", "list", "watch"},
                                        # the template snapshot a Flow runs (the console reads it)
                                        ("apps", "controllerrevisions"): {"get"}}
    assert viewer["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    every = {"get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"}
    assert _grants(editor["rules"]) == {(c.GROUP, "flows"): every, (c.GROUP, "flowtemplates"): every,
                                        (c.GROUP, "cronflows"): every}
    # Shared templates are a platform team's: a role of their own, in no default role.
    shared = named(objs, "ClusterRole", "flowkube-clusterflowtemplate-editor")
    assert _grants(shared["rules"]) == {(c.GROUP, "clusterflowtemplates"): every}
    assert not [k for k in shared["metadata"]["labels"] if k.startswith("rbac.authorization.k8s.io/")]
    assert "flows/status" not in {r for rule in editor["rules"] for r in rule["resources"]}
    # A namespace's quotas are its admins', not its editors': whoever edits Flows cannot lift them,
    # and nobody but the operator writes their status.
    teams = named(objs, "ClusterRole", "flowkube-clusterflowquota-editor")
    assert _grants(teams["rules"]) == {(c.GROUP, "clusterflowquotas"): every}
    assert not [k for k in teams["metadata"]["labels"] if k.startswith("rbac.authorization.k8s.io/")]
    quotas = named(objs, "ClusterRole", "flowkube-flowquota-editor")
    assert _grants(quotas["rules"]) == {(c.GROUP, "flowquotas"): every}
    assert [k for k in quotas["metadata"]["labels"] if k.startswith("rbac.authorization.k8s.io/")] == [
        "rbac.authorization.k8s.io/aggregate-to-admin"]
    plain = render(helm, "--set", "rbac.aggregateToDefaultRoles=false")
    for name in ("flow-viewer", "flow-editor", "feedback-responder"):
        labels = named(plain, "ClusterRole", f"flowkube-{name}")["metadata"]["labels"]
        assert not [k for k in labels if k.startswith("rbac.authorization.k8s.io/")]


EXPECTED_OPERATOR_GRANTS = {
    # create: a CronFlow's scheduled Flows; delete: TTLs and a CronFlow's history limits.
    (c.GROUP, "flows"): {"get", "list", "watch", "create", "patch", "delete"},
    (c.GROUP, "cronflows"): {"get", "list", "watch"},
    (c.GROUP, "cronflows/status"): {"get", "patch", "update"},
    (c.GROUP, "cronflows/finalizers"): {"update"},
    (c.GROUP, "flows/status"): {"get", "patch", "update"},
    (c.GROUP, "flows/finalizers"): {"update"},
    (c.GROUP, "flowtemplates"): {"get", "list", "watch"},  # read at admission, taken at a Flow's start
    ("", "pods"): {"get", "list", "watch", "create", "delete"},
    # The state ConfigMap: made on first use, written for the runners, reports read. No list/watch.
    ("", "configmaps"): {"get", "create", "patch", "delete"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    # Template snapshots: made at a Flow's take, read on demand, deleted once no Flow names them.
    ("apps", "controllerrevisions"): {"get", "list", "watch", "create", "delete"},
    # Notifications: only list/watch, which the operator sends with the flowkube.io/notifications
    # label selector; no get, so no Flow can point it at another Secret.
    ("", "secrets"): {"list", "watch"},
}
CLUSTER_GRANTS = {
    (c.GROUP, "clusterflowtemplates"): {"get", "list", "watch"},
    # Notifications: the cluster's own ranges (Services, nodes' pods and addresses), denied as
    # receivers' addresses, watched to stay current; no get.
    ("networking.k8s.io", "servicecidrs"): {"list", "watch"},
    ("", "nodes"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"},
    ("authentication.k8s.io", "tokenreviews"): {"create"},  # runner pods' tokens, at the state API
    # The service-account issuer's keys: runner tokens are checked with them before a TokenReview.
    ("nonResourceURL", "/.well-known/openid-configuration"): {"get"},
    ("nonResourceURL", "/openid/v1/jwks"): {"get"},
    ("authorization.k8s.io", "subjectaccessreviews"): {"create"},  # may this scraper get /metrics; may this person fork
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): {"get", "patch", "update"},
    ("admissionregistration.k8s.io", "mutatingwebhookconfigurations"): {"get", "patch", "update"},
}


def test_operator_rbac_cluster_scope(helm: Path) -> None:
    objs = render(helm)
    role = named(objs, "ClusterRole", "flowkube-operator")
    assert _grants(role["rules"]) == {**EXPECTED_OPERATOR_GRANTS, **CLUSTER_GRANTS,
                                      ("", "namespaces"): {"list", "watch"}}
    webhook_rule = next(r for r in role["rules"] if r.get("apiGroups") == ["admissionregistration.k8s.io"])
    assert webhook_rule["resourceNames"] == ["flowkube-flowkube-system.flowkube.io"]
    binding = named(objs, "ClusterRoleBinding", "flowkube-operator")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flowkube",
                                    "namespace": "flowkube-system"}]
    # Its Roles, both in its own namespace: get/patch on its own CA Secret, by name (no `create`), and
    # its leader-election Lease.
    ca_role, leader_role = (named(objs, "Role", n) for n in ("flowkube-operator-ca", "flowkube-operator-leader"))
    assert len(of_kind(objs, "Role")) == 2
    assert ca_role["metadata"] == {**ca_role["metadata"], "name": "flowkube-operator-ca",
                                   "namespace": "flowkube-system"}
    assert ca_role["rules"] == [{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["flowkube-ca"],
                                 "verbs": ["get", "patch"]}]
    assert leader_role["metadata"]["namespace"] == "flowkube-system"
    _assert_leader_election_role(leader_role)
    secret = named(objs, "Secret", "flowkube-ca")
    assert "data" not in secret  # filled in by the operator, kept by `helm upgrade`
    env = {e["name"]: e.get("value") for e in named(objs, "Deployment", "flowkube")["spec"]["template"]["spec"][
        "containers"][0]["env"]}
    assert env["FLOWKUBE_TLS_SECRET"] == "flowkube-system/flowkube-ca"


def test_notifications_off_take_the_secret_grant_away_and_the_values_reach_the_operator(helm: Path) -> None:
    on = render(helm, "--set", "notifications.allowedCIDRs={10.96.0.10/32,10.244.0.0/16}",
                "--set", "console.externalURL=https://flows.example.com")
    env = env_of(next(containers(on)))
    assert env["FLOWKUBE_NOTIFICATIONS_ENABLED"] == "true"
    assert env["FLOWKUBE_NOTIFICATIONS_ALLOWED_CIDRS"] == "10.96.0.10/32,10.244.0.0/16"
    assert env["FLOWKUBE_NOTIFICATIONS_DENIED_CIDRS"].startswith("10.0.0.0/8,172.16.0.0/12,")
    assert env["FLOWKUBE_CONSOLE_URL"] == "https://flows.example.com"
    off = render(helm, "--set", "notifications.enabled=false")
    assert env_of(next(containers(off)))["FLOWKUBE_NOTIFICATIONS_ENABLED"] == "false"
    off_grants = _grants(named(off, "ClusterRole", "flowkube-operator")["rules"])
    assert not {("", "secrets"), ("", "nodes"), ("networking.k8s.io", "servicecidrs")} & off_grants.keys()


def test_quotas_on_grant_the_flowquota_watch_and_status_and_tell_the_operator(helm: Path) -> None:
    off = render(helm)
    assert env_of(next(containers(off)))["FLOWKUBE_QUOTAS_ENABLED"] == "false"
    assert not {(c.GROUP, "flowquotas"), (c.GROUP, "flowquotas/status")} & _grants(_operator_rules(off)).keys()
    on = render(helm, "--set", "quotas.enabled=true", "--set", "quotas.statusSeconds=0.5")
    env = env_of(next(containers(on)))
    assert (env["FLOWKUBE_QUOTAS_ENABLED"], env["FLOWKUBE_QUOTA_STATUS_SECONDS"]) == ("true", "0.5")
    grants = _grants(_operator_rules(on))
    assert grants[(c.GROUP, "flowquotas")] == {"get", "list", "watch"}
    assert grants[(c.GROUP, "flowquotas/status")] == {"get", "patch"}, "the operator never changes a quota's spec"
    cluster = _grants(named(on, "ClusterRole", "flowkube-operator")["rules"])
    assert cluster[(c.GROUP, "clusterflowquotas")] == {"get", "list", "watch"}
    assert cluster[(c.GROUP, "clusterflowquotas/status")] == {"get", "patch"}
    assert cluster[("", "namespaces")] == {"list", "watch"}, "a namespaceSelector's labels, no get"
    assert (c.GROUP, "clusterflowquotas") not in _grants(named(off, "ClusterRole", "flowkube-operator")["rules"])
    namespaced = render(helm, "--set", "quotas.enabled=true", "--set", "rbac.scope=namespaced",
                        "--set", "watchNamespaces={team-a}")
    assert _grants(named(namespaced, "ClusterRole", "flowkube-operator")["rules"])[("", "namespaces")] == {
        "list", "watch"}
    assert named(on, "CustomResourceDefinition", "flowquotas.flowkube.io")["spec"]["names"]["shortNames"] == ["fq"]


def _assert_leader_election_role(role: Obj) -> None:
    """get/update/patch on the one Lease by name; create on Leases (RBAC cannot restrict it by name)."""
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["flowkube-operator"],
         "verbs": ["get", "update", "patch"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
    ]


def test_leader_election_and_the_disruption_budget(helm: Path) -> None:
    objs = render(helm)
    env = env_of(next(containers(objs)))
    assert env["FLOWKUBE_LEADER_ELECTION"] == "true"
    assert env["FLOWKUBE_LEADER_ELECTION_LEASE"] == "flowkube-operator"
    operator = next(containers(objs))
    (ns_env,) = [e for e in operator["env"] if e["name"] == "FLOWKUBE_LEADER_ELECTION_NAMESPACE"]
    assert ns_env["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    binding = named(objs, "RoleBinding", "flowkube-operator-leader")
    assert binding["roleRef"]["name"] == "flowkube-operator-leader"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flowkube", "namespace": "flowkube-system"}]
    pdb = named(objs, "PodDisruptionBudget", "flowkube")
    assert pdb["metadata"]["namespace"] == "flowkube-system"
    assert pdb["spec"]["minAvailable"] == 1
    deploy = named(objs, "Deployment", "flowkube")
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    assert deploy["spec"]["template"]["metadata"]["labels"] | pdb["spec"]["selector"]["matchLabels"] \
        == deploy["spec"]["template"]["metadata"]["labels"]
    # Two replicas prefer two nodes (one node still runs both); an affinity of the user's replaces that.
    spread = deploy["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    (term,) = spread["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert term["podAffinityTerm"]["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    own = render(helm, "--set", "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                 ".nodeSelectorTerms[0].matchExpressions[0].key=pool",
                 "--set", "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
                 ".nodeSelectorTerms[0].matchExpressions[0].operator=Exists")
    assert list(named(own, "Deployment", "flowkube")["spec"]["template"]["spec"]["affinity"]) == ["nodeAffinity"]
    # One replica: no budget (minAvailable 1 would block every drain), leader election still on
    # (a rollout runs two pods for a moment).
    single = render(helm, "--set", "replicaCount=1")
    assert "affinity" not in named(single, "Deployment", "flowkube")["spec"]["template"]["spec"]
    assert not of_kind(single, "PodDisruptionBudget")
    assert named(single, "Deployment", "flowkube")["spec"]["replicas"] == 1
    assert env_of(next(containers(single)))["FLOWKUBE_LEADER_ELECTION"] == "true"
    # The Lease follows the release's names, so two releases in one namespace do not share it.
    other = render(helm, release="other")
    assert env_of(next(containers(other)))["FLOWKUBE_LEADER_ELECTION_LEASE"] == "other-flowkube-operator"
    assert named(other, "Role", "other-flowkube-operator-leader")["rules"][0]["resourceNames"] == [
        "other-flowkube-operator"]
    # Without chart RBAC there is no Role, and the chart says nothing more about the Lease.
    assert not [r for r in of_kind(render(helm, "--set", "rbac.create=false"), "Role")]


def test_operator_rbac_namespaced_scope(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "namespaced-values.yaml"))
    cluster_role = named(objs, "ClusterRole", "flowkube-operator")
    assert _grants(cluster_role["rules"]) == CLUSTER_GRANTS
    roles = [r for r in of_kind(objs, "Role")
             if r["metadata"]["name"] not in ("flowkube-operator-ca", "flowkube-operator-leader")]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert _grants(role["rules"]) == EXPECTED_OPERATOR_GRANTS
    # The Lease stays in the release namespace, whatever namespaces are watched.
    _assert_leader_election_role(named(objs, "Role", "flowkube-operator-leader"))
    assert named(objs, "Role", "flowkube-operator-leader")["metadata"]["namespace"] == "flowkube-system"
    assert sorted(b["metadata"]["namespace"] for b in of_kind(objs, "RoleBinding")) == [
        "flowkube-system", "flowkube-system", "team-a", "team-b"]
    env = env_of(next(containers(objs)))
    assert env["FLOWKUBE_WATCH_NAMESPACES"] == "team-a,team-b"
    for hook in (of_kind(objs, "ValidatingWebhookConfiguration")[0]["webhooks"]
                 + of_kind(objs, "MutatingWebhookConfiguration")[0]["webhooks"]):
        assert hook["namespaceSelector"]["matchExpressions"] == [
            {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]


def test_minimal_install_has_no_webhooks_validator_or_crd(helm: Path) -> None:
    objs = render(helm, "-f", str(CHART / "ci" / "minimal-values.yaml"))
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"CustomResourceDefinition", "ValidatingWebhookConfiguration",
                        "MutatingWebhookConfiguration"}
    assert [ctr["name"] for ctr in containers(objs)] == ["operator"]
    env = env_of(next(containers(objs)))
    assert env["FLOWKUBE_WEBHOOK_ENABLED"] == "false"
    assert "FLOWKUBE_VALIDATOR_URL" not in env
    role = named(objs, "ClusterRole", "flowkube-operator")
    assert ("admissionregistration.k8s.io", "validatingwebhookconfigurations") not in _grants(role["rules"])
    assert sorted(s["metadata"]["name"] for s in of_kind(objs, "Service")) == ["flowkube-metrics",
                                                                               "flowkube-webhook"]
    # The state API is served with or without webhooks, and its certificate names the Service.
    assert named(objs, "Service", "flowkube-webhook")["spec"]["ports"] == [
        {"name": "state", "port": 8443, "targetPort": "state", "protocol": "TCP"}]
    assert env["FLOWKUBE_WEBHOOK_SERVICE"] == "flowkube-system/flowkube-webhook"
    assert env["FLOWKUBE_STATE_PORT"] == "8443"
    assert "FLOWKUBE_WEBHOOK_CONFIGURATION" not in env
    assert {p["name"] for p in next(containers(objs))["ports"]} == {"health", "metrics", "state"}
    assert _grants(role["rules"])[("authentication.k8s.io", "tokenreviews")] == {"create"}


def test_operator_settings_and_ports(helm: Path) -> None:
    objs = render(helm)
    operator, validator = containers(objs)
    env = env_of(operator)
    assert env == env | {
        "FLOWKUBE_RUNNER_IMAGE": "ghcr.io/flowkube/flowkube-runner:0.1.0",
        "FLOWKUBE_WATCH_NAMESPACES": "",
        "FLOWKUBE_HEALTH_PORT": "8080",
        "FLOWKUBE_METRICS_PORT": "9090",
        "FLOWKUBE_WEBHOOK_PORT": "9443",
        "FLOWKUBE_STATE_PORT": "8443",
        "FLOWKUBE_WEBHOOK_ENABLED": "true",
        "FLOWKUBE_WEBHOOK_SERVICE": "flowkube-system/flowkube-webhook",
        "FLOWKUBE_WEBHOOK_CONFIGURATION": "flowkube-flowkube-system.flowkube.io",
        "FLOWKUBE_VALIDATOR_URL": "http://127.0.0.1:8081/validate",
        "FLOWKUBE_METRICS_PER_FLOW": "true",
        "FLOWKUBE_METRICS_LABEL_VALUES": "20",
        "FLOWKUBE_LOG_FORMAT": "json",
        "FLOWKUBE_LOG_LEVEL": "INFO",
    }
    assert operator["image"] == "ghcr.io/flowkube/flowkube-operator:0.1.0"
    assert "command" not in operator  # the image's entrypoint, flowkube-operator
    assert {p["name"]: p["containerPort"] for p in operator["ports"]} == {
        "health": 8080, "metrics": 9090, "state": 8443, "webhook": 9443}
    assert operator["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    # Ready only once its webhooks can answer: a Flow applied right after `helm install --wait` is admitted.
    assert operator["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert validator["image"] == "ghcr.io/flowkube/flowkube-runner:0.1.0"
    assert validator["args"] == ["validate-server", "--host", "127.0.0.1", "--port", "8081"]
    metrics = named(objs, "Service", "flowkube-metrics")
    assert metrics["spec"]["ports"] == [{"name": "metrics", "port": 9090, "targetPort": "metrics",
                                         "protocol": "TCP"}]
    custom = env_of(next(containers(render(
        helm, "--set", "log.format=text", "--set", "metrics.perFlow=false", "--set", "watchNamespaces={a,b}",
        "--set", "extraEnv[0].name=FLOWKUBE_EXTRA", "--set-string", "extraEnv[0].value=1",
        "--set", "runner.defaultEnv.OPENAI_BASE_URL=http://llm:8080/v1"))))
    assert custom["FLOWKUBE_LOG_FORMAT"] == "text"
    assert custom["FLOWKUBE_METRICS_PER_FLOW"] == "false"
    assert custom["FLOWKUBE_WATCH_NAMESPACES"] == "a,b"
    assert custom["FLOWKUBE_EXTRA"] == "1"
    assert json.loads(custom["FLOWKUBE_RUNNER_DEFAULT_ENV"]) == {"OPENAI_BASE_URL": "http://llm:8080/v1"}
    assert "FLOWKUBE_RUNNER_DEFAULT_ENV" not in env


def test_state_port_follows_the_value(helm: Path) -> None:
    objs = render(helm, "--set", "state.port=10443")
    operator = next(containers(objs))
    assert env_of(operator)["FLOWKUBE_STATE_PORT"] == "10443"
    assert {p["name"]: p["containerPort"] for p in operator["ports"]}["state"] == 10443
    # The operator derives the runners' URL from the Service name and its own state port, so the
    # Service must expose the state API on that same port.
    ports = {p["name"]: p for p in named(objs, "Service", "flowkube-webhook")["spec"]["ports"]}
    assert ports["state"] == {"name": "state", "port": 10443, "targetPort": "state", "protocol": "TCP"}
    assert ports["https"]["port"] == 443


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_the_operator_understands_every_setting_the_chart_gives_it(
        helm: Path, values: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowkube_operator.settings import Settings

    objs = render(helm, "-f", str(values), "--set", "runner.defaultEnv.A=b",
                  "--set", "runner.enforcedEnv.OPENAI_BASE_URL=http://gateway/v1")
    operator = next(ctr for ctr in containers(objs) if ctr["name"] == "operator")
    env = env_of(operator)
    for e in operator["env"]:  # values the chart keeps in its own ConfigMaps
        if (ref := (e.get("valueFrom") or {}).get("configMapKeyRef")) is not None:
            env[e["name"]] = named(objs, "ConfigMap", ref["name"])["data"][ref["key"]]
    for name, value in env.items():
        assert name.startswith("FLOWKUBE_"), name
        assert name.removeprefix("FLOWKUBE_").lower() in Settings.model_fields, f"{name}: no such setting"
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert settings.runner_image == env["FLOWKUBE_RUNNER_IMAGE"]
    assert settings.runner_default_env == {"A": "b"}
    assert settings.runner_enforced_env == {"OPENAI_BASE_URL": "http://gateway/v1"}
    # The chart's reserved prefixes are the operator's default, stated where the platform team edits them.
    assert settings.runner_reserved_metadata_prefixes == Settings.model_fields[
        "runner_reserved_metadata_prefixes"].get_default(call_default_factory=True)
    assert (settings.health_port, settings.metrics_port, settings.webhook_port) == (8080, 9090, 9443)
    assert settings.state_port == 8443
    assert settings.watch_namespaces == [n for n in env["FLOWKUBE_WATCH_NAMESPACES"].split(",") if n]
    assert settings.webhook_enabled is (values.stem != "minimal-values")
    # Always set: the state API's serving certificate and URL come from the Service.
    ns, name = settings.webhook_service.split("/")
    assert (ns, name) == ("flowkube-system", "flowkube-webhook")
    service = named(objs, "Service", name)
    state_port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "state")
    assert settings.state_endpoint == f"https://{name}.{ns}.svc:{state_port}"
    if settings.webhook_enabled:
        assert settings.webhook_configuration == of_kind(objs, "ValidatingWebhookConfiguration")[0]["metadata"]["name"]


def test_webhooks(helm: Path) -> None:
    objs = render(helm)
    service = named(objs, "Service", "flowkube-webhook")
    assert service["spec"]["ports"] == [
        {"name": "state", "port": 8443, "targetPort": "state", "protocol": "TCP"},
        {"name": "https", "port": 443, "targetPort": "webhook", "protocol": "TCP"},
    ]
    validating = of_kind(objs, "ValidatingWebhookConfiguration")[0]["webhooks"]
    mutating = of_kind(objs, "MutatingWebhookConfiguration")[0]["webhooks"]
    table = {(h["clientConfig"]["service"]["path"], h["rules"][0]["resources"][0],
              tuple(h["rules"][0]["operations"]), h["failurePolicy"]) for h in validating + mutating}
    assert table == {
        ("/validate-flows", "flows", ("CREATE", "UPDATE"), "Fail"),
        ("/validate-flowtemplates", "flowtemplates", ("CREATE", "UPDATE"), "Fail"),
        ("/validate-clusterflowtemplates", "clusterflowtemplates", ("CREATE", "UPDATE"), "Fail"),
        ("/validate-cronflows", "cronflows", ("CREATE", "UPDATE"), "Fail"),
        ("/validate-flows-status", "flows/status", ("UPDATE",), "Ignore"),
        ("/mutate-flows-status", "flows/status", ("UPDATE",), "Ignore"),
    }
    for hook in validating + mutating:
        assert "caBundle" not in hook["clientConfig"]  # the operator patches it in
        assert hook["clientConfig"]["service"]["name"] == "flowkube-webhook"
        assert hook["sideEffects"] == "None"
        assert "namespaceSelector" not in hook
    flows = validating[0]
    assert flows["name"] == "flows.validate.flowkube.io"
    # Inline definitions, the schemaless fields' bounds and the runner pod policy are checked; a
    # flowRef Flow with none of those fields is admitted without a round trip.
    assert flows["matchConditions"] == [
        {"name": "spec-written", "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec"},
        {"name": "checked-fields", "expression": (
            "has(object.spec.definition) || has(object.spec.inputs) || has(object.spec.envFrom) "
            "|| has(object.spec.podTemplate) || has(object.spec.env) || has(object.spec.image) "
            "|| has(object.spec.templateRef) || has(object.spec.forkFrom)")},
    ]
    # With quotas on, every new Flow is sent: a used-up FlowQuota with action Refuse refuses it.
    quota_hook = next(h for h in of_kind(render(helm, "--set", "quotas.enabled=true"),
                                         "ValidatingWebhookConfiguration")[0]["webhooks"]
                      if h["name"] == "flows.validate.flowkube.io")
    assert quota_hook["matchConditions"][1]["expression"].endswith(
        "|| has(object.spec.templateRef) || has(object.spec.forkFrom) || request.operation == 'CREATE'")
    for hook in [h for h in validating + mutating if "-status" in h["name"]]:
        assert hook["matchConditions"] == [{
            "name": "not-the-operator",
            "expression": "request.userInfo.username != \"system:serviceaccount:flowkube-system:flowkube\""}]
    flipped = render(helm, "--set", "webhook.failurePolicy.flows=Ignore",
                     "--set", "webhook.failurePolicy.status=Fail")
    policies = [h["failurePolicy"] for h in of_kind(flipped, "ValidatingWebhookConfiguration")[0]["webhooks"]]
    assert policies == ["Ignore"] * 4 + ["Fail"]  # Flows, templates, CronFlows; feedback


def test_service_monitor_needs_the_api_and_the_switch(helm: Path) -> None:
    monitoring = CHART / "ci" / "monitoring-values.yaml"
    without_api = render(helm, "-f", str(monitoring))
    assert of_kind(without_api, "ServiceMonitor") == []
    with_api = render(helm, "-f", str(monitoring), "--api-versions", "monitoring.coreos.com/v1")
    sm = named(with_api, "ServiceMonitor", "flowkube")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert sm["spec"]["endpoints"][0]["port"] == "metrics"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert sm["spec"]["endpoints"][0]["honorLabels"] is True  # the Flow's namespace, not the operator's
    metrics_service = named(with_api, "Service", "flowkube-metrics")
    assert metrics_service["metadata"]["labels"].items() >= sm["spec"]["selector"]["matchLabels"].items()
    assert of_kind(render(helm, "--api-versions", "monitoring.coreos.com/v1"), "ServiceMonitor") == []


def test_dashboards_configmap(helm: Path) -> None:
    assert [o["metadata"]["name"] for o in of_kind(render(helm), "ConfigMap")] == ["flowkube-prices"]
    cm = named(render(helm, "--set", "dashboards.enabled=true"), "ConfigMap", "flowkube-dashboards")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted(p.name for p in (CHART / "dashboards").glob("*.json"))
    assert sorted(cm["data"]) == files and "flowkube.json" in files
    for name in files:
        assert json.loads(cm["data"][name]) == json.loads((CHART / "dashboards" / name).read_text())


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "bogus=1"], "additional properties 'bogus' not allowed"),
        (["--set", "rbac.scope=namespaced"], "watchNamespaces"),
        (["--set", "webhook.failurePolicy.flows=Maybe"], "webhook/failurePolicy/flows"),
        (["--set", "log.format=xml"], "log/format"),
        (["--set", "state.port=0"], "state/port"),
        (["--set", "state.port=9090"], "state.port 9090 is already the port of another endpoint"),
        (["--set", "state.port=9443"], "state.port 9443 is already the port of another endpoint"),
        (["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
        (["--set", "extraEnv[0].name=X", "--set", "extraEnv[0].value=1"], "extraEnv/0/value"),
    ],
)
def test_bad_values_are_refused(helm: Path, args: list[str], message: str) -> None:
    proc = run_helm(helm, "template", "flowkube", str(CHART), *args, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_names_follow_the_release(helm: Path) -> None:
    objs = render(helm, release="team", namespace="ops")
    names = {o["metadata"]["name"] for o in of_kind(objs, "ClusterRole")}
    assert names == {"team-flowkube-operator", "team-flowkube-flow-viewer", "team-flowkube-flow-editor",
                     "team-flowkube-feedback-responder", "team-flowkube-metrics-reader",
                     "team-flowkube-clusterflowtemplate-editor", "team-flowkube-flowquota-editor",
                     "team-flowkube-clusterflowquota-editor"}
    assert of_kind(objs, "ValidatingWebhookConfiguration")[0]["metadata"]["name"] == "team-flowkube-ops.flowkube.io"


# -- scripts and images ----------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_kind_e2e_script_is_shellcheck_clean() -> None:
    proc = subprocess.run(["shellcheck", "--severity=style", str(REPO / "hack" / "kind-e2e.sh")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint is not installed")
@pytest.mark.parametrize("dockerfile", ["operator/Dockerfile", "runner/Dockerfile", "devstack/Dockerfile",
                                        "examples/runner-image/Dockerfile"])
def test_dockerfiles_are_hadolint_clean(dockerfile: str) -> None:
    proc = subprocess.run(["hadolint", str(REPO / dockerfile)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(("component", "extra"), [("operator", "operator"), ("runner", "runner")])
def test_dockerfiles_install_the_right_extra_as_non_root(component: str, extra: str) -> None:
    text = (REPO / component / "Dockerfile").read_text()
    final = text.rsplit("\nFROM ", 1)[1]
    assert f"[{extra}]" in final or f"[{extra}," in final
    assert "USER 65532:65532" in final
    assert f'ENTRYPOINT ["flowkube-{component}"]' in final
    assert "--no-cache-dir" in final
    assert "apt-get" not in final and "build-essential" not in final


def test_price_overrides_reach_the_operator_from_a_configmap_and_roll_it_on_change(helm: Path) -> None:
    objs = render(helm, "--set-json", 'runner.prices={"my-llama":{"prompt":"0.20","completion":"0.60"}}')
    cm = named(objs, "ConfigMap", "flowkube-prices")
    assert json.loads(cm["data"]["prices.json"]) == {"my-llama": {"prompt": "0.20", "completion": "0.60"}}
    deployment = named(objs, "Deployment", "flowkube")
    operator = deployment["spec"]["template"]["spec"]["containers"][0]
    prices = next(e for e in operator["env"] if e["name"] == "FLOWKUBE_RUNNER_PRICES")
    assert prices["valueFrom"]["configMapKeyRef"] == {"name": "flowkube-prices", "key": "prices.json"}
    checksum = deployment["spec"]["template"]["metadata"]["annotations"]["checksum/prices"]
    plain = named(render(helm), "Deployment", "flowkube")["spec"]["template"]["metadata"]["annotations"]
    assert plain["checksum/prices"] != checksum
    assert json.loads(named(render(helm), "ConfigMap", "flowkube-prices")["data"]["prices.json"]) == {}
    bad = run_helm(helm, "template", "x", str(CHART), "--set", "runner.prices.m.prompt=cheap",
                   "--set", "runner.prices.m.completion=1", check=False)
    assert bad.returncode != 0 and "prompt" in bad.stderr


def test_the_operators_requests_get_the_priority_levels_of_kube_controller_managers(helm: Path) -> None:
    objs = render(helm, release="fk", namespace="ops")
    schemas = {s["spec"]["priorityLevelConfiguration"]["name"]: s["spec"] for s in of_kind(objs, "FlowSchema")}
    assert set(schemas) == {"leader-election", "workload-high"}
    for spec in schemas.values():
        assert spec["matchingPrecedence"] < 9000  # before the built-in `service-accounts` (workload-low)
        for rule in spec["rules"]:
            assert rule["subjects"] == [{"kind": "ServiceAccount",
                                         "serviceAccount": {"name": "fk-flowkube", "namespace": "ops"}}]
    lease = schemas["leader-election"]["rules"][0]["resourceRules"]
    assert lease == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                      "verbs": ["get", "create", "update"], "namespaces": ["ops"]}]
    assert schemas["leader-election"]["matchingPrecedence"] < schemas["workload-high"]["matchingPrecedence"]
    off = render(helm, "--set", "priorityAndFairness.enabled=false")
    assert not of_kind(off, "FlowSchema")


def test_a_stopping_operator_pod_keeps_serving_until_its_endpoint_is_gone(helm: Path) -> None:
    objs = render(helm)
    operator = next(ctr for ctr in containers(objs) if ctr["name"] == "operator")
    assert operator["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}
    off = render(helm, "--set", "preStopSleepSeconds=0")
    assert "lifecycle" not in next(ctr for ctr in containers(off) if ctr["name"] == "operator")


def test_the_validator_sidecar_holds_no_credentials_and_none_of_the_operators_files(helm: Path) -> None:
    """It loads tenants' definitions with crewAI: no API token, another UID, a /tmp of its own."""
    objs = render(helm)
    deployment = named(objs, "Deployment", "flowkube")
    pod = deployment["spec"]["template"]["spec"]
    operator, validator = containers(objs)
    assert pod["automountServiceAccountToken"] is False
    mounts = {c["name"]: {m["name"]: m["mountPath"] for m in c["volumeMounts"]} for c in (operator, validator)}
    assert mounts["operator"]["kube-api-access"] == "/var/run/secrets/kubernetes.io/serviceaccount"
    assert mounts["validator"] == {"validator-tmp": "/tmp"}
    volumes = {v["name"]: v for v in pod["volumes"]}
    sources = volumes["kube-api-access"]["projected"]["sources"]
    assert [next(iter(s)) for s in sources] == ["serviceAccountToken", "configMap", "downwardAPI"]
    assert validator["securityContext"]["runAsUser"] != pod["securityContext"]["runAsUser"]
    assert "runAsUser" not in operator["securityContext"] or operator["securityContext"]["runAsUser"] == 65532


def test_watching_some_namespaces_grants_rights_in_those_alone(helm: Path) -> None:
    """rbac.scope=cluster with watchNamespaces used to grant pod create in every namespace."""
    objs = render(helm, "--set", "watchNamespaces={team-a}", "--set", "rbac.scope=cluster")
    assert _grants(named(objs, "ClusterRole", "flowkube-operator")["rules"]) == CLUSTER_GRANTS
    roles = [r for r in of_kind(objs, "Role") if r["metadata"]["namespace"] == "team-a"]
    assert [_grants(r["rules"]) for r in roles] == [EXPECTED_OPERATOR_GRANTS]


def test_network_policies_keep_the_state_api_for_runner_pods_and_runners_closed(helm: Path) -> None:
    from flowkube_api import constants as c

    objs = render(helm, "--set", "watchNamespaces={team-a}")
    operator, runners = of_kind(objs, "NetworkPolicy")
    runner_labels = {c.LABEL_MANAGED_BY: c.MANAGED_BY, c.LABEL_COMPONENT: c.COMPONENT_RUNNER}
    state_rule, open_rule = operator["spec"]["ingress"]
    assert state_rule["from"] == [{"namespaceSelector": {}, "podSelector": {"matchLabels": runner_labels}}]
    assert state_rule["ports"] == [{"port": 8443, "protocol": "TCP"}]
    assert "from" not in open_rule and {p["port"] for p in open_rule["ports"]} == {8080, 9090, 9443}
    assert runners["metadata"]["namespace"] == "team-a"
    assert runners["spec"] == {"podSelector": {"matchLabels": runner_labels}, "policyTypes": ["Ingress"]}
    assert of_kind(render(helm, "--set", "networkPolicy.enabled=false"), "NetworkPolicy") == []


def test_metrics_ask_for_a_token_and_the_reader_role_grants_it(helm: Path) -> None:
    objs = render(helm, "--set", "metrics.serviceMonitor.enabled=true", "--api-versions", "monitoring.coreos.com/v1")
    assert env_of(next(containers(objs)))["FLOWKUBE_METRICS_AUTH"] == "true"
    reader = named(objs, "ClusterRole", "flowkube-metrics-reader")
    assert reader["rules"] == [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]
    (sm,) = of_kind(objs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["bearerTokenFile"] == "/var/run/secrets/kubernetes.io/serviceaccount/token"
    off = render(helm, "--set", "metrics.auth.enabled=false")
    assert env_of(next(containers(off)))["FLOWKUBE_METRICS_AUTH"] == "false"
    assert [r["metadata"]["name"] for r in of_kind(off, "ClusterRole") if "metrics" in r["metadata"]["name"]] == []


def test_tracing_on_gives_the_operator_the_standard_otlp_settings_and_off_none(helm: Path) -> None:
    off = env_of(next(containers(render(helm))))
    assert not {k for k in off if k.startswith("OTEL_") or k.startswith("FLOWKUBE_TRACING_")}
    objs = render(helm, "--set", "tracing.endpoint=http://tempo.monitoring:4318", "--set",
                  "tracing.headersSecret.name=otlp", "--set", "tracing.headersSecret.key=headers",
                  "--set", "console.traceUrl=https://jaeger.example.com/trace/{traceId}")
    operator = next(containers(objs))
    env = env_of(operator)
    assert (env["OTEL_EXPORTER_OTLP_ENDPOINT"], env["OTEL_SERVICE_NAME"], env["OTEL_EXPORTER_OTLP_TIMEOUT"]) == (
        "http://tempo.monitoring:4318", "flowkube-operator", "5")
    assert env["FLOWKUBE_TRACING_CAPTURE_CONTENT"] == "false"
    (headers,) = [e for e in operator["env"] if e["name"] == "OTEL_EXPORTER_OTLP_HEADERS"]
    assert headers["valueFrom"]["secretKeyRef"] == {"name": "otlp", "key": "headers"}
    console = [c for c in containers(objs, everywhere=True) if "FLOWKUBE_CONSOLE_TRACE_URL" in env_of(c)]
    assert env_of(console[0])["FLOWKUBE_CONSOLE_TRACE_URL"] == "https://jaeger.example.com/trace/{traceId}"
    bad = run_helm(helm, "template", "x", str(CHART), "--set", "tracing.endpoint=tempo:4318", check=False)
    assert bad.returncode != 0 and "tracing" in bad.stderr
