"""Fixtures for tests that run the operator against the local control plane."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import subprocess
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import kopf
import pytest
import yaml

from flowkube_api import constants as c
from flowkube_devstack import images
from flowkube_devstack.cluster import ClusterError, LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from flowkube_operator.kube.client import Kube


def operator_kube(cluster: LocalCluster) -> Kube:
    """The operator's own API client, logged in as the cluster's admin."""
    cfg = yaml.safe_load(cluster.kubeconfig.read_text())
    user = cfg["users"][0]["user"]
    return Kube(kopf.ConnectionInfo(server=cluster.server,
                                    ca_path=cfg["clusters"][0]["cluster"]["certificate-authority"],
                                    certificate_path=user["client-certificate"],
                                    private_key_path=user["client-key"]))


class LeaseWatch:
    """A Lease's renewTime, read every ``interval`` seconds (on a thread) until `stop`: the longest gap
    between two renewals is how late its holder renewed. ``lease``: its spec ({} when there is none)."""

    def __init__(self, lease: Callable[[], dict[str, Any]], interval: float = 0.5) -> None:
        self.lease = lease
        self.interval = interval
        self.renewals: list[dt.datetime] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            renewed = self.lease().get("renewTime")
            if renewed:
                at = dt.datetime.fromisoformat(renewed.replace("Z", "+00:00"))
                if not self.renewals or at != self.renewals[-1]:
                    self.renewals.append(at)

    def stop(self) -> float:
        """The longest gap between renewals seen, in seconds."""
        self._stop.set()
        self._thread.join(timeout=10)
        gaps = [(b - a).total_seconds() for a, b in zip(self.renewals, self.renewals[1:], strict=False)]
        return max(gaps, default=0.0)


def scripted_operator(cluster: LocalCluster, **kwargs: Any) -> ChartOperator:
    """The operator installed by its chart, running the scripted fake runner (devstack image) in its
    runner pods: for lifecycle tests, where what the runner does must be exact and quick."""
    assert cluster.images is not None
    return ChartOperator(cluster, runner_image=cluster.images.devstack, runner_command=images.FAKE_RUNNER_COMMAND,
                         **kwargs)


def require_last_in_module(request: pytest.FixtureRequest) -> None:
    """For a module-scoped fixture that upgrades the module's operator and does not upgrade it back
    (the module's operator is uninstalled after its last test: an upgrade back, a rollout, would be
    for nobody): the tests that take it must come last in the module, so that no other test meets
    values it did not ask for."""
    name = request.fixturename
    mine = [item for item in request.session.items if item.nodeid.startswith(f"{request.node.nodeid}::")]
    first = next(i for i, item in enumerate(mine) if name in getattr(item, "fixturenames", ()))
    later = [item.name for item in mine[first:] if name not in getattr(item, "fixturenames", ())]
    assert not later, f"the tests taking {name} come last in {request.node.nodeid}; not {later}"


@pytest.fixture(scope="module")
def ha(cluster: LocalCluster) -> Iterator[ChartOperator]:
    """The chart's operator with two replicas (leader election) and the scripted runner, per module."""
    op = scripted_operator(cluster, values=["replicaCount=2"]).start()
    try:
        yield op
    finally:
        op.stop()


class PodWatch:
    """Every version of the matching objects (pods, unless told otherwise) the API server shows, as
    `kubectl get --watch` prints them: what the kubelet reported of a pod before it was deleted,
    termination messages included; a Flow's phases before the TTL deleted it."""

    def __init__(self, cluster: LocalCluster, namespace: str, selector: Sequence[str], resource: str) -> None:
        self.seen: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._proc = subprocess.Popen(
            [str(cluster.bins["kubectl"]), "--kubeconfig", str(cluster.kubeconfig), "get", resource, "-n", namespace,
             *selector, "--watch", "-o", "json"], stdout=subprocess.PIPE, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        decoder, buffer = json.JSONDecoder(), ""
        for line in self._proc.stdout:
            buffer += line
            try:
                obj, end = decoder.raw_decode(buffer.lstrip())
            except json.JSONDecodeError:
                continue  # the object is not whole yet
            buffer = buffer.lstrip()[end:]
            with self._changed:
                self.seen.append(obj)
                self._changed.notify_all()

    def wait(self, predicate: Callable[[list[dict[str, Any]]], bool], timeout: float, what: str) -> None:
        with self._changed:
            if not self._changed.wait_for(lambda: predicate(self.seen), timeout=timeout):
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")

    def stop(self) -> None:
        self._proc.terminate()
        self._proc.wait(timeout=10)


@contextlib.contextmanager
def watched_pods(cluster: LocalCluster, namespace: str, *selector: str, resource: str = "pods") -> Iterator[PodWatch]:
    """``selector``: kubectl's own arguments, ``-l LABELS`` or ``--field-selector FIELDS``."""
    watch = PodWatch(cluster, namespace, selector, resource)
    try:
        yield watch
    finally:
        watch.stop()


def terminated_states(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `terminated` container states among pod versions, oldest first."""
    return [cs["state"]["terminated"] for pod in pods for cs in pod.get("status", {}).get("containerStatuses", [])
            if "terminated" in cs.get("state", {})]


@pytest.fixture(scope="module")
def operator(cluster: LocalCluster) -> Iterator[ChartOperator]:
    """The real operator, Helm-installed as a pod, with the scripted fake runner in its runner pods."""
    op = scripted_operator(cluster).start()
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
        # From the API server directly, as every wait polls it (LocalCluster.get: no kubectl process).
        result: dict[str, Any] | None = self.cluster.get(f"/apis/{c.API_VERSION}/namespaces/{self.ns}/flows/{name}")
        return result

    def status(self, name: str) -> dict[str, Any]:
        return (self.get(name) or {}).get("status") or {}

    def pods(self, name: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.cluster.get(f"/api/v1/namespaces/{self.ns}/pods",
                                                       labelSelector=f"{c.LABEL_FLOW}={name}")["items"]
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
