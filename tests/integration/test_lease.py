"""The operator's Lease against the real kube-apiserver while its event loop is saturated.

The elector acquires, renews and releases on a thread of its own, with its own event loop and client
(kube/leader.py, `ElectionThread`): a loop that runs CPU-bound Python in synchronous slices, each
longer than the renew deadline, costs neither the Lease nor the write fence, and the renewals go on
at the retry period on the API server. Another holder's write still ends the term while the loop is
blocked (the fence closes at once; `hold` returns as soon as the loop turns), and a clean stop
releases the Lease.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import time
from typing import Any

import pytest

from flowkube_devstack.cluster import LocalCluster, wait_for
from flowkube_operator.kube.leader import ElectionThread, LeaseConfig
from tests.integration.conftest import LeaseWatch, operator_kube

LEASE = "flowkube-operator"
SLICE = 3.0  # seconds of one synchronous section: 1.5 renew deadlines
SLICES = 3


def spin(seconds: float) -> int:
    """CPU-bound Python for ``seconds`` without yielding to the event loop (a reconcile's long
    synchronous section): the GIL is taken from it only at the interpreter's switch interval."""
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(i * i for i in range(200))
    return n


def lease_config(namespace: str) -> LeaseConfig:
    """Short timings, so that each slice is longer than the renew deadline."""
    return LeaseConfig(namespace=namespace, name=LEASE, identity="busy-leader", lease_duration=3.0,
                       renew_deadline=2.0, retry_period=0.25)


def lease_path(namespace: str) -> str:
    return f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{LEASE}"


def lease_spec(cluster: LocalCluster, namespace: str) -> dict[str, Any]:
    try:
        spec: dict[str, Any] = cluster.api("GET", lease_path(namespace)).get("spec") or {}
    except OSError:
        return {}
    return spec


def micro_time(value: str) -> dt.datetime:
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


@pytest.mark.slow
def test_a_saturated_event_loop_keeps_the_lease_renewed_and_the_fence_open(
        cluster: LocalCluster, namespace: str) -> None:
    cfg = lease_config(namespace)

    async def scenario() -> tuple[float, int]:
        kube = operator_kube(cluster)  # the operator's login; the election makes its own client of it
        election = ElectionThread(lambda: kube, cfg)
        elector = election.elector
        try:
            await asyncio.wait_for(election.acquire(), 30)
            holding = asyncio.create_task(election.hold())  # as App._lead awaits it
            watch = LeaseWatch(lambda: lease_spec(cluster, namespace), interval=0.1)
            try:
                for i in range(SLICES):
                    spin(SLICE)
                    assert elector.still_leading(), (
                        f"after busy slice {i + 1} of {SLICE}s the fence is closed: last renewal "
                        f"{time.monotonic() - elector.renewed_at:.1f}s ago (renew deadline {cfg.renew_deadline}s)")
                    await asyncio.sleep(0)  # one turn of the loop between slices, as between reconciles
                busy_end = dt.datetime.now(dt.UTC)
            finally:
                longest = watch.stop()
            renewed = micro_time(lease_spec(cluster, namespace)["renewTime"])
            assert renewed >= busy_end - dt.timedelta(seconds=cfg.renew_deadline), (renewed, busy_end)
            assert longest < cfg.renew_deadline, f"the Lease went {longest:.2f}s without a renewal"
            assert not holding.done() and elector.leading and not elector.lost_to, "no leadership loss"
            # A clean stop, as App.stop: the term's wait cancelled, then the Lease released.
            holding.cancel()
            assert await asyncio.wait_for(election.release(), 10)
            return longest, len(watch.renewals)
        finally:
            await election.close()
            await kube.close()

    longest, renewals = asyncio.run(scenario())
    spec = lease_spec(cluster, namespace)
    assert spec["holderIdentity"] == "" and spec["leaseDurationSeconds"] == 1, spec
    print(f"\n{SLICES} busy slices of {SLICE}s (renew deadline {cfg.renew_deadline}s, retry period "
          f"{cfg.retry_period}s): {renewals} renewals seen on the API server, the longest gap {longest:.2f}s")


def test_another_holder_ends_the_term_while_the_event_loop_is_blocked(cluster: LocalCluster, namespace: str) -> None:
    cfg = lease_config(namespace)

    async def scenario() -> None:
        kube = operator_kube(cluster)
        election = ElectionThread(lambda: kube, cfg)
        elector = election.elector
        try:
            await asyncio.wait_for(election.acquire(), 30)
            holding = asyncio.create_task(election.hold())
            cluster.api("PATCH", lease_path(namespace), {"spec": {"holderIdentity": "intruder"}},
                        content_type="application/merge-patch+json")
            # The loop blocked: the thread alone sees the other holder and closes the fence.
            wait_for(lambda: not elector.still_leading(), cfg.renew_deadline, "the fence to close")
            assert not holding.done()
            await asyncio.wait_for(holding, 5)  # the loss reaches the loop at its next turn
            assert elector.lost_to == "intruder" and not elector.leading
            assert not await election.release(), "nothing to release: the Lease is another's"
        finally:
            await election.close()
            await kube.close()

    asyncio.run(scenario())
    assert lease_spec(cluster, namespace)["holderIdentity"] == "intruder"
