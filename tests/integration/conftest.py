"""Fixtures for tests that run the operator against the local control plane."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flowkube_devstack.cluster import ClusterError, LocalCluster, wait_for
from flowkube_devstack.operator import OperatorProcess

FAKE_RUNNER = Path(__file__).with_name("fakerunner.py")


@pytest.fixture(scope="module")
def operator(cluster: LocalCluster) -> Iterator[OperatorProcess]:
    """The real operator, with the scripted fake runner as its runner command."""
    op = OperatorProcess(cluster, env={"FLOWKUBE_RUNNER_COMMAND": f"{sys.executable} {FAKE_RUNNER}"})
    op.start()
    try:
        yield op
    finally:
        op.stop()


class Flows:
    """kubectl-level helpers for one namespace."""

    def __init__(self, cluster: LocalCluster, namespace: str) -> None:
        self.cluster = cluster
        self.ns = namespace

    def apply(self, name: str, spec: dict[str, Any]) -> None:
        obj = {"apiVersion": "flowkube.io/v1alpha1", "kind": "Flow", "metadata": {"name": name}, "spec": spec}
        self.cluster.kubectl("apply", "-n", self.ns, "-f", "-", input=json.dumps(obj))

    def get(self, name: str) -> dict[str, Any] | None:
        out = self.cluster.kubectl("get", "flow", name, "-n", self.ns, "-o", "json", check=False)
        if out.returncode != 0:
            if "NotFound" in out.stderr:
                return None
            raise AssertionError(out.stderr)
        result: dict[str, Any] = json.loads(out.stdout)
        return result

    def status(self, name: str) -> dict[str, Any]:
        return (self.get(name) or {}).get("status") or {}

    def pods(self, name: str) -> list[dict[str, Any]]:
        out = self.cluster.kubectl("get", "pods", "-n", self.ns, "-l", f"flowkube.io/flow={name}", "-o", "json")
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        return items

    def wait(self, name: str, predicate: Callable[[dict[str, Any]], bool], what: str,
             timeout: float = 60) -> dict[str, Any]:
        seen: dict[str, Any] = {}

        def check() -> bool:
            seen.clear()
            seen.update(self.status(name))
            return predicate(seen)

        try:
            wait_for(check, timeout, f"{name}: {what}", interval=0.1)
        except ClusterError as e:
            raise AssertionError(f"{e}; last status: {json.dumps(seen, indent=1)[-3000:]}") from e
        return dict(seen)

    def wait_phase(self, name: str, phase: str, timeout: float = 60) -> dict[str, Any]:
        def reached(s: dict[str, Any]) -> bool:
            if s.get("phase") in ("Succeeded", "Failed") and s.get("phase") != phase:
                raise AssertionError(f"{name} ended {s['phase']} instead of {phase}: {s.get('message')}")
            return s.get("phase") == phase

        return self.wait(name, reached, f"phase {phase}", timeout)

    def patch_status(self, name: str, patch: dict[str, Any]) -> tuple[int, str]:
        out = self.cluster.kubectl("patch", "flow", name, "-n", self.ns, "--subresource=status",
                                   "--type=merge", "-p", json.dumps(patch), check=False)
        return out.returncode, out.stderr + out.stdout


@pytest.fixture
def flows(cluster: LocalCluster, namespace: str) -> Flows:
    return Flows(cluster, namespace)
