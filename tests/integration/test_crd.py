"""The Flow CRD on the real API server: accepted shapes, and refusals that name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from flowkube_api import crd
from flowkube_devstack.cluster import LocalCluster, wait_for


@pytest.fixture(scope="module")
def flow_crd(cluster: LocalCluster) -> Iterator[None]:
    # Every CRD of the category `flowkube`: `kubectl get flowkube` lists them all (its discovery may
    # know them from an earlier cluster at the same address).
    for path in crd.CRD_FILES.values():
        cluster.kubectl("apply", "--server-side", "-f", str(path))
    cluster.kubectl("wait", "--for=condition=Established", *(f"crd/{p}.flowkube.io" for p in crd.PLURALS.values()),
                    "--timeout=60s")
    yield


def _apply(cluster: LocalCluster, ns: str, name: str, spec: dict[str, Any]) -> tuple[int, str]:
    obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name}, "spec": spec}
    out = cluster.kubectl("apply", "-n", ns, "-f", "-", input=json.dumps(obj), check=False)
    return out.returncode, out.stderr


@pytest.mark.usefixtures("flow_crd")
def test_valid_flow_is_accepted_and_listed_with_printer_columns(cluster: LocalCluster, namespace: str) -> None:
    rc, err = _apply(cluster, namespace, "ok", {"flowRef": "pkg.flows:Research", "retries": {"limit": 2}})
    assert rc == 0, err
    out = cluster.kubectl("get", "fl", "-n", namespace).stdout
    assert out.split("\n")[0].split() == ["NAME", "PHASE", "DEFINITION", "TEMPLATE", "TOKENS", "COST", "AGE",
                                           "MESSAGE"]

    def listed() -> bool:
        return "ok" in cluster.kubectl("get", "flowkube", "-n", namespace, "-o", "name").stdout

    wait_for(listed, 10, "the flow listed under its category")


@pytest.mark.usefixtures("flow_crd")
@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ({}, "exactly one of spec.definition, spec.flowRef or spec.templateRef must be set"),
        ({"flowRef": "a:B", "definition": {"name": "x"}}, "exactly one of spec.definition, spec.flowRef or"),
        ({"templateRef": {"name": "t"}, "definition": {"name": "x"}}, "exactly one of spec.definition, spec.flowRef"),
        ({"templateRef": {"name": "Not_A_Name"}}, "spec.templateRef.name"),
        ({"templateRef": {"name": "t", "kind": "Job"}}, "spec.templateRef.kind"),
        ({"flowRef": "not a ref"}, "spec.flowRef"),
        ({"flowRef": "a:B", "image": "../../etc"}, "spec.image"),  # admitted, it waited as InvalidImageName
        ({"flowRef": "a:B", "image": "runner\u0000:1"}, "spec.image"),
        ({"flowRef": "a:B", "image": "Team/Runner:1"}, "spec.image"),
        ({"definition": {"methods": []}}, "spec.definition.name: Required value"),
        ({"flowRef": "a:B", "retries": {"limit": -1}}, "spec.retries.limit"),
        ({"flowRef": "a:B", "activeDeadlineSeconds": 0}, "spec.activeDeadlineSeconds"),
        ({"flowRef": "a:B", "budget": {"maxTotalTokens": 0}}, "spec.budget.maxTotalTokens"),
        ({"flowRef": "a:B", "budget": {"maxCost": "two dollars"}}, "spec.budget.maxCost"),
        ({"flowRef": "a:B", "budget": {}}, "budget sets maxTotalTokens, maxCost or both"),
        ({"flowRef": "a:B", "retries": {"disruptionLimit": -1}}, "spec.retries.disruptionLimit"),
        ({"flowRef": "a:B", "suspend": "yes"}, "spec.suspend"),
        ({"flowRef": "a:B", "env": [{"value": "no name"}]}, "spec.env[0].name: Required value"),
    ],
)
def test_invalid_flow_is_refused_naming_the_field(
    cluster: LocalCluster, namespace: str, spec: dict[str, Any], expected: str
) -> None:
    rc, err = _apply(cluster, namespace, "bad", spec)
    assert rc != 0
    assert expected in err


@pytest.mark.usefixtures("flow_crd")
def test_overlong_name_is_refused(cluster: LocalCluster, namespace: str) -> None:
    rc, err = _apply(cluster, namespace, "x" * 64, {"flowRef": "a:B"})
    assert rc != 0
    assert "metadata.name must be at most 63 characters" in err


@pytest.mark.usefixtures("flow_crd")
@pytest.mark.parametrize(("spec", "field", "message"), [
    ({"env": [{"name": "A", "value": "b"}, {"name": "FLOWKUBE_STATE_DIR", "value": "/tmp"}]},
     "spec.env[1].name", "env name prefix FLOWKUBE_ is reserved"),
    ({"envFrom": [{"prefix": "FLOWKUBE_", "configMapRef": {"name": "c"}}]},
     "spec.envFrom[0].prefix", "envFrom prefix FLOWKUBE_ is reserved"),
])
def test_the_operators_runner_variables_are_refused_naming_the_field(
        cluster: LocalCluster, namespace: str, spec: dict[str, Any], field: str, message: str) -> None:
    """A Flow that set FLOWKUBE_STATE_DIR and FLOWKUBE_TERMINATION_LOG ran with its usage unreported."""
    rc, err = _apply(cluster, namespace, "reserved", {"flowRef": "a:B", **spec})
    assert rc != 0 and field in err and message in err, err
