"""Shared fixtures: a real local control plane per test session, a fresh namespace per test."""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from flowkube_devstack.cluster import ClusterError, LocalCluster, wait_for
from flowkube_devstack.jaeger import Jaeger

# tests.lanes: each local stack's tests in one xdist worker, on its own cluster, the other tests
# beside them; tests.budget: each test's time budget, and the slowest modules at the end.
pytest_plugins = ["tests.lanes", "tests.budget"]

# Fixtures whose binaries are built from the Kubernetes Go modules: a test that takes one is marked
# `controlplane` whether or not its author said so, and `-m "not controlplane"` needs no Go.
BUILT_FROM_GO = frozenset({"cluster", "helm"})


@pytest.hookimpl(tryfirst=True)  # before tests.lanes reads the fixtures' closure
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if BUILT_FROM_GO & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.controlplane)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    chosen = os.environ.get("FLOWKUBE_TEST_CLUSTER_DIR")  # one per xdist worker: each has its own cluster
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    root = Path(f"{chosen}-{worker}" if chosen and worker else chosen or tmp_path_factory.mktemp("cluster"))
    c = LocalCluster(root, with_node=os.environ.get("FLOWKUBE_TEST_NO_NODE") != "1").start()
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="session")
def jaeger(cluster: LocalCluster) -> Iterator[Jaeger]:
    """The lane's trace backend (a host process beside the cluster), started by the first module that
    asks; pods reach it at ``Jaeger.endpoint``."""
    j = Jaeger.beside(cluster)
    try:
        yield j
    finally:
        j.stop()


@pytest.fixture
def namespace(cluster: LocalCluster, request: pytest.FixtureRequest) -> Iterator[str]:
    slug = re.sub(r"[^a-z0-9-]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"{slug}-{secrets.token_hex(3)}"
    cluster.api("POST", "/api/v1/namespaces",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})

    def has_default_sa() -> bool:
        try:
            cluster.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default")
            cluster.api("GET", f"/api/v1/namespaces/{name}/configmaps/kube-root-ca.crt")
        except OSError:
            return False
        return True

    wait_for(has_default_sa, 30, f"ServiceAccount default in {name}")
    yield name
    with contextlib.suppress(OSError, ClusterError):
        cluster.api("DELETE", f"/api/v1/namespaces/{name}")
