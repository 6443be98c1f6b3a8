"""The stack the real-runner benchmarks run on: a local cluster of their own (real node), the stub
model on this host behind a Service, the operator from its chart, and one namespace."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_devstack.operator import ChartOperator
from flowkube_devstack.stubmodel import Rules, StubModel

RUNNER_ENV = {"OPENAI_API_KEY": "stub", "CREWAI_TRACING_ENABLED": "false"}


def namespace_ready(cluster: LocalCluster, namespace: str) -> None:
    cluster.kubectl("create", "namespace", namespace)
    wait_for(lambda: cluster.kubectl("get", "sa", "default", "-n", namespace, check=False).returncode == 0,
             30, "the namespace's ServiceAccount")


@contextmanager
def scripted_stack(name: str, namespace: str) -> Iterator[tuple[LocalCluster, ChartOperator]]:
    """A local cluster of the benchmark's own with the chart's operator running the scripted runner."""
    from tests.integration.conftest import scripted_operator

    with tempfile.TemporaryDirectory(prefix=f"flowkube-bench-{name}-") as tmp:
        cluster = LocalCluster(Path(tmp)).start()
        op = scripted_operator(cluster, values=["log.level=WARNING"])
        try:
            op.start()
            namespace_ready(cluster, namespace)
            yield cluster, op
        finally:
            op.stop()
            cluster.stop()


@contextmanager
def real_stack(name: str, rules: Rules, namespace: str) -> Iterator[tuple[LocalCluster, StubModel, ChartOperator]]:
    with tempfile.TemporaryDirectory(prefix=f"flowkube-bench-{name}-") as tmp:
        t0 = time.monotonic()
        cluster = LocalCluster(Path(tmp)).start()
        print(f"local cluster started in {time.monotonic() - t0:.0f} s", flush=True)
        try:
            with StubModel(rules, host=cluster.host_ip) as stub:
                url = cluster.host_service("stub-model", "flowkube-dev", stub.port)
                op = ChartOperator(cluster, runner_env={"OPENAI_BASE_URL": f"{url}/v1", **RUNNER_ENV},
                                   values=["log.level=WARNING"])
                try:
                    t0 = time.monotonic()
                    op.start()
                    print(f"operator installed in {time.monotonic() - t0:.0f} s", flush=True)
                    namespace_ready(cluster, namespace)
                    yield cluster, stub, op
                finally:
                    op.stop()
        finally:
            cluster.stop()
